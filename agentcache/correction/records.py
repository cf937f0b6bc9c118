"""Typed records the strategies' parts hand each other: an edge of the workflow, an anchor built
for insertion, and what a decision used."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from agentcache.correction.anchors import Anchor, AnchorBank, Correction
from agentcache.correction.lowrank import Factors

__all__ = ["Edge", "NewAnchor", "PreparedAnchor", "Prepared", "UsedAnchors"]


@dataclass(frozen=True)
class Edge:
    """What verification keys its record by: a source agent's materialization of a slot read by a
    consumer. A source that was itself reused carries its own error down a chain, and an
    approximate segment that a longer context follows can drift where a short one did not (a
    conversation's later turns): each is verified on its own, so the edge also says whether the
    source is exact and how long the rest of the call is, in powers of 4 (`after`)."""

    tenant: str | None
    slot: str
    source: str
    consumer: str
    exact_source: bool
    after: int  # the bucket: (tokens after the segment).bit_length() // 2

    @classmethod
    def of(cls, tenant: str | None, slot: str, source: str, exact_source: bool, consumer: str,
           tokens_after: int) -> Edge:
        return cls(tenant, slot, source, consumer, exact_source, tokens_after.bit_length() // 2)

    @property
    def pool_key(self) -> tuple[str | None, str]:
        """The anchor pool the edge's corrections live in: the tenant's, for the slot."""
        return (self.tenant, self.slot)


@dataclass(frozen=True)
class NewAnchor:
    """An anchor to insert: the source materialization it describes (its base factors) and the
    correction one consumer observed from it."""

    source_id: str
    source: str  # the source agent
    keys: Factors
    values: Factors
    consumer: str
    correction: Correction

    def add_to(self, bank: AnchorBank, pool_key: Hashable) -> None:
        """Insert it, unless another call added an anchor of this source over other tokens since."""
        held = bank.anchor(pool_key, self.source_id)
        if held is None or held.length == self.keys.length:
            bank.add(pool_key, self.source_id, self.source, self.keys, self.values, self.consumer, self.correction)


@dataclass(frozen=True)
class PreparedAnchor:
    """An anchor built with no lock held, for insertion under it: the anchor (None: nothing to
    learn), the seconds its building took, or the error that stopped it (counted as `fault`)."""

    anchor: NewAnchor | None
    seconds: float
    error: BaseException | None = None
    fault: str = "anchor_build_error"


@dataclass(frozen=True)
class Prepared:
    """What a strategy's `prepare` built for `settle`: per PH segment index, its anchor."""

    anchors: Mapping[int, PreparedAnchor] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class UsedAnchors:
    """A correction's `PHDecision.detail`: the anchors it interpolated (credited a use when it is served)."""

    anchors: tuple[Anchor, ...]

"""NonShared: every shared segment prefilled in its own call (exact prefix caching still on)."""

from __future__ import annotations

import logging
from collections import Counter
from types import MappingProxyType

from agentcache.correction.plan import (Piece, Planned, PHDecision, Served, SharedContextStrategy, TokenizedCall,
                                        common_figures)
from agentcache.correction.records import Prepared
from agentcache.correction.strategies import Strategy
from agentcache.engine.protocol import Engine, SegmentPlan, Step

__all__ = ["NonShared"]

log = logging.getLogger(__name__)


class NonShared(SharedContextStrategy):
    """The baseline: no reuse across agents, nothing kept, nothing learned."""

    def __init__(self, engine: Engine, settings: Strategy, anchor_bytes: int = 0, store_bytes: int = 0) -> None:
        self.engine = engine
        self.strategy = settings
        self.faults: Counter[str] = Counter()

    def plan_call(self, call: TokenizedCall, *, lineage: str, namespace: str | None,
                  capture_all: bool = False) -> Planned:
        """Every segment prefilled; a PH segment the prefix cache does not serve whole is `off`."""
        covered = self.engine.cached_prefix_length(call.prompt, lineage=lineage, cache_salt=namespace)  # a hint
        decisions = {index: PHDecision("off") for index, seg in enumerate(call.segments)
                     if seg.kind == "ph" and call.starts[index + 1] > covered}
        pieces = tuple(Piece(index, SegmentPlan(seg.name, tokens, Step.PREFIX, capture=capture_all or seg.kind == "ph"))
                       for index, (seg, tokens) in enumerate(zip(call.segments, call.token_lists)))
        return Planned(pieces, MappingProxyType(decisions))

    def settle(self, served: Served, prepared: Prepared | None = None) -> None:
        """Nothing to record: no later call reads this one's KV."""

    def fault(self, kind: str, what: str, exc: BaseException | None = None) -> None:
        self.faults[kind] += 1
        log.warning("%s: %s%s", kind, what, f" ({type(exc).__name__}: {exc})" if exc is not None else "")

    def figures(self) -> dict:
        return common_figures(self.strategy) | dict(faults=dict(self.faults))

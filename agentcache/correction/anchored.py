"""Strategies that correct a reused source with anchors (KVCMAS and its ablations, KVCOMM): the
common part. It keeps the anchor pools (per tenant and slot, shared by the tenant's sessions) and
the entropy gate's τ, re-aligns a source before the strategy's `correct` runs, and cleans up
after a fault: not knowing which part was bad, neither the source nor the edge's anchors are used
again (they are learned anew from the next fallbacks)."""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Sequence

import torch

from agentcache.correction.acceptance import EntropyGate
from agentcache.correction.anchors import Anchor, AnchorBank
from agentcache.correction.plan import Learned, PHDecision
from agentcache.correction.records import PreparedAnchor, UsedAnchors
from agentcache.correction.sourced import SourcedStrategy
from agentcache.correction.store import Materialization
from agentcache.correction.strategies import Strategy
from agentcache.correction.verification import Verification
from agentcache.engine.kv import SegmentKV
from agentcache.engine.protocol import Engine
from agentcache.isolation import Scope

__all__ = ["AnchoredStrategy"]

log = logging.getLogger(__name__)


class AnchoredStrategy(SourcedStrategy):
    def __init__(self, engine: Engine, settings: Strategy, anchor_bytes: int, store_bytes: int) -> None:
        super().__init__(engine, settings, anchor_bytes, store_bytes)
        self.bank = AnchorBank(settings.max_anchors, anchor_bytes)
        self.gate = EntropyGate(settings)
        self.verification = Verification()  # a verified strategy's records (persisted with the pools)
        self.anchor_build_s = 0.0

    @property
    def tau(self) -> float:
        """The gate's threshold now."""
        return self.gate.tau

    @property
    def calibrated(self) -> dict | None:
        return self.gate.calibrated

    def calibrate(self, target: float, recent: int | None = None) -> float:
        """Hold the gate at reuse ratio `target` from now on (the papers tune τ per workload); τ is
        read from the gate entropies of the latest `recent` eligible segments (`EntropyGate.calibrate`)."""
        return self.gate.calibrate(target, recent)

    def planned_with_source(self, decision: PHDecision, tokens: int) -> None:
        self.gate.observe(decision, tokens)

    def reuse(self, scope: Scope, agent: str, slot: str, source: Materialization, shared: int,
              start: int) -> PHDecision:
        """The source re-aligned to canonical positions, then corrected (`correct`)."""
        try:
            aligned = self.engine.realign(source.kv.slice(0, shared), 0)
        except Exception:
            self.store.remove(source.entry_id)  # a source that cannot be re-aligned is not used again
            raise
        try:
            return self.correct(scope, agent, slot, source, aligned, start)
        except Exception:
            self.store.remove(source.entry_id)
            for anchor in self.bank.candidates((scope.tenant, slot), source.agent, agent):
                self.bank.drop((scope.tenant, slot), anchor)
            raise

    @abstractmethod
    def correct(self, scope: Scope, agent: str, slot: str, source: Materialization, aligned: SegmentKV,
                start: int = 0) -> PHDecision:
        """The decision for `source` re-aligned to canonical positions (`aligned`) at `start` of the call."""

    def drop_non_finite(self, pool_key: tuple, anchors: Sequence[Anchor]) -> None:
        """Count a non-finite correction and drop the anchors that hold NaN or Inf."""
        self.faults["nonfinite"] += 1
        for anchor in anchors:
            if not anchor.is_finite():
                log.warning("dropping anchor %s of slot %r: it holds NaN or Inf", anchor.source_id, pool_key[1])
                self.bank.drop(pool_key, anchor)

    def commit(self, scope: Scope, agent: str, slot: str, token_ids: Sequence[int], decision: PHDecision,
               kv: SegmentKV | None, how: str, *, own_tokens_exact: bool = True,
               hidden: torch.Tensor | None = None, prepared: PreparedAnchor | None = None) -> None:
        """The segment's source recorded (`SourcedStrategy.commit`) after crediting the anchors its
        correction used, then the anchor `prepared` for it inserted; a fault building it loses
        only the anchor."""
        if kv is None:
            return
        self.credit_uses(decision)
        super().commit(scope, agent, slot, token_ids, decision, kv, how, own_tokens_exact=own_tokens_exact,
                       hidden=hidden, prepared=prepared)
        if prepared is not None:
            self.insert(prepared, (scope.tenant, slot), agent)

    def credit_uses(self, decision: PHDecision) -> None:
        """A reused segment credits every anchor its correction used."""
        if decision.reused and isinstance(decision.detail, UsedAnchors):
            for used in decision.detail.anchors:
                used.uses += 1

    def insert(self, prepared: PreparedAnchor, pool_key: tuple, consumer: str) -> None:
        """Insert an anchor built with no lock held; a fault while building it is counted here."""
        self.anchor_build_s += prepared.seconds
        if prepared.error is not None:
            self.fault(prepared.fault, f"no anchor from agent {consumer!r}'s fallback on slot {pool_key[1]!r}",
                       prepared.error)
        elif prepared.anchor is not None:
            prepared.anchor.add_to(self.bank, pool_key)

    def held_bytes(self) -> dict[str, int]:
        return super().held_bytes() | dict(anchor_bytes=self.bank.nbytes)

    def learned(self) -> Learned:
        return Learned(self.bank, self.verification, self.strategy)

    def figures(self) -> dict:
        return super().figures() | dict(
            anchors=self.bank.num_anchors, anchor_bytes=self.bank.nbytes, anchors_evicted=self.bank.evicted,
            anchor_build_s=self.anchor_build_s,
            anchor_dense_bytes=self.bank.dense_numel * self.engine.layout.dtype.itemsize,  # the KV they describe
            **self.gate.figures())

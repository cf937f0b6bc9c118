"""KVCMAS (and its ablations): a reused source corrected by its edge's anchors, where the edge's
acceptance policy (`acceptance`, verified or the entropy gate) allows it.

A call's shared segment with a source is, in order: weighed against its cost (`costs`), accepted
or refused from the edge's record (`acceptance`), re-aligned and corrected with the anchors the
policy selects (`corrections`), or prefilled densely, and then what that dense prefill teaches is
learned when idle (`learner`). Siblings dispatched together on a new segment may share their
leader's prefill (`siblings`; verified and chained only).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import replace

from agentcache.correction.acceptance import ACCEPTANCE_POLICIES, Refusal
from agentcache.correction.anchored import AnchoredStrategy
from agentcache.correction.corrections import corrected, fits
from agentcache.correction.learner import Learner, SiblingRead
from agentcache.correction.plan import Planned, PHDecision, Served, TokenizedCall
from agentcache.correction.records import Edge, UsedAnchors
from agentcache.correction.siblings import Content, Leader, SiblingReads
from agentcache.correction.sources import REFERENCE
from agentcache.correction.store import Materialization
from agentcache.correction.strategies import Strategy
from agentcache.engine.kv import SegmentKV
from agentcache.engine.protocol import Engine
from agentcache.idle import Lesson
from agentcache.isolation import Scope

__all__ = ["KVCMAS"]


class KVCMAS(AnchoredStrategy):
    def __init__(self, engine: Engine, settings: Strategy, anchor_bytes: int, store_bytes: int) -> None:
        super().__init__(engine, settings, anchor_bytes, store_bytes)
        self.acceptance = ACCEPTANCE_POLICIES[settings.accept](settings, self.gate, self.verification)
        self.learner = Learner(engine, settings, self.bank, self.verification if self.verified else None, self.insert)
        self.siblings = SiblingReads()

    def plan_call(self, call: TokenizedCall, *, lineage: str, namespace: str | None,
                  capture_all: bool = False) -> Planned:
        for exc in self.siblings.harvest(self.store):
            self.fault("reference_error", "a reference prefill for siblings failed; they prefill densely", exc)
        return super().plan_call(call, lineage=lineage, namespace=namespace, capture_all=capture_all)

    def accepts(self, scope: Scope, agent: str, slot: str, source: Materialization,
                after: int = 0) -> tuple[str | None, str | None]:
        """The edge's acceptance policy, from its record and how many anchors it has."""
        candidates = self.bank.candidates((scope.tenant, slot), source.agent, agent)
        edge = Edge.of(scope.tenant, slot, source.agent, source.exact, agent, after)
        return self.acceptance.accepts(edge, len(candidates), context_free=source.agent == REFERENCE)

    def correct(self, scope: Scope, agent: str, slot: str, source: Materialization, aligned: SegmentKV,
                start: int = 0) -> PHDecision:
        """The source corrected by the anchors the acceptance policy selects (Eq. 8)."""
        pool_key = (scope.tenant, slot)
        candidates = self.bank.candidates(pool_key, source.agent, agent)
        for anchor in candidates:
            if not fits(anchor, self.engine.layout):
                self.fault("bad_anchor", f"dropping anchor {anchor.source_id} of slot {slot!r}: its shapes do not "
                           f"fit {self.engine.model_name}")
                self.bank.drop(pool_key, anchor)
                return PHDecision("fallback", reason="bad_anchor", source=source)
        selection = self.acceptance.select(aligned, candidates)
        if isinstance(selection, Refusal):
            if selection.nonfinite:
                self.drop_non_finite(pool_key, selection.nonfinite)
            return PHDecision("fallback", reason=selection.reason, source=source, entropy=selection.entropy)
        fixed = corrected(aligned, selection.anchors, selection.k, agent, self.engine.layout)
        if fixed is None:
            self.drop_non_finite(pool_key, selection.anchors)
            return PHDecision("fallback", reason="nonfinite", source=source, entropy=selection.entropy)
        return PHDecision("corrected", source=source, covered=aligned.length, inject=fixed,
                          entropy=selection.entropy, detail=UsedAnchors(selection.anchors))

    def lessons(self, served: Served) -> list[Lesson]:
        return self.learner.lessons(served)

    def figures(self) -> dict:
        return (super().figures() | self.acceptance.figures()
                | (self.siblings.figures() if self.verified else {}))

    # --- siblings ------------------------------------------------------------------------

    def dense_read(self, call: TokenizedCall, index: int, decision: PHDecision) -> PHDecision:
        """A segment new to the session that siblings read: the edge from their leader waits for
        verification, learned from this call."""
        if decision.decision != "first":
            return decision
        seg, tokens = call.segments[index], call.token_lists[index]
        leader = self._siblings_leader(Content(call.scope, seg.slot, tuple(tokens)))
        if leader is None or leader.agent == call.agent:
            return decision
        return replace(decision, detail=SiblingRead(leader))

    def awaited(self, call: TokenizedCall) -> tuple[Future, ...]:
        """Leader prefills `call` should wait for before it is planned: for each shared segment new
        to its session that siblings read and that is worth reuse, the leader's prompt prefilled
        through the segment, once reuse from it is verified for this sibling (for the leader: for
        any sibling)."""
        if not self.strategy.siblings:
            return ()
        waits: list[Future] = []
        for index, (seg, tokens) in enumerate(zip(call.segments, call.token_lists)):
            if seg.kind != "ph":
                continue
            content = Content(call.scope, seg.slot, tuple(tokens))
            leader = self._siblings_leader(content, Leader(call.agent, call.prompt[:call.starts[index]]))
            if leader is None or not self._sibling_verified(call, index, leader):
                continue
            future = self.siblings.prefill(self.engine, content, leader)
            if not future.done():
                waits.append(future)
        return tuple(waits)

    def _sibling_verified(self, call: TokenizedCall, index: int, leader: Leader) -> bool:
        tenant, slot = call.scope.tenant, call.segments[index].slot
        if leader.agent == call.agent:
            return self.verification.serves_from(tenant, slot, leader.agent)
        edge = Edge.of(tenant, slot, leader.agent, True, call.agent, len(call.prompt) - call.starts[index + 1])
        anchors = len(self.bank.candidates(edge.pool_key, leader.agent, call.agent))
        return self.acceptance.accepts(edge, anchors, context_free=False)[0] is not None

    def _siblings_leader(self, content: Content, reader: Leader | None = None) -> Leader | None:
        """The leader of this segment's siblings when it is new to the session (no source), read by
        siblings and worth reuse, for a strategy that verifies reuse (`reader`: a call reads it
        now, counted once per call)."""
        if not (self.strategy.siblings and self.verified and self.strategy.chained
                and self.engine.supports_realignment and self.costs.worth(len(content.tokens))):
            return None
        if self.sources.find(content.scope, content.slot, content.tokens, None) is not None:
            return None
        return self.siblings.read(content, reader) if reader is not None else self.siblings.leader(content)

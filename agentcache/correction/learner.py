"""What a KVCMAS call teaches, learned when the engine is idle (`agentcache.idle`).

For each PH segment prefilled densely while it had a source: shadow runs of the reuse methods
the edge could serve (verified acceptance, `replays`) and, unless raw reuse gave the same
output, the observed correction Δ = C_dense − Align(C_source) as an anchor. A sibling's dense
read of a new segment teaches the same about its leader's KV; a reused call due for an audit is
replayed densely. Each lesson studies with no lock held and applies under the runtime's lock.
A lesson that gives an edge serving nothing a method's first verdict (raw reuse on its first
dense call; the correction, once the edge has anchors, when raw reuse disagreed) is urgent: it runs
right away, beside calls, its shadow runs at a call's priority, since until then every call on the
edge prefills what it could reuse (a server with traffic has no idle time to wait for).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from agentcache.correction.anchors import Anchor, AnchorBank
from agentcache.correction.corrections import corrected, fits, observed_correction
from agentcache.correction.plan import PHDecision, Served
from agentcache.correction.records import Edge, NewAnchor, PreparedAnchor
from agentcache.correction.replays import (FIRST_VERDICT_PRIORITY, REPLAY_PRIORITY, dense_replay, exact_reference,
                                          shadow_run)
from agentcache.correction.siblings import Content, Leader, study_source
from agentcache.correction.strategies import Strategy
from agentcache.correction.verification import Verdict, Verification
from agentcache.engine.kv import SegmentKV
from agentcache.engine.protocol import Engine
from agentcache.engine.tokens import common_prefix
from agentcache.idle import Lesson

__all__ = ["Learner", "SiblingRead", "Studied"]


@dataclass(frozen=True)
class SiblingRead:
    """A `first` decision's detail: siblings read the segment, and the edge from their leader to
    this agent waits for verification (learned from this call when idle)."""

    leader: Leader


@dataclass(frozen=True)
class Studied:
    """A lesson's result: the shadow runs' verdicts, their seconds, and the anchor built."""

    verdicts: list[Verdict]
    seconds: float
    anchor: PreparedAnchor | None


class Learner:
    def __init__(self, engine: Engine, settings: Strategy, bank: AnchorBank, verification: Verification | None,
                 insert: Callable[[PreparedAnchor, tuple, str], None]) -> None:
        """`verification`: the edges' records, None when acceptance is not verified (no shadow runs,
        no audits); `insert(prepared, pool key, consumer)`: the strategy inserts a built anchor."""
        self.engine = engine
        self.settings = settings
        self.bank = bank
        self.verification = verification
        self.insert = insert

    def lessons(self, served: Served) -> list[Lesson]:
        """The lessons of a settled call: audits, siblings' reads, and dense fallbacks with a source."""
        lessons = self._audits(served) + self._sibling_lessons(served)
        for index, seg, tokens, decision, _, kv in served.shared():
            if not (kv is not None and kv.exact and decision.decision == "fallback" and decision.source is not None):
                continue
            edge = Edge.of(served.call.scope.tenant, seg.slot, decision.source.agent, decision.source.exact,
                           served.call.agent, _after(served, index))
            candidates = tuple(self.bank.candidates(edge.pool_key, edge.source, edge.consumer))  # as they are now
            first = self._first_verdict(served, index, edge, candidates)
            lessons.append(Lesson(
                f"{seg.slot} {edge.source}->{edge.consumer}",
                lambda index=index, tokens=tokens, decision=decision, kv=kv, candidates=candidates, edge=edge,
                first=first: self.study(served, index, tokens, decision, kv, candidates, edge, first=first),
                lambda studied, edge=edge: self.learn(edge, studied),
                urgent=first, needed=(lambda edge=edge, candidates=candidates:
                                      bool(self._untested(edge, candidates))) if first else None))
        return lessons

    def _first_verdict(self, served: Served, index: int, edge: Edge, candidates: Sequence[Anchor]) -> bool:
        """Whether this call's shadow runs would give the edge a method's first verdict while it serves
        nothing (its calls prefill until then): the lesson is then urgent. A call that reused another
        segment is no exact reference (no shadow run): it only builds an anchor, when idle."""
        return (self.verification is not None and exact_reference(served, index)
                and bool(self._untested(edge, candidates)))

    def _untested(self, edge: Edge, candidates: Sequence[Anchor]) -> list[str]:
        methods = ["raw"] + (["corrected"] if self._usable(candidates) else [])
        return self.verification.untested(edge, methods)

    def _usable(self, candidates: Sequence[Anchor]) -> list[Anchor]:
        """The anchors whose shapes fit this engine's model: those a correction can apply."""
        return [a for a in candidates if fits(a, self.engine.layout)]

    def _sibling_lessons(self, served: Served) -> list[Lesson]:
        """A sibling's dense read of a new segment: the leader's prefill is rebuilt (mostly from the
        prefix cache) and shadow-run when idle."""
        lessons = []
        for index, seg, tokens, decision, _, kv in served.shared():
            if not (isinstance(decision.detail, SiblingRead) and kv is not None and kv.exact):
                continue
            scope, agent, leader = served.call.scope, served.call.agent, decision.detail.leader
            edge = Edge.of(scope.tenant, seg.slot, leader.agent, True, agent, _after(served, index))
            content = Content(scope, seg.slot, tuple(tokens))

            def study(index=index, tokens=tokens, decision=decision, kv=kv, edge=edge, content=content,
                      leader=leader):
                source = study_source(self.engine, content, leader, REPLAY_PRIORITY)
                candidates = tuple(self.bank.candidates(edge.pool_key, edge.source, edge.consumer))
                return self.study(served, index, tokens, replace(decision, source=source), kv, candidates, edge)

            lessons.append(Lesson(f"{seg.slot} {leader.agent}->{agent} (siblings)", study,
                                  lambda studied, edge=edge: self.learn(edge, studied)))
        return lessons

    def _audits(self, served: Served) -> list[Lesson]:
        """A reused call due for an audit (per edge) is replayed densely when idle: its served
        output against the exact one is a verdict on every method it used."""
        if self.verification is None:
            return []
        tenant, agent = served.call.scope.tenant, served.call.agent
        due = [(Edge.of(tenant, seg.slot, d.source.agent, d.source.exact, agent, _after(served, i)),
                "raw" if d.decision == "reused" else "corrected")
               for i, seg, _, d, _, _ in served.shared() if d.reused and d.source is not None]
        due = [(edge, method) for edge, method in due if self.verification.audit_due(edge)]
        if not due:
            return []

        def audit() -> Studied:
            started = time.perf_counter()
            return Studied(dense_replay(self.engine, served, [m for _, m in due]), time.perf_counter() - started, None)

        return [Lesson(f"audit of {agent}'s call", audit, lambda studied: self._audited([e for e, _ in due], studied))]

    def _audited(self, edges: list[Edge], studied: Studied) -> None:
        for edge, verdict in zip(edges, studied.verdicts):
            self.verification.record(edge, [verdict], studied.seconds / len(edges), audit=True)

    def study(self, served: Served, index: int, tokens: Sequence[int], decision: PHDecision, kv: SegmentKV,
              candidates: Sequence[Anchor], edge: Edge, *, first: bool = False) -> Studied:
        """A lesson's work, with no lock held: the shadow runs of each reuse method the edge could
        serve (verified acceptance) and, unless raw reuse gave the same output, the anchor of the
        observed correction (factorizing is the costliest learning: done only where it is needed).
        `first`: the edge's first verdicts, which its later calls wait for: run as a call's request."""
        source, agent = decision.source, served.call.agent
        verdicts, started = [], time.perf_counter()
        shared = common_prefix(source.token_ids, tokens)
        if self.verification is not None and shared and exact_reference(served, index):
            aligned = self.engine.realign(source.kv.slice(0, shared), 0)
            methods = [("raw", aligned)]
            usable = self._usable(candidates)
            if usable:
                fixed = corrected(aligned, usable, min(shared, max(a.length for a in usable)), agent,
                                  self.engine.layout)
                if fixed is not None:
                    methods.insert(0, ("corrected", fixed))
            priority = FIRST_VERDICT_PRIORITY if first else REPLAY_PRIORITY
            verdicts = [shadow_run(self.engine, served, index, shared, reused, method, priority)
                        for method, reused in methods]
        shadow_s = time.perf_counter() - started
        anchor = None
        raw_serves = any(v.method == "raw" and v.agrees for v in verdicts)  # then a correction is not needed
        if not raw_serves and not self._pool_settled(edge):
            anchor = self.prepare_anchor(agent, tokens, decision, kv)
        return Studied(verdicts, shadow_s, anchor)

    def _pool_settled(self, edge: Edge) -> bool:
        """A full pool whose corrections this edge serves learns nothing worth its factorization."""
        pool = self.bank.pools.get(edge.pool_key)
        record = self.verification.edges.get(edge) if self.verification is not None else None
        return (pool is not None and len(pool) >= pool.capacity and record is not None
                and record.choice(can_correct=True) == "corrected")

    def learn(self, edge: Edge, studied: Studied) -> None:
        """A lesson's result, under the runtime's lock: the verdicts and the anchor."""
        if studied.verdicts:
            self.verification.record(edge, studied.verdicts, studied.seconds)
        if studied.anchor is not None:
            self.insert(studied.anchor, edge.pool_key, edge.consumer)

    def prepare_anchor(self, agent: str, token_ids: Sequence[int], decision: PHDecision,
                       kv: SegmentKV) -> PreparedAnchor | None:
        """The anchor a dense fallback teaches, built without changing anything; None when the
        segment teaches nothing. A fault while building is returned, to be counted at insertion."""
        if decision.decision != "fallback" or decision.source is None:
            return None
        started = time.perf_counter()
        try:
            anchor = self._observed(agent, decision.source, token_ids, kv)
        except FloatingPointError as exc:
            return PreparedAnchor(None, time.perf_counter() - started, exc, fault="nonfinite_delta")
        except Exception as exc:  # noqa: BLE001 - a fault here costs one anchor, never the call
            return PreparedAnchor(None, time.perf_counter() - started, exc)
        return PreparedAnchor(anchor, time.perf_counter() - started)

    def _observed(self, agent: str, source, token_ids: Sequence[int], dense: SegmentKV) -> NewAnchor | None:
        """The anchor of the correction this fallback observed; None when there is nothing to learn."""
        shared = common_prefix(source.token_ids, token_ids)
        existing = self.bank.anchor((source.scope.tenant, source.slot), source.id)
        if shared == 0 or (existing is not None and existing.length != shared):
            return None  # an anchor's corrections all cover its base's tokens
        aligned = self.engine.realign(source.kv.slice(0, shared), 0)
        target = self.engine.realign(dense.slice(0, shared), 0)
        base = (existing.keys, existing.values) if existing is not None else None
        observed = observed_correction(aligned, target, base, self.settings.base_rank, self.settings.delta_rank)
        if observed is None:
            raise FloatingPointError(f"the observed correction of slot {source.slot!r} holds NaN or Inf")
        base_k, base_v, correction = observed
        return NewAnchor(source.id, source.agent, base_k, base_v, agent, correction)


def _after(served: Served, index: int) -> int:
    """How many of the call's tokens follow segment `index`."""
    return len(served.call.prompt) - served.call.starts[index + 1]

"""The chained corrector (KVCMAS and its ablations, FullShared, NonShared): decides how each
shared (PH) segment of a call is materialized, one segment at a time.

Before a call, `plan_call` asks the prefix cache what it already serves and `plan` decides each
remaining PH segment: skip one not worth reuse work (`costs`), look up its source cache
(`sources`), ask the edge's acceptance (verified, `verification`; or the entropy gate), re-align
the source to canonical positions, and either hand back KV to inject (raw or corrected) or ask
for dense prefill. After the call, `settle` records what each segment became (the source of the
next edge), and `lessons` leave to idle time what a dense fallback teaches: shadow runs of the
reuse methods (`replays`) and, where raw reuse fails, the observed correction
Δ = C_dense − Align(C_source) as an anchor; and audits of reused calls. Any fault (any exception while planning, a corrupt
anchor or source, NaN) falls back to dense and is counted in `faults`; a corrupt anchor or source
is removed so that it stops poisoning later calls. A fault while building an anchor after the
call loses only that anchor.

Sources are looked up in the caller's scope (its tenant's session) only; anchor pools are per
tenant and slot, shared by the tenant's sessions.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from types import MappingProxyType

import torch

from agentcache.correction.anchors import Anchor, AnchorBank, Correction
from agentcache.correction.calibration import CALIBRATION_WINDOW, ReuseController
from agentcache.correction.costs import CostModel
from agentcache.correction.lowrank import as_rows, factorize, from_rows
from agentcache.correction.matching import (add_interpolated_correction, gate_distances, gate_weights,
                                            interpolation_weights, normalized_entropy)
from agentcache.correction.plan import Piece, Planned, PHDecision, Served, SharedContextStrategy, TokenizedCall
from agentcache.correction.sources import SourceFinder
from agentcache.correction.store import Materialization, SegmentStore
from agentcache.correction.strategies import Strategy
from agentcache.correction.replays import REPLAY_PRIORITY, dense_replay, exact_reference, shadow_run
from agentcache.correction.siblings import Leader, SiblingReads, content_of, study_source
from agentcache.correction.sources import REFERENCE
from agentcache.correction.verification import CONTEXT_FREE_VERDICTS, MIN_VERDICTS, Verdict, Verification
from agentcache.engine.kv import SegmentKV, all_finite
from agentcache.engine.protocol import Engine, SegmentPlan, Step
from agentcache.idle import Lesson
from agentcache.engine.tokens import common_prefix
from agentcache.errors import InputError
from agentcache.isolation import Scope

__all__ = ["Corrector", "PreparedAnchor", "UsedAnchors", "DEFERRED"]

log = logging.getLogger(__name__)

TOKEN_WEIGHT_TEMPERATURE = 1.0  # softmax temperature of the token-wise interpolation weights (App. A.3)
GATE_LOG = 512  # the latest planned segments kept for calibrating the gate
DEFERRED = object()  # `prepare`'s answer when the call's learning waits for idle time (`lessons`)


@dataclass(frozen=True)
class UsedAnchors:
    """A correction's `PHDecision.detail`: the anchors it interpolated (credited a use when it is served)."""

    anchors: tuple[Anchor, ...]


@dataclass(frozen=True)
class SiblingRead:
    """A `first` decision's detail: siblings read the segment, and the edge from their leader to
    this agent waits for verification (learned from this call when idle)."""

    leader: Leader


@dataclass(frozen=True)
class PreparedAnchor:
    """An anchor built for a commit: `AnchorBank.add`'s arguments (less the pool key), or the error."""

    args: tuple | None
    seconds: float
    error: BaseException | None = None


class Corrector(SharedContextStrategy):
    def __init__(self, engine: Engine, strategy: Strategy, anchor_bytes: int, store_bytes: int) -> None:
        self.engine = engine
        self.strategy = strategy
        self.bank = AnchorBank(strategy.max_anchors, anchor_bytes)
        self.store = SegmentStore(store_bytes)
        self.sources = SourceFinder(engine, self.store, strategy.chained, prefer_exact=strategy.accept == "verified")
        self.faults: Counter[str] = Counter()  # real faults only: each one fell back to dense prefill
        self.tau = strategy.tau  # the gate's threshold; `reuse_control` sets it for a target reuse ratio
        # planned segments that had a source: (gate entropy, or None when the gate was not reached; tokens)
        self.gate_log: deque[tuple[float | None, int]] = deque(maxlen=GATE_LOG)
        self.reuse_control: ReuseController | None = None  # from the first calibration on
        self.planned = 0  # segments ever logged in gate_log
        self.anchor_build_s = 0.0
        self.verified = strategy.accept == "verified"
        self.verification = Verification()
        # KVCMAS weighs each segment's reuse against its cost; the baselines reuse whatever they can
        self.costs = CostModel() if self.verified and strategy.reuse else None
        self.siblings = SiblingReads()

    def fault(self, kind: str, what: str, exc: BaseException | None = None) -> None:
        """Count and log one fault (`kind` is what summary()["faults"] reports)."""
        self.faults[kind] += 1
        log.warning("%s: %s%s", kind, what, f" ({type(exc).__name__}: {exc})" if exc is not None else "")

    # --- a call ----------------------------------------------------------------------------

    def plan_call(self, call: TokenizedCall, *, lineage: str, namespace: str | None,
                  capture_all: bool = False) -> Planned:
        """Decide every PH segment the prefix cache does not already serve. A reused segment is
        injected whole: the engine serves from its prefix cache whatever it holds of it at
        admission; the prefix cache is asked here only as a hint, to skip correcting what it
        covers. Only PH segments' KV comes back from the engine, unless `capture_all`."""
        for exc in self.siblings.harvest(self.store):
            self.fault("reference_error", "a reference prefill for siblings failed; they prefill densely", exc)
        covered = self.engine.cached_prefix_length(call.prompt, lineage=lineage, cache_salt=namespace)  # a hint
        kept = self._kept_for_next_call(call)  # tokens of this prompt the agent's next call would find cached
        decisions: dict[int, PHDecision] = {}
        pieces: list[Piece] = []
        for index, (seg, tokens) in enumerate(zip(call.segments, call.token_lists)):
            pos = call.starts[index]
            if seg.kind == "ph" and pos + len(tokens) > covered and not self._worth(len(tokens), max(0, kept - pos)):
                decisions[index] = PHDecision("off", reason="not_worth")  # as NonShared: nothing captured or kept
                pieces.append(Piece(index, SegmentPlan(seg.name, tokens, Step.PREFIX, capture=capture_all)))
                continue
            if seg.kind == "ph" and pos + len(tokens) > covered:
                decision = self.plan(call.scope, call.agent, seg.slot, tokens, seg.source,
                                     after=len(call.prompt) - call.starts[index + 1])
                if decision.reused and decision.covered > covered - pos:
                    kept = 0  # nothing after reused KV is cached: later reuses cost the next call nothing more
                    decisions[index] = decision
                    pieces.extend(Piece(index, plan) for plan in self._injected(seg.slot, tokens, decision))
                    continue
                if decision.reused:  # the prefix cache already serves what the source covers
                    decision = PHDecision("fallback", reason="prefix_covers_source", source=decision.source)
                elif decision.decision == "first":
                    leader = self._siblings_leader(call.scope, seg.slot, tokens)
                    if leader is not None and leader.agent != call.agent:
                        decision = replace(decision, detail=SiblingRead(leader))
                decisions[index] = decision
            pieces.append(Piece(index, SegmentPlan(seg.name, tokens, Step.PREFIX,
                                                   capture=capture_all or seg.kind == "ph")))
        return Planned(tuple(pieces), MappingProxyType(decisions))

    def awaited(self, call: TokenizedCall) -> tuple[Future, ...]:
        """Leader prefills `call` should wait for before it is planned (`siblings`): for each shared
        segment new to its session that siblings read and that is worth reuse, the leader's prompt
        prefilled through the segment, once reuse from it is verified for this sibling (for the
        leader: for any sibling)."""
        if not self.strategy.siblings:
            return ()
        waits: list[Future] = []
        for index, (seg, tokens) in enumerate(zip(call.segments, call.token_lists)):
            if seg.kind != "ph":
                continue
            reader = Leader(call.agent, call.prompt[:call.starts[index]])
            leader = self._siblings_leader(call.scope, seg.slot, tokens, reader)
            if leader is None:
                continue
            tenant = call.scope.tenant
            if leader.agent == call.agent:
                verified = self.verification.serves_from(tenant, seg.slot, leader.agent)
            else:
                edge = _edge_of(tenant, seg.slot, leader.agent, True, call.agent, len(call.prompt) - call.starts[index + 1])
                candidates = self.bank.candidates((tenant, seg.slot), leader.agent, call.agent)
                verified = self.verification.decide(edge, can_correct=bool(candidates))[0] is not None
            if verified:
                future = self.siblings.prefill(self.engine, content_of(call.scope, seg.slot, tokens), leader)
                if not future.done():
                    waits.append(future)
        return tuple(waits)

    def _siblings_leader(self, scope: Scope, slot: str, tokens: Sequence[int],
                         reader: Leader | None = None) -> Leader | None:
        """The leader of this segment's siblings when it is new to the session (no source), read by
        siblings and worth reuse, for a strategy that verifies reuse (`reader`: a call reads it
        now, counted once per call)."""
        if not (self.strategy.siblings and self.verified and self.strategy.chained and self.costs is not None
                and self.engine.supports_realignment and self.costs.worth(len(tokens))):
            return None
        if self.sources.find(scope, slot, tokens, None) is not None:
            return None
        content = content_of(scope, slot, tokens)
        return self.siblings.read(content, reader) if reader is not None else self.siblings.leader(content)

    def _kept_for_next_call(self, call: TokenizedCall) -> int:
        """How many of this prompt's tokens the agent's next call in the session is expected to find
        in the prefix cache if this call is served exactly (learned per agent as calls come)."""
        if self.costs is None:
            return 0
        tenant, session = call.scope.tenant, call.scope.session
        return int(self.costs.continuations.observe(tenant, session, call.agent, call.prompt) * len(call.prompt))

    def _worth(self, tokens: int, lost: int = 0) -> bool:
        """Whether a shared segment this long is worth any reuse work (always, for the baselines),
        `lost` tokens of the agent's next call's prefix hit included."""
        if self.costs is None or self.costs.worth(tokens, lost):
            return True
        self.costs.skipped(tokens)
        return False

    def _injected(self, slot: str, tokens: Sequence[int], decision: PHDecision) -> list[SegmentPlan]:
        """A reused segment's engine segments: its covered part injected (the engine re-aligns it
        from canonical start 0), the rest prefilled."""
        cover = decision.covered
        plans = [SegmentPlan(slot, tokens[:cover], Step.INJECT, decision.inject.slice(0, cover))]
        if cover < len(tokens):
            plans.append(SegmentPlan(slot, tokens[cover:], Step.PREFIX))
        return plans

    @property
    def caches_approximate(self) -> bool:
        """Verified reuse keeps no approximate KV in the prefix cache: a later call would be
        served it as a prefix hit, in a context no shadow run verified."""
        return not self.verified

    def prepare(self, served: Served) -> Mapping[int, PreparedAnchor | None] | object:
        """`DEFERRED`: what this call teaches is built when the engine is idle (`lessons`)."""
        return DEFERRED

    def settle(self, served: Served, prepared: Mapping[int, PreparedAnchor | None] | object | None = None) -> None:
        """Record how each PH segment was materialized and the agent's output: the sources of the
        next edges. Anchors come from `lessons` when `prepared` is DEFERRED, from `prepared` when
        it maps segments to anchors, and are built here when it is None. A fault while recording
        is counted and costs only what it touched; the call's result stands."""
        call, result = served.call, served.result
        self._observe_costs(served)
        for index, seg, tokens, decision, how, kv in served.shared():
            if decision.decision == "off":
                continue
            anchor = (None if prepared is DEFERRED else
                      prepared.get(index) if isinstance(prepared, Mapping) else False)
            try:  # anchors learn only from KV known exact for this prompt (its digest says so)
                self.commit(call.scope, call.agent, seg.slot, tokens, decision, kv, how,
                            own_tokens_exact=kv is not None and kv.exact, hidden=served.hiddens[index],
                            prepared=anchor)
            except Exception as exc:  # noqa: BLE001
                self.fault("commit_error", f"recording agent {call.agent!r}'s segment {seg.slot!r}", exc)
        try:
            if self._worth(max(0, len(result.token_ids) - 1)):
                self.record_output(call.scope, call.agent, result.token_ids[:-1], result.generated_kv,
                                   result.generated_hidden)
        except Exception as exc:  # noqa: BLE001
            self.fault("commit_error", f"recording agent {call.agent!r}'s output", exc)

    def _observe_costs(self, served: Served) -> None:
        """Time the call's prefill and its reused segments' planning for the cost model."""
        if self.costs is None:
            return
        result = served.result
        self.costs.observe_prefill(result.computed_tokens, max(0.0, result.ttft_s - result.queued_s))
        for decision in served.decisions.values():
            if decision.reused:
                self.costs.observe_reuse(decision.covered, decision.plan_s)

    def lessons(self, served: Served) -> list[Lesson]:
        """What a settled call teaches, to learn when the engine is idle: for each PH segment
        prefilled densely while it had a source, whether reusing it would have given the same
        output (shadow runs, `verification`) and the correction it observed (an anchor)."""
        if not (self.strategy.reuse and self.strategy.correct):
            return []
        lessons = self._audits(served) + self._sibling_lessons(served)
        for index, seg, tokens, decision, _, kv in served.shared():
            if not (kv is not None and kv.exact and decision.decision == "fallback" and decision.source is not None):
                continue
            edge = _edge(served.call.scope.tenant, seg.slot, decision.source, served.call.agent, _after(served, index))
            candidates = tuple(self.bank.candidates(edge[:2], edge[2], edge[3]))  # as they are now
            lessons.append(Lesson(
                f"{seg.slot} {edge[2]}->{edge[3]}",
                lambda index=index, tokens=tokens, decision=decision, kv=kv, candidates=candidates, edge=edge:
                    self._study(served, index, tokens, decision, kv, candidates, edge),
                lambda studied, edge=edge: self._learn(edge, studied)))
        return lessons

    def _sibling_lessons(self, served: Served) -> list[Lesson]:
        """A sibling's dense read of a new segment teaches whether reusing its leader's KV of the
        segment gives the same output: the leader's prefill is rebuilt (mostly from the prefix
        cache) and shadow-run when idle."""
        lessons = []
        for index, seg, tokens, decision, _, kv in served.shared():
            if not (isinstance(decision.detail, SiblingRead) and kv is not None and kv.exact):
                continue
            scope, agent, leader = served.call.scope, served.call.agent, decision.detail.leader
            edge = _edge_of(scope.tenant, seg.slot, leader.agent, True, agent, _after(served, index))
            content = content_of(scope, seg.slot, tokens)

            def study(index=index, tokens=tokens, decision=decision, kv=kv, edge=edge, content=content,
                      leader=leader):
                source = study_source(self.engine, content, leader, REPLAY_PRIORITY)
                candidates = tuple(self.bank.candidates(edge[:2], edge[2], edge[3]))
                return self._study(served, index, tokens, replace(decision, source=source), kv, candidates, edge)

            lessons.append(Lesson(f"{seg.slot} {leader.agent}->{agent} (siblings)", study,
                                  lambda studied, edge=edge: self._learn(edge, studied)))
        return lessons

    def _audits(self, served: Served) -> list[Lesson]:
        """A reused call due for an audit (`Verification.audit_due`, per edge) is replayed densely
        when idle: its served output against the exact one is a verdict on every method it used."""
        if not self.verified:
            return []
        tenant, agent = served.call.scope.tenant, served.call.agent
        due = [(_edge(tenant, seg.slot, d.source, agent, _after(served, i)), "raw" if d.decision == "reused" else "corrected")
               for i, seg, _, d, _, _ in served.shared() if d.reused and d.source is not None]
        due = [(edge, method) for edge, method in due if self.verification.audit_due(edge)]
        if not due:
            return []
        return [Lesson(f"audit of {agent}'s call", lambda: self._audit(served, [m for _, m in due]),
                       lambda studied: self._audited([e for e, _ in due], studied))]

    def _audit(self, served: Served, methods: list[str]) -> tuple[list[Verdict], float]:
        started = time.perf_counter()
        return dense_replay(self.engine, served, methods), time.perf_counter() - started

    def _audited(self, edges: list[tuple], studied: tuple[list[Verdict], float]) -> None:
        verdicts, seconds = studied
        for edge, verdict in zip(edges, verdicts):
            self.verification.record(edge, [verdict], seconds / len(edges), audit=True)

    def _study(self, served: Served, index: int, tokens: Sequence[int], decision: PHDecision, kv: SegmentKV,
               candidates: Sequence[Anchor], edge: tuple) -> tuple[list[Verdict], float, PreparedAnchor | None]:
        """A lesson's work, with no lock held: the shadow runs of each reuse method the edge could
        serve (verified acceptance) and, unless raw reuse gave the same output, the anchor of the
        observed correction (factorizing is the costliest learning: done only where it is needed)."""
        source, agent = decision.source, served.call.agent
        verdicts, started = [], time.perf_counter()
        shared = common_prefix(source.token_ids, tokens)
        if self.verified and shared and exact_reference(served, index):
            aligned = self.engine.realign(source.kv.slice(0, shared), 0)
            methods = [("raw", aligned)]
            layout = self.engine.layout
            usable = [a for a in candidates if _fits(a, layout.num_layers, layout.num_kv_heads * layout.head_dim)]
            if usable:
                corrected = self._corrected(aligned, usable, min(shared, max(a.length for a in usable)), agent)
                if corrected is not None:
                    methods.insert(0, ("corrected", corrected))
            verdicts = [shadow_run(self.engine, served, index, shared, reused, method) for method, reused in methods]
        shadow_s = time.perf_counter() - started
        anchor = None
        raw_serves = any(v.method == "raw" and v.agrees for v in verdicts)  # then a correction is not needed
        if not raw_serves and not self._pool_settled(edge):
            anchor = self.prepare_anchor(agent, tokens, decision, kv, own_tokens_exact=True)
        return verdicts, shadow_s, anchor

    def _pool_settled(self, edge: tuple) -> bool:
        """A full pool whose corrections this edge serves learns nothing worth its factorization."""
        pool = self.bank.pools.get(edge[:2])
        record = self.verification.edges.get(edge)
        return (pool is not None and len(pool) >= pool.capacity and record is not None
                and record.choice(can_correct=True) == "corrected")

    def _learn(self, edge: tuple, studied: tuple[list[Verdict], float, PreparedAnchor | None]) -> None:
        """A lesson's result, under the runtime's lock: the verdicts and the anchor."""
        verdicts, shadow_s, anchor = studied
        if verdicts:
            self.verification.record(edge, verdicts, shadow_s)
        if anchor is None:
            return
        self.anchor_build_s += anchor.seconds
        if anchor.error is not None:
            self.fault("anchor_build_error", f"no anchor from agent {edge[3]!r}'s fallback on slot {edge[1]!r}",
                       anchor.error)
        elif anchor.args is not None:
            self._insert_anchor((edge[0], edge[1]), anchor.args)

    def _insert_anchor(self, pool_key: tuple, args: tuple) -> None:
        held = self.bank.anchor(pool_key, args[0])
        if held is None or held.length == args[2].length:  # another call may have added one since
            self.bank.add(pool_key, *args)

    def refused(self, decisions: Mapping[int, PHDecision], exc: BaseException, agent: str) -> None:
        self.fault("engine_rejected", f"the engine refused reused KV for agent {agent!r}; prefilling densely", exc)
        for decision in decisions.values():
            if decision.reused and decision.source is not None:
                self.store.remove(decision.source.id)

    def figures(self) -> dict:
        faults = dict(self.faults)
        if self.store.dropped_corrupt:
            faults["corrupt_source"] = self.store.dropped_corrupt
        return dict(
            anchors=self.bank.num_anchors, anchor_bytes=self.bank.nbytes, anchors_evicted=self.bank.evicted,
            store_bytes=self.store.nbytes, store_entries=len(self.store), anchor_build_s=self.anchor_build_s,
            anchor_dense_bytes=self.bank.dense_numel * self.engine.layout.dtype.itemsize,  # the KV they describe
            gate_tau=self.tau, gate_calibration=self.calibrated, acceptance=self.strategy.accept,
            **(self.verification.figures() if self.verified else {}),
            **(self.costs.figures() if self.costs is not None else {}),
            **(self.siblings.figures() if self.verified else {}),
            faults=faults,  # real faults only; normal fallbacks are in fallback_reasons
        )

    def forget(self, scope: Scope) -> None:
        """A session ended: its source caches go."""
        self.store.drop_scope(scope)

    # --- one shared segment, before the call -----------------------------------------------

    def plan(self, scope: Scope, agent: str, slot: str, token_ids: Sequence[int],
             source: str | None = None, *, start: int = 0, lead_in: Sequence[int] | None = None,
             after: int = 0) -> PHDecision:
        """How `agent` should materialize this PH segment; `source` pins the edge's source agent.
        `start`: where the segment sits in the call; `lead_in`: tokens (BOS first) a context-free
        reference prefill puts before the segment (default: BOS and a neutral newline); `after`:
        how many of the call's tokens follow the segment (verification tells calls apart by it)."""
        started, references_before = time.perf_counter(), self.sources.reference_s
        try:
            decision = self._plan(scope, agent, slot, token_ids, source, start, lead_in, after)
        except Exception as exc:  # noqa: BLE001 - never serve a cache a fault touched: prefill
            self.fault("plan_error", f"planning slot {slot!r} for agent {agent!r}; prefilling densely", exc)
            decision = PHDecision("fallback", reason="error")
        decision = replace(decision, plan_s=time.perf_counter() - started,
                           setup_s=decision.setup_s + self.sources.reference_s - references_before)
        if decision.source is not None and self.strategy.correct:
            self._log_gate(decision, len(token_ids))
        return decision

    def _log_gate(self, decision: PHDecision, tokens: int) -> None:
        """Log an eligible segment's gate entropy; a controlled gate follows it, and a target reuse
        ratio starts being controlled after `calibrate_after` segments with gate evaluations."""
        self.gate_log.append((decision.entropy, tokens))
        self.planned += 1
        if self.reuse_control is not None:
            self.tau = self.reuse_control.record(decision.entropy, tokens, decision.covered if decision.reused else 0)
            return
        target = self.strategy.target_reuse
        if (target is not None and self.planned >= self.strategy.calibrate_after
                and any(entropy is not None for entropy, _ in self.gate_log)):
            self.calibrate(target, CALIBRATION_WINDOW)

    def calibrate(self, target: float, recent: int | None = None) -> float:
        """Hold the gate at reuse ratio `target` from now on (the papers tune τ per workload): τ is
        read from the gate entropies of the latest `recent` eligible segments (all that are kept by
        default) and then follows every segment planned (`calibration.ReuseController`); returns τ.
        Needs gate evaluations."""
        if not self.strategy.correct:
            raise InputError(f"strategy {self.strategy.name!r} has no correction gate to calibrate")
        history = list(self.gate_log)[-recent:] if recent else list(self.gate_log)
        try:
            self.reuse_control = ReuseController(target, history)
        except ValueError as exc:
            raise InputError(str(exc)) from None
        self.tau = self.reuse_control.tau
        log.info("gate held at reuse %.2f: tau = %.4f from %d segments", target, self.tau, len(history))
        return self.tau

    @property
    def calibrated(self) -> dict | None:
        """How τ is set, once a target reuse ratio holds it."""
        return self.reuse_control.report() if self.reuse_control is not None else None

    def _plan(self, scope: Scope, agent: str, slot: str, token_ids: Sequence[int],
              source_agent: str | None, start: int = 0, lead_in: Sequence[int] | None = None,
              after: int = 0) -> PHDecision:
        if not self.strategy.reuse:
            return PHDecision("off")
        found = self.sources.find(scope, slot, token_ids, source_agent, lead_in)
        if found is None:
            return PHDecision("first") if self.strategy.chained else PHDecision("fallback", reason="no_source")
        source, shared = found
        if source.agent == agent and source.how == "dense":  # its own prefill (a siblings' leader): a prefix hit
            return PHDecision("fallback", reason="own_prefill")
        if not self.engine.supports_realignment:
            return PHDecision("fallback", reason="not_realignable", source=source)
        method, refusal = self._accepts(scope, agent, slot, source, after)  # bookkeeping only: before any tensor work
        if refusal is not None:
            return PHDecision("fallback", reason=refusal, source=source)
        if not self._source_is_sound(source):
            return PHDecision("fallback", reason="bad_source")
        if method == "raw":  # at the source's positions: the engine moves it where the call reads it
            return PHDecision("reused", source=source, covered=shared, inject=source.kv.slice(0, shared))
        return self._reuse(scope, agent, slot, source, shared, start)

    def _accepts(self, scope: Scope, agent: str, slot: str, source: Materialization,
                 after: int = 0) -> tuple[str | None, str | None]:
        """(reuse method, refusal) from what is known without touching a tensor: verified
        acceptance's record of the edge ("raw" or "corrected"), or for the entropy gate whether
        the edge has the anchors it needs (None: decide later)."""
        if not self.strategy.correct:
            return None, None
        candidates = self.bank.candidates((scope.tenant, slot), source.agent, agent)
        if self.verified:
            return self.verification.decide(_edge(scope.tenant, slot, source, agent, after), can_correct=bool(candidates),
                                            needed=CONTEXT_FREE_VERDICTS if source.agent == REFERENCE else MIN_VERDICTS)
        if len(candidates) < (1 if self.strategy.max_anchors == 1 else 2):
            return None, "few_anchors"
        return None, None

    def _reuse(self, scope: Scope, agent: str, slot: str, source: Materialization, shared: int,
               start: int) -> PHDecision:
        """The decision for a sound source whose first `shared` tokens the call reads: raw reuse
        (FullShared; the engine moves the keys, one rotation), or a correction of the source
        re-aligned to canonical positions, where the anchors are."""
        if not self.strategy.correct:
            return PHDecision("reused", source=source, covered=shared, inject=source.kv.slice(0, shared))
        try:
            aligned = self.engine.realign(source.kv.slice(0, shared), 0)
        except Exception:
            self.store.remove(source.id)  # a source that cannot be re-aligned is not used again
            raise
        try:
            return self._correct(scope, agent, slot, source, aligned, start)
        except Exception:
            # Not knowing which part was bad, use none of what the fault touched again: the source and
            # the anchors of this edge (they are learned anew from the next fallbacks).
            self.store.remove(source.id)
            for anchor in self.bank.candidates((scope.tenant, slot), source.agent, agent):
                self.bank.drop((scope.tenant, slot), anchor)
            raise

    def _source_is_sound(self, source: Materialization) -> bool:
        """The stored KV fits the model and is finite; otherwise it is removed from the store."""
        kv = source.kv
        try:
            kv.check(self.engine.layout, len(source.token_ids), f"source cache {source.id}")
            sound = all_finite(kv.keys, kv.values)
        except Exception:  # noqa: BLE001 - a mis-shaped, mistyped or missing KV: not a source
            sound = False
        if not sound:
            self.faults["bad_source"] += 1
            log.warning("removing source cache %s of slot %r: wrong shape or NaN/Inf", source.id, source.slot)
            self.store.remove(source.id)
        return sound

    def _correct(self, scope: Scope, agent: str, slot: str, source: Materialization, aligned: SegmentKV,
                 start: int = 0) -> PHDecision:
        layout = self.engine.layout
        features = layout.num_kv_heads * layout.head_dim
        pool_key = (scope.tenant, slot)
        candidates = self.bank.candidates(pool_key, source.agent, agent)
        for anchor in candidates:
            if not _fits(anchor, layout.num_layers, features):
                self.fault("bad_anchor", f"dropping anchor {anchor.source_id} of slot {slot!r}: its shapes do not "
                           f"fit {self.engine.model_name}")
                self.bank.drop(pool_key, anchor)
                return PHDecision("fallback", reason="bad_anchor", source=source)
        length = aligned.length
        entropy = None
        if self.verified or (self.strategy.max_anchors == 1 and len(candidates) == 1):
            # verified on this edge (or V = 1: the sole anchor): every anchor, no gate
            compatible, k = candidates, min(length, max(a.length for a in candidates))
        else:
            # Compare over the longest prefix at least two anchors cover (App. A.3, Eq. 9-11).
            k = min(length, sorted((a.length for a in candidates), reverse=True)[1])
            compatible = [a for a in candidates if a.length >= k]
            values = as_rows(aligned.values[:, :, :k]).float()  # (L, k, F)
            distances = gate_distances(values, [a.values for a in compatible], k)
            if not bool(torch.isfinite(distances).all()):
                self._drop_non_finite(pool_key, compatible)
                return PHDecision("fallback", reason="nonfinite", source=source)
            entropy = normalized_entropy(gate_weights(distances, self.strategy.temperature, self.strategy.gate_scale))
            if not entropy <= self.tau:
                return PHDecision("fallback", reason="gate", source=source, entropy=entropy)
            if self.reuse_control is not None and not self.reuse_control.allows(entropy, length):
                return PHDecision("fallback", reason="budget", source=source, entropy=entropy)
        corrected = self._corrected(aligned, compatible, k, agent)
        if corrected is None:
            self._drop_non_finite(pool_key, compatible)
            return PHDecision("fallback", reason="nonfinite", source=source, entropy=entropy)
        return PHDecision("corrected", source=source, covered=length, inject=corrected,
                          entropy=entropy, detail=UsedAnchors(tuple(compatible)))

    def _corrected(self, aligned: SegmentKV, anchors: Sequence[Anchor], k: int, agent: str) -> SegmentKV | None:
        """`aligned` (canonical positions) with its first `k` tokens corrected for `agent` by the
        anchors' interpolated corrections (Eq. 8); None when the result is not finite."""
        layout = self.engine.layout
        corrected = []
        for part in ("keys", "values"):
            rows = as_rows(getattr(aligned, part)).to(torch.float32, copy=True)  # (L, S, F); the source stays intact
            # layer 0 depends on position only (exact after alignment); rows past k stay the aligned
            # source: no extrapolation past the anchors
            target = rows[1:, :k]
            weights, reach = interpolation_weights(target, [getattr(a, part) for a in anchors],
                                                   TOKEN_WEIGHT_TEMPERATURE, base_layer_offset=1)
            add_interpolated_correction(target, weights, [getattr(a.corrections[agent], part) for a in anchors], reach)
            corrected.append(from_rows(rows.to(layout.dtype), layout.num_kv_heads))
        if not all_finite(*corrected):
            return None
        return SegmentKV(corrected[0], corrected[1], 0)

    def _drop_non_finite(self, pool_key: tuple, anchors: list[Anchor]) -> None:
        self.faults["nonfinite"] += 1
        for anchor in anchors:
            if not anchor.is_finite():
                log.warning("dropping anchor %s of slot %r: it holds NaN or Inf", anchor.source_id, pool_key[1])
                self.bank.drop(pool_key, anchor)

    # --- one shared segment, after the call ------------------------------------------------

    def prepare_anchor(self, agent: str, token_ids: Sequence[int], decision: PHDecision, kv: SegmentKV | None,
                       own_tokens_exact: bool) -> PreparedAnchor | None:
        """The anchor a commit of this segment would insert, built without changing anything (so the
        runtime can factorize outside its lock, off other calls' critical path); None when the
        segment teaches nothing. A fault while building is returned, to be counted at the commit.
        Only a dense fallback teaches the pool (accepted corrections are never inserted), and only
        when its tokens were prefilled or exact prefix hits (not the lineage's maybe corrected blocks)."""
        if not (kv is not None and self.strategy.reuse and self.strategy.correct and own_tokens_exact
                and decision.decision == "fallback" and decision.source is not None):
            return None
        started = time.perf_counter()
        try:
            args = self._build_anchor(agent, decision.source, token_ids, kv)
        except Exception as exc:  # noqa: BLE001 - a fault here costs one anchor, never the call
            return PreparedAnchor(None, time.perf_counter() - started, exc)
        return PreparedAnchor(args, time.perf_counter() - started)

    def commit(self, scope: Scope, agent: str, slot: str, token_ids: Sequence[int], decision: PHDecision,
               kv: SegmentKV | None, how: str, *, own_tokens_exact: bool = True,
               hidden: torch.Tensor | None = None, prepared: PreparedAnchor | None | bool = False) -> None:
        """Record what the segment became in the call (`how`), with its KV `kv`: the next edge's source
        and, after a dense fallback, a new anchor (`prepared` by `prepare_anchor`, or built here when
        False). A fault while building it loses only the anchor. `own_tokens_exact`: none of the
        segment's tokens came from the lineage's approximate blocks."""
        if kv is None or not self.strategy.reuse:
            return
        if prepared is False:
            prepared = self.prepare_anchor(agent, token_ids, decision, kv, own_tokens_exact)
        anchor = None
        if prepared is not None:
            self.anchor_build_s += prepared.seconds
            anchor = prepared.args
            if prepared.error is not None:
                self.fault("anchor_build_error", f"no anchor from agent {agent!r}'s fallback on slot {slot!r}",
                           prepared.error)
        self._credit_uses(decision)
        if self.strategy.chained:
            self.store.put(scope, slot, agent, token_ids, kv, how, hidden=hidden)
        if anchor is not None:
            self._insert_anchor((scope.tenant, slot), anchor)

    def _credit_uses(self, decision: PHDecision) -> None:
        """A reused segment credits every anchor its correction used."""
        if decision.reused and isinstance(decision.detail, UsedAnchors):
            for used in decision.detail.anchors:
                used.uses += 1

    def record_output(self, scope: Scope, agent: str, token_ids: Sequence[int], kv: SegmentKV | None,
                      hidden: torch.Tensor | None = None) -> None:
        """An agent's decoded output becomes the source of its `out:<agent>` slot."""
        if kv is not None and token_ids and self.strategy.reuse:
            self.store.put(scope, f"out:{agent}", agent, token_ids, kv, "decoded", hidden=hidden)

    def _build_anchor(self, agent: str, source: Materialization, token_ids: Sequence[int],
                      dense: SegmentKV) -> tuple | None:
        """The arguments of `AnchorBank.add` for the correction this fallback observed (without the
        pool key), or None when there is nothing to learn. Changes nothing."""
        shared = common_prefix(source.token_ids, token_ids)
        existing = self.bank.anchor((source.scope.tenant, source.slot), source.id)
        if shared == 0 or (existing is not None and existing.length != shared):
            return None  # an anchor's corrections all cover its base's tokens
        aligned = self.engine.realign(source.kv.slice(0, shared), 0)
        target = self.engine.realign(dense.slice(0, shared), 0)
        src_k, src_v = as_rows(aligned.keys).float(), as_rows(aligned.values).float()  # (L, S, F)
        tgt_k, tgt_v = as_rows(target.keys).float(), as_rows(target.values).float()
        delta_k, delta_v = tgt_k[1:] - src_k[1:], tgt_v[1:] - src_v[1:]  # (L-1, S, F)
        if not all_finite(delta_k, delta_v):
            self.fault("nonfinite_delta", f"the observed correction of slot {source.slot!r} holds NaN or Inf")
            return None
        s = self.strategy
        if existing is not None:
            base_k, base_v = existing.keys, existing.values
        else:
            base_k, base_v = factorize(src_k, s.base_rank), factorize(src_v, s.base_rank)
        correction = Correction(factorize(delta_k, s.delta_rank), factorize(delta_v, s.delta_rank))
        return source.id, source.agent, base_k, base_v, agent, correction


def _edge(tenant: str | None, slot: str, source: Materialization, consumer: str, after: int) -> tuple:
    """What verification keys its record by: (tenant, slot, source agent, consumer, whether the
    source is exact, how long the rest of the call is, in powers of 4). A source that was itself
    reused carries its own error down a chain, and an approximate segment that a longer context
    follows can drift where a short one did not (a conversation's later turns): each is verified
    on its own."""
    return _edge_of(tenant, slot, source.agent, source.exact, consumer, after)


def _edge_of(tenant: str | None, slot: str, source_agent: str, exact: bool, consumer: str, after: int) -> tuple:
    return (tenant, slot, source_agent, consumer, exact, after.bit_length() // 2)


def _after(served: Served, index: int) -> int:
    """How many of the call's tokens follow segment `index`."""
    return len(served.call.prompt) - served.call.starts[index + 1]


def _fits(anchor: Anchor, num_layers: int, features: int) -> bool:
    """The anchor's shapes fit the model; an anchor too corrupt to say does not."""
    try:
        return anchor.fits(num_layers, features)
    except Exception:  # noqa: BLE001 - factors that are not even tensors
        return False

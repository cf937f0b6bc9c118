"""The Runtime: one object that runs agent calls with a shared-context strategy.

For each call it tokenizes the segments, serves the longest exact prefix from the engine's
block pool (the agent's own lineage included), asks the corrector how to materialize every
shared segment after it (corrected, raw, or dense), executes the plan on the engine, and then
records each shared segment's cache as the source of the next workflow edge, builds anchors
after dense fallbacks, and keeps the agent's decoded output as the source of `out:<agent>`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from agentcache.correction.corrector import Corrector, PHDecision
from agentcache.correction.strategies import STRATEGIES, Strategy, get_strategy
from agentcache.engine.kv import SegmentKV
from agentcache.engine.protocol import Engine, ExecRequest, ExecResult, SamplingParams, SegmentOutcome, SegmentPlan, Step
from agentcache.errors import KVShapeError, PlanError, RopeAlignmentError
from agentcache.metrics import CallResult, SegmentReport, summarize
from agentcache.scout.config import ScoutConfig
from agentcache.scout.learner import TransitionLearner
from agentcache.scout.policies import SurvivalPolicy
from agentcache.scout.recorder import TraceRecorder
from agentcache.scout.warmup import Warmup, WarmupCoordinator
from agentcache.segments import AgentCall, DispatchEvent, Segment, output_slot

__all__ = ["Runtime", "RuntimeConfig"]

log = logging.getLogger(__name__)

_SESSIONS_REMEMBERED = 64  # sessions whose shared texts `shared_texts` keeps


@dataclass(frozen=True)
class RuntimeConfig:
    anchor_bytes: int = 2**30  # all anchor pools together
    store_bytes: int = 2**30  # materialized shared-segment caches (chain sources)
    self_check: bool = True  # verify re-alignment and correction on this model before correcting
    keep_kv: bool = False  # keep each call's KV and engine result on its CallResult (for measuring)
    warmup: bool = False  # between calls, prefill the predicted next agent's prefix (CacheScout)
    # the warm-up gate and rate limit (r_min, warmup_min_gap); the learning constants too when the
    # engine's eviction policy is not Survival (Survival brings its own ScoutConfig)
    scout: ScoutConfig = field(default_factory=ScoutConfig)

    def __post_init__(self) -> None:
        for name in ("anchor_bytes", "store_bytes"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"RuntimeConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.scout, ScoutConfig):
            raise ValueError(f"RuntimeConfig.scout must be a ScoutConfig, got {type(self.scout).__name__}")


@dataclass
class _Piece:
    """One engine segment: a whole call segment, or part of a PH segment split at its reuse cover."""

    index: int  # the call segment it belongs to
    plan: SegmentPlan


class Runtime:
    """Runs agent calls end to end; see `run`. Thread-safe: calls run one at a time."""

    def __init__(
        self,
        engine: Engine | None = None,
        *,
        model: Any = None,
        strategy: str | Strategy = "kvcmas",
        config: RuntimeConfig | None = None,
        check: Any = None,
        recorder: TraceRecorder | None = None,
    ) -> None:
        if engine is None:
            from agentcache.engine.embedded import EmbeddedEngine
            from agentcache.models import DEFAULT_MODEL

            engine = EmbeddedEngine(model or DEFAULT_MODEL)
        elif model is not None:
            raise ValueError("give either an engine or a model, not both")
        self.engine = engine
        self.config = config or RuntimeConfig()
        self.requested_strategy = get_strategy(strategy)
        self.check = check
        self.refusal: str | None = None  # why a requested correcting strategy was refused
        self.strategy = self._vet(self.requested_strategy)
        self.corrector = Corrector(engine, self.strategy, self.config.anchor_bytes, self.config.store_bytes)
        self.results: list[CallResult] = []
        self.events: list[DispatchEvent] = []  # the adapters' dispatch events, in call order
        self._shared_texts: OrderedDict[str | None, dict[str, str]] = OrderedDict()  # session -> text -> slot
        self._texts_lock = threading.Lock()  # not the runtime's lock: adapters read texts while a call runs
        self._waiting = 0  # calls that entered `run` and wait for the lock: a warm-up must not delay them
        self._waiting_lock = threading.Lock()
        self._last_output: dict[str, str] = {}
        self._id = uuid.uuid4().hex[:12]
        self._lock = threading.RLock()
        self.recorder = recorder
        self._own_learner: TransitionLearner | None = None
        self.warmup_coordinator = self._warmup_coordinator() if self.config.warmup else None
        self._warmup_thread: threading.Thread | None = None
        self.warmup_faults = 0
        self.warmup_s = 0.0  # engine time spent warming up, off every call's critical path

    def _warmup_coordinator(self) -> WarmupCoordinator | None:
        """Shares the learner of the engine's Survival policy; any other policy gets a learner of its
        own (then `config.scout` sets its constants; with Survival the policy's own config does)."""
        if not getattr(getattr(self.engine, "config", None), "prefix_caching", True):
            log.warning("warm-up is off: the engine does not cache prefixes, so a warm-up could serve nothing")
            return None
        policy = getattr(getattr(self.engine, "pool", None), "policy", None)
        if isinstance(policy, SurvivalPolicy):
            return WarmupCoordinator(policy.learner, self.config.scout, min_prefix=self.engine.block_size)
        self._own_learner = TransitionLearner(self.config.scout.smoothing, max_agents=self.config.scout.max_agents)
        return WarmupCoordinator(self._own_learner, self.config.scout, min_prefix=self.engine.block_size)

    def _vet(self, strategy: Strategy) -> Strategy:
        """Refuse cross-context reuse on a model that fails the self-check: run NonShared instead."""
        if not strategy.reuse:
            return strategy
        if not self.engine.supports_realignment:
            log.warning("%s cannot re-align RoPE exactly; running NonShared instead of %s",
                        self.engine.model_name, strategy.name)
            self.refusal = f"{self.engine.model_name}: RoPE re-alignment is not exact on this model"
            return STRATEGIES["nonshared"]
        if self.check is None and self.config.self_check:
            from agentcache.selfcheck import check_model

            self.check = check_model(self.engine)
        if self.check is not None and not self.check.passed:
            log.warning("self-check failed on %s (%s); running NonShared instead of %s",
                        self.engine.model_name, self.check.reason, strategy.name)
            self.refusal = f"{self.engine.model_name} failed the self-check: {self.check.reason}"
            return STRATEGIES["nonshared"]
        return strategy

    # --- running calls -------------------------------------------------------------------

    def run(
        self,
        call: AgentCall,
        sampling: SamplingParams | None = None,
        *,
        event: DispatchEvent | None = None,
        on_token: Callable[[int], None] | None = None,
    ) -> CallResult:
        """Run one agent call and return its text, timings and per-segment decisions.

        `event` is the adapter's dispatch event for this call (it must name the call's agent and
        session); `on_token` is called with each generated token id as it is produced."""
        if not isinstance(call, AgentCall):
            raise TypeError(f"Runtime.run takes an AgentCall, got {type(call).__name__}")
        if event is not None:
            if not isinstance(event, DispatchEvent):
                raise TypeError(f"event must be a DispatchEvent, got {type(event).__name__}")
            if (event.agent, event.session) != (call.agent, call.session):
                raise PlanError(f"dispatch event for agent {event.agent!r} (session {event.session!r}) does not "
                                f"match the call of agent {call.agent!r} (session {call.session!r})")
        sampling = sampling or SamplingParams()
        started = time.perf_counter()  # TTFT includes waiting for a call or warm-up holding the runtime
        self._count_waiting(+1)
        with self._lock, torch.inference_mode():
            self._count_waiting(-1)
            queued = time.perf_counter() - started  # waiting for other calls or a warm-up
            result = self._run(call, sampling, started, queued, on_token, event)
            if event is not None:  # a failed call records no event
                self.events.append(event)
            if self.warmup_coordinator is not None:
                self._plan_warmup(call.session)
        return result

    def _count_waiting(self, change: int) -> None:
        with self._waiting_lock:
            self._waiting += change

    async def arun(
        self,
        call: AgentCall,
        sampling: SamplingParams | None = None,
        *,
        event: DispatchEvent | None = None,
        on_token: Callable[[int], None] | None = None,
    ) -> CallResult:
        """`run` on a worker thread, so a framework's event loop keeps going while the engine works.
        Concurrent calls are safe: they run one at a time on the engine."""
        return await asyncio.to_thread(self.run, call, sampling, event=event, on_token=on_token)

    # --- warm-up (CacheScout) --------------------------------------------------------------

    def _plan_warmup(self, session: str | None) -> None:
        """After a call, under the lock: plan a warm-up and start it on a background thread, where
        it runs once the lock is free. A call arriving meanwhile waits (in its TTFT). Planning
        faults are counted and logged: a warm-up never costs a call."""
        if self._warmup_thread is not None and self._warmup_thread.is_alive():
            self.warmup_coordinator.outcomes["busy"] += 1  # the previous warm-up has not run yet
            return
        if self._waiting:  # dispatched calls are queued: they come first, and may well make it moot
            self.warmup_coordinator.outcomes["calls_waiting"] += 1
            return
        try:
            plan = self.warmup_coordinator.next_warmup(session, self._prefix_cached)
        except Exception as exc:
            self.warmup_faults += 1
            log.warning("planning a warm-up failed: %s", exc)
            return
        if plan is not None:
            self._warmup_thread = threading.Thread(target=self._warm, args=(plan,), name="agentcache-warmup",
                                                   daemon=True)
            self._warmup_thread.start()

    def _prefix_cached(self, prefix: Sequence[int]) -> bool:
        servable = (len(prefix) - 1) // self.engine.block_size * self.engine.block_size  # what a hit can cover
        return self.engine.cached_prefix_length(prefix) >= servable

    def _warm(self, plan: Warmup) -> None:
        request = ExecRequest([SegmentPlan(f"warmup:{plan.agent}", list(plan.prefix), Step.PREFIX)],
                              SamplingParams(max_tokens=1), owner=plan.agent, warmup=True, capture_kv=False)
        try:
            with self._lock, torch.inference_mode():
                if self._waiting:  # a call arrived since the plan: never delay it for a guess
                    self.warmup_coordinator.outcomes["preempted"] += 1
                    return
                started = time.perf_counter()
                self.engine.execute(request)
                self.warmup_s += time.perf_counter() - started
        except Exception as exc:  # a failed warm-up costs a future hit, never a call
            self.warmup_faults += 1
            log.warning("warm-up of agent %r failed: %s", plan.agent, exc)

    def wait_warmup(self) -> None:
        """Block until a planned warm-up has run. Do not call it while holding the runtime's lock."""
        thread = self._warmup_thread
        if thread is not None:
            thread.join()

    def close(self) -> None:
        """Let a planned warm-up finish (call before exiting; warm-ups run on a daemon thread)."""
        self.wait_warmup()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def output_segment(self, agent: str) -> Segment:
        """A PH segment holding `agent`'s latest output, for another agent's call."""
        if agent not in self._last_output:
            raise PlanError(f"agent {agent!r} has produced no output yet; known: {sorted(self._last_output)}")
        return Segment.ph(output_slot(agent), self._last_output[agent])

    def shared_texts(self, session: str | None = None) -> dict[str, str]:
        """The shared texts (PH contents and agents' outputs, stripped) seen in `session`, each
        with its slot: what an adapter can find quoted inside a monolithic prompt."""
        with self._texts_lock:
            return dict(self._shared_texts.get(session, {}))

    def _remember_texts(self, call: AgentCall, output: str) -> None:
        with self._texts_lock:
            texts = self._shared_texts.setdefault(call.session, {})
            self._shared_texts.move_to_end(call.session)
            for seg in call.segments:
                if seg.kind == "ph" and seg.text and seg.text.strip():
                    texts.setdefault(seg.text.strip(), seg.slot)
            if output.strip():
                texts[output.strip()] = output_slot(call.agent)
            while len(self._shared_texts) > _SESSIONS_REMEMBERED:
                self._shared_texts.popitem(last=False)

    def _lineage(self, call: AgentCall) -> str:
        """Salt for the approximate KV a call caches: only this agent's later calls in the same
        runtime and session may be served from it."""
        return f"{self._id}/{call.session or '-'}/{call.agent}"

    def _tokenize(self, call: AgentCall) -> tuple[list[Segment], list[list[int]]]:
        """The call's segments and their tokens. The prompt starts with BOS: in the first segment
        when it is PF, as a PF segment of its own before a leading PH (whose tokens must match
        other agents' copies of the same content)."""
        segments, ids = list(call.segments), []
        bos = self.engine.bos_token_id
        for i, seg in enumerate(segments):
            tokens = list(seg.token_ids) if seg.token_ids is not None else self.engine.tokenize(seg.text)
            if not tokens:
                raise PlanError(f"segment {i} ({seg.name}) of agent {call.agent!r} tokenizes to nothing")
            ids.append(tokens)
        if bos is not None and ids[0][0] != bos:
            if segments[0].kind == "pf":
                ids[0].insert(0, bos)
            else:
                segments.insert(0, Segment(kind="pf", token_ids=(bos,)))
                ids.insert(0, [bos])
        return segments, ids

    def _run(
        self, call: AgentCall, sampling: SamplingParams, started: float, queued: float,
        on_token: Callable[[int], None] | None, event: DispatchEvent | None,
    ) -> CallResult:
        agent = call.agent
        lineage = self._lineage(call)
        segments, token_lists = self._tokenize(call)
        prompt = [t for tokens in token_lists for t in tokens]
        hit = self.engine.cached_prefix_length(prompt, lineage=lineage)

        decisions: dict[int, PHDecision] = {}
        pieces: list[_Piece] = []
        leading = True  # still inside the run of segments the prefix cache is looked up for
        pos = 0
        for index, (seg, tokens) in enumerate(zip(segments, token_lists)):
            end = pos + len(tokens)
            if seg.kind == "ph" and end > hit:
                decision = self.corrector.plan(agent, seg.slot, tokens, seg.source)
                skip = max(0, hit - pos)  # leading tokens of the segment the prefix cache serves
                # Only a hit reaching into the segment matters; was it free of the lineage's approximate blocks?
                decision.prefix_exact = skip == 0 or self.engine.cached_prefix_length(prompt) >= hit
                decisions[index] = decision
                if decision.reused and decision.covered > skip:
                    cover = decision.covered
                    if skip:
                        pieces.append(_Piece(index, SegmentPlan(seg.slot, tokens[:skip], Step.PREFIX)))
                    kv = decision.inject.slice(skip, cover)  # canonical start `skip`; the engine re-aligns it
                    pieces.append(_Piece(index, SegmentPlan(seg.slot, tokens[skip:cover], Step.INJECT, kv)))
                    if cover < len(tokens):
                        pieces.append(_Piece(index, SegmentPlan(seg.slot, tokens[cover:], Step.DENSE)))
                    leading = False
                    pos = end
                    continue
                if decision.reused:  # the prefix cache already serves what the source covers
                    decisions[index] = PHDecision("fallback", reason="prefix_covers_source", source=decision.source)
            pieces.append(_Piece(index, SegmentPlan(seg.name, tokens, Step.PREFIX if leading else Step.DENSE)))
            pos = end

        try:
            result = self.engine.execute(ExecRequest([p.plan for p in pieces], sampling, lineage=lineage, owner=agent,
                                                     session=call.session, on_token=on_token))
        except (KVShapeError, RopeAlignmentError) as exc:
            if not any(p.plan.step is Step.INJECT for p in pieces):
                raise
            # The engine refused reused KV: never serve it, prefill everything instead.
            log.warning("engine refused reused KV for agent %r (%s); prefilling densely", agent, exc)
            for index, decision in decisions.items():
                if decision.reused:
                    decisions[index] = PHDecision("fallback", reason="engine_rejected")
            pieces = [_Piece(i, SegmentPlan(s.name, t, Step.PREFIX)) for i, (s, t) in enumerate(zip(segments, token_lists))]
            result = self.engine.execute(ExecRequest([p.plan for p in pieces], sampling, lineage=lineage, owner=agent, session=call.session,
                                                     on_token=on_token))
        first_token = time.perf_counter() - result.total_s + result.ttft_s  # when the engine produced it
        ttft = first_token - started

        outcomes: list[list[SegmentOutcome]] = [[] for _ in segments]  # engine segments per call segment
        for piece, outcome in zip(pieces, result.segments):
            outcomes[piece.index].append(outcome)
        kvs = [_joined([o.kv for o in parts]) for parts in outcomes]
        reports = self._commit(agent, segments, token_lists, outcomes, decisions, result, kvs)
        self._last_output[agent] = result.text
        self._remember_texts(call, result.text)
        outcome = CallResult(
            agent=agent, text=result.text, token_ids=result.token_ids, finish_reason=result.finish_reason,
            ttft_s=ttft, queued_s=queued, total_s=time.perf_counter() - started, event=event, prompt_tokens=result.prompt_tokens,
            cached_tokens=result.cached_tokens,
            ph_tokens=sum(r.length for r in reports if r.kind == "ph"),
            eligible_tokens=sum(r.length - r.cached_tokens for r in reports if r.kind == "ph" and r.source is not None),
            reused_tokens=sum(r.injected_tokens for r in reports if r.kind == "ph"),
            segments=reports, prompt_ids=prompt,
            engine_result=result if self.config.keep_kv else None, segment_kv=kvs if self.config.keep_kv else [],
        )
        self.results.append(outcome)
        if self.warmup_coordinator is not None or self.recorder is not None:
            self._observe(call, segments, token_lists, prompt, result.token_ids)
        return outcome

    def _observe(
        self, call: AgentCall, segments: list[Segment], token_lists: list[list[int]], prompt: list[int],
        output: list[int],
    ) -> None:
        """Tell the warm-up coordinator and the trace recorder about a finished call; the agent's
        prefix is its leading PF segments."""
        prefix_len = 0
        for seg, tokens in zip(segments, token_lists):
            if seg.kind != "pf":
                break
            prefix_len += len(tokens)
        if self.warmup_coordinator is not None:
            if self._own_learner is not None:  # the engine's policy does not learn dispatches itself
                self._own_learner.observe(call.agent, call.session)
            self.warmup_coordinator.observe(call.agent, prompt, prefix_len)
        if self.recorder is not None:
            self.recorder.record(call.agent, call.session, prompt, output, prefix_len)

    def _commit(
        self,
        agent: str,
        segments: list[Segment],
        token_lists: list[list[int]],
        outcomes: list[list[SegmentOutcome]],
        decisions: dict[int, PHDecision],
        result: ExecResult,
        kvs: list[SegmentKV | None],
    ) -> list[SegmentReport]:
        """After the first token: record materializations and anchors, and report each segment."""
        reports = []
        for index, (seg, tokens, parts) in enumerate(zip(segments, token_lists, outcomes)):
            cached = sum(o.cached_tokens for o in parts)
            computed = sum(o.computed_tokens for o in parts)
            injected = sum(o.injected_tokens for o in parts)
            made = "prefix_hit" if cached == len(tokens) else "dense"
            decision = decisions.get(index)
            label = decision.decision if decision is not None else made
            if seg.kind == "ph":
                self.corrector.commit(agent, seg.slot, tokens, decision or PHDecision(made), kvs[index],
                                      how=label if decision is not None and decision.reused else made)
            reports.append(SegmentReport(
                name=seg.name, kind=seg.kind, start=parts[0].start, length=len(tokens), decision=label,
                reason=decision.reason if decision else None, cached_tokens=cached, computed_tokens=computed,
                injected_tokens=injected, entropy=decision.entropy if decision else None,
                source=decision.source.agent if decision and decision.source else None,
                plan_s=decision.plan_s if decision else 0.0,
            ))
        fed = result.token_ids[:-1]
        self.corrector.record_output(agent, fed, result.generated_kv)
        return reports

    # --- figures -------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        with self._lock:
            return self._summary()

    def _summary(self) -> dict[str, Any]:
        figures = summarize(self.results)
        bank, store = self.corrector.bank, self.corrector.store
        figures.update(
            model=self.engine.model_name,
            strategy=self.strategy.name,
            requested_strategy=self.requested_strategy.name,
            refusal=self.refusal,
            anchors=bank.num_anchors,
            anchor_bytes=bank.nbytes,
            anchors_evicted=bank.evicted,
            store_bytes=store.nbytes,
            store_entries=len(store),
            anchor_build_s=self.corrector.anchor_build_s,
            faults=dict(self.corrector.fallbacks),
            eviction=getattr(getattr(getattr(self.engine, "pool", None), "policy", None), "name", None),
            warmups=dict(self.warmup_coordinator.outcomes) if self.warmup_coordinator is not None else None,
            warmup_faults=self.warmup_faults,
            warmup_s=self.warmup_s,
            dispatches=dict(Counter(f"{e.framework}:{e.agent}" for e in self.events)),
        )
        return figures

    def export_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            payload = {"summary": self._summary(), "calls": [r.to_dict() for r in self.results]}
        path.write_text(json.dumps(payload, indent=2))
        return path


def _joined(parts: Sequence[SegmentKV | None]) -> SegmentKV | None:
    """One segment's KV from the engine segments it was split into (contiguous positions)."""
    if not parts or any(p is None for p in parts):
        return None
    if len(parts) == 1:
        return parts[0]
    keys = torch.cat([p.keys for p in parts], dim=2)  # (L, H, T, D)
    values = torch.cat([p.values for p in parts], dim=2)
    return SegmentKV(keys, values, parts[0].start, None)

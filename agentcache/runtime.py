"""The Runtime: one object that runs agent calls with a shared-context strategy.

A call's story (`run`):
1. plan, under the runtime's lock: tokenize, and ask the corrector how to materialize every
   shared segment (corrected, raw, or dense); the plan is an immutable `CallPlan`;
2. execute, with no runtime lock held: the engine admits the request, serves the longest exact
   prefix it holds (the agent's own lineage included), injects the rest of each reused segment,
   and batches the call with whatever else runs;
3. commit, under the lock: each shared segment's cache becomes the source of the next workflow
   edge, dense fallbacks whose KV is exact build anchors, the agent's decoded output becomes the
   source of `out:<agent>`, and the figures are kept.
Concurrent calls overlap in the engine; only planning and committing take turns.

Isolation (see `agentcache.isolation`): sources and agents' outputs belong to the call's session,
anchors to its tenant, approximate blocks to its lineage (runtime, tenant, session, agent). Memory
is bounded: sessions, per-call records (a ring; stream them out with `on_call`) and figures (kept
incrementally) all have limits in `RuntimeConfig`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections import Counter, deque
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from agentcache.calls import CallPlan, plan_call, prepare_anchors, settle_call
from agentcache.correction import make_corrector
from agentcache.correction.strategies import STRATEGIES, Strategy, get_strategy
from agentcache.engine.cache_manager import servable_tokens
from agentcache.engine.protocol import Engine, ExecRequest, ExecResult, SamplingParams, SegmentPlan, Step
from agentcache.errors import InputError, KVShapeError, PlanError, Preempted, RopeAlignmentError
from agentcache.isolation import Scope, lineage_salt, tenant_salt
from agentcache.metrics import CallResult, Figures
from agentcache import selfcheck
from agentcache.selfcheck import CheckReport
from agentcache.sessions import SessionTable
from agentcache.scout.config import ScoutConfig
from agentcache.scout.learner import TransitionLearner
from agentcache.scout.policies import SurvivalPolicy
from agentcache.scout.recorder import TraceRecorder
from agentcache.scout.warmup import WarmupCoordinator
from agentcache.segments import AgentCall, DispatchEvent, Segment, output_slot
from agentcache.transcript import ChatML, chat_format

__all__ = ["Runtime", "RuntimeConfig"]

log = logging.getLogger(__name__)

_DISPATCH_KEYS = 1024  # distinct framework:agent keys `summary()["dispatches"]` counts apart


@dataclass(frozen=True)
class RuntimeConfig:
    anchor_bytes: int = 2**30  # all anchor pools together
    store_bytes: int = 2**30  # materialized shared-segment caches (chain sources)
    keep_calls: int = 1000  # per-call records (`results`, `events`) kept in a ring; 0 keeps none
    max_sessions: int = 128  # sessions remembered (outputs, shared texts, sources); the oldest are forgotten
    session_entries: int = 256  # agents' outputs and shared texts kept per session
    self_check: bool = True  # verify re-alignment and correction on this model before correcting
    keep_kv: bool = False  # keep each call's KV and engine result on its CallResult (for measuring)
    warmup: bool = False  # between calls, prefill the predicted next agent's prefix (CacheScout)
    # the warm-up gate and rate limit (r_min, warmup_min_gap); the learning constants too when the
    # engine's eviction policy is not Survival (Survival brings its own ScoutConfig)
    scout: ScoutConfig = field(default_factory=ScoutConfig)

    def __post_init__(self) -> None:
        for name in ("anchor_bytes", "store_bytes", "max_sessions", "session_entries"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise InputError(f"RuntimeConfig.{name} must be a positive int, got {value!r}")
        if type(self.keep_calls) is not int or self.keep_calls < 0:
            raise InputError(f"RuntimeConfig.keep_calls must be an int >= 0 (0 keeps no records), got {self.keep_calls!r}")
        if not isinstance(self.scout, ScoutConfig):
            raise InputError(f"RuntimeConfig.scout must be a ScoutConfig, got {type(self.scout).__name__}")


class Runtime:
    """Runs agent calls end to end; see `run`. Thread-safe: concurrent calls run together on the engine."""

    def __init__(
        self,
        engine: Engine | None = None,
        *,
        model: Any = None,
        strategy: str | Strategy = "kvcmas",
        config: RuntimeConfig | None = None,
        check: CheckReport | None = None,
        recorder: TraceRecorder | None = None,
        on_call: Callable[[CallResult], None] | None = None,
    ) -> None:
        """`check`: a self-check report to trust instead of running the check; `on_call`: called with
        every finished call's record (e.g. `metrics.JsonlSink(path)`), to keep records beyond the ring."""
        if config is not None and not isinstance(config, RuntimeConfig):
            raise InputError(f"Runtime(config=...) must be a RuntimeConfig, got {type(config).__name__}")
        if check is not None and not isinstance(check, CheckReport):
            raise InputError(f"Runtime(check=...) must be a CheckReport (from agentcache.check_model) or None, "
                             f"got {type(check).__name__}")
        if on_call is not None and not callable(on_call):
            raise InputError(f"Runtime(on_call=...) must be callable or None, got {type(on_call).__name__}")
        if engine is None:
            from agentcache.engine.embedded import EmbeddedEngine
            from agentcache.models import DEFAULT_MODEL

            engine = EmbeddedEngine(model or DEFAULT_MODEL)
        elif model is not None:
            raise ValueError("give either an engine or a model, not both")
        self.engine = engine
        self.config = config or RuntimeConfig()
        # how adapters lay out a chat for this model: its ChatML, else the plain transcript (None)
        self.chat: ChatML | None = chat_format(engine)
        self.requested_strategy = get_strategy(strategy)
        self.check = check
        self.refusal: str | None = None  # why a requested correcting strategy was refused
        self.strategy = self._vet(self.requested_strategy)
        self.corrector = make_corrector(engine, self.strategy, self.config.anchor_bytes, self.config.store_bytes)
        self.figures = Figures()
        self._results: deque[CallResult] = deque(maxlen=self.config.keep_calls)
        self._events: deque[DispatchEvent] = deque(maxlen=self.config.keep_calls)
        self._dispatches: Counter[str] = Counter()
        self._records_lock = threading.Lock()  # not the runtime's lock: records are read while a call runs
        self.on_call = on_call
        self.sessions = SessionTable(self.config.max_sessions, self.config.session_entries, self._forget_session)
        self._in_flight = 0  # calls between entering `run` and their commit
        self._in_flight_lock = threading.Lock()
        self.id = uuid.uuid4().hex  # names this runtime (its lineages, configs that run on it)
        self._lock = threading.RLock()  # correction state: held to plan and to commit, never while the engine runs
        self.recorder = recorder
        self._own_learner: TransitionLearner | None = None
        self.warmup_coordinator = self._warmup_coordinator() if self.config.warmup else None
        self._warmup: Future | None = None  # the warm-up request in the engine, if any
        self.warmup_faults = 0
        self.warmup_s = 0.0  # engine time spent warming up, off every call's critical path

    def _warmup_coordinator(self) -> WarmupCoordinator | None:
        """Shares the learner of the engine's Survival policy; any other policy gets a learner of its
        own (then `config.scout` sets its constants; with Survival the policy's own config does)."""
        if not self.engine.prefix_caching:
            log.warning("warm-up is off: the engine does not cache prefixes, so a warm-up could serve nothing")
            return None
        policy = self.engine.eviction_policy
        if isinstance(policy, SurvivalPolicy):
            return WarmupCoordinator(policy.learner, self.config.scout, min_prefix=self.engine.block_size)
        self._own_learner = TransitionLearner(self.config.scout.smoothing, max_agents=self.config.scout.max_agents)
        return WarmupCoordinator(self._own_learner, self.config.scout, min_prefix=self.engine.block_size)

    def _vet(self, strategy: Strategy) -> Strategy:
        """Refuse cross-context reuse on a model that fails the self-check: run NonShared instead."""
        if not strategy.reuse:
            return strategy
        if strategy.recompute is not None and not self.engine.supports_recompute:
            raise InputError(f"strategy {strategy.name!r} recomputes part of the reused cache, which "
                             f"{type(self.engine).__name__} cannot do (its KV connector fills whole contiguous "
                             "ranges); run it on the EmbeddedEngine")
        if not self.engine.supports_realignment:
            log.warning("%s cannot re-align RoPE exactly; running NonShared instead of %s",
                        self.engine.model_name, strategy.name)
            self.refusal = f"{self.engine.model_name}: RoPE re-alignment is not exact on this model"
            return STRATEGIES["nonshared"]
        if self.check is None and self.config.self_check:
            try:
                self.check = selfcheck.check_model(self.engine)  # the check's one entry point
            except Exception as exc:  # noqa: BLE001 - a check that cannot run proves nothing: refuse reuse
                log.warning("the self-check raised on %s (%s: %s); running NonShared instead of %s",
                            self.engine.model_name, type(exc).__name__, exc, strategy.name)
                self.refusal = f"the self-check raised {type(exc).__name__}: {exc}"
                return STRATEGIES["nonshared"]
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
            raise InputError(f"Runtime.run takes an AgentCall, got {type(call).__name__}")
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise InputError(f"Runtime.run(sampling=...) must be a SamplingParams, got {type(sampling).__name__}: "
                             "pass SamplingParams(max_tokens=..., ...)")
        if on_token is not None and not callable(on_token):
            raise InputError(f"Runtime.run(on_token=...) must be callable (it gets each token id) or None, "
                             f"got {type(on_token).__name__}")
        if event is not None:
            if not isinstance(event, DispatchEvent):
                raise InputError(f"event must be a DispatchEvent, got {type(event).__name__}")
            if (event.agent, event.session) != (call.agent, call.session):
                raise PlanError(f"dispatch event for agent {event.agent!r} (session {event.session!r}) does not "
                                f"match the call of agent {call.agent!r} (session {call.session!r})")
        sampling = sampling or SamplingParams()
        started = time.perf_counter()  # TTFT runs from here: planning and waiting in the engine included
        self._count_in_flight(+1)
        try:
            with self._lock, torch.inference_mode():
                locked = time.perf_counter() - started  # waiting for other calls' planning or commits
                plan = self._plan(call, sampling, on_token)
            plan, result, first_token = self._execute(plan)  # no runtime lock: other calls plan, run, commit
            with torch.inference_mode():  # factorizing new anchors is the slow part of a commit: no lock
                prepared = self._prepare_anchors(plan, result)
            with self._lock, torch.inference_mode():
                outcome = self._finish(plan, result, started, first_token, locked, event, prepared)
                if event is not None:  # a failed call records no event
                    self._record_event(event)
                if self.warmup_coordinator is not None:
                    self._plan_warmup(call)
        finally:
            self._count_in_flight(-1)
        self._emit(outcome)
        return outcome

    def _record_event(self, event: DispatchEvent) -> None:
        key = f"{event.framework}:{event.agent}"
        with self._records_lock:
            self._events.append(event)
            self._dispatches[key if key in self._dispatches or len(self._dispatches) < _DISPATCH_KEYS
                             else "(other)"] += 1

    @property
    def results(self) -> list[CallResult]:
        """The newest `config.keep_calls` calls' records, oldest first (all figures are in `summary()`)."""
        with self._records_lock:
            return list(self._results)

    @property
    def events(self) -> list[DispatchEvent]:
        """The newest `config.keep_calls` dispatch events the adapters sent, in call order."""
        with self._records_lock:
            return list(self._events)

    def _emit(self, result: CallResult) -> None:
        """Hand a finished call's record to `on_call`; a failing sink is counted, never the call's fault."""
        if self.on_call is None:
            return
        try:
            self.on_call(result)
        except Exception as exc:  # noqa: BLE001
            self.corrector.fault("sink_error", "the on_call sink raised; the call's record was not kept there", exc)

    def _count_in_flight(self, change: int) -> None:
        with self._in_flight_lock:
            self._in_flight += change

    async def arun(
        self,
        call: AgentCall,
        sampling: SamplingParams | None = None,
        *,
        event: DispatchEvent | None = None,
        on_token: Callable[[int], None] | None = None,
    ) -> CallResult:
        """`run` on a worker thread, so a framework's event loop keeps going while the engine works.
        Concurrent calls run together: the engine batches them."""
        return await asyncio.to_thread(self.run, call, sampling, event=event, on_token=on_token)

    # --- warm-up (CacheScout) --------------------------------------------------------------

    def _plan_warmup(self, call: AgentCall) -> None:
        """After a call, under the lock: plan a warm-up and hand it to the engine as a low-priority
        request (the engine runs real calls first and preempts a warm-up for them). Planning faults
        are counted and logged: a warm-up never costs a call."""
        outcomes = self.warmup_coordinator.outcomes
        if self._warmup is not None and not self._warmup.done():
            outcomes["busy"] += 1  # the previous warm-up has not run yet
            return
        if self._in_flight > 1:  # other calls are under way: they are certain, a warm-up is a guess
            outcomes["calls_waiting"] += 1
            return
        try:
            plan = self.warmup_coordinator.next_warmup(self._engine_session(call), self._prefix_cached,
                                                       tenant_salt(call.tenant))
        except Exception as exc:
            self.warmup_faults += 1
            log.warning("planning a warm-up failed: %s", exc)
            return
        if plan is None:
            return
        request = ExecRequest([SegmentPlan(f"warmup:{plan.agent}", list(plan.prefix), Step.PREFIX)],
                              SamplingParams(max_tokens=1), owner=plan.agent, warmup=True, capture_kv=False,
                              cache_salt=plan.namespace)
        try:
            self._warmup = self.engine.submit(request)
        except Exception as exc:  # noqa: BLE001 - a refused warm-up costs a future hit, never a call
            self.warmup_faults += 1
            log.warning("warm-up of agent %r was refused: %s", plan.agent, exc)
            return
        self._warmup.add_done_callback(partial(self._warmed, plan.agent))

    def _warmed(self, agent: str, future: Future) -> None:
        """A warm-up request ended (on the engine's thread): account for it."""
        if future.cancelled():
            return
        exc = future.exception()
        if exc is None:
            self.warmup_s += future.result().total_s - future.result().queued_s
        elif isinstance(exc, Preempted):
            self.warmup_coordinator.outcomes["preempted"] += 1
        else:
            self.warmup_faults += 1
            log.warning("warm-up of agent %r failed: %s", agent, exc)

    def _prefix_cached(self, prefix: Sequence[int], namespace: str | None) -> bool:
        servable = servable_tokens(len(prefix), self.engine.block_size)
        return self.engine.cached_prefix_length(prefix, cache_salt=namespace) >= servable

    def wait_warmup(self) -> None:
        """Block until the warm-up handed to the engine, if any, has ended."""
        warmup = self._warmup
        if warmup is not None:
            wait([warmup])

    def close(self) -> None:
        """Let a planned warm-up finish (call before exiting: the engine's loop is a daemon thread)."""
        self.wait_warmup()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def output_segment(self, agent: str, *, session: str | None, tenant: str | None = None) -> Segment:
        """A PH segment holding `agent`'s latest output in `session` (of `tenant`), for another
        agent's call in that session. `session` is required: pass None for the default session."""
        scope = Scope(tenant, session)
        output = self.sessions.output(scope, agent)
        if output is None:
            raise PlanError(f"agent {agent!r} has produced no output in session {session!r}"
                            f"{f' of tenant {tenant!r}' if tenant is not None else ''}; agents with output there: "
                            f"{self.sessions.agents(scope)}")
        if not output:
            raise PlanError(f"agent {agent!r}'s latest output in session {session!r} is empty: there is nothing "
                            "to read; leave it out of the call")
        return Segment.ph(output_slot(agent), output)

    def shared_texts(self, session: str | None = None, tenant: str | None = None) -> dict[str, str]:
        """The shared texts (PH contents and agents' outputs, stripped) seen in `session`, each
        with its slot: what an adapter can find quoted inside a monolithic prompt."""
        return self.sessions.texts(Scope(tenant, session))

    def _forget_session(self, scope: Scope) -> None:
        """A session left the session table: its source caches go too."""
        self.corrector.store.drop_scope(scope)

    def _lineage(self, call: AgentCall) -> str:
        """Salt for the approximate KV a call caches: only this agent's later calls in the same
        runtime, tenant and session may be served from it."""
        return lineage_salt(self.id, Scope(call.tenant, call.session), call.agent)

    @staticmethod
    def _engine_session(call: AgentCall) -> str | None:
        """The session as the engine's eviction policy sees it (tenants apart)."""
        if call.tenant is None:
            return call.session
        return json.dumps([call.tenant, call.session])

    def _plan(self, call: AgentCall, sampling: SamplingParams, on_token: Callable[[int], None] | None) -> CallPlan:
        """Under the lock: the call's plan (`agentcache.calls.plan_call`)."""
        return plan_call(self.engine, self.corrector, call, sampling, lineage=self._lineage(call),
                         namespace=tenant_salt(call.tenant), session=self._engine_session(call), on_token=on_token,
                         capture_all=self.config.keep_kv)  # measuring keeps every segment's KV

    def _execute(self, plan: CallPlan) -> tuple[CallPlan, ExecResult, float]:
        """Run the plan on the engine (no runtime lock held); returns the plan run, its result and
        when its first token came. If the engine refuses the reused KV, that KV is never offered
        again and the call runs densely instead."""
        try:
            submitted = time.perf_counter()
            result = self.engine.submit(plan.request).result()
            return plan, result, submitted + result.ttft_s
        except (KVShapeError, RopeAlignmentError) as exc:
            if not plan.injects:
                raise
            with self._lock:
                self.corrector.fault("engine_rejected", f"the engine refused reused KV for agent {plan.call.agent!r}; "
                                     "prefilling densely", exc)
                for decision in plan.decisions.values():
                    if decision.reused and decision.source is not None:
                        self.corrector.store.remove(decision.source.id)
            dense = plan.densely()
            submitted = time.perf_counter()
            result = self.engine.submit(dense.request).result()
            return dense, result, submitted + result.ttft_s

    def _prepare_anchors(self, plan: CallPlan, result: ExecResult) -> dict | None:
        """The call's new anchors, built with no lock held (None: build them at the commit instead)."""
        try:
            return prepare_anchors(self.corrector, plan, result)
        except Exception:  # noqa: BLE001 - the commit builds them again and counts what fails there
            return None

    def _finish(
        self, plan: CallPlan, result: ExecResult, started: float, first_token: float, locked: float,
        event: DispatchEvent | None, prepared: dict | None = None,
    ) -> CallResult:
        """Under the lock: record what the call's segments became, its output, and its figures."""
        call, agent = plan.call, plan.call.agent
        settled = settle_call(self.corrector, plan, result, prepared)
        reports, kvs = settled.reports, settled.kvs
        try:
            self.sessions.record(plan.scope, agent, result.text, output_slot(agent), [
                (seg.text.strip(), seg.slot) for seg in call.segments if seg.kind == "ph" and seg.text and seg.text.strip()])
        except Exception as exc:  # noqa: BLE001 - the call's result stands
            self.corrector.fault("commit_error", f"remembering agent {agent!r}'s output for its session", exc)
        outcome = CallResult(
            agent=agent, text=result.text, token_ids=result.token_ids, finish_reason=result.finish_reason,
            ttft_s=first_token - started, queued_s=locked + result.queued_s, total_s=time.perf_counter() - started,
            event=event, prompt_tokens=result.prompt_tokens,
            cached_tokens=result.cached_tokens, lineage_tokens=sum(r.lineage_tokens for r in reports),
            session=call.session, tenant=call.tenant,
            ph_tokens=sum(r.length for r in reports if r.kind == "ph"),
            eligible_tokens=sum(r.length - r.cached_tokens for r in reports if r.kind == "ph" and r.source is not None),
            reused_tokens=sum(r.injected_tokens - r.recomputed_tokens for r in reports if r.kind == "ph"),
            segments=reports, prompt_ids=list(plan.prompt),
            engine_result=result if self.config.keep_kv else None, segment_kv=kvs if self.config.keep_kv else [],
        )
        with self._records_lock:
            self._results.append(outcome)
        self.figures.add(outcome)
        if self.warmup_coordinator is not None or self.recorder is not None:
            try:
                self._observe(call, list(plan.segments), plan.token_lists, list(plan.prompt), result.token_ids)
            except Exception as exc:  # noqa: BLE001 - learning who runs next never costs the call
                self.corrector.fault("observe_error", f"observing agent {agent!r}'s call for CacheScout", exc)
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
                self._own_learner.observe(call.agent, self._engine_session(call))
            self.warmup_coordinator.observe(call.agent, prompt, prefix_len, tenant_salt(call.tenant))
        if self.recorder is not None:
            self.recorder.record(call.agent, call.session, prompt, output, prefix_len)

    def calibrate_gate(self, target_reuse: float, recent: int | None = None) -> float:
        """Set the correction gate's τ so that the share `target_reuse` of the shared tokens planned
        so far (a warm-up's; only the latest `recent` segments when given) would have been reused;
        returns τ. `Strategy(target_reuse=...)` does this by itself after `calibrate_after` segments."""
        if not self.strategy.correct:
            raise InputError(f"strategy {self.strategy.name!r} has no correction gate to calibrate")
        with self._lock:
            try:
                return self.corrector.calibrate(target_reuse, recent)
            except ValueError as exc:
                raise InputError(str(exc)) from None

    # --- figures -------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        with self._lock:
            return self._summary()

    def _summary(self) -> dict[str, Any]:
        figures = self.figures.to_dict()
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
            sessions=len(self.sessions),
            sessions_forgotten=self.sessions.forgotten,
            anchor_build_s=self.corrector.anchor_build_s,
            gate_tau=self.corrector.tau,
            gate_calibration=self.corrector.calibrated,
            faults=self._faults(),  # real faults only; normal fallbacks are in fallback_reasons
            eviction=getattr(self.engine.eviction_policy, "name", None),
            warmups=dict(self.warmup_coordinator.outcomes) if self.warmup_coordinator is not None else None,
            warmup_faults=self.warmup_faults,
            warmup_s=self.warmup_s,
            dispatches=self._dispatch_counts(),
        )
        return figures

    def _faults(self) -> dict[str, int]:
        faults = dict(self.corrector.faults)
        if self.corrector.store.dropped_corrupt:
            faults["corrupt_source"] = self.corrector.store.dropped_corrupt
        return faults

    def _dispatch_counts(self) -> dict[str, int]:
        with self._records_lock:
            return dict(self._dispatches)

    def export_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            payload = {"summary": self._summary(), "calls": [r.to_dict() for r in self.results]}
        path.write_text(json.dumps(payload, indent=2))
        return path

"""The Runtime: one object that runs agent calls with a shared-context strategy.

A call's story (`run`, or `arun` on an event loop): check the input; wait, with no lock held, for
shared context in flight that the strategy says the call should reuse (a reference prefill its
siblings share); plan it under the runtime's
lock (the strategy decides every shared segment into an immutable `CallPlan`); run it on the
engine with no lock held (batched with the other calls; reused KV the engine refuses is never
offered again); let the strategy learn from what was served (with no lock held) and settle it
under the lock; the session keeps the output, CacheScout learns who ran, the call log the figures.
Isolation (`agentcache.isolation`): sources and outputs belong to the call's session, anchors to
its tenant, approximate blocks to its lineage (runtime, tenant, session, agent).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from agentcache.calls import CallPlan, awaited_context, checked_tokens, plan_call
from agentcache.config import RuntimeConfig
from agentcache.correction import make_strategy
from agentcache.correction.anchor_store import AnchorStore
from agentcache.correction.persist import AnchorFiles
from agentcache.correction.plan import Served, SharedContextStrategy, TokenizedCall
from agentcache.correction.strategies import Strategy, get_strategy
from agentcache.engine.choice import open_engine
from agentcache.engine.eviction import EvictionPolicy
from agentcache.engine.protocol import Engine, ExecResult, SamplingParams
from agentcache.errors import InputError, KVShapeError, RequestCancelled, RopeAlignmentError
from agentcache.idle import IdleWorker, Lesson, calls_in_flight
from agentcache.isolation import Scope
from agentcache.metrics import CallLog, CallResult
from agentcache.models import DEFAULT_MODEL
from agentcache.scout.driver import ScoutDriver
from agentcache.scout.recorder import TraceRecorder
from agentcache.segments import AgentCall, DispatchEvent, Segment
from agentcache.selfcheck import CheckReport, vet_strategy
from agentcache.sessions import SessionTable
from agentcache.story import Await, Do, Story, drive, drive_async
from agentcache.toolcalls import ToolFormat
from agentcache.transcript import ChatML, chat_format

__all__ = ["Runtime", "RuntimeConfig"]

LEARN_TIMEOUT_S = 120.0  # `close` waits at most this long for pending learning
PLANNING, LEARNING = "planning", "learning"  # the runtime's two threads under `arun`


@dataclass
class _Flight:
    """One call on its way through the runtime."""

    call: AgentCall
    event: DispatchEvent | None
    sampling: SamplingParams
    on_token: Callable[[int], None] | None
    cancelled: threading.Event | None
    started: float  # TTFT runs from here: planning and waiting in the engine included
    ticket: object  # counts the call in flight
    locked_s: float = 0.0  # waiting for other calls' planning or settling
    tokenized: TokenizedCall | None = None
    awaited: tuple[Future, ...] = ()  # shared context in flight to wait for before planning
    plan: CallPlan | None = None
    submitted: float = 0.0

    @classmethod
    def checked(cls, call: AgentCall, sampling: SamplingParams | None, event: DispatchEvent | None,
                on_token: Callable[[int], None] | None, cancelled: threading.Event | None,
                tokenized: TokenizedCall | None, started: float) -> _Flight:
        """A call's flight from `Runtime.run`'s arguments, each checked (InputError names a bad one)."""
        call = AgentCall.checked(call, "Runtime.run")
        sampling = SamplingParams.checked(sampling, "Runtime.run(sampling=...)")
        if on_token is not None and not callable(on_token):
            raise InputError(f"Runtime.run(on_token=...) must be callable (it gets each token id) or None, "
                             f"got {type(on_token).__name__}")
        if cancelled is not None and not isinstance(cancelled, threading.Event):
            raise InputError(f"Runtime.run(cancelled=...) must be a threading.Event or None, got {type(cancelled).__name__}")
        return cls(call, DispatchEvent.checked_for(event, call), sampling, on_token, cancelled, started, object(),
                   tokenized=checked_tokens(tokenized, call, "Runtime.run(tokenized=...)"))


class Runtime:
    """Runs agent calls end to end; see `run`. Thread-safe: concurrent calls run together on the engine."""

    def __init__(self, engine: Engine | None = None, *, model: Any = None, strategy: str | Strategy = "kvcmas",
                 config: RuntimeConfig | None = None, check: CheckReport | None = None,
                 recorder: TraceRecorder | None = None, on_call: Callable[[CallResult], None] | None = None,
                 anchors_dir: str | Path | AnchorStore | None = None) -> None:
        """`check`: a self-check report to trust instead of running the check; `on_call`: gets every
        finished call's record (e.g. `metrics.JsonlSink(path)`); `anchors_dir`: a directory or an
        `AnchorStore` (shared by instances) where anchor pools persist (`correction.persist`)."""
        self.config = RuntimeConfig.checked(config)
        self.log = CallLog(self.config.keep_calls, on_call)
        self.engine = _engine(engine, model)
        self.chat: ChatML | None = chat_format(self.engine)  # how adapters lay out a chat for this model
        self.requested_strategy = get_strategy(strategy)
        verdict = vet_strategy(self.engine, self.requested_strategy, CheckReport.checked(check), self.config.self_check)
        self.strategy, self.check, self.refusal = verdict.strategy, verdict.check, verdict.refusal
        self.corrector = make_strategy(self.engine, self.strategy, self.config.anchor_bytes, self.config.store_bytes)
        self.sessions = SessionTable(self.config.max_sessions, self.config.session_entries, self.corrector.forget)
        self.scout = ScoutDriver(self.engine, self.config.scout, warmup=self.config.warmup, recorder=recorder)
        self.id = uuid.uuid4().hex  # names this runtime (its lineages, configs that run on it)
        self._lock = threading.RLock()  # strategy and session state: held to plan and to settle, never while the engine runs
        self.cancelled_calls = 0  # calls their callers cancelled (dropped from the engine)
        self._flying: set[object] = set()  # a ticket per call between entering the runtime and settling
        self._threads = {PLANNING: ThreadPoolExecutor(1, thread_name_prefix="agentcache-plan"),  # `arun`'s planning
                         LEARNING: ThreadPoolExecutor(1, thread_name_prefix="agentcache-learn")}  # and settling
        # what finished calls teach the strategy, learned while no call is in flight
        self._idle = IdleWorker(calls_in_flight.idle, self._lock, on_fault=lambda name, exc: self.corrector.fault(
            "lesson_error", f"learning from a finished call ({name})", exc))  # called under the lock
        self.anchors = AnchorFiles.open(anchors_dir, self.engine, self.corrector)  # None: not persisted
        self._closing = threading.Event()
        if self.anchors is not None:
            self.anchors.load(None)  # the default tenant now: a mismatched file is refused here
        self._anchor_syncer = _start_anchor_sync(self)

    # --- running calls -------------------------------------------------------------------

    def run(self, call: AgentCall, sampling: SamplingParams | None = None, *, event: DispatchEvent | None = None,
            on_token: Callable[[int], None] | None = None, cancelled: threading.Event | None = None,
            tokenized: TokenizedCall | None = None) -> CallResult:
        """Run one agent call and return its text, timings and per-segment decisions. `event` is the
        adapter's dispatch event (of the call's agent and session); `on_token` gets each token id;
        setting `cancelled` (a client that went away) drops the call from the engine, which frees its
        blocks, and the call raises `RequestCancelled`: nothing of it is learned or kept. `tokenized`:
        the call's tokens when the caller has them already (`calls.tokenize_call`)."""
        return drive(self._story((call, sampling, event, on_token, cancelled, tokenized), time.perf_counter()))

    async def arun(self, call: AgentCall, sampling: SamplingParams | None = None, *,
                   event: DispatchEvent | None = None, on_token: Callable[[int], None] | None = None,
                   cancelled: threading.Event | None = None, tokenized: TokenizedCall | None = None) -> CallResult:
        """`run` for an event loop. It awaits the engine's future, so concurrent calls hold no thread
        each: planning takes turns on one runtime thread; learning, settling and the `on_call` sink
        on another. A caller that stops waiting does not stop the call: like `run` on a thread, it
        runs to its end and is recorded, unless it sets `cancelled`."""
        story = self._story((call, sampling, event, on_token, cancelled, tokenized), time.perf_counter())
        call_task = asyncio.ensure_future(drive_async(story, self._threads))
        call_task.add_done_callback(lambda task: task.cancelled() or task.exception())  # retrieved, even if unawaited
        return await asyncio.shield(call_task)

    def _story(self, arguments: tuple, started: float) -> Story:
        """A call's story (see the module's description), told once for `run` and `arun` (`arguments`: theirs)."""
        flight = yield Do(PLANNING, self._enter, (arguments, started))
        try:
            if flight.sampling.constraint is not None:  # compiled off the planning thread
                yield Await.result(self.engine.constraint_ready(flight.sampling.constraint))
            yield Await(flight.awaited)  # shared context in flight, with no lock held
            yield Do(PLANNING, self._plan, (flight,))
            while True:
                try:
                    result = yield Await.result((yield Do(PLANNING, self._submit, (flight,))))
                    break
                except (KVShapeError, RopeAlignmentError) as exc:
                    yield Do(PLANNING, self._refused, (flight, exc))
            outcome = yield Do(LEARNING, self._finish, (flight, result))
        except RequestCancelled:
            with self._lock:
                self.cancelled_calls += 1
            raise
        finally:
            self._land(flight)
        yield Do(LEARNING, self.log.emit, (outcome,))
        return outcome

    def _enter(self, arguments: tuple, started: float) -> _Flight:
        """Check `run`'s arguments and ask the strategy, under the lock, what shared context in flight
        the call should wait for; the call is in flight from here (`started`: when it reached the runtime)."""
        flight = _Flight.checked(*arguments, started)
        self._flying.add(flight.ticket)  # set.add and discard are atomic: the count needs no lock of its own
        calls_in_flight.enter(flight.ticket)
        try:
            with self._lock, torch.inference_mode():
                flight.locked_s = time.perf_counter() - flight.started  # waiting for other calls' planning or settling
                if self.anchors is not None:
                    self.anchors.load(flight.call.tenant)  # once per tenant
                flight.tokenized, flight.awaited = awaited_context(self.engine, self.corrector, flight.call,
                                                                   flight.tokenized)
        except BaseException:
            self._land(flight)
            raise
        return flight

    def _plan(self, flight: _Flight) -> None:
        """Plan the call under the lock, once what it awaited is done."""
        began = time.perf_counter()
        with self._lock, torch.inference_mode():
            flight.locked_s += time.perf_counter() - began
            flight.plan = plan_call(self.engine, self.corrector, flight.call, flight.sampling, runtime_id=self.id,
                                    on_token=flight.on_token, capture_all=self.config.keep_kv,  # measuring keeps every KV
                                    tokenized=flight.tokenized, cancelled=flight.cancelled)

    def _land(self, flight: _Flight) -> None:
        """The call is settled or failed: no longer in flight."""
        self._flying.discard(flight.ticket)
        calls_in_flight.leave(flight.ticket)  # pokes every runtime's idle worker

    def _submit(self, flight: _Flight) -> Future:
        flight.submitted = time.perf_counter()
        return self.engine.submit(flight.plan.request)

    def _refused(self, flight: _Flight, exc: KVShapeError | RopeAlignmentError) -> None:
        """The engine refused the plan's reused KV: that KV is never offered again, and the call runs densely."""
        if not flight.plan.injects:
            raise exc
        with self._lock:
            self.corrector.refused(flight.plan.decisions, exc, flight.call.agent)
        flight.plan = flight.plan.densely()

    def _finish(self, flight: _Flight, result: ExecResult) -> CallResult:
        """The strategy learns from what was served with no lock held (factorizing anchors), then,
        under the lock, settles it; the session keeps the output, CacheScout learns who ran, and the
        call log keeps the call's figures. A fault past the engine costs only what it touched."""
        call, tokenized, request = flight.call, flight.plan.tokenized, flight.plan.request
        served = Served.of(tokenized, flight.plan.planned, result, greedy=request.sampling.temperature == 0)
        prepared, lessons = None, []
        preparing = f"preparing what agent {call.agent!r}'s call teaches"
        with _counted(self.corrector, "lesson_error", preparing, self._lock), torch.inference_mode():
            prepared = self.corrector.prepare(served)
        with self._lock, torch.inference_mode():
            self.corrector.settle(served, prepared)
            with _counted(self.corrector, "lesson_error", f"planning what agent {call.agent!r}'s call teaches"):
                lessons = self.corrector.lessons(served)  # learned later: when idle, or before returning
            reports, prefix = served.reports(), tokenized.fixed_prefix  # prefix: the agent's own, for CacheScout
            with _counted(self.corrector, "commit_error", f"remembering agent {call.agent!r}'s output for its session"):
                self.sessions.record_call(call, result.text)
            total_s = time.perf_counter() - flight.started  # to the last token, anchors and session included
            with _counted(self.corrector, "observe_error", f"observing agent {call.agent!r}'s call for CacheScout"):
                self.scout.observe(call.agent, request.session, request.cache_salt, tokenized.prompt,
                                   prefix, result.token_ids, call.session)
            self.scout.after_call(request.session, request.cache_salt, len(self._flying))
            outcome = CallResult.of(call, flight.event, reports, result, tokenized.prompt,
                                    ttft_s=flight.submitted + result.ttft_s - flight.started,
                                    queued_s=flight.locked_s + result.queued_s, total_s=total_s,
                                    kvs=served.kvs if self.config.keep_kv else None)
            self.log.record(outcome)
        if self.config.learn == "after_call":
            self._idle.run_now(lessons)
        else:
            self._idle.submit(lessons)
        return outcome

    # --- records, sessions, warm-up, gate ------------------------------------------------

    @property
    def tool_format(self) -> ToolFormat | None:
        """The model's tool-call format (from its chat template); None: it cannot call tools."""
        return None if self.chat is None else self.chat.tool_format

    @property
    def results(self) -> list[CallResult]:
        """The newest `config.keep_calls` calls' records, oldest first (all figures are in `summary()`)."""
        return self.log.results

    @property
    def events(self) -> list[DispatchEvent]:
        """The newest `config.keep_calls` dispatch events the adapters sent, in call order."""
        return self.log.events

    @property
    def on_call(self) -> Callable[[CallResult], None] | None:
        """Called with every finished call's record (the call log's sink)."""
        return self.log.on_call

    @on_call.setter
    def on_call(self, sink: Callable[[CallResult], None] | None) -> None:
        self.log.on_call = sink

    def output_segment(self, agent: str, *, session: str | None, tenant: str | None = None) -> Segment:
        """A PH segment of `agent`'s latest output in `session` (required: None is the default session)."""
        return self.sessions.output_segment(Scope(tenant, session), agent)

    def shared_texts(self, session: str | None = None, tenant: str | None = None) -> dict[str, str]:
        """Per slot, the shared texts seen in `session`: what an adapter finds quoted in a monolithic prompt."""
        return self.sessions.texts(Scope(tenant, session))

    def close(self) -> None:
        """Let a planned warm-up and pending learning finish and save the anchor pools (call before exiting)."""
        self._closing.set()
        self.scout.wait()
        self._idle.drain(LEARN_TIMEOUT_S)
        self.save_anchors()

    def save_anchors(self) -> list[Path]:
        """Write every tenant's anchor pools and verification records to `anchors_dir`; the files written."""
        if self.anchors is None:
            return []
        with self._lock:
            return self.anchors.save()

    def sync_anchors(self) -> None:
        """Exchange anchors with the store now (it also happens every `config.anchor_sync_s`, when idle)."""
        if self.anchors is not None:
            with self._lock, torch.inference_mode():
                self.anchors.sync()

    def wait_warmup(self) -> None:
        """Let a planned warm-up finish."""
        self.scout.wait()

    def learned(self, timeout: float | None = None) -> bool:
        """Wait until what finished calls teach is learned (while no call is in flight); False on `timeout`."""
        return self._idle.drain(timeout)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def calibrate_gate(self, target_reuse: float, recent: int | None = None) -> float:
        """Set the gate's τ so that the share `target_reuse` of the shared tokens planned so far (the
        latest `recent` segments) would have been reused; returns τ (`Strategy(target_reuse=...)`)."""
        with self._lock:
            return self.corrector.calibrate(target_reuse, recent)

    # --- figures -------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        with self._lock:
            strategy = self.corrector.figures()
            faults = strategy.pop("faults", {}) | ({"sink_error": self.log.sink_faults} if self.log.sink_faults else {})
            return self.log.figures.to_dict() | dict(
                model=self.engine.model_name, strategy=self.strategy.name,
                requested_strategy=self.requested_strategy.name, refusal=self.refusal, **strategy,
                sessions=len(self.sessions), sessions_forgotten=self.sessions.forgotten, cancelled_calls=self.cancelled_calls,
                faults=faults,  # real faults only; normal fallbacks are in fallback_reasons
                eviction=_policy_name(self.engine.eviction_policy), **self.scout.figures(),
                **self._idle.figures(), **(self.anchors.figures() if self.anchors is not None else {}),
                dispatches=self.log.dispatch_counts())

    def export_json(self, path: str | Path) -> Path:
        with self._lock:  # one snapshot: calls are recorded under the lock
            summary, calls = self.summary(), self.results
        return self.log.export_json(path, summary, calls)


@contextmanager
def _counted(strategy: SharedContextStrategy, kind: str, what: str,
             lock: threading.RLock | None = None) -> Iterator[None]:
    """Count an exception of the block as the strategy's fault `kind` (under `lock`, when given)."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - the call's result stands
        with lock if lock is not None else nullcontext():
            strategy.fault(kind, what, exc)


def _start_anchor_sync(runtime: Runtime) -> threading.Thread | None:
    """The thread that hands `runtime` an anchor sync every `config.anchor_sync_s` (None: no syncing)."""
    if runtime.anchors is None or runtime.config.anchor_sync_s is None:
        return None
    thread = threading.Thread(target=_sync_anchors_every, name="agentcache-anchor-sync", daemon=True,
                              args=(weakref.ref(runtime), runtime.config.anchor_sync_s, runtime._closing))
    thread.start()
    return thread


def _sync_anchors_every(runtime: "weakref.ref[Runtime]", seconds: float, closing: threading.Event) -> None:
    """Hand the runtime's idle worker an anchor sync every `seconds` until it closes or is collected
    (the thread holds it only weakly)."""
    while not closing.wait(seconds):
        rt = runtime()
        if rt is None:
            return
        files = rt.anchors
        rt._idle.submit([Lesson("anchor_sync", study=lambda: None, apply=lambda _: files.sync())])
        del rt


def _engine(engine: Engine | None, model: Any) -> Engine:
    """The engine given, or an embedded engine over `model` (the default model when None)."""
    if engine is not None and model is not None:
        raise ValueError("give either an engine or a model, not both")
    return engine if engine is not None else open_engine("embedded", model or DEFAULT_MODEL)


def _policy_name(policy: EvictionPolicy | None) -> str | None:
    return None if policy is None else policy.name

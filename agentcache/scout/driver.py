"""What the runtime tells CacheScout after each call, and the warm-ups it drives between calls.

After a call the driver teaches the warm-up coordinator (and a trace recorder, when one is
attached) the agent's prefix, and, when no other call is under way, hands the engine the
coordinator's next warm-up as a low-priority request (the engine runs real calls first and
preempts a warm-up for them). A warm-up never costs a call: its faults are counted and logged.

The runtime calls `observe`, `after_call` and `figures` one at a time (under its lock). The
engine reports a warm-up's end on its own thread: what that report counts is kept under the
driver's one lock, which is never held while the engine is asked anything.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, wait
from functools import partial

from agentcache.engine.cache_manager import servable_tokens
from agentcache.engine.protocol import Engine, ExecRequest, SamplingParams, SegmentPlan, Step
from agentcache.errors import Preempted
from agentcache.scout.config import ScoutConfig
from agentcache.scout.learner import TransitionLearner
from agentcache.scout.policies import SurvivalPolicy
from agentcache.scout.recorder import TraceRecorder
from agentcache.scout.warmup import WarmupCoordinator

__all__ = ["ScoutDriver"]

log = logging.getLogger(__name__)


class ScoutDriver:
    def __init__(self, engine: Engine, config: ScoutConfig, *, warmup: bool,
                 recorder: TraceRecorder | None = None) -> None:
        """`warmup`: drive warm-ups (off with a warning when the engine caches no prefixes)."""
        self.engine = engine
        self.recorder = recorder
        self.own_learner: TransitionLearner | None = None  # when the engine's policy learns no dispatches
        self.coordinator = self._coordinator(config) if warmup else None
        self._lock = threading.Lock()  # what the engine's thread counts (`_warmed`)
        self._warmup: Future | None = None  # the warm-up handed to the engine, if any
        self.faults = 0
        self.preempted = 0  # warm-ups a real call took the place of
        self.warmup_s = 0.0  # engine time spent warming up, off every call's critical path

    def _coordinator(self, config: ScoutConfig) -> WarmupCoordinator | None:
        """Shares the learner of the engine's Survival policy; any other policy gets a learner of its
        own (then `config` sets its constants; with Survival the policy's own config does)."""
        if not self.engine.prefix_caching:
            log.warning("warm-up is off: the engine does not cache prefixes, so a warm-up could serve nothing")
            return None
        policy = self.engine.eviction_policy
        if isinstance(policy, SurvivalPolicy):
            return WarmupCoordinator(policy.learner, config, min_prefix=self.engine.block_size)
        self.own_learner = TransitionLearner(config.smoothing, max_agents=config.max_agents)
        return WarmupCoordinator(self.own_learner, config, min_prefix=self.engine.block_size)

    def observe(self, agent: str, session: str | None, namespace: str | None, prompt: Sequence[int],
                prefix_len: int, output: Sequence[int], trace_session: str | None) -> None:
        """A call finished: `prefix_len` leading tokens of `prompt` are the agent's fixed prefix.
        `session` is the engine's view of the call's session, `namespace` its tenant's salt."""
        if self.coordinator is not None:
            if self.own_learner is not None:  # the engine's policy does not learn dispatches itself
                self.own_learner.observe(agent, session)
            self.coordinator.observe(agent, prompt, prefix_len, namespace)
        if self.recorder is not None:
            self.recorder.record(agent, trace_session, prompt, output, prefix_len)

    def after_call(self, session: str | None, namespace: str | None, calls_in_flight: int) -> None:
        """Plan a warm-up for `session` and hand it to the engine, unless other calls are under way
        (they are certain, a warm-up is a guess) or the previous warm-up has not run yet."""
        if self.coordinator is None:
            return
        outcomes = self.coordinator.outcomes
        if self._warmup is not None and not self._warmup.done():
            outcomes["busy"] += 1
            return
        if calls_in_flight > 1:
            outcomes["calls_waiting"] += 1
            return
        agent = None
        try:
            plan = self.coordinator.next_warmup(session, self._prefix_cached, namespace)
            if plan is None:
                return
            agent = plan.agent
            self._warmup = self.engine.submit(ExecRequest(
                [SegmentPlan(f"warmup:{agent}", list(plan.prefix), Step.PREFIX)], SamplingParams(max_tokens=1),
                owner=agent, warmup=True, capture_kv=False, cache_salt=plan.namespace))
        except Exception as exc:  # noqa: BLE001 - a refused warm-up costs a future hit, never a call
            with self._lock:
                self.faults += 1
            log.warning("warm-up%s could not be planned or was refused: %s", f" of agent {agent!r}" if agent else "", exc)
            return
        self._warmup.add_done_callback(partial(self._warmed, agent))  # may run at once, on this thread

    def _warmed(self, agent: str, future: Future) -> None:
        """A warm-up request ended (on the engine's thread): account for it."""
        if future.cancelled():
            return
        exc = future.exception()
        with self._lock:
            if exc is None:
                self.warmup_s += future.result().total_s - future.result().queued_s
            elif isinstance(exc, Preempted):
                self.preempted += 1
            else:
                self.faults += 1
        if exc is not None and not isinstance(exc, Preempted):
            log.warning("warm-up of agent %r failed: %s", agent, exc)

    def _prefix_cached(self, prefix: Sequence[int], namespace: str | None) -> bool:
        servable = servable_tokens(len(prefix), self.engine.block_size)
        return self.engine.cached_prefix_length(prefix, cache_salt=namespace) >= servable

    def wait(self) -> None:
        """Block until the warm-up handed to the engine, if any, has ended."""
        warmup = self._warmup
        if warmup is not None:
            wait([warmup])

    def figures(self) -> dict:
        with self._lock:
            warmups = None
            if self.coordinator is not None:
                warmups = dict(self.coordinator.outcomes) | ({"preempted": self.preempted} if self.preempted else {})
            return dict(warmups=warmups, warmup_faults=self.faults, warmup_s=self.warmup_s)

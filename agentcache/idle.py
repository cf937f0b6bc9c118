"""Work that must never compete with a call in flight: a strategy's learning, run when idle.

A strategy hands the runtime `Lesson`s after a call (building anchors, verifying a reuse method
on a finished call): each has a `study` part that needs no shared state (factorizing, shadow
engine requests) and an `apply` part that changes the strategy's state under the runtime's lock.
One `IdleWorker` thread per runtime runs them one at a time, once no call has been in flight for
IDLE_GRACE_S (the gap between two agents of a sequential workflow is not idle time), in any runtime
of the process (`calls_in_flight`: their engines share the cores): on a small
machine the engine uses every core during a call, and float64 eigendecompositions beside it slow
every call in flight. A runtime that is never idle (a saturated server) still learns, within a
budget: a lesson that has waited MAX_WAIT_S runs if learning has taken less than CPU_BUDGET of the
time since the worker started. An urgent lesson (an edge's first verdict for a method: until then,
every call on the edge prefills what it could reuse) waits for neither: it runs next, beside
calls, unless what it would learn is known by then (`needed`). A lesson that starts beside calls
computes on one thread. A lesson that started runs to its end. When lessons pile up faster than
they can run, the oldest are dropped and counted: newer ones describe the workload as it is now.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch

from agentcache.engine.vllm.gate import set_threads

__all__ = ["Lesson", "IdleWorker", "CallsInFlight", "calls_in_flight", "MAX_PENDING", "IDLE_GRACE_S", "MAX_WAIT_S",
           "CPU_BUDGET"]

log = logging.getLogger(__name__)

MAX_PENDING = 64  # lessons waiting for idle time; the oldest go first beyond this
IDLE_GRACE_S = 0.5  # no call for this long: idle (over HTTP a workflow's next agent arrived 40-50 ms after the last landed)
MAX_WAIT_S = 1.0  # a lesson waiting this long may run beside calls, within the budget
CPU_BUDGET = 0.1  # share of wall time learning may take beside calls
# torch threads of a lesson that starts beside calls: the engine's steps use every core, and a second
# OpenMP team on the same cores slows both (oversubscribed teams cost up to 10x on 2 cores)
BESIDE_CALLS_THREADS = 1


class CallsInFlight:
    """The calls in flight in this process, over every runtime: a runtime with none of its own is not
    idle while another runtime's call runs on the same cores (a benchmark's strategies side by side)."""

    def __init__(self) -> None:
        self._tickets: set[object] = set()  # set.add and discard are atomic: no lock of their own

    def enter(self, ticket: object) -> None:
        self._tickets.add(ticket)

    def leave(self, ticket: object) -> None:
        """A call landed: every worker's idle time counts from now."""
        self._tickets.discard(ticket)
        for worker in _registered():
            worker.poke()

    def idle(self) -> bool:
        return not self._tickets


@dataclass(frozen=True)
class Lesson:
    """What a strategy learns from one finished call: `study()` with no lock held, then
    `apply(study's result)` under the runtime's lock."""

    name: str
    study: Callable[[], Any]
    apply: Callable[[Any], None]
    urgent: bool = False  # run next, beside calls: no idle time or budget to wait for
    needed: Callable[[], bool] | None = None  # asked under the lock before running: False skips it


class IdleWorker:
    def __init__(self, is_idle: Callable[[], bool], lock: threading.RLock, *,
                 on_fault: Callable[[str, BaseException], None], max_pending: int = MAX_PENDING) -> None:
        """`is_idle()`: whether no call is in flight; `lock`: the runtime's (held to apply);
        `on_fault(name, exc)`: a lesson failed (it costs only that lesson; called under `lock`)."""
        self._is_idle = is_idle
        self._lock = lock
        self._on_fault = on_fault
        self._pending: deque[tuple[float, Lesson]] = deque()  # (submitted at, lesson)
        self._max_pending = max_pending
        self._wake = threading.Condition()
        self._busy = False
        self._closed = False
        self.done = 0
        self.dropped = 0
        self.failed = 0
        self.skipped = 0  # urgent lessons whose lesson was learned before they ran
        self.urgent = 0  # urgent lessons run
        self.busy_s = 0.0
        self._started = time.monotonic()
        self._busy_since = self._started  # when the runtime was last seen with a call in flight
        self._thread: threading.Thread | None = None  # started by a submit, ends when nothing is pending
        self._threads = torch.get_num_threads()  # an idle machine's: the creating thread's
        with _workers_lock:
            _workers.add(self)

    def stop(self, timeout: float = 10.0) -> None:
        """Drop what is pending and let a running lesson end (the interpreter is exiting: a daemon
        thread killed inside a torch op aborts the process)."""
        with self._wake:
            self._closed = True
            self.dropped += len(self._pending)
            self._pending.clear()
            self._wake.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def submit(self, lessons: list[Lesson]) -> None:
        if not lessons:
            return
        with self._wake:
            if self._closed:
                self.dropped += len(lessons)
                return
            now = time.monotonic()
            for lesson in lessons:
                self._pending.append((now, lesson))
                if len(self._pending) > self._max_pending:
                    self._pending.popleft()
                    self.dropped += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="agentcache-idle", daemon=True)
                self._thread.start()
            self._wake.notify_all()

    def poke(self) -> None:
        """A call left the runtime: the engine may be idle from now (not from the worker's last look,
        which a busy machine can delay by more than IDLE_GRACE_S)."""
        with self._wake:
            self._busy_since = time.monotonic()
            self._wake.notify_all()

    @property
    def pending(self) -> int:
        return len(self._pending) + (1 if self._busy else 0)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every lesson submitted so far ran (as soon as the runtime is idle); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._wake:
            while self._pending or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._wake.wait(0.05 if left is None else min(left, 0.05))
        return True

    def figures(self) -> dict:
        return dict(lessons_done=self.done, lessons_dropped=self.dropped, lessons_failed=self.failed,
                    lessons_pending=self.pending, lessons_urgent=self.urgent, lessons_skipped=self.skipped,
                    learning_s=round(self.busy_s, 4))

    def _next(self) -> Lesson | None:
        """The oldest lesson, once it may run; None when closed or when nothing is pending (the
        thread then ends: it holds no strategy alive, and the next submit starts another)."""
        with self._wake:
            while not self._closed:
                if not self._pending:
                    self._thread = None
                    return None
                now = time.monotonic()
                if not self._is_idle():
                    self._busy_since = now
                urgent = next((item for item in self._pending if item[1].urgent), None)
                if urgent is not None:
                    self._pending.remove(urgent)
                    self._busy = True
                    return urgent[1]
                if self._pending and self._may_run(now):
                    self._busy = True
                    return self._pending.popleft()[1]
                self._wake.wait(0.01)  # calls landing poke it too
        self._thread = None
        return None

    def _may_run(self, now: float) -> bool:
        if now - self._busy_since >= IDLE_GRACE_S:
            return True
        waited = now - self._pending[0][0]
        return waited >= MAX_WAIT_S and self.busy_s < CPU_BUDGET * (now - self._started)

    def run_now(self, lessons: list[Lesson]) -> None:
        """Learn these in the calling thread, now (`RuntimeConfig(learn="after_call")`)."""
        for lesson in lessons:
            self._run(lesson)

    def _loop(self) -> None:
        while (lesson := self._next()) is not None:
            try:
                self._run(lesson)
            finally:
                with self._wake:
                    self._busy = False
                    self._wake.notify_all()

    def _run(self, lesson: Lesson) -> None:
        if lesson.needed is not None:
            with self._lock:
                if not lesson.needed():
                    self.skipped += 1
                    return
        self.urgent += lesson.urgent
        started = time.perf_counter()
        set_threads(self._threads if self._is_idle() else BESIDE_CALLS_THREADS)  # for this worker's thread
        try:
            with torch.inference_mode():
                result = lesson.study()
                with self._lock:
                    lesson.apply(result)
            self.done += 1
        except Exception as exc:  # noqa: BLE001 - a failed lesson costs only itself
            self.failed += 1
            try:
                with self._lock:
                    self._on_fault(lesson.name, exc)
            except Exception:  # noqa: BLE001
                log.exception("reporting a failed lesson %s", lesson.name)
        finally:
            self.busy_s += time.perf_counter() - started


_workers: "weakref.WeakSet[IdleWorker]" = weakref.WeakSet()
_workers_lock = threading.Lock()  # a new runtime's worker may register while a call lands elsewhere
calls_in_flight = CallsInFlight()  # the process's: every runtime enters its calls here


def _registered() -> list[IdleWorker]:
    with _workers_lock:
        return list(_workers)


@atexit.register
def _stop_all() -> None:
    for worker in _registered():
        worker.stop()

"""The engine loop: requests go in from any thread, one thread steps the engine while it has work.

Both engines are step machines (vLLM's `LLMEngine` is `add_request` + `step`; the embedded
engine admits, prefills a chunk and decodes a batch per step), so the contract every engine
offers is `submit(request) -> Future`, and this loop is what turns steps into futures. The
loop's thread starts on the first submit and ends after `idle_s` without work, so an idle
engine holds no thread (and can be garbage-collected). At interpreter exit every loop still
running finishes its step and fails what it has left (`EngineShutdown`): a daemon thread that
the interpreter's shutdown catches inside a torch op would abort the process.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["Job", "EngineLoop", "EngineShutdown"]

log = logging.getLogger(__name__)


class EngineShutdown(RuntimeError):
    """The engine loop was closed (the process is exiting) before this request was served."""


@dataclass(eq=False)
class Job:
    """One submitted request and the future its result goes to."""

    request: Any
    future: Future = field(default_factory=Future)
    submitted: float = field(default_factory=time.perf_counter)  # the request's TTFT counts from here
    seq: int = 0  # submission order, to break priority ties first come first served


class EngineLoop:
    """Feeds submitted jobs to `step(new_jobs) -> has_more_work` on a thread of its own.

    `step` owns the engine's state: it is only ever called from the loop's thread, and must
    resolve every job's future (a result or an exception) sooner or later. `on_crash` is told
    when `step` itself raises (or the loop is closed): the loop then fails the jobs it can no
    longer serve.
    """

    def __init__(self, step: Callable[[list[Job]], bool], on_crash: Callable[[BaseException], None], *,
                 name: str, idle_s: float = 1.0) -> None:
        self._step = step
        self._on_crash = on_crash
        self._name = name
        self._idle_s = idle_s
        self._inbox: list[Job] = []
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._seq = itertools.count()
        self._closing = False
        _LOOPS.add(self)

    def submit(self, request: Any) -> Job:
        job = Job(request, seq=next(self._seq))
        with self._wake:
            if self._closing:
                job.future.set_exception(EngineShutdown("the engine loop is closed"))
                return job
            self._inbox.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._wake.notify()
        return job

    @property
    def running(self) -> bool:
        return self._thread is not None

    def close(self, timeout: float = 30.0) -> None:
        """Stop after the current step; what the engine holds or never took fails with EngineShutdown."""
        with self._wake:
            self._closing = True
            thread = self._thread
            self._wake.notify()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        busy = False
        while True:
            with self._wake:
                if self._closing:
                    break
                if not busy and not self._inbox:
                    self._wake.wait(self._idle_s)
                    if self._closing:
                        break
                    if not self._inbox:
                        self._thread = None  # a submit from now on starts a new thread
                        return
                jobs, self._inbox = self._inbox, []
            try:
                busy = self._step(jobs)
            except BaseException as exc:  # noqa: BLE001 - the loop must never die with futures pending
                log.exception("the engine loop's step raised")
                self._on_crash(exc)
                busy = False
        with self._wake:
            left, self._inbox = self._inbox, []
            self._thread = None
        shutdown = EngineShutdown("the engine loop was closed (the process is exiting)")
        if busy:
            self._on_crash(shutdown)  # the requests the engine holds
        for job in left:  # and those it never took
            if not job.future.done():
                job.future.set_exception(shutdown)


_LOOPS: "weakref.WeakSet[EngineLoop]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """At interpreter exit, before daemon threads are frozen: let every running loop stop."""
    for loop in list(_LOOPS):
        loop.close()

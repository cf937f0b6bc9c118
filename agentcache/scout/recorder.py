"""Record real runs of the runtime as traces, in the format the generator writes.

    recorder = TraceRecorder()
    runtime = Runtime(engine, recorder=recorder)
    ... run calls ...
    recorder.trace().save("run.trace.jsonl")     # replay it: agentcache.scout.replay(trace, ...)

Each call becomes one request: agent, session (the call's, or "-"), the prompt's token ids,
the generated token ids, and the tokens of the call's leading PF segments as the agent's prefix.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

from agentcache.errors import TraceError
from agentcache.scout.workloads import Trace, TraceRequest

__all__ = ["TraceRecorder"]


class TraceRecorder:
    def __init__(self, meta: dict[str, Any] | None = None) -> None:
        self.meta = dict(meta or {})
        self._requests: list[TraceRequest] = []
        self._agents: dict[str, None] = {}  # in order of first appearance
        self._lock = threading.Lock()

    def record(
        self, agent: str, session: str | None, prompt: Sequence[int], output: Sequence[int], prefix_len: int
    ) -> None:
        request = TraceRequest(agent, session or "-", tuple(prompt), tuple(output), prefix_len)
        with self._lock:
            self._agents.setdefault(agent, None)
            self._requests.append(request)

    def __len__(self) -> int:
        return len(self._requests)

    def trace(self) -> Trace:
        with self._lock:
            if not self._requests:
                raise TraceError("nothing recorded yet: run some calls through the runtime first")
            return Trace(tuple(self._agents), list(self._requests), {"recorder": "agentcache.scout.recorder", **self.meta})

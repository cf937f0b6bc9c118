"""What a runtime remembers per session, bounded: agents' latest outputs and the shared texts seen.

A session is a `Scope` (a tenant's session). The table keeps the most recently used
`max_sessions` of them; forgetting one calls `on_forget(scope)`, so the runtime can drop the
session's source caches too. Within a session, the newest `max_entries` outputs and texts are kept.
The table has its own lock: adapters read shared texts while a call runs.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable

from agentcache.errors import PlanError
from agentcache.isolation import Scope
from agentcache.segments import AgentCall, Segment, output_slot

__all__ = ["SessionTable"]


class _Session:
    def __init__(self) -> None:
        self.outputs: OrderedDict[str, str] = OrderedDict()  # agent -> its latest output
        self.texts: OrderedDict[str, str] = OrderedDict()  # shared text (stripped) -> its slot


def _bounded_set(table: OrderedDict[str, str], key: str, value: str, limit: int, *, replace: bool = True) -> None:
    if key in table and not replace:
        table.move_to_end(key)
        return
    table[key] = value
    table.move_to_end(key)
    while len(table) > limit:
        table.popitem(last=False)


class SessionTable:
    def __init__(self, max_sessions: int, max_entries: int, on_forget: Callable[[Scope], None]) -> None:
        self.max_sessions = max_sessions
        self.max_entries = max_entries
        self._on_forget = on_forget
        self._sessions: OrderedDict[Scope, _Session] = OrderedDict()
        self._lock = threading.Lock()
        self.forgotten = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def record(self, scope: Scope, agent: str, output: str, slot: str, shared: list[tuple[str, str]]) -> None:
        """After a call: `agent`'s output (read through `slot`) and the shared (text, slot) pairs it read."""
        forgotten = []
        with self._lock:
            session = self._sessions.get(scope)
            if session is None:
                session = self._sessions[scope] = _Session()
            self._sessions.move_to_end(scope)
            _bounded_set(session.outputs, agent, output, self.max_entries)
            for text, text_slot in shared:
                _bounded_set(session.texts, text, text_slot, self.max_entries, replace=False)
            if output.strip():
                _bounded_set(session.texts, output.strip(), slot, self.max_entries)
            while len(self._sessions) > self.max_sessions:
                forgotten.append(self._sessions.popitem(last=False)[0])
                self.forgotten += 1
        for old in forgotten:
            self._on_forget(old)

    def record_call(self, call: AgentCall, output: str) -> None:
        """After `call`: its agent's output, and the shared texts the call read."""
        shared = [(seg.text.strip(), seg.slot) for seg in call.segments
                  if seg.kind == "ph" and seg.text and seg.text.strip()]
        self.record(Scope(call.tenant, call.session), call.agent, output, output_slot(call.agent), shared)

    def output(self, scope: Scope, agent: str) -> str | None:
        with self._lock:
            session = self._sessions.get(scope)
            return session.outputs.get(agent) if session is not None else None

    def output_segment(self, scope: Scope, agent: str) -> Segment:
        """A PH segment holding `agent`'s latest output in `scope`, for another agent's call there."""
        output = self.output(scope, agent)
        if output is None:
            raise PlanError(f"agent {agent!r} has produced no output in session {scope.session!r}"
                            f"{f' of tenant {scope.tenant!r}' if scope.tenant is not None else ''}; agents with "
                            f"output there: {self.agents(scope)}")
        if not output:
            raise PlanError(f"agent {agent!r}'s latest output in session {scope.session!r} is empty: there is "
                            "nothing to read; leave it out of the call")
        return Segment.ph(output_slot(agent), output)

    def agents(self, scope: Scope) -> list[str]:
        with self._lock:
            session = self._sessions.get(scope)
            return sorted(session.outputs) if session is not None else []

    def texts(self, scope: Scope) -> dict[str, str]:
        with self._lock:
            session = self._sessions.get(scope)
            return dict(session.texts) if session is not None else {}

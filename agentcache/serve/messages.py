"""OpenAI chat messages as the shared transcript layout (`agentcache.transcript`), as the adapters lay them out.

System (and "developer") messages are the calling agent's private prefix (PF). A user message is
the query (PH "query"; the user's later messages "user:1", "user:2", ...: a closing ask is not the
document before it), unless it carries another agent's `name`: then it is that agent's
output handed over (PH "out:<name>"), as AutoGen's client sends other agents' messages. An
assistant message is the caller's own earlier output (PH "out:<self>"), or another agent's when
it names one; its `tool_calls` become the turn's calls. A tool message is the result of the call
its `tool_call_id` answers (PH "tool:<name>"). Content is text or a list of text parts; anything
else is refused with the message and part named.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from agentcache.serve.api import ApiError
from agentcache.segments import output_author
from agentcache.toolcalls import ToolCall
from agentcache.transcript import MIN_KNOWN_CHARS, ChatTurn

__all__ = ["Transcript", "read_messages"]

_SYSTEM_ROLES = ("system", "developer")


class Transcript:
    """The messages read: system texts, the chat turns (with the caller still to be named), and the names."""

    def __init__(self, system: list[str], turns: list[tuple[str, str | None, str, tuple[ToolCall, ...]]],
                 system_name: str | None) -> None:
        self.system = system
        self._turns = turns  # (role, name, text, calls) with role user/assistant/tool
        self.system_name = system_name  # the `name` on a system message, when one has it

    @property
    def own_names(self) -> set[str]:
        """The names on the assistant messages: the caller's own turns, as AutoGen's client names them."""
        return {name for role, name, _, _ in self._turns if role == "assistant" and name}

    def turns(self, agent: str, known: Mapping[str, str] | None = None) -> list[ChatTurn]:
        """The chat turns as `agent` reads them: assistant messages without a name are its own.
        `known` (a session's shared texts -> their slots): another agent's message whose text is
        an output the session knows is read as that output, whatever name the client gave its author
        (AutoGen names the author by its agent name; the author called in by its fingerprint)."""
        read = []
        asked = 0  # the user's own messages so far: the first is the query, each later one a slot of its own
        for role, name, text, calls in self._turns:
            if role == "user":
                other = name and name != "user"
                author = _known_author(text, known, agent) or name
                read.append(ChatTurn("agent", author, text) if other else ChatTurn("user", "user", text, ordinal=asked))
                asked += not other
            elif role == "assistant":
                author = (_known_author(text, known, agent) or name) if name and name != agent else agent
                read.append(ChatTurn("agent", author, text, calls))
            else:
                read.append(ChatTurn("tool", name or "tool", text))
        return read


def _known_author(text: str, known: Mapping[str, str] | None, caller: str) -> str | None:
    """The agent whose output `text` is, when the session knows it: long enough to be an output and
    not a short reply anyone could write ("OK", "TERMINATE"), and another agent than the caller."""
    text = text.strip()
    slot = (known or {}).get(text) if len(text) >= MIN_KNOWN_CHARS else None
    author = output_author(slot) if slot else None
    return author if author != caller else None


def read_messages(messages: Sequence[Any]) -> Transcript:
    """`messages` (the request's, as parsed JSON) read; an ApiError 400 naming the message at fault."""
    system: list[str] = []
    system_name: str | None = None
    turns: list[tuple[str, str | None, str, tuple[ToolCall, ...]]] = []
    called: dict[str, str] = {}  # tool_call_id -> the tool's name, from the assistant messages so far
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, Mapping):
            raise ApiError(400, f"{where}: a message must be an object with a role", param=where)
        role = message.get("role")
        name = _name(message, where)
        if role in _SYSTEM_ROLES:
            system.append(_text(message.get("content"), where, required=True))
            system_name = system_name or name
        elif role == "user":
            turns.append(("user", name, _text(message.get("content"), where, required=True), ()))
        elif role == "assistant":
            calls = _calls(message.get("tool_calls"), where)
            called.update({call.id: call.name for call in calls if call.id})
            text = _text(message.get("content"), where, required=not calls)
            turns.append(("assistant", name, text, calls))
        elif role == "tool":
            tool_call_id = message.get("tool_call_id")
            if not isinstance(tool_call_id, str) or not tool_call_id:
                raise ApiError(400, f"{where}.tool_call_id: a tool message needs the id of the call it answers",
                               param=f"{where}.tool_call_id")
            turns.append(("tool", called.get(tool_call_id) or name, _text(message.get("content"), where), ()))
        elif role == "function":
            raise ApiError(400, f"{where}.role: 'function' messages (legacy function calling) are not supported; "
                                "send tool messages", param=f"{where}.role")
        else:
            raise ApiError(400, f"{where}.role: must be one of system, developer, user, assistant, tool; got {role!r}",
                           param=f"{where}.role")
    return Transcript(system, turns, system_name)


def _name(message: Mapping[str, Any], where: str) -> str | None:
    name = message.get("name")
    if name is None:
        return None
    if not isinstance(name, str) or not name.strip() or name.startswith("<"):
        raise ApiError(400, f"{where}.name: must be a non-empty string not starting with '<', got {name!r}",
                       param=f"{where}.name")
    return name


def _text(content: Any, where: str, *, required: bool = False) -> str:
    """A message's text: a string, or the text parts of a list (a "refusal" part is text too)."""
    if content is None:
        if required:
            raise ApiError(400, f"{where}.content: this message needs content", param=f"{where}.content")
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content: must be a string or a list of text parts, got {type(content).__name__}",
                       param=f"{where}.content")
    parts = []
    for number, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        field = "text" if kind == "text" else "refusal" if kind == "refusal" else None
        value = part.get(field) if field else None
        if not isinstance(value, str):
            raise ApiError(400, f"{where}.content[{number}]: only text parts are supported (got type {kind!r}); "
                                "agentcache serves text models", param=f"{where}.content[{number}]")
        parts.append(value)
    return "".join(parts)


def _calls(tool_calls: Any, where: str) -> tuple[ToolCall, ...]:
    if tool_calls is None:
        return ()
    if not isinstance(tool_calls, list):
        raise ApiError(400, f"{where}.tool_calls: must be a list", param=f"{where}.tool_calls")
    calls = []
    for number, call in enumerate(tool_calls):
        at = f"{where}.tool_calls[{number}]"
        function = call.get("function") if isinstance(call, Mapping) else None
        name = function.get("name") if isinstance(function, Mapping) else None
        arguments = function.get("arguments") if isinstance(function, Mapping) else None
        if not isinstance(name, str) or not name:
            raise ApiError(400, f"{at}.function.name: a tool call needs the tool's name", param=f"{at}.function.name")
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise ApiError(400, f"{at}.function.arguments: must be a JSON object (as a string), got {arguments!r}",
                           param=f"{at}.function.arguments")
        call_id = call.get("id")
        calls.append(ToolCall(name, parsed, call_id if isinstance(call_id, str) else ""))
    return tuple(calls)

"""LangChain messages as the shared transcript layout (`agentcache.transcript`).

System messages are the agent's private prefix; human, AI and tool messages are chat turns. An
`AIMessage`'s `tool_calls` become the turn's calls (rendered by the model's chat template when it
has a tool-call format, else one JSON line each); its `invalid_tool_calls` are left out (they were
never run). A `ToolMessage` is the result of the tool it names, else of the call its
`tool_call_id` answers, else of "tool".
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage

from agentcache.content import flatten_content, text_block
from agentcache.segments import AgentCall
from agentcache.toolcalls import ToolCall
from agentcache.transcript import ChatML, ChatTurn, UnsupportedMessageError, build_call

__all__ = ["to_call", "to_turns", "AGENT_KEY"]

AGENT_KEY = "agentcache_agent"  # response_metadata key naming the agent that wrote an AIMessage
# Content parts of an AIMessage that repeat its tool calls (Anthropic's "tool_use", LangChain's
# standard blocks): the calls are read from `tool_calls`, so these parts are skipped.
_CALL_PARTS = frozenset({"tool_use", "tool_call", "tool_call_chunk", "invalid_tool_call"})


def _text(message: BaseMessage, index: int, skip: frozenset[str] = frozenset()) -> str:
    """The message's text; a list content keeps its text parts (and skips the `skip` kinds) and
    refuses anything else."""

    def read(part: Any) -> str | None:
        text = text_block(part)
        if text is not None:
            return text
        if isinstance(part, dict) and part.get("type") in skip:
            return None
        kind = part.get("type", "untyped") if isinstance(part, dict) else type(part).__name__
        what = "a tool result" if isinstance(message, ToolMessage) else "a message"
        raise UnsupportedMessageError(
            f"message {index} ({type(message).__name__}) has a {kind!r} content part; the agentcache "
            f"runtime reads text only (send {what} as text, or leave the part out)")

    return flatten_content(message.content, read)


def _author(message: AIMessage) -> str | None:
    """Who wrote an AI message: its name, else the agent our model recorded on it (LangChain drops
    `name` when it merges streamed chunks; the response metadata survives)."""
    if message.name:
        return message.name
    recorded = (message.response_metadata or {}).get(AGENT_KEY)
    return recorded if isinstance(recorded, str) and recorded else None


def _tool_calls(message: AIMessage, index: int) -> tuple[ToolCall, ...]:
    calls = []
    for call in message.tool_calls:
        args = call.get("args")
        if not isinstance(args, Mapping):
            raise UnsupportedMessageError(f"message {index} (AIMessage) has a tool call to {call.get('name')!r} whose "
                                          f"args are a {type(args).__name__}, not a JSON object")
        calls.append(ToolCall(call["name"], dict(args), call.get("id") or ""))
    return tuple(calls)


def to_turns(messages: Sequence[BaseMessage], agent: str) -> tuple[list[str], list[ChatTurn]]:
    """System texts and chat turns of `messages` as `agent` reads them."""
    system: list[str] = []
    turns: list[ChatTurn] = []
    called: dict[str, str] = {}  # tool_call_id -> the tool's name, from the AI messages read so far
    for index, message in enumerate(messages):
        if isinstance(message, SystemMessage):
            system.append(_text(message, index))
        elif isinstance(message, HumanMessage):
            text = _text(message, index)
            # A named human message is another agent's output handed over as input.
            named = message.name and message.name != "user"
            turns.append(ChatTurn("agent", message.name, text) if named else ChatTurn("user", "user", text))
        elif isinstance(message, AIMessage):
            calls = _tool_calls(message, index)
            called.update({call.id: call.name for call in calls if call.id})
            skip = _CALL_PARTS if message.tool_calls or message.invalid_tool_calls else frozenset()
            turns.append(ChatTurn("agent", _author(message) or agent, _text(message, index, skip), calls))
        elif isinstance(message, ToolMessage):
            name = message.name or called.get(message.tool_call_id) or "tool"
            turns.append(ChatTurn("tool", name, _text(message, index)))
        else:
            raise UnsupportedMessageError(
                f"message {index} is a {type(message).__name__}; the agentcache runtime reads system, human, "
                "AI and tool messages")
    return system, turns


def to_call(messages: Sequence[Any], agent: str, session: str | None, chat: ChatML | None = None,
            tools: Sequence[Mapping[str, Any]] = ()) -> AgentCall:
    """The agent call `agent` makes after reading `messages` (in the model's ChatML when `chat`),
    with `tools` (OpenAI-shaped schemas) offered to it."""
    system, turns = to_turns(messages, agent)
    return build_call(agent, system, turns, tools=tools, session=session, chat=chat)

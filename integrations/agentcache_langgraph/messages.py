"""LangChain messages as the shared transcript layout (`agentcache.transcript`)."""

from __future__ import annotations

from typing import Any, Sequence

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage

from agentcache.segments import AgentCall
from agentcache.transcript import ChatML, ChatTurn, UnsupportedMessageError, build_call

__all__ = ["to_call", "to_turns", "AGENT_KEY"]

AGENT_KEY = "agentcache_agent"  # response_metadata key naming the agent that wrote an AIMessage


def _text(message: BaseMessage, index: int) -> str:
    """The message's text; a list content keeps its text parts and refuses anything else."""
    content = message.content
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if isinstance(part, str):
            parts.append(part)
        elif isinstance(part, dict) and part.get("type") == "text":
            parts.append(str(part.get("text", "")))
        else:
            kind = part.get("type", "untyped") if isinstance(part, dict) else type(part).__name__
            raise UnsupportedMessageError(
                f"message {index} ({type(message).__name__}) has a {kind!r} content part; the agentcache "
                "runtime reads text only (send the part as text, or leave it out)")
    return "".join(parts)


def _author(message: AIMessage) -> str | None:
    """Who wrote an AI message: its name, else the agent our model recorded on it (LangChain drops
    `name` when it merges streamed chunks; the response metadata survives)."""
    if message.name:
        return message.name
    recorded = (message.response_metadata or {}).get(AGENT_KEY)
    return recorded if isinstance(recorded, str) and recorded else None


def to_turns(messages: Sequence[BaseMessage], agent: str) -> tuple[list[str], list[ChatTurn]]:
    """System texts and chat turns of `messages` as `agent` reads them."""
    system: list[str] = []
    turns: list[ChatTurn] = []
    for index, message in enumerate(messages):
        if isinstance(message, SystemMessage):
            system.append(_text(message, index))
        elif isinstance(message, HumanMessage):
            text = _text(message, index)
            # A named human message is another agent's output handed over as input.
            named = message.name and message.name != "user"
            turns.append(ChatTurn("agent", message.name, text) if named else ChatTurn("user", "user", text))
        elif isinstance(message, AIMessage):
            if message.tool_calls or message.invalid_tool_calls:
                raise UnsupportedMessageError(
                    f"message {index} (AIMessage) carries tool calls; the agentcache runtime neither emits nor "
                    "reads tool calls (describe tools in the system prompt and parse the text instead)")
            turns.append(ChatTurn("agent", _author(message) or agent, _text(message, index)))
        elif isinstance(message, ToolMessage):
            turns.append(ChatTurn("tool", message.name or "tool", _text(message, index)))
        else:
            raise UnsupportedMessageError(
                f"message {index} is a {type(message).__name__}; the agentcache runtime reads system, human, "
                "AI and tool messages")
    return system, turns


def to_call(messages: Sequence[Any], agent: str, session: str | None, chat: ChatML | None = None) -> AgentCall:
    """The agent call `agent` makes after reading `messages` (in the model's ChatML when `chat`)."""
    system, turns = to_turns(messages, agent)
    return build_call(agent, system, turns, session=session, chat=chat)

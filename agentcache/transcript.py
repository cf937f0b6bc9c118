"""The prompt layout every adapter shares: a chat transcript as PF and PH segments.

A framework hands the model a list of messages. The adapters turn them into `ChatTurn`s and
`build_call` lays them out for a base model, one segment per piece (KVCMAS Eq. 1):

    {system}                    PF  the agent's system message(s)
    \\n\\nTools:\\n{schemas}        PF  tool definitions, one JSON object per line, when given
    \\n\\n### user\\n               PF  glue framing the next message
    {text}                      PH  slot "query"
    \\n\\n### planner\\n            PF
    {text}                      PH  slot "out:planner" (the agent's own output: "out:<self>")
    \\n\\n### tool search\\n        PF
    {text}                      PH  slot "tool:search"
    \\n\\n### {agent}\\n            PF  the cue the agent answers after

The glue is the same for every agent, so the same message gets the same tokens in every
agent's prompt. Generation stops at the next header (`TRANSCRIPT_STOP`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Sequence

from agentcache.segments import AgentCall, Segment, output_slot

__all__ = ["ChatTurn", "build_call", "split_known", "TRANSCRIPT_STOP", "UnsupportedMessageError"]

TRANSCRIPT_STOP = ("\n###",)
_MIN_KNOWN_CHARS = 24  # shorter shared texts are not worth a PH segment inside a monolithic prompt


class UnsupportedMessageError(ValueError):
    """A message the adapters cannot lay out as text segments (an image, an unknown content type)."""


@dataclass(frozen=True)
class ChatTurn:
    role: Literal["user", "agent", "tool"]
    source: str  # "user", the agent that wrote it, or the tool's name
    text: str

    @property
    def slot(self) -> str:
        if self.role == "user":
            return "query"
        if self.role == "agent":
            return output_slot(self.source)
        return f"tool:{self.source}"

    @property
    def header(self) -> str:
        return f"\n\n### {'tool ' if self.role == 'tool' else ''}{self.source}\n"


def _tool_lines(tools: Sequence[Mapping[str, Any]]) -> str:
    return "".join(json.dumps(dict(tool), sort_keys=True, default=str) + "\n" for tool in tools)


def build_call(
    agent: str,
    system: Sequence[str],
    turns: Sequence[ChatTurn],
    *,
    tools: Sequence[Mapping[str, Any]] = (),
    session: str | None = None,
    known: Mapping[str, str] | None = None,
) -> AgentCall:
    """The call `agent` makes after reading `turns`.

    `known` (shared text -> slot) is for an agent whose messages are its own wording quoting
    shared texts (a selector prompt embedding the conversation): each turn is split, the wording
    PF and the quoted texts PH. Without it every turn is one PH segment of the turn's slot."""
    pieces: list[Segment] = []
    head = "\n\n".join(part.strip("\n") for part in system if part.strip())
    if tools:
        head += ("\n\n" if head else "") + "Tools:\n" + _tool_lines(tools).rstrip("\n")
    if head:
        pieces.append(Segment.pf(head))
    for turn in turns:
        pieces.append(Segment.pf(turn.header))
        if not turn.text:
            continue  # an empty message keeps its header only
        if known is not None:
            pieces.extend(split_known(turn.text, known))
        else:
            pieces.append(Segment.ph(turn.slot, turn.text))
    pieces.append(Segment.pf(f"\n\n### {agent}\n"))
    return AgentCall(agent=agent, segments=tuple(_merge_pf(pieces)), session=session)


def split_known(text: str, known: Mapping[str, str]) -> list[Segment]:
    """`text` cut at the known shared texts it quotes: PF around, PH (with the known slot) for each
    quote. A text quoting none is one PF segment; a text that is itself known, one PH segment.

    The text stays exactly the same; its tokens may not. Segments are tokenized apart, so where a
    quote follows a space ("user: A family") the space becomes a token of its own instead of
    joining the quote's first word: the price of the quote having the same tokens as everywhere
    else, which is what lets its KV be reused."""
    if text.strip() in known:
        return [Segment.ph(known[text.strip()], text)]
    quotes: list[tuple[int, int, str]] = []  # (start, end, slot), non-overlapping, longest first
    for shared in sorted((k for k in known if len(k) >= _MIN_KNOWN_CHARS), key=len, reverse=True):
        start = text.find(shared)
        while start != -1:
            end = start + len(shared)
            if all(end <= s or start >= e for s, e, _ in quotes):
                quotes.append((start, end, known[shared]))
            start = text.find(shared, end)
    pieces, cursor = [], 0
    for start, end, slot in sorted(quotes):
        if start > cursor:
            pieces.append(Segment.pf(text[cursor:start]))
        pieces.append(Segment.ph(slot, text[start:end]))
        cursor = end
    if cursor < len(text):
        pieces.append(Segment.pf(text[cursor:]))
    return pieces


def _merge_pf(pieces: list[Segment]) -> list[Segment]:
    """Adjacent PF texts become one segment (fewer, longer segments; same tokens for every agent)."""
    merged: list[Segment] = []
    for piece in pieces:
        if piece.kind == "pf" and merged and merged[-1].kind == "pf":
            merged[-1] = Segment.pf(merged[-1].text + piece.text)
        else:
            merged.append(piece)
    return merged

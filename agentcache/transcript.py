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

An instruct model whose chat template is ChatML (Qwen2.5) reads the same turns in its own
format instead (`ChatML`, chosen by `chat_format(engine)`): every message framed by its
`<|im_start|>role` and `<|im_end|>` control tokens, which the format places as token ids (text
never becomes a control token), the frames PF and each message's text PH as above:

    <|im_start|>system\n{system}<|im_end|>\n               PF
    <|im_start|>user\n {text} <|im_end|>\n                 PF, PH "query", PF
    <|im_start|>user\nplanner:\n {text} <|im_end|>\n      another agent's output, PH "out:planner"
    <|im_start|>assistant\n {text} <|im_end|>\n            the caller's own output, PH "out:<self>"
    <|im_start|>user\ntool search:\n {text} <|im_end|>\n  PH "tool:search"
    <|im_start|>assistant\n                                the cue

The turn ends with the model's end-of-turn token, an EOS the engine stops at.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Sequence

from agentcache.segments import AgentCall, Segment, output_slot

__all__ = ["ChatTurn", "ChatML", "build_call", "chat_format", "split_known", "stop_strings", "TRANSCRIPT_STOP",
           "UnsupportedMessageError"]

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


@dataclass(frozen=True)
class ChatML:
    """The ChatML frames of one model: its control token ids and its literal tokenizer."""

    start_id: int  # <|im_start|>
    end_id: int  # <|im_end|>
    encode: Callable[[str], list[int]]

    def opener(self, role: str, label: str = "") -> list[int]:
        return [self.start_id, *self.encode(f"{role}\n{label}")]

    def closer(self) -> list[int]:
        return [self.end_id, *self.encode("\n")]

    def turn_opener(self, turn: ChatTurn, agent: str) -> list[int]:
        if turn.role == "user":
            return self.opener("user")
        if turn.role == "agent" and turn.source == agent:
            return self.opener("assistant")
        label = f"tool {turn.source}" if turn.role == "tool" else turn.source
        return self.opener("user", f"{label}:\n")


def chat_format(engine: Any) -> ChatML | None:
    """ChatML when the engine's model has a ChatML chat template and its control tokens; None: the
    plain transcript (base models, and any other template)."""
    template = getattr(engine, "chat_template", None)
    if not isinstance(template, str) or "<|im_start|>" not in template:
        return None
    start, end = engine.control_token_id("<|im_start|>"), engine.control_token_id("<|im_end|>")
    if start is None or end is None:
        return None
    return ChatML(start, end, engine.tokenize)


def stop_strings(chat: ChatML | None) -> tuple[str, ...]:
    """The layout's own stop strings: the plain transcript's next header; none for ChatML, whose
    turns end with an end-of-turn token the engine stops at."""
    return TRANSCRIPT_STOP if chat is None else ()


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
    chat: ChatML | None = None,
) -> AgentCall:
    """The call `agent` makes after reading `turns`, in the plain transcript or, with `chat`, in
    the model's ChatML.

    `known` (shared text -> slot) is for an agent whose messages are its own wording quoting
    shared texts (a selector prompt embedding the conversation): each turn is split, the wording
    PF and the quoted texts PH. Without it every turn is one PH segment of the turn's slot."""
    pieces: list[Segment] = []
    head = "\n\n".join(part.strip("\n") for part in system if part.strip())
    if tools:
        head += ("\n\n" if head else "") + "Tools:\n" + _tool_lines(tools).rstrip("\n")
    if chat is not None and head:
        pieces += [_ids(chat.opener("system")), Segment.pf(head), _ids(chat.closer())]
    elif head:
        pieces.append(Segment.pf(head))
    for turn in turns:
        pieces.append(_ids(chat.turn_opener(turn, agent)) if chat is not None else Segment.pf(turn.header))
        if turn.text and known is not None:
            pieces.extend(split_known(turn.text, known))
        elif turn.text:  # an empty message keeps its frame only
            pieces.append(Segment.ph(turn.slot, turn.text))
        if chat is not None:
            pieces.append(_ids(chat.closer()))
    pieces.append(_ids(chat.opener("assistant")) if chat is not None else Segment.pf(f"\n\n### {agent}\n"))
    encode = chat.encode if chat is not None else None
    return AgentCall(agent=agent, segments=tuple(_merge_pf(pieces, encode)), session=session)


def _ids(token_ids: list[int]) -> Segment:
    return Segment(kind="pf", token_ids=tuple(token_ids))


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


def _merge_pf(pieces: list[Segment], encode: Callable[[str], list[int]] | None = None) -> list[Segment]:
    """Adjacent PF pieces become one segment (fewer, longer segments; same tokens for every agent).
    With `encode` (a chat format that places control tokens as ids) PF texts become token ids and
    adjacent PF ids join; without it adjacent PF texts join."""
    merged: list[Segment] = []
    for piece in pieces:
        if piece.kind == "pf" and encode is not None and piece.text is not None:
            piece = _ids(encode(piece.text))
        if piece.kind == "pf" and merged and merged[-1].kind == "pf":
            last = merged[-1]
            if last.text is not None and piece.text is not None:
                merged[-1] = Segment.pf(last.text + piece.text)
                continue
            if last.token_ids is not None and piece.token_ids is not None:
                merged[-1] = _ids([*last.token_ids, *piece.token_ids])
                continue
        merged.append(piece)
    return merged

"""The prompt layout every adapter shares: a chat transcript as PF and PH segments.

A framework hands the model a list of messages. The adapters turn them into `ChatTurn`s and
`build_call` lays them out for a base model, one segment per piece (KVCMAS Eq. 1):

    {system}                    PF  the agent's system message(s)
    \\n\\nTools:\\n{schemas}        PF  tool definitions, one JSON object per line, when given
    \\n\\n### user\\n               PF  glue framing the next message
    {text}                      PH  slot "query" (a later message of the user's: "user:1", "user:2", ...)
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

A model whose chat template can call tools (`ChatML.tool_format`) gets its tools, tool results and
its own tool calls rendered by that template, the frames PF and the texts PH as before:

    <|im_start|>system\n{system}{the template's tool section}<|im_end|>\n      PF (the agent's own)
    <|im_start|>user\n<tool_response>\n {result} \n</tool_response>...        PH "tool:<name>" per result
    <|im_start|>assistant\n {its text and <tool_call> blocks} <|im_end|>\n     PH "out:<self>"

Each frame is cut from the template's own rendering of a conversation whose texts are stand-ins,
so the layout is token for token what `apply_chat_template` gives (tests/test_tool_calls.py).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Sequence

from agentcache.engine.protocol import Engine
from agentcache.errors import InputError
from agentcache.segments import AgentCall, Segment, output_slot
from agentcache.toolcalls import ToolCall, ToolFormat, function_tools

__all__ = ["ChatTurn", "ChatML", "build_call", "chat_format", "split_known", "stop_strings", "TRANSCRIPT_STOP",
           "UnsupportedMessageError"]

TRANSCRIPT_STOP = ("\n###",)
MIN_KNOWN_CHARS = 24  # shorter shared texts are not worth a PH segment inside a monolithic prompt


class UnsupportedMessageError(ValueError):
    """A message the adapters cannot lay out as text segments (an image, an unknown content type)."""


@dataclass(frozen=True)
class ChatTurn:
    role: Literal["user", "agent", "tool"]
    source: str  # "user", the agent that wrote it, or the tool's name
    text: str
    calls: tuple[ToolCall, ...] = ()  # an agent's tool calls, after its text
    ordinal: int = 0  # a user turn's place among the user's turns: the first is the query, later ones follow-ups

    @property
    def slot(self) -> str:
        if self.role == "user":
            return "query" if self.ordinal == 0 else f"user:{self.ordinal}"
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
    template: str | None = None  # the model's chat template (its Jinja source)
    tool_format: ToolFormat | None = None  # how the template renders tool calls; None: it cannot

    def frame(self, text: str) -> list[int]:
        """Ids of template-written text: its control-token spellings as control ids, the rest literal.
        Only text the template wrote goes here, never a message's."""
        ids: list[int] = []
        for piece in _CONTROL_SPLIT.split(text):
            if piece == _START:
                ids.append(self.start_id)
            elif piece == _END:
                ids.append(self.end_id)
            elif piece:
                ids.extend(self.encode(piece))
        return ids

    def system_with_tools(self, system: str, tools: Sequence[Mapping[str, Any]]) -> list["Segment"]:
        """The system turn with the template's tool section, as PF segments (the agent's own)."""
        written = json.dumps(function_tools(tools))  # the control spellings are ASCII: escaping keeps them
        if _START in written or _END in written:
            raise InputError("a tool schema spells a ChatML control token (<|im_start|> or <|im_end|>); "
                             "tool schemas are text and cannot hold one")
        before, after = _system_frames(self.template, written, bool(system))
        # One literal run from the last control token before the system text to the first after it,
        # tokenized whole as the template's own tokenization does ("." and "\n\n" may join).
        *lead, opening = _CONTROL_SPLIT.split(before)
        closing, *trail = _CONTROL_SPLIT.split(after)
        ids = [*self.frame("".join(lead)), *self.encode(opening + system + closing), *self.frame("".join(trail))]
        return [_ids(ids)]

    def frame_segments(self, text: str) -> list["Segment"]:
        """`frame(text)` as a PF segment; none for an empty frame."""
        return [_ids(self.frame(text))] if text else []

    def tool_frames(self) -> tuple[str, str, str]:
        """(before the first result, between two results, after the last) of a run of tool results."""
        return _tool_frames(self.template)

    def assistant_text(self, text: str, calls: Sequence[ToolCall]) -> str:
        """An assistant turn's text with its tool calls, as the template writes it."""
        return _assistant_text(self.template, text, tuple((c.name, c.arguments_json) for c in calls))

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


def chat_format(engine: Engine) -> ChatML | None:
    """ChatML when the engine's model has a ChatML chat template and its control tokens; None: the
    plain transcript (base models, and any other template)."""
    template = engine.chat_template
    if not isinstance(template, str) or "<|im_start|>" not in template:
        return None
    start, end = engine.control_token_id("<|im_start|>"), engine.control_token_id("<|im_end|>")
    if start is None or end is None:
        return None
    return ChatML(start, end, engine.tokenize, template, ToolFormat.of_template(template))


# --- frames cut from the template's own rendering ------------------------------------------------

_START, _END = "<|im_start|>", "<|im_end|>"
_CONTROL_SPLIT = re.compile(f"({re.escape(_START)}|{re.escape(_END)})")
_STAND_IN = "\u2063agentcache-{}\u2063"  # text no message holds (invisible separators around a name)


def _render(template: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template([messages], tools=tools, chat_template=template)
    return rendered[0]


def _cut(rendered: str, *stand_ins: str) -> list[str]:
    """`rendered` split at each stand-in in turn; a template that drops or repeats one is not ours to read."""
    parts, rest = [], rendered
    for stand_in in stand_ins:
        if rest.count(stand_in) != 1:
            raise InputError(f"the model's chat template does not render each message once (looked for "
                             f"{stand_in!r}); agentcache cannot lay out tool calls with it")
        head, rest = rest.split(stand_in)
        parts.append(head)
    return [*parts, rest]


@functools.lru_cache(maxsize=32)
def _system_frames(template: str, tools_json: str, with_system: bool) -> tuple[str, str]:
    """The system turn with tools: the text before the system message and after it (the tool
    section and the turn's end), up to the first user turn. Without a system message, the whole
    turn the template writes (its default system prompt included) comes before."""
    system, user = _STAND_IN.format("system"), _STAND_IN.format("user")
    messages = ([{"role": "system", "content": system}] if with_system else []) + [{"role": "user", "content": user}]
    rendered = _render(template, messages, json.loads(tools_json))
    user_turn = f"{_START}user\n{user}"
    if user_turn not in rendered:
        raise InputError("the model's chat template does not write a user turn as ChatML; agentcache cannot lay "
                         "out tools with it")
    head = rendered[: rendered.index(user_turn)]
    if not with_system:
        return head, ""
    before, after = _cut(head, system)
    return before, after


@functools.lru_cache(maxsize=8)
def _tool_frames(template: str) -> tuple[str, str, str]:
    first, second = _STAND_IN.format("result-1"), _STAND_IN.format("result-2")
    base = [{"role": "user", "content": "q"}]
    lead = len(_render(template, base))
    one = _render(template, [*base, {"role": "tool", "content": first}])[lead:]
    two = _render(template, [*base, {"role": "tool", "content": first}, {"role": "tool", "content": second}])[lead:]
    before, after = _cut(one, first)
    before2, between, after2 = _cut(two, first, second)
    if (before2, after2) != (before, after):
        raise InputError("the model's chat template frames tool results in a way agentcache cannot read")
    return before, between, after


@functools.lru_cache(maxsize=256)
def _assistant_text(template: str, text: str, calls: tuple[tuple[str, str], ...]) -> str:
    base = [{"role": "user", "content": "q"}]
    lead = len(_render(template, base))
    message = {"role": "assistant", "content": text,
               "tool_calls": [{"type": "function", "function": {"name": name, "arguments": json.loads(arguments)}}
                              for name, arguments in calls]}
    turn = _render(template, [*base, message])[lead:]
    opener, closer = f"{_START}assistant\n", f"{_END}\n"
    if not (turn.startswith(opener) and turn.endswith(closer)):
        raise InputError("the model's chat template writes an assistant's tool calls in a frame agentcache cannot read")
    return turn[len(opener) : -len(closer)]


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
    templated = chat is not None and chat.tool_format is not None  # the template renders tools and results
    if tools and templated:
        pieces += chat.system_with_tools(head, tools)
        head = ""
    elif tools:
        head += ("\n\n" if head else "") + "Tools:\n" + _tool_lines(tools).rstrip("\n")
    if chat is not None and head:
        pieces += [_ids(chat.opener("system")), Segment.pf(head), _ids(chat.closer())]
    elif head:
        pieces.append(Segment.pf(head))
    for index, turn in enumerate(turns):
        if turn.role == "tool" and templated:
            pieces.extend(_tool_result(chat, turns, index))
            continue
        pieces.append(_ids(chat.turn_opener(turn, agent)) if chat is not None else Segment.pf(turn.header))
        text = _turn_text(turn, chat if templated else None)
        if text and known is not None:
            pieces.extend(split_known(text, known))
        elif text:  # an empty message keeps its frame only
            pieces.append(Segment.ph(turn.slot, text))
        if chat is not None:
            pieces.append(_ids(chat.closer()))
    pieces.append(_ids(chat.opener("assistant")) if chat is not None else Segment.pf(f"\n\n### {agent}\n"))
    encode = chat.encode if chat is not None else None
    return AgentCall(agent=agent, segments=tuple(_merge_pf(pieces, encode)), session=session)


def _turn_text(turn: ChatTurn, chat: ChatML | None) -> str:
    """A turn's text with its tool calls: as the template writes them, else one JSON line each."""
    if not turn.calls:
        return turn.text
    if chat is not None:
        return chat.assistant_text(turn.text, turn.calls)
    lines = [json.dumps({"name": c.name, "arguments": c.arguments}, ensure_ascii=False) for c in turn.calls]
    return "\n".join(part for part in (turn.text, *lines) if part)


def _tool_result(chat: ChatML, turns: Sequence[ChatTurn], index: int) -> list[Segment]:
    """A tool result in the template's frame; consecutive results share one turn, as the template writes them."""
    before, between, after = chat.tool_frames()
    first = index == 0 or turns[index - 1].role != "tool"
    last = index == len(turns) - 1 or turns[index + 1].role != "tool"
    pieces = chat.frame_segments(before if first else between)
    if turns[index].text:
        pieces.append(Segment.ph(turns[index].slot, turns[index].text))
    return pieces + (chat.frame_segments(after) if last else [])


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
    for shared in sorted((k for k in known if len(k) >= MIN_KNOWN_CHARS), key=len, reverse=True):
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

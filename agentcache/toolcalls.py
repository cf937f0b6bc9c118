"""Tool calls: a model's tool-call format, the calls parsed from its output, and the constraints
that make it call a tool or answer in JSON.

A model can call tools when its chat template declares them in its own format. The one format
known here is the one of Qwen2.5 and Qwen3 instruct models (Hermes style): the template renders
tools in the system turn, the model answers with

    <tool_call>
    {"name": "add", "arguments": {"a": 1, "b": 2}}
    </tool_call>

(one block per call), and results come back in the `tool` role. `ToolFormat.of_template` reads
that from a template; a model without it (a base model such as Gemma 3 270M) has none and
refuses tool calls. The grammar of a forced call comes from xgrammar's structural tag for this
format (`get_model_structural_tag`), so the constrained call is the call the template describes.

Parsing is ours: a JSON object between the tags is a call; anything else between them is an
`InvalidToolCall`, kept with its text and the reason, never dropped. The object after an opening
tag is decoded whole before its closing tag is looked for, so a tag inside one of its strings
(`{"arguments": {"text": "</tool_call>"}}`, which the call's grammar allows) does not cut it.
Tool names follow OpenAI's pattern (`^[a-zA-Z0-9_-]{1,64}$`): they are written into the prompt and
the grammar as they are.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

from agentcache.engine.grammar import MAX_WHITESPACE, OutputConstraint, schema_error
from agentcache.errors import InputError

__all__ = ["ToolCall", "InvalidToolCall", "ParsedOutput", "ToolFormat", "ContentStream", "function_tools",
           "no_tool_format", "TOOL_PRESETS"]

TOOL_PRESETS = ("qwen2.5-coder-0.5b", "tiny-qwen2-chat")  # the presets whose chat template can call tools
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's pattern for a function's name
_JSON = json.JSONDecoder(strict=False)  # raw control characters in strings, as xgrammar allows


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass(frozen=True)
class InvalidToolCall:
    text: str  # what the model wrote between the tags; a call of a tool not offered: its arguments
    error: str
    id: str
    name: str | None = None  # the tool it named, when it is a call of a tool not offered


@dataclass(frozen=True)
class ParsedOutput:
    content: str  # the text outside tool-call blocks, stripped
    calls: tuple[ToolCall, ...] = ()
    invalid: tuple[InvalidToolCall, ...] = ()


def no_tool_format(model_name: str) -> str:
    """Why `model_name` cannot call tools, and which presets can (for the adapters' errors)."""
    return (f"{model_name!r} cannot call tools: its chat template has no tool-call format (a base model); use a "
            f"model whose template has one, e.g. the preset {TOOL_PRESETS[0]!r} (or {TOOL_PRESETS[1]!r} in tests)")


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def function_tools(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Tool schemas in the OpenAI shape `{"type": "function", "function": {name, description,
    parameters}}`, from that shape or the bare one (AutoGen's `ToolSchema`: name, description,
    parameters). A schema without a name is an InputError."""
    shaped = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise InputError(f"tool {index} must be a mapping (a JSON schema of the tool), got {type(tool).__name__}")
        function = tool.get("function") if tool.get("type") == "function" else tool
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) or not function["name"]:
            raise InputError(f"tool {index} has no name: give {{'name': ..., 'parameters': {{...}}}} or the OpenAI "
                             "shape {'type': 'function', 'function': {...}}")
        if not TOOL_NAME.fullmatch(function["name"]):
            raise InputError(f"tool {index}: the name {function['name'][:80]!r} must be 1 to 64 letters, digits, "
                             "'_' or '-'")
        entry = {"name": function["name"]}
        if function.get("description"):
            entry["description"] = function["description"]
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, Mapping):
            raise InputError(f"tool {index} ({function['name']}): parameters must be a JSON schema object, "
                             f"got {type(parameters).__name__}")
        error = schema_error(json.dumps(parameters, sort_keys=True))
        if error is not None:
            raise InputError(f"tool {index} ({function['name']}): its parameters' JSON schema cannot be compiled: "
                             f"{error}")
        entry["parameters"] = dict(parameters)
        shaped.append({"type": "function", "function": entry})
    names = [t["function"]["name"] for t in shaped]
    if len(set(names)) != len(names):
        raise InputError(f"tool names must be unique, got {names}")
    return shaped


@functools.lru_cache(maxsize=8)
def _block_pattern(begin: str, end: str) -> re.Pattern[str]:
    """A call block; an unclosed last one ends at the text's end, less a cut-off start of the end tag."""
    cut = "|".join(re.escape(end[:n]) for n in range(len(end) - 1, 0, -1))
    return re.compile(re.escape(begin) + r"(.*?)(?:" + re.escape(end) + r"|\s*(?:" + cut + r")?\Z)", re.DOTALL)


def _blocks(text: str, begin: str, end: str) -> Iterator[tuple[int, int, str, Any, str | None]]:
    """(start, stop, body, value, error) of each call block in `text`: `value` is the JSON value after
    the opening tag; when none decodes there, `error` says why and the block ends at its closing tag."""
    pattern = _block_pattern(begin, end)
    closing = re.compile(r"\s*" + re.escape(end))
    pos = 0
    while (start := text.find(begin, pos)) != -1:
        head = start + len(begin)
        at = head + len(text[head:]) - len(text[head:].lstrip())  # the body, past whitespace
        try:
            value, stop = _JSON.raw_decode(text, at)
        except ValueError as exc:
            match = pattern.match(text, start)
            yield start, match.end(), match.group(1).strip(), None, f"not JSON: {exc}"
            pos = max(match.end(), head)
            continue
        tag = closing.match(text, stop)
        if tag is not None:
            block_end = tag.end()
        elif not text[stop:].strip() or end.startswith(text[stop:].strip()):
            block_end = len(text)  # an unclosed last block, or one cut inside its closing tag
        else:
            block_end = stop
        yield start, block_end, text[at:stop], value, None
        pos = block_end


def _bare_call(text: str, tool_names: Sequence[str]) -> ToolCall | None:
    stripped = text.strip()
    if not tool_names or not stripped.startswith("{"):
        return None
    try:
        value = json.loads(stripped, strict=False)
    except ValueError:
        return None
    if (isinstance(value, dict) and set(value) <= {"name", "arguments"} and value.get("name") in tool_names
            and isinstance(value.get("arguments", {}), dict) and _is_text(value)):
        return ToolCall(value["name"], value.get("arguments", {}), _call_id())
    return None


def _is_text(value: Any) -> bool:
    """Whether decoded JSON `value` is text throughout: no lone UTF-16 surrogate in any string."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclass(frozen=True)
class ToolFormat:
    """A chat template's tool-call format."""

    name: str
    begin: str
    end: str
    xgrammar_model: str  # the key of xgrammar's structural tag for this format

    @classmethod
    def of_template(cls, template: str | None) -> "ToolFormat | None":
        """The format the template renders tool calls in, or None when it renders none."""
        if not template or "tools" not in template:
            return None
        if "<tool_call>" in template and "tool_calls" in template:
            return HERMES
        return None

    def parse(self, text: str, tool_names: Sequence[str] = ()) -> ParsedOutput:
        """The calls in `text` and the text around them. An unclosed last block is parsed to the end.
        With `tool_names` (the tools offered), a call of any other tool is invalid.

        A small model sometimes writes its call without the tags: an answer that is nothing but
        `{"name": <one of tool_names>, "arguments": {...}}` is read as that call."""
        bare = _bare_call(text, tool_names)
        if bare is not None:
            return ParsedOutput("", (bare,))
        calls: list[ToolCall] = []
        invalid: list[InvalidToolCall] = []
        content: list[str] = []
        cursor = 0
        for start, stop, body, value, error in _blocks(text, self.begin, self.end):
            content.append(text[cursor:start])
            cursor = stop
            if error is not None:
                invalid.append(InvalidToolCall(body, error, _call_id()))
                continue
            if not isinstance(value, dict) or not isinstance(value.get("name"), str):
                invalid.append(InvalidToolCall(body, 'not an object with a "name"', _call_id()))
                continue
            arguments = value.get("arguments", {})
            if isinstance(arguments, str):  # some models write the arguments as a JSON string
                try:
                    arguments = json.loads(arguments, strict=False)
                except ValueError:
                    pass
            if not isinstance(arguments, dict):
                invalid.append(InvalidToolCall(body, '"arguments" is not a JSON object', _call_id()))
                continue
            if not (_is_text(value) and _is_text(arguments)):  # "\ud800" is no character: it cannot be sent as UTF-8
                invalid.append(InvalidToolCall(body, "the call holds a lone UTF-16 surrogate escape, which is not text",
                                               _call_id()))
                continue
            if tool_names and value["name"] not in tool_names:
                invalid.append(InvalidToolCall(json.dumps(arguments, ensure_ascii=False),
                                               f"no tool named {value['name']!r}; the tools are {list(tool_names)}",
                                               _call_id(), value["name"]))
                continue
            calls.append(ToolCall(value["name"], arguments, _call_id()))
        content.append(text[cursor:])
        return ParsedOutput("".join(content).strip(), tuple(calls), tuple(invalid))

    def constraint(self, tools: Sequence[Mapping[str, Any]], choice: str | None) -> OutputConstraint | None:
        """The constraint that makes the model call a tool: `choice` "required" (any of `tools`) or
        a tool's name (that one); None for "auto" or "none" (free text, parsed after)."""
        if choice in (None, "auto", "none"):
            return None
        from xgrammar import get_model_structural_tag

        shaped = function_tools(tools)
        if choice == "required":
            tool_choice: Any = "required"
        else:
            if choice not in {t["function"]["name"] for t in shaped}:
                raise InputError(f"tool_choice names {choice!r}, which is not among the tools "
                                 f"{[t['function']['name'] for t in shaped]}")
            tool_choice = {"type": "function", "function": {"name": choice}}
        if not shaped:
            raise InputError(f"tool_choice={choice!r} needs at least one tool")
        try:
            tag = get_model_structural_tag(self.xgrammar_model, tools=shaped, tool_choice=tool_choice,
                                           reasoning="disabled", parallel_tool_calls=False,
                                           max_whitespace_cnt=MAX_WHITESPACE)
        except ValueError as exc:
            raise InputError(f"cannot constrain the tool call: {exc}") from None
        return OutputConstraint.structural_tag(tag)


class ContentStream:
    """The content of a reply that may call tools, as it streams: the text before the first call,
    sent as it comes. A tail that may begin the call's tag waits for more; from the tag on nothing
    is sent; a reply opening with "{" may be a call written without tags and waits for the end.
    What is sent is always a prefix of the parsed content (`ParsedOutput.content`, stripped), and
    `rest` gives what is left of it once the reply is whole."""

    def __init__(self, fmt: ToolFormat) -> None:
        self._begin = fmt.begin
        self._text = ""
        self.sent = ""
        self._held = False  # a call began: nothing more is sent before the end

    def push(self, piece: str) -> str:
        """What of the reply so far may be sent now, after what was sent before."""
        self._text += piece
        if self._held or (not self.sent and self._text.lstrip().startswith("{")):
            return ""
        text = self._text
        tag = text.find(self._begin)
        if tag != -1:
            self._held, text = True, text[:tag]
        else:
            for n in range(min(len(self._begin) - 1, len(text)), 0, -1):
                if text.endswith(self._begin[:n]):
                    text = text[:-n]
                    break
        safe = text.strip()
        if len(safe) <= len(self.sent):
            return ""
        chunk, self.sent = safe[len(self.sent):], safe
        return chunk

    def rest(self, content: str) -> str:
        """What is left to send of the reply's final content (text, or the parsed content)."""
        content = content.lstrip()
        return content[len(self.sent):] if content.startswith(self.sent) else ""


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", "qwen_3")

"""An autogen-core `ChatCompletionClient` backed by an agentcache `Runtime`.

    runtime = Runtime(model="gemma3-270m")
    client = AgentCacheChatCompletionClient(runtime)          # one client for a whole team
    team = SelectorGroupChat([planner, local, ...], model_client=client)

Which agent calls: the client's `agent`; else the AutoGen agent whose message handler is
running (a team's participants by name; the team's selector as `selector`); else the AutoGen
chat agent whose code calls the client (`AssistantAgent("helper", client).run(...)` outside a
team runs as "helper"); else the client's `default_agent` ("assistant"). The team's id is the
session. Messages become segments through `agentcache.transcript`: system messages and tool
schemas are PF, a user's message is PH `query`, another agent's message PH `out:<agent>`, the
caller's own earlier message PH `out:<self>`, and the headers framing each message are PF glue.
The selector's prompt quotes the conversation inside its own wording: the quoted messages the
runtime has seen in this session become PH segments, the wording PF.

The client is an AutoGen component: `dump_component()` writes its config (model, strategy, engine
and runtime options; see `agentcache_autogen.config`) and `load_component` builds it again, the
clients of one loaded team on one runtime.

Tool calls, JSON output and structured output:

- A model whose chat template has a tool-call format (`runtime.chat.tool_format`: Qwen2.5 and
  the `tiny-qwen2-chat` preset) calls tools: `model_info` says `function_calling=True`, its tools,
  its own earlier calls and the tools' results are laid out by its template, and its output is
  parsed into `FunctionCall`s (`finish_reason="function_calls"`, the text around the calls as
  `thought`). `tool_choice="auto"` lets the model choose (the output is parsed after);
  `"required"` or a `Tool` forces a call with constrained decoding, so the call is a well-formed
  call of one of the request's tools with arguments valid for its schema; `"none"` shows the
  tools and parses nothing. AutoGen's `AssistantAgent` always asks with "auto": the client's
  `tool_choice="required"` forces a call whenever a request has tools and asks for "auto"
  (a reflection, which AutoGen asks for with "none" and no tools, stays free text).
- A call the model writes that is not a call (not JSON, or a tool the request does not have) is
  never raised: the output stays text (`finish_reason` "stop", or "length" when cut) and the call
  is kept in `client.invalid_tool_calls`. When valid calls come with invalid ones, the valid calls
  are the result and the invalid ones are kept there.
- `json_output=True` constrains the output to one JSON object, `json_output=<a pydantic model>`
  to JSON valid for the model's schema, on every model (constrained decoding needs no template).
  With a JSON constraint the output is JSON, so the model cannot call a tool in that request.
- Streaming: text chunks as generated; once a tool call begins nothing more streams, and the
  final `CreateResult` carries the calls (an answer that opens with "{", perhaps a call written
  without its tags, waits for the end).

What it refuses, with a clear error: images and other non-text content (in messages and in tool
results), a forced tool call (`tool_choice="required"` or a `Tool`) on a model whose template has
no tool-call format (a base model such as the default Gemma 3 270M; `model_info` says
`function_calling=False` there, and AutoGen agents will not take tools), a forced tool call together
with `json_output`, a `json_output` that is neither a bool nor a pydantic model, and unknown create
arguments. A schema the constrained decoder cannot compile is the runtime's `InputError`; the
client stays usable after any of these.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, AsyncGenerator, Literal, Mapping, Sequence

from autogen_agentchat.base import ChatAgent
from autogen_core import CancellationToken, Component, FunctionCall, Image, MessageHandlerContext
from autogen_core.models import (
    AssistantMessage,
    ChatCompletionClient,
    CreateResult,
    FunctionExecutionResultMessage,
    LLMMessage,
    ModelFamily,
    ModelInfo,
    RequestUsage,
    SystemMessage,
    UserMessage,
)
from autogen_core.tools import Tool, ToolSchema
from pydantic import BaseModel

from agentcache.content import flatten_content
from agentcache.engine.grammar import OutputConstraint
from agentcache.engine.protocol import SamplingParams
from agentcache.errors import InputError
from agentcache.metrics import CallResult
from agentcache.runtime import Runtime
from agentcache.segments import AgentCall, DispatchEvent
from agentcache.streaming import astream_call
from agentcache.toolcalls import ContentStream, InvalidToolCall, ToolCall, no_tool_format
from agentcache.transcript import ChatTurn, UnsupportedMessageError, build_call, stop_strings

from agentcache_autogen.config import DEFAULT_AGENT, AgentCacheClientConfig, remember, runtime_for, runtime_spec

__all__ = ["AgentCacheChatCompletionClient", "Caller", "UnsupportedMessageError", "UnsupportedRequestError",
           "DEFAULT_AGENT"]

SELECTOR = "selector"
_MANAGER_SUFFIX = "GroupChatManager"  # AutoGen names a team's manager type "<Kind>GroupChatManager_<team id>"
_CREATE_ARGS = {"max_tokens", "temperature", "top_p", "stop", "seed"}
_CALLER_FRAMES = 48  # how far up the stack to look for the AutoGen chat agent that calls
_CLIENT_TOOL_CHOICES = ("auto", "required")


@dataclass(frozen=True)
class Caller:
    agent: str
    session: str | None
    id: str | None  # the AutoGen agent id, inside a handler
    manager: bool  # a team's group chat manager (its selector): the prompt quotes the conversation


class UnsupportedRequestError(ValueError):
    """A request the runtime cannot honour: a forced tool call on a model without a tool-call format,
    a forced call together with JSON output, unknown create arguments."""


@dataclass(frozen=True)
class _Request:
    call: AgentCall
    sampling: SamplingParams
    event: DispatchEvent
    tools: tuple[str, ...] | None  # parse the output for calls of these tools; None: the output is text


class AgentCacheChatCompletionClient(ChatCompletionClient, Component[AgentCacheClientConfig]):
    """`ChatCompletionClient` for autogen-core 0.7 that runs every call through `runtime`."""

    component_type = "model"
    component_config_schema = AgentCacheClientConfig
    component_provider_override = "agentcache_autogen.AgentCacheChatCompletionClient"

    def __init__(
        self,
        runtime: Runtime,
        *,
        agent: str | None = None,
        default_agent: str = DEFAULT_AGENT,
        session: str | None = None,
        max_tokens: int = 64,
        temperature: float = 0.0,
        stop: Sequence[str] = (),
        tool_choice: Literal["auto", "required"] = "auto",
    ) -> None:
        """`agent`: always call as this agent; `default_agent`: the agent when neither `agent` nor
        AutoGen names one (a bare `client.create(...)`). `stop`: the caller's stop strings; they join
        the transcript's own stop, never replace it. `tool_choice`: what a request with tools that
        asks for "auto" gets; "required" forces a tool call there (AutoGen's `AssistantAgent` always
        asks for "auto"), and needs a model whose chat template has a tool-call format."""
        if not isinstance(runtime, Runtime):
            raise TypeError(f"runtime must be an agentcache Runtime, got {type(runtime).__name__}")
        for name, value in (("agent", agent), ("default_agent", default_agent)):
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise InputError(f"AgentCacheChatCompletionClient({name}=...) must be a non-empty agent name, "
                                 f"got {value!r}")
        if tool_choice not in _CLIENT_TOOL_CHOICES:
            raise InputError(f"AgentCacheChatCompletionClient(tool_choice=...) must be one of "
                             f"{list(_CLIENT_TOOL_CHOICES)}, got {tool_choice!r}")
        if tool_choice == "required" and runtime.tool_format is None:
            raise InputError(f"AgentCacheChatCompletionClient(tool_choice='required'): "
                             f"{no_tool_format(runtime.engine.model_name)}")
        self.runtime = runtime
        self.tool_choice = tool_choice
        self.agent = agent
        self.default_agent = default_agent
        self.session = session
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        self._own_stop = stop
        self.sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                       stop=tuple(dict.fromkeys((*stop_strings(runtime.chat), *stop))))
        self._actual = RequestUsage(prompt_tokens=0, completion_tokens=0)
        self._total = RequestUsage(prompt_tokens=0, completion_tokens=0)
        self._usage_lock = threading.Lock()
        # this client's newest calls, in order; as many as the runtime keeps (RuntimeConfig.keep_calls)
        self._results: deque[CallResult] = deque(maxlen=runtime.config.keep_calls)
        self._invalid: deque[InvalidToolCall] = deque(maxlen=runtime.config.keep_calls)

    @property
    def results(self) -> list[CallResult]:
        """This client's newest calls (as many as the runtime keeps), oldest first."""
        return list(self._results)

    @property
    def invalid_tool_calls(self) -> list[InvalidToolCall]:
        """The tool calls the model wrote that were not calls (not JSON, or a tool the request did not
        offer), newest last; as many as the runtime keeps calls. Their text stayed in the output."""
        return list(self._invalid)

    def for_agent(self, agent: str, session: str | None = None, *,
                  tool_choice: Literal["auto", "required"] | None = None) -> "AgentCacheChatCompletionClient":
        """A client on the same runtime that always calls as `agent` (one client per agent);
        `tool_choice` as the constructor's, by default this client's."""
        return AgentCacheChatCompletionClient(
            self.runtime, agent=agent, default_agent=self.default_agent, session=session or self.session,
            max_tokens=self.sampling.max_tokens, temperature=self.sampling.temperature, stop=self._own_stop,
            tool_choice=tool_choice or self.tool_choice)

    # --- the component config --------------------------------------------------------------

    def _to_config(self) -> AgentCacheClientConfig:
        spec = runtime_spec(self.runtime)
        remember(self.runtime)  # a config loaded in this process runs on this runtime again
        return AgentCacheClientConfig(
            **spec, agent=self.agent, default_agent=self.default_agent, session=self.session,
            max_tokens=self.sampling.max_tokens, temperature=self.sampling.temperature, stop=list(self._own_stop),
            tool_choice=self.tool_choice)

    @classmethod
    def _from_config(cls, config: AgentCacheClientConfig) -> "AgentCacheChatCompletionClient":
        return cls(runtime_for(config), agent=config.agent, default_agent=config.default_agent,
                   session=config.session, max_tokens=config.max_tokens, temperature=config.temperature,
                   stop=config.stop, tool_choice=config.tool_choice)

    # --- who calls -------------------------------------------------------------------------

    def caller(self) -> Caller:
        """Who makes the current call: the client's agent, else the AutoGen agent whose handler runs,
        else the chat agent whose code calls, else the default agent."""
        try:
            agent_id = MessageHandlerContext.agent_id()
        except RuntimeError:
            agent_id = None
        manager, name = False, None
        if agent_id is not None:
            kind, key = agent_id.type, agent_id.key
            name = kind[: -len(key) - 1] if kind.endswith(f"_{key}") else kind  # a team's types end with its id
            manager = name.endswith(_MANAGER_SUFFIX)
            if manager:
                name = SELECTOR
        agent = self.agent or name or _calling_chat_agent() or self.default_agent
        session = self.session or (agent_id.key if agent_id is not None else None)  # in a team: the team's id
        return Caller(agent, session, str(agent_id) if agent_id is not None else None, manager)

    # --- messages to segments --------------------------------------------------------------

    def to_call(
        self, messages: Sequence[LLMMessage], tools: Sequence[Tool | ToolSchema] = (), *,
        caller: Caller | None = None,
    ) -> AgentCall:
        """The agentcache call these messages make, as `caller` (by default the current caller)."""
        caller = caller or self.caller()
        agent = caller.agent
        system, turns = [], []
        for index, message in enumerate(messages):
            if isinstance(message, SystemMessage):
                system.append(message.content)
            elif isinstance(message, UserMessage):
                text = _text_of(message.content, index)
                role = "user" if message.source == "user" else "agent"
                turns.append(ChatTurn(role, message.source, text))
            elif isinstance(message, AssistantMessage):
                source = message.source or agent
                if isinstance(message.content, list) and message.content and all(
                        isinstance(part, FunctionCall) for part in message.content):
                    # its tool calls, after the text it wrote around them (AutoGen keeps that as the thought)
                    turns.append(ChatTurn("agent", source, message.thought or "",
                                          calls=_tool_calls(message.content, index)))
                else:
                    turns.append(ChatTurn("agent", source, _text_of(message.content, index)))
            elif isinstance(message, FunctionExecutionResultMessage):
                turns.extend(ChatTurn("tool", result.name or "tool", _result_text(result, index))
                             for result in message.content)
            else:
                raise UnsupportedMessageError(
                    f"message {index} is a {type(message).__name__}; the agentcache client maps SystemMessage, "
                    "UserMessage, AssistantMessage and FunctionExecutionResultMessage")
        # A team manager's prompt is its own wording around quoted messages: split out what is shared.
        known = self.runtime.shared_texts(caller.session) if caller.manager else None
        schemas = [tool.schema if isinstance(tool, Tool) else tool for tool in tools]
        return build_call(agent, system, turns, tools=schemas, session=caller.session, known=known,
                          chat=self.runtime.chat)

    def _plan(
        self, messages: Sequence[LLMMessage], tools: Sequence[Tool | ToolSchema], tool_choice: Any,
        json_output: Any, extra_create_args: Mapping[str, Any],
    ) -> _Request:
        unknown = set(extra_create_args) - _CREATE_ARGS
        if unknown:
            raise UnsupportedRequestError(f"unsupported create arguments {sorted(unknown)}; use {sorted(_CREATE_ARGS)}")
        schemas = [tool.schema if isinstance(tool, Tool) else tool for tool in tools]
        json_constraint = _json_constraint(json_output)
        choice = self._tool_choice(tool_choice, schemas, json_constraint is not None)
        tool_format = self.runtime.tool_format
        forced = choice not in ("auto", "none")
        label = _choice_text(tool_choice) if tool_choice == choice or isinstance(tool_choice, Tool) else \
            f"{choice!r} (the client's own, for 'auto')"
        if forced and json_constraint is not None:
            raise UnsupportedRequestError(
                f"json_output and tool_choice={label} cannot both hold: a forced tool call is "
                "the whole output, so it cannot be JSON of another schema; ask for one or the other")
        constraint = json_constraint
        if forced:
            if tool_format is None:
                raise UnsupportedRequestError(f"tool_choice={label} cannot be honoured: "
                                              f"{no_tool_format(self.runtime.engine.model_name)}")
            try:
                constraint = tool_format.constraint(schemas, choice)
            except InputError as exc:
                raise UnsupportedRequestError(f"tool_choice={label}: {exc}") from None
        # Parse the output for calls when the model can write them and may here (a JSON answer is no call).
        names = None
        if tool_format is not None and schemas and choice != "none" and json_constraint is None:
            names = tuple(_tool_name(schema) for schema in schemas)
        caller = self.caller()
        call = self.to_call(messages, tools, caller=caller)
        fields = {"max_tokens": self.sampling.max_tokens, "temperature": self.sampling.temperature,
                  "top_p": self.sampling.top_p, "seed": self.sampling.seed}
        fields.update({k: v for k, v in extra_create_args.items() if k != "stop"})
        extra_stop = extra_create_args.get("stop") or ()
        extra_stop = (extra_stop,) if isinstance(extra_stop, str) else tuple(extra_stop)
        # The transcript's own stop always stays: without it the model would write other agents' turns.
        fields["stop"] = tuple(dict.fromkeys((*self.sampling.stop, *extra_stop)))
        sampling = SamplingParams(**fields, constraint=constraint)
        event = DispatchEvent(agent=caller.agent, session=caller.session, framework="autogen", caller=caller.id,
                              messages=len(messages))
        return _Request(call, sampling, event, names)

    def _tool_choice(self, tool_choice: Any, schemas: Sequence[Mapping[str, Any]], wants_json: bool) -> str:
        """The request's tool choice as "auto", "none", "required" or a tool's name; the client's own
        `tool_choice` stands in for "auto" when the request has tools and asks for no JSON (a request
        for JSON answers in JSON)."""
        if isinstance(tool_choice, Tool):
            return tool_choice.name
        if tool_choice not in ("auto", "required", "none"):
            raise UnsupportedRequestError(f"tool_choice must be 'auto', 'required', 'none' or a Tool, "
                                          f"got {tool_choice!r}")
        if tool_choice == "auto" and schemas and not wants_json:
            return self.tool_choice
        return tool_choice

    def _result(self, result: CallResult, tools: tuple[str, ...] | None = None) -> CreateResult:
        completion = len(result.token_ids)
        with self._usage_lock:
            self._results.append(result)
            self._total = _add(self._total, RequestUsage(prompt_tokens=result.prompt_tokens,
                                                         completion_tokens=completion))
            # What the engine actually prefilled: prefix-cache hits and reused shared segments are not.
            prefilled = result.prompt_tokens - result.cached_tokens - result.reused_tokens
            self._actual = _add(self._actual, RequestUsage(prompt_tokens=prefilled, completion_tokens=completion))
        usage = RequestUsage(prompt_tokens=result.prompt_tokens, completion_tokens=completion)
        finish: Literal["stop", "length"] = "length" if result.finish_reason == "length" else "stop"
        tool_format = self.runtime.tool_format
        if tools is None or tool_format is None:
            return CreateResult(finish_reason=finish, content=result.text, usage=usage, cached=False)
        parsed = tool_format.parse(result.text, tools)  # a call of a tool not offered is invalid
        calls = parsed.calls
        if parsed.invalid:
            with self._usage_lock:
                self._invalid.extend(parsed.invalid)
        if not calls:  # no call, or none that is one: the model's text, as it wrote it
            return CreateResult(finish_reason=finish, content=result.text, usage=usage, cached=False)
        return CreateResult(finish_reason="function_calls",
                            content=[FunctionCall(id=c.id, name=c.name, arguments=c.arguments_json) for c in calls],
                            thought=parsed.content or None, usage=usage, cached=False)

    # --- the ChatCompletionClient interface --------------------------------------------------

    async def create(
        self,
        messages: Sequence[LLMMessage],
        *,
        tools: Sequence[Tool | ToolSchema] = [],
        tool_choice: Tool | Literal["auto", "required", "none"] = "auto",
        json_output: bool | type | None = None,
        extra_create_args: Mapping[str, Any] = {},
        cancellation_token: CancellationToken | None = None,
    ) -> CreateResult:
        request = self._plan(messages, tools, tool_choice, json_output, extra_create_args)
        task = asyncio.ensure_future(self.runtime.arun(request.call, request.sampling, event=request.event))
        if cancellation_token is not None:
            cancellation_token.link_future(task)  # cancels the wait; the engine finishes the call it started
        return self._result(await task, request.tools)

    async def create_stream(
        self,
        messages: Sequence[LLMMessage],
        *,
        tools: Sequence[Tool | ToolSchema] = [],
        tool_choice: Tool | Literal["auto", "required", "none"] = "auto",
        json_output: bool | type | None = None,
        extra_create_args: Mapping[str, Any] = {},
        cancellation_token: CancellationToken | None = None,
        include_usage: bool | None = None,
    ) -> AsyncGenerator[str | CreateResult, None]:
        """Text chunks as the engine generates them, then the `CreateResult`. A cancelled token stops
        the stream (the engine finishes the call it started). When the output may hold tool calls,
        nothing streams once a call begins (its text is no content); the result carries the calls,
        or, when they were no calls, the rest of the text streams before it."""
        request = self._plan(messages, tools, tool_choice, json_output, extra_create_args)
        tool_format = self.runtime.tool_format
        held = ContentStream(tool_format) if request.tools is not None and tool_format is not None else None
        async for item in astream_call(self.runtime, request.call, request.sampling, request.event):
            if cancellation_token is not None and cancellation_token.is_cancelled():
                raise asyncio.CancelledError("create_stream was cancelled")
            if isinstance(item, CallResult):
                final = self._result(item, request.tools)
                if held is not None and isinstance(final.content, str):
                    rest = held.rest(final.content)
                    if rest:
                        yield rest
                yield final
            elif held is None:
                yield item
            else:
                chunk = held.push(item)
                if chunk:
                    yield chunk

    async def close(self) -> None:
        """Waits for a pending warm-up; the runtime stays open (other clients may share it)."""
        await asyncio.to_thread(self.runtime.wait_warmup)

    def actual_usage(self) -> RequestUsage:
        """Tokens the engine computed: prompt tokens minus prefix hits and reused shared tokens."""
        return self._actual

    def total_usage(self) -> RequestUsage:
        return self._total

    def count_tokens(self, messages: Sequence[LLMMessage], *, tools: Sequence[Tool | ToolSchema] = []) -> int:
        call = self.to_call(messages, tools)
        engine = self.runtime.engine
        tokens = sum(len(list(s.token_ids) if s.token_ids is not None else engine.tokenize(s.text))
                     for s in call.segments)
        return tokens + (1 if engine.bos_token_id is not None else 0)

    def remaining_tokens(self, messages: Sequence[LLMMessage], *, tools: Sequence[Tool | ToolSchema] = []) -> int:
        return self.runtime.engine.max_context - self.count_tokens(messages, tools=tools)

    @property
    def capabilities(self) -> dict[str, bool]:  # deprecated in autogen-core, still abstract there
        return {"vision": False, "function_calling": self.runtime.tool_format is not None, "json_output": True}

    @property
    def model_info(self) -> ModelInfo:
        """Tool calls where the model's chat template has a tool-call format; JSON and structured
        output on every model (constrained decoding); text only (no vision)."""
        return ModelInfo(vision=False, function_calling=self.runtime.tool_format is not None, json_output=True,
                         family=ModelFamily.UNKNOWN, structured_output=True, multiple_system_messages=True)


def _calling_chat_agent() -> str | None:
    """The name of the AutoGen chat agent whose code makes this call, if any. Outside a team AutoGen
    runs an agent directly, and the agent object up the stack is the only place that names it."""
    frame = sys._getframe(1)
    for _ in range(_CALLER_FRAMES):
        if frame is None:
            return None
        if "self" in frame.f_code.co_varnames[:1]:
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, ChatAgent):
                return candidate.name
        frame = frame.f_back
    return None


def _tool_name(schema: Mapping[str, Any]) -> str:
    """A tool schema's name, in AutoGen's shape or OpenAI's."""
    function = schema.get("function") if schema.get("type") == "function" else schema
    return str(function.get("name", "")) if isinstance(function, Mapping) else ""


def _choice_text(tool_choice: Any) -> str:
    return f"<tool {tool_choice.name!r}>" if isinstance(tool_choice, Tool) else repr(tool_choice)


def _json_constraint(json_output: Any) -> OutputConstraint | None:
    """The constraint of AutoGen's `json_output`: True, any JSON object; a pydantic model, its schema."""
    if json_output is None or json_output is False:
        return None
    if json_output is True:
        return OutputConstraint.json_object()
    if isinstance(json_output, type) and issubclass(json_output, BaseModel):
        return OutputConstraint.json_schema(json_output.model_json_schema())
    raise UnsupportedRequestError(f"json_output must be a bool or a pydantic BaseModel subclass, got {json_output!r}")


def _tool_calls(parts: Sequence[FunctionCall], index: int) -> tuple[ToolCall, ...]:
    """An assistant message's `FunctionCall`s as tool calls; arguments that are no JSON object are refused."""
    calls = []
    for part in parts:
        try:
            arguments = json.loads(part.arguments) if part.arguments.strip() else {}
        except ValueError as exc:
            raise UnsupportedMessageError(f"message {index}: the arguments of the tool call {part.name!r} are not "
                                          f"JSON ({exc})") from None
        if not isinstance(arguments, dict):
            raise UnsupportedMessageError(f"message {index}: the arguments of the tool call {part.name!r} are not "
                                          f"a JSON object")
        calls.append(ToolCall(part.name, arguments, part.id))
    return tuple(calls)


def _result_text(result: Any, index: int) -> str:
    """A tool result's text; anything else (an image, a list of parts) is refused."""
    content = getattr(result, "content", None)
    if not isinstance(content, str):
        raise UnsupportedMessageError(
            f"message {index}: the result of the tool {getattr(result, 'name', None) or 'tool'!r} is a "
            f"{type(content).__name__}, not text: the agentcache client maps text tool results only "
            "(return a string from the tool)")
    return content


def _text_of(content: str | list[Any], index: int) -> str:
    """A message's text, a list's parts one per line; images and other parts are refused (never dropped silently)."""

    def read(part: Any) -> str:
        if isinstance(part, FunctionCall):
            return f"call {part.name}({part.arguments})"
        if isinstance(part, Image):
            raise UnsupportedMessageError(f"message {index} contains an image: the agentcache runtime is text-only")
        raise UnsupportedMessageError(
            f"message {index} contains a {type(part).__name__} part: the agentcache client maps text only")

    return flatten_content(content, read, separator="\n")


def _add(a: RequestUsage, b: RequestUsage) -> RequestUsage:
    return RequestUsage(prompt_tokens=a.prompt_tokens + b.prompt_tokens,
                        completion_tokens=a.completion_tokens + b.completion_tokens)


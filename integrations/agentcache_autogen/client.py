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

What it refuses, with a clear error: images and other non-text content, `json_output`, tool
calls (`tool_choice="required"` or a specific tool; the runtime only generates text, so
`model_info` says `function_calling=False` and AutoGen agents will not offer it tools).
"""

from __future__ import annotations

import asyncio
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

from agentcache.engine.protocol import SamplingParams
from agentcache.errors import InputError
from agentcache.metrics import CallResult
from agentcache.runtime import Runtime
from agentcache.segments import AgentCall, DispatchEvent
from agentcache.streaming import astream_call
from agentcache.transcript import ChatTurn, UnsupportedMessageError, build_call, stop_strings

from agentcache_autogen.config import DEFAULT_AGENT, AgentCacheClientConfig, remember, runtime_for, runtime_spec

__all__ = ["AgentCacheChatCompletionClient", "Caller", "UnsupportedMessageError", "UnsupportedRequestError",
           "DEFAULT_AGENT"]

SELECTOR = "selector"
_MANAGER_SUFFIX = "GroupChatManager"  # AutoGen names a team's manager type "<Kind>GroupChatManager_<team id>"
_CREATE_ARGS = {"max_tokens", "temperature", "top_p", "stop", "seed"}
_CALLER_FRAMES = 48  # how far up the stack to look for the AutoGen chat agent that calls


@dataclass(frozen=True)
class Caller:
    agent: str
    session: str | None
    id: str | None  # the AutoGen agent id, inside a handler
    manager: bool  # a team's group chat manager (its selector): the prompt quotes the conversation


class UnsupportedRequestError(ValueError):
    """A request the runtime cannot honour: JSON output, forced tool calls, unknown create arguments."""


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
    ) -> None:
        """`agent`: always call as this agent; `default_agent`: the agent when neither `agent` nor
        AutoGen names one (a bare `client.create(...)`). `stop`: the caller's stop strings; they join
        the transcript's own stop, never replace it."""
        if not isinstance(runtime, Runtime):
            raise TypeError(f"runtime must be an agentcache Runtime, got {type(runtime).__name__}")
        for name, value in (("agent", agent), ("default_agent", default_agent)):
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise InputError(f"AgentCacheChatCompletionClient({name}=...) must be a non-empty agent name, "
                                 f"got {value!r}")
        self.runtime = runtime
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

    @property
    def results(self) -> list[CallResult]:
        """This client's newest calls (as many as the runtime keeps), oldest first."""
        return list(self._results)

    def for_agent(self, agent: str, session: str | None = None) -> "AgentCacheChatCompletionClient":
        """A client on the same runtime that always calls as `agent` (one client per agent)."""
        return AgentCacheChatCompletionClient(
            self.runtime, agent=agent, default_agent=self.default_agent, session=session or self.session,
            max_tokens=self.sampling.max_tokens, temperature=self.sampling.temperature, stop=self._own_stop)

    # --- the component config --------------------------------------------------------------

    def _to_config(self) -> AgentCacheClientConfig:
        spec = runtime_spec(self.runtime)
        remember(self.runtime)  # a config loaded in this process runs on this runtime again
        return AgentCacheClientConfig(
            **spec, agent=self.agent, default_agent=self.default_agent, session=self.session,
            max_tokens=self.sampling.max_tokens, temperature=self.sampling.temperature, stop=list(self._own_stop))

    @classmethod
    def _from_config(cls, config: AgentCacheClientConfig) -> "AgentCacheChatCompletionClient":
        return cls(runtime_for(config), agent=config.agent, default_agent=config.default_agent,
                   session=config.session, max_tokens=config.max_tokens, temperature=config.temperature,
                   stop=config.stop)

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
                turns.append(ChatTurn("agent", message.source or agent, _text_of(message.content, index)))
            elif isinstance(message, FunctionExecutionResultMessage):
                turns.extend(ChatTurn("tool", result.name or "tool", result.content) for result in message.content)
            else:
                raise UnsupportedMessageError(
                    f"message {index} is a {type(message).__name__}; the agentcache client maps SystemMessage, "
                    "UserMessage, AssistantMessage and FunctionExecutionResultMessage")
        # A team manager's prompt is its own wording around quoted messages: split out what is shared.
        known = self.runtime.shared_texts(caller.session) if caller.manager else None
        schemas = [tool.schema if isinstance(tool, Tool) else tool for tool in tools]
        return build_call(agent, system, turns, tools=schemas, session=caller.session, known=known,
                          chat=self.runtime.chat)

    def _request(
        self, messages: Sequence[LLMMessage], tools: Sequence[Tool | ToolSchema], tool_choice: Any,
        json_output: Any, extra_create_args: Mapping[str, Any],
    ) -> tuple[AgentCall, SamplingParams, DispatchEvent]:
        if json_output is not None and json_output is not False:
            raise UnsupportedRequestError(
                "json_output is not supported: the agentcache runtime generates free text without constrained "
                "decoding; ask for JSON in the prompt and parse the text instead")
        if tool_choice not in ("auto", "none"):
            raise UnsupportedRequestError(
                f"tool_choice={tool_choice!r} cannot be honoured: the agentcache runtime does not emit tool calls "
                "(tool schemas are shown to the model as text only)")
        unknown = set(extra_create_args) - _CREATE_ARGS
        if unknown:
            raise UnsupportedRequestError(f"unsupported create arguments {sorted(unknown)}; use {sorted(_CREATE_ARGS)}")
        caller = self.caller()
        call = self.to_call(messages, tools, caller=caller)
        fields = {"max_tokens": self.sampling.max_tokens, "temperature": self.sampling.temperature,
                  "top_p": self.sampling.top_p, "seed": self.sampling.seed}
        fields.update({k: v for k, v in extra_create_args.items() if k != "stop"})
        extra_stop = extra_create_args.get("stop") or ()
        extra_stop = (extra_stop,) if isinstance(extra_stop, str) else tuple(extra_stop)
        # The transcript's own stop always stays: without it the model would write other agents' turns.
        fields["stop"] = tuple(dict.fromkeys((*self.sampling.stop, *extra_stop)))
        sampling = SamplingParams(**fields)
        event = DispatchEvent(agent=caller.agent, session=caller.session, framework="autogen", caller=caller.id,
                              messages=len(messages))
        return call, sampling, event

    def _result(self, result: CallResult) -> CreateResult:
        completion = len(result.token_ids)
        with self._usage_lock:
            self._results.append(result)
            self._total = _add(self._total, RequestUsage(prompt_tokens=result.prompt_tokens,
                                                         completion_tokens=completion))
            # What the engine actually prefilled: prefix-cache hits and reused shared segments are not.
            prefilled = result.prompt_tokens - result.cached_tokens - result.reused_tokens
            self._actual = _add(self._actual, RequestUsage(prompt_tokens=prefilled, completion_tokens=completion))
        finish: Literal["stop", "length"] = "length" if result.finish_reason == "length" else "stop"
        return CreateResult(finish_reason=finish, content=result.text,
                            usage=RequestUsage(prompt_tokens=result.prompt_tokens, completion_tokens=completion),
                            cached=False)

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
        call, sampling, event = self._request(messages, tools, tool_choice, json_output, extra_create_args)
        task = asyncio.ensure_future(self.runtime.arun(call, sampling, event=event))
        if cancellation_token is not None:
            cancellation_token.link_future(task)  # cancels the wait; the engine finishes the call it started
        return self._result(await task)

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
        the stream (the engine finishes the call it started)."""
        call, sampling, event = self._request(messages, tools, tool_choice, json_output, extra_create_args)
        async for item in astream_call(self.runtime, call, sampling, event):
            if cancellation_token is not None and cancellation_token.is_cancelled():
                raise asyncio.CancelledError("create_stream was cancelled")
            yield self._result(item) if isinstance(item, CallResult) else item

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
        return {"vision": False, "function_calling": False, "json_output": False}

    @property
    def model_info(self) -> ModelInfo:
        return ModelInfo(vision=False, function_calling=False, json_output=False, family=ModelFamily.UNKNOWN,
                         structured_output=False, multiple_system_messages=True)


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


def _text_of(content: str | list[Any], index: int) -> str:
    """A message's text; images and other parts are refused (never dropped silently)."""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if isinstance(part, str):
            parts.append(part)
        elif isinstance(part, FunctionCall):
            parts.append(f"call {part.name}({part.arguments})")
        elif isinstance(part, Image):
            raise UnsupportedMessageError(f"message {index} contains an image: the agentcache runtime is text-only")
        else:
            raise UnsupportedMessageError(
                f"message {index} contains a {type(part).__name__} part: the agentcache client maps text only")
    return "\n".join(parts)


def _add(a: RequestUsage, b: RequestUsage) -> RequestUsage:
    return RequestUsage(prompt_tokens=a.prompt_tokens + b.prompt_tokens,
                        completion_tokens=a.completion_tokens + b.completion_tokens)


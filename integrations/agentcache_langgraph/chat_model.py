"""`AgentCacheChatModel`: a LangChain chat model that runs every call through an agentcache Runtime."""

from __future__ import annotations

import json
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, AsyncIterator, Iterable, Iterator, Literal, Mapping, Sequence

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.language_models.base import LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import invalid_tool_call, tool_call, tool_call_chunk
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import JsonOutputKeyToolsParser, PydanticToolsParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.json import parse_partial_json
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import ConfigDict, Field

from agentcache.engine.protocol import SamplingParams
from agentcache.errors import InputError
from agentcache.metrics import CallResult
from agentcache.output_format import read_tool_choice, response_constraint
from agentcache.runtime import Runtime
from agentcache.segments import AgentCall, DispatchEvent
from agentcache.streaming import astream_call, stream_call
from agentcache.toolcalls import ContentStream, ParsedOutput, ToolFormat, function_tools, no_tool_format
from agentcache.transcript import stop_strings

from agentcache_langgraph.messages import AGENT_KEY, to_call
from agentcache_langgraph.nodes import NodeTag, current_node, graph_context

__all__ = ["AgentCacheChatModel", "UnsupportedFeatureError", "DEFAULT_AGENT"]

FRAMEWORK = "langgraph"
DEFAULT_AGENT = "assistant"  # who calls when no decorator, `agent=` or graph node names anyone
_SAMPLING_KWARGS = ("max_tokens", "temperature", "top_p", "seed")
_OUTPUT_KWARGS = ("tools", "tool_choice", "response_format")  # what the output is: tool calls, JSON
_LEGACY_KWARGS = ("functions", "function_call")  # OpenAI's pre-tools function calling
_IGNORED_KWARGS = ("stream",)  # LangChain's own switch, already acted on when we are called
_STRUCTURED_METHODS = ("json_schema", "function_calling", "json_mode")


class UnsupportedFeatureError(NotImplementedError):
    """A LangChain feature the agentcache runtime cannot provide for this model (tool calls on a
    model whose chat template has no tool-call format, another model's weights, legacy functions)."""


@dataclass(frozen=True)
class _Prepared:
    call: AgentCall
    sampling: SamplingParams
    event: DispatchEvent
    tool_names: tuple[str, ...] = ()  # the tools the model may call, when its output is parsed for calls
    tool_format: ToolFormat | None = None  # set: parse the output for tool calls

    def parse(self, text: str) -> ParsedOutput | None:
        return None if self.tool_format is None else self.tool_format.parse(text, self.tool_names)


def _calling_agent(tag: NodeTag | None, explicit: str | None, node: str | None) -> str:
    """The innermost `@agent_node`, else the model's `agent=`, else the LangGraph node the call runs in
    (LangGraph puts its name in the run's metadata), else `DEFAULT_AGENT`."""
    if tag is not None:
        return tag.agent
    return explicit or node or DEFAULT_AGENT


# --- tools, tool choice and response format ------------------------------------------------

def _openai_tools(tools: Iterable[Any]) -> list[dict[str, Any]]:
    """`tools` (LangChain tools, functions, Pydantic or TypedDict classes, JSON schemas, OpenAI-shaped
    dicts) in the OpenAI shape. Checked when a call is made (`function_tools`: names present and
    unique), not here: LangChain binds tools before anything runs."""
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Iterable):
        raise InputError(f"tools must be a list of tools, got {type(tools).__name__}")
    shaped = []
    for tool in tools:
        if isinstance(tool, Mapping) and tool.get("type") == "function":
            shaped.append(dict(tool))
        else:
            try:
                shaped.append(convert_to_openai_tool(tool))
            except (ValueError, TypeError) as exc:
                raise InputError(f"cannot read {tool!r} as a tool: {exc}") from None
    return shaped


def _names(tools: Sequence[Mapping[str, Any]]) -> list[str]:
    return [str((t.get("function") or {}).get("name")) for t in tools]


def _structured_schema(schema: Any, strict: bool | None) -> dict[str, Any]:
    """The JSON schema of a Pydantic class, TypedDict, tool or JSON-schema dict."""
    if isinstance(schema, Mapping) and "function" not in schema and "name" not in schema and "title" not in schema:
        return dict(schema)  # a bare JSON schema: LangChain's conversion needs a title it has not got
    try:
        return convert_to_json_schema(schema, strict=strict)
    except (ValueError, TypeError) as exc:
        raise InputError(f"cannot read {schema!r} as a schema: {exc}") from None


def _wants_pydantic(schema: Any) -> bool:
    return isinstance(schema, type) and is_basemodel_subclass(schema)


# --- tool calls as LangChain reads them ---------------------------------------------------

def _calls(parsed: ParsedOutput) -> tuple[list[dict], list[dict]]:
    """LangChain's `tool_calls` and `invalid_tool_calls` of the parsed output (a call of a tool not
    offered is invalid, with its name and arguments; a block that is no call, with its text)."""
    valid = [tool_call(name=call.name, args=call.arguments, id=call.id) for call in parsed.calls]
    invalid = [invalid_tool_call(name=bad.name, args=bad.text, id=bad.id, error=bad.error) for bad in parsed.invalid]
    return valid, invalid


def _call_chunks(valid: list[dict], invalid: list[dict], tool_format: ToolFormat) -> list[dict]:
    """The calls as `tool_call_chunks`, which LangChain turns back into the same `tool_calls` when it
    merges a stream. An invalid call goes as its text, which reads as no JSON object and so stays
    invalid; one whose text would read as an object (a call to an unknown tool, cut-off JSON) keeps
    the tool-call tags around it to stay so (the merged message has no `error`: chunks cannot carry one)."""
    chunks = [tool_call_chunk(name=c["name"], args=json.dumps(c["args"], ensure_ascii=False), id=c["id"], index=i)
              for i, c in enumerate(valid)]
    for index, bad in enumerate(invalid, start=len(valid)):
        args = bad["args"] or ""
        try:
            reads_as_object = isinstance(parse_partial_json(args), dict)
        except Exception:  # noqa: BLE001 - LangChain's merge treats any failure as "not an object"
            reads_as_object = False
        if reads_as_object:
            args = f"{tool_format.begin}\n{args}\n{tool_format.end}"
        chunks.append(tool_call_chunk(name=bad["name"], args=args, id=bad["id"], index=index))
    return chunks


class AgentCacheChatModel(BaseChatModel):
    """A chat model served by an `agentcache.Runtime`, for LangGraph nodes.

    Messages are laid out with the shared transcript format (`agentcache.transcript`): system
    messages are the agent's private prefix, every other message a shared segment that other
    agents' calls can reuse. The calling agent is the innermost `@agent_node` in effect, else the
    `agent` field, else the LangGraph node the call runs in (so `create_react_agent(model, ...)`
    and plain nodes need nothing more), else `"assistant"`. The session is the `session` field,
    else the graph run's `thread_id`.

    Tool calling (`bind_tools`, `tool_choice`): on a model whose chat template has a tool-call
    format (`runtime.chat.tool_format`; the preset "qwen2.5-coder-0.5b"), tools, the model's own
    tool calls and tool results are rendered by that template; the reply's `<tool_call>` blocks
    become `AIMessage.tool_calls`, and a block that is no call (bad JSON, an unknown tool) becomes
    an `invalid_tool_calls` entry, never an error. `tool_choice` "any"/"required" or a tool's name
    forces a call by constrained decoding, so the call is one of the tools with arguments valid
    under its schema; "auto" (the default) lets the model decide; "none" parses nothing. Streamed
    replies send their text up to the first `<tool_call>`; the last chunk carries
    `tool_call_chunks` that merge to the same `tool_calls`. A model without a tool-call format
    (a base model: Gemma 3 270M, the tiny test presets but "tiny-qwen2-chat") refuses tools with
    `UnsupportedFeatureError`.

    Structured output: `with_structured_output(schema)` with a Pydantic class, TypedDict or JSON
    schema. `method="json_schema"` (the default) constrains the reply to the schema and works on
    any model; `"json_mode"` constrains it to a JSON object (the prompt must ask for the keys);
    `"function_calling"` forces a call of the schema as a tool (needs a tool-call format). The
    same constraints are `response_format={"type": "json_object"}` or `{"type": "json_schema",
    "json_schema": {"schema": ...}}` on `bind`/`invoke`. A schema the grammar compiler cannot
    compile is an `agentcache.errors.InputError` when the call is made.

    Not supported: the legacy `functions`/`function_call` arguments (use `bind_tools`), a
    per-call `model` other than the runtime's, and non-text inputs (images, audio, files).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    runtime: Runtime
    agent: str | None = None  # the calling agent; an enclosing @agent_node overrides it, None: the graph node
    session: str | None = None  # None: the LangGraph thread_id when called inside a graph
    max_tokens: int = Field(default=64, ge=1)
    temperature: float = Field(default=0.0, ge=0.0)
    stop: tuple[str, ...] = ()  # the caller's stop strings: they join the transcript's own stop, never replace it

    @property
    def _llm_type(self) -> str:
        return "agentcache"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.runtime.engine.model_name, "strategy": self.runtime.strategy.name,
                "agent": self.agent, "max_tokens": self.max_tokens, "temperature": self.temperature,
                "stop": list(self._stops())}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "agentcache"
        params["ls_model_name"] = kwargs.get("model") or self.runtime.engine.model_name  # a per-call model wins
        params["ls_stop"] = list(self._stops(stop))
        return params

    def _stops(self, per_call: Sequence[str] | None = None) -> tuple[str, ...]:
        """The transcript's stop (without it the model writes other agents' turns), the model's own
        stop strings and the call's, in order, without repeats."""
        return tuple(dict.fromkeys((*stop_strings(self.runtime.chat), *self.stop, *(per_call or ()))))

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of `text` with the runtime's own tokenizer."""
        return self.runtime.engine.tokenize(text)

    # --- tools and structured output -------------------------------------------------------

    def _require_tool_format(self, what: str) -> ToolFormat:
        tool_format = self.runtime.tool_format
        if tool_format is None:
            reason = no_tool_format(self.runtime.engine.model_name)
            raise UnsupportedFeatureError(f"AgentCacheChatModel {what}: {reason}")
        return tool_format

    def bind_tools(self, tools: Sequence[Any], *, tool_choice: Any = None, strict: bool | None = None,
                   **kwargs: Any) -> Runnable:
        """This model with `tools` bound (LangChain tools, functions, Pydantic or TypedDict classes,
        JSON schemas). `tool_choice`: None or "auto" (the model decides), "none" (no call),
        "any"/"required" (some tool), a tool's name, `{"type": "function", "function": {"name": ...}}`
        or True (the only tool). A forced call is constrained to the tools' schemas, so `strict`
        (accepted for LangChain's signature) changes nothing. Refused (`UnsupportedFeatureError`)
        on a model whose chat template has no tool-call format."""
        self._require_tool_format("bind_tools")
        shaped = _openai_tools(tools)
        choice = read_tool_choice(tool_choice, _names(shaped))
        return self.bind(tools=shaped, **({} if choice is None else {"tool_choice": choice}), **kwargs)

    def with_structured_output(
        self,
        schema: Any,
        *,
        method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable:
        """A runnable that answers with `schema` (a Pydantic class: an instance; a TypedDict or JSON
        schema: a dict). `method`: "json_schema" (default; the reply is constrained to the schema,
        on any model), "json_mode" (constrained to a JSON object; say the keys in the prompt) or
        "function_calling" (a forced call of the schema as a tool; needs a tool-call format).
        `include_raw=True` returns {"raw": the AIMessage, "parsed": the value or None,
        "parsing_error": the exception or None} instead of raising on a reply that does not parse."""
        if kwargs:
            raise ValueError(f"Received unsupported arguments {kwargs}")
        if method not in _STRUCTURED_METHODS:
            raise ValueError(f"method must be one of {list(_STRUCTURED_METHODS)}, got {method!r}")
        if schema is None and method != "json_mode":
            raise ValueError(f"method={method!r} needs a schema")
        traced = {"kwargs": {"method": method, "strict": strict}, "schema": schema}
        pydantic = _wants_pydantic(schema)
        if method == "function_calling":
            self._require_tool_format("with_structured_output(method='function_calling')")
            name = _names(_openai_tools([schema]))[0]
            model = self.bind_tools([schema], tool_choice=name, ls_structured_output_format=traced)
            parser: Runnable = (PydanticToolsParser(tools=[schema], first_tool_only=True) if pydantic
                                else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True))
        else:
            if method == "json_schema":
                json_schema = _structured_schema(schema, strict)
                name = str(json_schema.get("title") or "output")
                response_format = {"type": "json_schema",
                                   "json_schema": {"name": name, "schema": json_schema, "strict": strict}}
            else:
                response_format = {"type": "json_object"}
            if schema is None:
                traced = None
            model = self.bind(response_format=response_format,
                              **({} if traced is None else {"ls_structured_output_format": traced}))
            parser = PydanticOutputParser(pydantic_object=schema) if pydantic else JsonOutputParser()
        if not include_raw:
            return model | parser
        parse = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        failed = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=model) | parse.with_fallbacks([failed], exception_key="parsing_error")

    # --- one call ------------------------------------------------------------------------

    def _prepare(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]) -> _Prepared:
        """The call, sampling and dispatch event for `messages`, as the current node's agent."""
        tag = current_node()
        thread_id, node = graph_context()
        agent = _calling_agent(tag, self.agent, node)
        if self.session is None and thread_id is not None and not thread_id.strip():
            raise InputError(f"the LangGraph thread_id is {thread_id!r}; a session needs a non-empty thread_id "
                             "(configurable={'thread_id': 'run-1'}) or none at all")
        session = self.session if self.session is not None else thread_id
        caller = node or (tag.function if tag is not None else None)

        legacy = sorted(k for k in kwargs if k in _LEGACY_KWARGS)
        if legacy:
            raise UnsupportedFeatureError(
                f"AgentCacheChatModel got {legacy}: OpenAI's legacy function calling is not supported; bind the "
                "functions as tools with bind_tools(...) (and tool_choice=... to force one)")
        model = kwargs.get("model")
        if model is not None and model != self.runtime.engine.model_name:
            raise UnsupportedFeatureError(
                f"AgentCacheChatModel got model={model!r}, but its runtime serves {self.runtime.engine.model_name!r}; "
                "a call cannot switch weights: use an AgentCacheChatModel on a runtime of that model")
        unknown = sorted(k for k in kwargs if k not in (*_SAMPLING_KWARGS, *_OUTPUT_KWARGS, *_IGNORED_KWARGS, "model"))
        if unknown:
            raise TypeError(f"AgentCacheChatModel got unknown keyword arguments {unknown}; "
                            f"it takes {list(_SAMPLING_KWARGS + _OUTPUT_KWARGS)} and stop")

        tools = function_tools(_openai_tools(kwargs.get("tools") or ()))
        names = tuple(t["function"]["name"] for t in tools)
        choice = read_tool_choice(kwargs.get("tool_choice"), names)
        tool_format = self._require_tool_format("got tools") if tools else None
        constraint = response_constraint(kwargs.get("response_format"))
        if choice not in (None, "none"):
            if constraint is not None:
                raise InputError(f"tool_choice={choice!r} forces a tool call and response_format constrains the "
                                 "reply to JSON; a reply cannot be both: give one of them")
            constraint = tool_format.constraint(tools, choice)

        stops = self._stops(stop)
        options = {"max_tokens": self.max_tokens, "temperature": self.temperature}
        options.update({k: kwargs[k] for k in _SAMPLING_KWARGS if k in kwargs})
        sampling = SamplingParams(stop=stops, constraint=constraint, **options)

        call = to_call(messages, agent, session, self.runtime.chat, tools=tools)
        event = DispatchEvent(agent=agent, session=session, framework=FRAMEWORK, caller=caller,
                              messages=len(messages))
        parsing = tool_format if tools and choice != "none" else None
        return _Prepared(call, sampling, event, names, parsing)

    def _message_fields(self, result: CallResult, session: str | None) -> dict[str, Any]:
        """Name and metadata of the reply: timings, cache figures and per-segment decisions."""
        output = len(result.token_ids)
        return {
            "name": result.agent,
            "response_metadata": {
                "model_name": self.runtime.engine.model_name,
                AGENT_KEY: result.agent,
                "session": session,
                "finish_reason": result.finish_reason,
                "ttft_s": result.ttft_s,
                "queued_s": result.queued_s,  # of ttft_s, waiting behind other calls (a fan-out's siblings)
                "total_s": result.total_s,
                "prompt_tokens": result.prompt_tokens,
                "cached_tokens": result.exact_cached_tokens,  # exact prefix hits
                "own_lineage_tokens": result.lineage_tokens,  # the agent's own approximate blocks
                "reused_tokens": result.reused_tokens,
                "decisions": [(s.name, s.decision) for s in result.segments],
            },
            "usage_metadata": UsageMetadata(
                input_tokens=result.prompt_tokens, output_tokens=output, total_tokens=result.prompt_tokens + output,
                input_token_details={"cache_read": result.cached_tokens}),
        }

    def _chat_result(self, result: CallResult, prepared: _Prepared) -> ChatResult:
        fields = self._message_fields(result, prepared.call.session)
        parsed = prepared.parse(result.text)
        if parsed is None:
            message = AIMessage(content=result.text, **fields)
        else:
            valid, invalid = _calls(parsed)
            message = AIMessage(content=parsed.content, tool_calls=valid, invalid_tool_calls=invalid, **fields)
        return ChatResult(generations=[ChatGeneration(message=message)],
                          llm_output={"model_name": self.runtime.engine.model_name})

    def _chunk(self, text: str, agent: str) -> ChatGenerationChunk:
        return ChatGenerationChunk(message=AIMessageChunk(content=text, name=agent))

    def _last_chunk(self, result: CallResult, prepared: _Prepared,
                    content: ContentStream | None) -> ChatGenerationChunk:
        """The call's metadata and, for a reply parsed for tool calls, the rest of its content and
        its calls as `tool_call_chunks`; LangChain merges it into the message."""
        fields = self._message_fields(result, prepared.call.session)
        parsed = prepared.parse(result.text)
        if parsed is None or content is None:
            return ChatGenerationChunk(message=AIMessageChunk(content="", chunk_position="last", **fields))
        valid, invalid = _calls(parsed)
        chunks = _call_chunks(valid, invalid, prepared.tool_format)
        return ChatGenerationChunk(message=AIMessageChunk(
            content=content.rest(parsed.content), tool_call_chunks=chunks, chunk_position="last", **fields))

    def _chunks(self, item: str | CallResult, prepared: _Prepared,
                content: ContentStream | None) -> Iterator[ChatGenerationChunk]:
        if isinstance(item, CallResult):
            yield self._last_chunk(item, prepared, content)
            return
        text = item if content is None else content.push(item)
        if text:
            yield self._chunk(text, prepared.call.agent)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        prepared = self._prepare(messages, stop, kwargs)
        result = self.runtime.run(prepared.call, prepared.sampling, event=prepared.event)
        return self._chat_result(result, prepared)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        prepared = self._prepare(messages, stop, kwargs)
        result = await self.runtime.arun(prepared.call, prepared.sampling, event=prepared.event)
        return self._chat_result(result, prepared)

    # --- streaming -----------------------------------------------------------------------

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        """Token by token (the call runs on a worker thread; see `agentcache.streaming`). A reply
        parsed for tool calls streams its text up to the first tool-call tag."""
        prepared = self._prepare(messages, stop, kwargs)
        content = None if prepared.tool_format is None else ContentStream(prepared.tool_format)
        for item in stream_call(self.runtime, prepared.call, prepared.sampling, prepared.event):
            yield from self._chunks(item, prepared, content)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        """Token by token without blocking the event loop."""
        prepared = self._prepare(messages, stop, kwargs)
        content = None if prepared.tool_format is None else ContentStream(prepared.tool_format)
        async for item in astream_call(self.runtime, prepared.call, prepared.sampling, prepared.event):
            for chunk in self._chunks(item, prepared, content):
                yield chunk

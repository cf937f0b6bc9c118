"""`AgentCacheChatModel`: a LangChain chat model that runs every call through an agentcache Runtime."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterator, Sequence

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.language_models.base import LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import ConfigDict, Field

from agentcache.errors import InputError
from agentcache.engine.protocol import SamplingParams
from agentcache.metrics import CallResult
from agentcache.runtime import Runtime
from agentcache.segments import AgentCall, DispatchEvent
from agentcache.streaming import astream_call, stream_call
from agentcache.transcript import stop_strings

from agentcache_langgraph.messages import AGENT_KEY, to_call
from agentcache_langgraph.nodes import NodeTag, current_node, graph_context

__all__ = ["AgentCacheChatModel", "UnsupportedFeatureError", "DEFAULT_AGENT"]

FRAMEWORK = "langgraph"
DEFAULT_AGENT = "assistant"  # who calls when no decorator, `agent=` or graph node names anyone
_SAMPLING_KWARGS = ("max_tokens", "temperature", "top_p", "seed")
_TOOL_KWARGS = ("tools", "tool_choice", "functions", "function_call", "response_format")
_IGNORED_KWARGS = ("stream",)  # LangChain's own switch, already acted on when we are called


class UnsupportedFeatureError(NotImplementedError):
    """A LangChain feature the agentcache runtime cannot provide (tool calls, structured output)."""


_NO_TOOLS = ("the agentcache runtime generates plain text and cannot emit tool calls; describe the tools in "
             "the system prompt and parse the model's text instead")


@dataclass(frozen=True)
class _Prepared:
    call: AgentCall
    sampling: SamplingParams
    event: DispatchEvent


def _calling_agent(tag: NodeTag | None, explicit: str | None, node: str | None) -> str:
    """The innermost `@agent_node`, else the model's `agent=`, else the LangGraph node the call runs in
    (LangGraph puts its name in the run's metadata), else `DEFAULT_AGENT`."""
    if tag is not None:
        return tag.agent
    return explicit or node or DEFAULT_AGENT


class AgentCacheChatModel(BaseChatModel):
    """A chat model served by an `agentcache.Runtime`, for LangGraph nodes.

    Messages are laid out with the shared transcript format (`agentcache.transcript`): system
    messages are the agent's private prefix, every other message a shared segment that other
    agents' calls can reuse. The calling agent is the innermost `@agent_node` in effect, else the
    `agent` field, else the LangGraph node the call runs in (so `create_react_agent(model, ...)`
    and plain nodes need nothing more), else `"assistant"`. The session is the `session` field,
    else the graph run's `thread_id`.

    Not supported, and refused with `UnsupportedFeatureError`: `bind_tools` (the runtime emits no
    tool calls; put tool descriptions in the system prompt) and `with_structured_output` (no
    constrained decoding).
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

    # --- refusals ------------------------------------------------------------------------

    def bind_tools(self, tools: Sequence[Any], *, tool_choice: Any = None, **kwargs: Any) -> Any:
        """Refused: the runtime cannot emit tool calls. Describe tools in the system prompt instead."""
        raise UnsupportedFeatureError(f"AgentCacheChatModel.bind_tools: {_NO_TOOLS}")

    def with_structured_output(self, schema: Any, *, include_raw: bool = False, **kwargs: Any) -> Any:
        """Refused: the runtime has no constrained decoding. Ask for the format in the prompt and parse the text."""
        raise UnsupportedFeatureError(
            "AgentCacheChatModel.with_structured_output: the agentcache runtime has no constrained decoding or "
            "tool calls; ask for the format in the prompt and parse the model's text instead")

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

        tool_kwargs = sorted(k for k in kwargs if k in _TOOL_KWARGS)
        if tool_kwargs:
            raise UnsupportedFeatureError(f"AgentCacheChatModel got {tool_kwargs}: {_NO_TOOLS}")
        model = kwargs.get("model")
        if model is not None and model != self.runtime.engine.model_name:
            raise UnsupportedFeatureError(
                f"AgentCacheChatModel got model={model!r}, but its runtime serves {self.runtime.engine.model_name!r}; "
                "a call cannot switch weights: use an AgentCacheChatModel on a runtime of that model")
        unknown = sorted(k for k in kwargs if k not in (*_SAMPLING_KWARGS, *_IGNORED_KWARGS, "model"))
        if unknown:
            raise TypeError(f"AgentCacheChatModel got unknown keyword arguments {unknown}; "
                            f"it takes {list(_SAMPLING_KWARGS)} and stop")
        stops = self._stops(stop)
        options = {"max_tokens": self.max_tokens, "temperature": self.temperature}
        options.update({k: kwargs[k] for k in _SAMPLING_KWARGS if k in kwargs})
        sampling = SamplingParams(stop=stops, **options)

        call = to_call(messages, agent, session, self.runtime.chat)
        event = DispatchEvent(agent=agent, session=session, framework=FRAMEWORK, caller=caller,
                              messages=len(messages))
        return _Prepared(call, sampling, event)

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
        message = AIMessage(content=result.text, **self._message_fields(result, prepared.call.session))
        return ChatResult(generations=[ChatGeneration(message=message)],
                          llm_output={"model_name": self.runtime.engine.model_name})

    def _chunk(self, text: str, agent: str) -> ChatGenerationChunk:
        return ChatGenerationChunk(message=AIMessageChunk(content=text, name=agent))

    def _last_chunk(self, result: CallResult, prepared: _Prepared) -> ChatGenerationChunk:
        """The call's metadata, with no text of its own; LangChain merges it into the message."""
        fields = self._message_fields(result, prepared.call.session)
        return ChatGenerationChunk(message=AIMessageChunk(content="", chunk_position="last", **fields))

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
        """Token by token (the call runs on a worker thread; see `agentcache.streaming`)."""
        prepared = self._prepare(messages, stop, kwargs)
        for item in stream_call(self.runtime, prepared.call, prepared.sampling, prepared.event):
            if isinstance(item, CallResult):
                yield self._last_chunk(item, prepared)
            else:
                yield self._chunk(item, prepared.call.agent)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        """Token by token without blocking the event loop."""
        prepared = self._prepare(messages, stop, kwargs)
        async for item in astream_call(self.runtime, prepared.call, prepared.sampling, prepared.event):
            if isinstance(item, CallResult):
                yield self._last_chunk(item, prepared)
            else:
                yield self._chunk(item, prepared.call.agent)

"""A chat completion request as a runtime call: its segments, sampling, output constraint and
dispatch event, laid out exactly as the adapters lay out theirs (`transcript.build_call`).

Defaults follow OpenAI's API: temperature 1 and top_p 1 when not given, and a reply budget of
`default_max_tokens` (or what the context has left, when less). A prompt over the server's
`max_prompt_tokens`, or one whose given budget does not fit the model's context, is a 400 naming
the limit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from agentcache.calls import tokenize_call
from agentcache.correction.plan import TokenizedCall
from agentcache.engine.protocol import SamplingParams
from agentcache.errors import InputError
from agentcache.output_format import read_tool_choice, response_constraint
from agentcache.runtime import Runtime
from agentcache.segments import AgentCall, DispatchEvent
from agentcache.serve.api import ApiError, ChatRequest
from agentcache.serve.identity import Caller
from agentcache.serve.messages import Transcript
from agentcache.toolcalls import ParsedOutput, ToolFormat, function_tools, no_tool_format
from agentcache.transcript import build_call, stop_strings

__all__ = ["PreparedCall", "prepare_call", "prompt_token_ids", "laid_out", "FRAMEWORK"]

FRAMEWORK = "openai-http"  # the dispatch events' framework: a client of `agentcache serve`


@dataclass(frozen=True)
class PreparedCall:
    call: AgentCall
    sampling: SamplingParams
    event: DispatchEvent
    prompt_tokens: int
    tokenized: TokenizedCall  # the call's tokens: the runtime does not tokenize it again
    tool_names: tuple[str, ...] = ()
    tool_format: ToolFormat | None = None  # set: the reply is parsed for tool calls

    def parse(self, text: str) -> ParsedOutput | None:
        return None if self.tool_format is None else self.tool_format.parse(text, self.tool_names)


def laid_out(runtime: Runtime, transcript: Transcript, caller: Caller, tools: list[dict]) -> AgentCall:
    """The caller's messages as the runtime's call: segments laid out as the adapters lay theirs."""
    known = runtime.shared_texts(caller.session, caller.tenant)
    call = build_call(caller.agent, transcript.system, transcript.turns(caller.agent, known), tools=tools,
                      session=caller.session, chat=runtime.chat)
    return call.model_copy(update={"tenant": caller.tenant})


def prompt_token_ids(runtime: Runtime, request: ChatRequest, transcript: Transcript, caller: Caller) -> list[int]:
    """The token ids the runtime would prefill for `request` (`/tokenize`, for routers placing it)."""
    call = laid_out(runtime, transcript, caller, function_tools(request.tools or ()))
    return list(tokenize_call(runtime.engine, call).prompt)


@contextmanager
def _blamed(field: str) -> Iterator[None]:
    """An InputError raised inside is a 400 whose `param` is `field`."""
    try:
        yield
    except InputError as exc:
        raise ApiError(400, str(exc), param=field) from None


def prepare_call(runtime: Runtime, request: ChatRequest, transcript: Transcript, caller: Caller, *,
                 default_max_tokens: int, max_prompt_tokens: int, user_agent: str | None) -> PreparedCall:
    """The runtime call of `request` by `caller`; an ApiError (or InputError) 400 naming what is wrong."""
    with _blamed("tools"):
        tools = function_tools(request.tools or ())
    names = tuple(tool["function"]["name"] for tool in tools)
    with _blamed("tool_choice"):
        choice = read_tool_choice(request.tool_choice, names)
    tool_format = runtime.tool_format
    if tools and tool_format is None:
        raise ApiError(400, f"tools: {no_tool_format(runtime.engine.model_name)}", param="tools")
    with _blamed("response_format"):
        constraint = response_constraint(request.response_format)
    if choice not in (None, "none"):
        if constraint is not None:
            raise ApiError(400, f"tool_choice={request.tool_choice!r} forces a tool call and response_format "
                                "constrains the reply to JSON; a reply cannot be both", param="tool_choice")
        with _blamed("tool_choice"):
            constraint = tool_format.constraint(tools, choice)

    call = laid_out(runtime, transcript, caller, tools)
    engine = runtime.engine
    tokenized = tokenize_call(engine, call)
    prompt_tokens = len(tokenized.prompt)
    if prompt_tokens > max_prompt_tokens:
        raise ApiError(400, f"messages: the prompt is {prompt_tokens} tokens; this server takes at most "
                            f"{max_prompt_tokens}", param="messages", code="context_length_exceeded")
    room = engine.max_context - prompt_tokens
    wanted = request.output_tokens
    if wanted is not None and wanted > room:
        field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        raise ApiError(400, f"{field}: the prompt is {prompt_tokens} tokens and {engine.model_name}'s context is "
                            f"{engine.max_context}, so at most {room} tokens can follow; asked for {wanted}",
                       param=field, code="context_length_exceeded")
    if room < 1:
        raise ApiError(400, f"messages: the prompt is {prompt_tokens} tokens and fills {engine.model_name}'s context "
                            f"of {engine.max_context}", param="messages", code="context_length_exceeded")
    stops = tuple(dict.fromkeys((*stop_strings(runtime.chat), *(request.stop or ()))))
    sampling = SamplingParams(
        max_tokens=wanted if wanted is not None else min(default_max_tokens, room),
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p, seed=request.seed, stop=stops, constraint=constraint,
        ignore_eos=bool(request.ignore_eos))
    event = DispatchEvent(agent=caller.agent, session=caller.session, framework=FRAMEWORK,
                          caller=(user_agent or None) and user_agent[:80], messages=len(request.messages))
    parsing = tool_format if tools and choice != "none" else None
    return PreparedCall(call, sampling, event, prompt_tokens, tokenized, names, parsing)


"""The OpenAI wire format of `/v1/chat/completions`: what a request may hold, errors, replies.

A request is read into `ChatRequest`. Every field OpenAI's API defines is known here: the fields
agentcache serves (sampling, stop, tools, tool_choice, response_format, streaming, `n=1`), the
ones it accepts and ignores because they change nothing in the reply (`user`, `metadata`,
`parallel_tool_calls`, `prompt_cache_key`, ...), and the ones it accepts only at their neutral
value (`logprobs=false`, `presence_penalty=0`, ...). Anything else, or a neutral-only field at
another value, is a 400 naming the field. `null` means "not given", as OpenAI's clients send it.

Replies are built as OpenAI's own pydantic types from the `openai` package (`ChatCompletion`,
`ChatCompletionChunk`), so their shape is the SDK's, not ours to keep in step.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

__all__ = ["ApiError", "ChatRequest", "AgentcacheFields", "read_request", "read_tokenize_request", "error_body", "completion", "chunk",
           "usage", "FINISH_REASONS"]

# the engine's finish reasons as OpenAI names them ("eos": the model ended its turn)
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # in one stop string: each decoded token is checked against a tail this long


class ApiError(Exception):
    """An OpenAI-style error: HTTP `status`, a message naming the problem, the field (`param`) when one is to blame."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or _KINDS.get(status, "invalid_request_error")
        self.headers = headers or {}


_KINDS = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 413: "invalid_request_error",
          429: "rate_limit_error", 500: "server_error", 503: "server_error"}


def error_body(error: ApiError) -> dict[str, Any]:
    return {"error": {"message": error.message, "type": error.kind, "param": error.param, "code": error.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class AgentcacheFields(_Strict):
    """`extra_body={"agentcache": {...}}`: who calls, when the client can say."""

    agent: str | None = None
    session: str | None = None

    @field_validator("agent", "session")
    @classmethod
    def _named(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must be a non-empty string")
        return value


class StreamOptions(_Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # OpenAI's padding of streamed chunks: none is sent here


class ChatRequest(_Strict):
    """The body of a chat completion request, as agentcache serves it."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    model: str = Field(min_length=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    n: Literal[1] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    cache_salt: str | None = Field(default=None, min_length=1)  # vLLM's field: a split inside the caller's tenant
    agentcache: AgentcacheFields | None = None
    # accepted and ignored: they change nothing in the reply
    parallel_tool_calls: bool | None = None  # every call the model writes is returned
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str] | None = None
    store: Literal[False] | None = None  # nothing is stored
    # accepted at their neutral value only
    frequency_penalty: Literal[0, 0.0] | None = None
    presence_penalty: Literal[0, 0.0] | None = None
    logprobs: Literal[False] | None = None
    top_logprobs: Literal[0] | None = None
    logit_bias: dict[str, Any] | None = None
    modalities: list[Literal["text"]] | None = None
    service_tier: Literal["auto", "default"] | None = None
    # vLLM's and SGLang's request extensions, which routers (vllm-router) add to every body they
    # forward at these defaults: accepted at them (the reasoning switches change nothing here:
    # no reasoning is parsed out of a reply); ignore_eos is honoured, as vLLM's load generators use it
    ignore_eos: bool | None = None
    no_stop_trim: Literal[False] | None = None
    continue_final_message: Literal[False] | None = None
    skip_special_tokens: Literal[True] | None = None
    return_hidden_states: Literal[False] | None = None
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None
    include_reasoning: bool | None = None

    @field_validator("temperature", "top_p", "frequency_penalty", "presence_penalty", mode="before")
    @classmethod
    def _number(cls, value: Any) -> Any:
        return float(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("max_tokens", "max_completion_tokens", "seed", mode="before")
    @classmethod
    def _whole(cls, value: Any) -> Any:  # JSON's 16.0 is the integer 16 (JSON Schema's reading; some clients write it)
        return int(value) if isinstance(value, float) and value.is_integer() and abs(value) < 2**63 else value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str] | None:
        stops = [value] if isinstance(value, str) else value
        if stops is None:
            return None
        if len(stops) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"must be up to {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} "
                             "characters")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value:
            raise ValueError("logit_bias is not supported; only an empty map is accepted")
        return value

    @property
    def output_tokens(self) -> int | None:
        """The reply's token budget: `max_completion_tokens`, else the older `max_tokens`."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


_UNSUPPORTED = {  # fields OpenAI defines that this server does not serve, and what to do instead
    "functions": "the legacy function calling is not supported; send `tools`",
    "function_call": "the legacy function calling is not supported; send `tool_choice`",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "reasoning_effort": "this model does not reason in a separate channel; leave reasoning_effort out",
    "verbosity": "verbosity is not supported; leave it out",
    "prompt_cache_retention": "prompt cache retention is set by the server; leave it out",
}


_TOKENIZE_FIELDS = {"model", "messages", "tools", "add_generation_prompt", "add_special_tokens",
                    "continue_final_message", "return_token_strs"}


def read_tokenize_request(body: Any) -> ChatRequest:
    """vLLM's `/tokenize` body in its chat form (what routers send to place a request) as a chat
    request; a 400 naming the field for anything else."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    for key in body:
        if key not in _TOKENIZE_FIELDS:
            raise ApiError(400, f"{key}: unknown or unsupported field of /tokenize", param=key,
                           code="unsupported_parameter")
    if body.get("add_generation_prompt") is False or body.get("return_token_strs"):
        field = "add_generation_prompt" if body.get("add_generation_prompt") is False else "return_token_strs"
        raise ApiError(400, f"{field}: only the prompt as a call prefills it is tokenized here", param=field)
    if "messages" not in body:
        raise ApiError(400, "messages: /tokenize takes the chat form (messages) only", param="messages")
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise ApiError(400, f"model: must be a string, got {type(body['model']).__name__}", param="model",
                       code="invalid_value")
    return read_request({"model": body.get("model") or "-", "messages": body["messages"], "tools": body.get("tools"),
                         "continue_final_message": body.get("continue_final_message")})


def read_request(body: Any) -> ChatRequest:
    """`body` (the parsed JSON) as a ChatRequest; an ApiError 400 naming the first field at fault."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    given = {key: value for key, value in body.items() if value is not None}
    for key in given:
        if key in _UNSUPPORTED:
            raise ApiError(400, f"{key}: {_UNSUPPORTED[key]}", param=key, code="unsupported_parameter")
    try:
        return ChatRequest(**given)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(part) for part in first["loc"])
        field = str(first["loc"][0]) if first["loc"] else None
        if first["type"] == "extra_forbidden":
            raise ApiError(400, f"{where}: unknown or unsupported field", param=where,
                           code="unsupported_parameter") from None
        value = first.get("input")
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        raise ApiError(400, f"{where}: {first['msg']} (got {shown})", param=where or field,
                       code="invalid_value") from None


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion(id_: str, model: str, content: str | None, tool_calls: list[dict[str, Any]], finish_reason: str,
               usage_: dict[str, Any], extension: dict[str, Any]) -> dict[str, Any]:
    """A `chat.completion` object, checked against the openai package's `ChatCompletion`."""
    from openai.types.chat import ChatCompletion

    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    body = {"id": id_, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
            "usage": usage_}
    ChatCompletion.model_validate(body)  # the SDK's own shape: a mismatch is our bug, caught here
    return body | {"agentcache": extension}


def chunk(id_: str, model: str, created: int, delta: dict[str, Any] | None, finish_reason: str | None = None,
          usage_: dict[str, Any] | None = None, extension: dict[str, Any] | None = None) -> dict[str, Any]:
    """A `chat.completion.chunk`; `delta` None: the usage chunk (no choices)."""
    body: dict[str, Any] = {"id": id_, "object": "chat.completion.chunk", "created": created, "model": model,
                            "choices": [] if delta is None else
                            [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]}
    if usage_ is not None:
        body["usage"] = usage_
    if extension is not None:
        body["agentcache"] = extension
    return body

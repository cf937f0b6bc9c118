"""The HTTP application: OpenAI's chat completions over a Runtime, on FastAPI.

Routes: `POST /v1/chat/completions` (a JSON reply, or Server-Sent Events with `stream: true`),
`GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus), `POST /tokenize` (vLLM's, for
routers). A request's way through:

1. the tenant from its API key (401 without one, when keys are configured);
2. the body, read up to `max_body_bytes` (413 past it) and parsed (`read_request`: 400s);
3. who calls (`identity`), and the call laid out as the adapters lay theirs (`prepare`);
4. admission (`admission.py`): at most `max_in_flight` requests are held at once, the rest get a
   429 with `Retry-After` instead of waiting without bound; of those, the engine's batch run at
   once and the others wait their tenant's turn, round robin between tenants;
5. the call runs on the runtime's event-loop path (`Runtime.arun`): no thread per request.
   A client that disconnects cancels its engine request, which frees its blocks.

Every error is an OpenAI-style JSON body (`{"error": {"message", "type", "param", "code"}}`);
an unexpected one is a 500 whose message names the exception type only (the traceback goes to
the server's log, never to the client).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from functools import partial
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from agentcache import __version__
from agentcache.errors import ContextLengthError, InputError, RequestCancelled
from agentcache.metrics import CallResult
from agentcache.runtime import Runtime
from agentcache.serve.admission import Admission, Slot
from agentcache.serve.api import (FINISH_REASONS, ApiError, ChatRequest, chunk, completion, completion_id,
                                  error_body, read_request, read_tokenize_request, usage)
from agentcache.serve.config import ServeConfig
from agentcache.serve.drain import Drain, DrainCut, until_drained, within_drain
from agentcache.serve.identity import METRICS_TENANT, Caller, Identities
from agentcache.serve.messages import Transcript, read_messages
from agentcache.serve.metrics import CONTENT_TYPE, ServeMetrics
from agentcache.serve.openapi import openapi_document
from agentcache.serve.prepare import PreparedCall, prepare_call, prompt_token_ids
from agentcache.streaming import astream_call
from agentcache.toolcalls import ContentStream, ParsedOutput
from agentcache.transcript import UnsupportedMessageError

__all__ = ["create_app"]

log = logging.getLogger(__name__)

_BAD_REQUEST = (InputError, ContextLengthError, UnsupportedMessageError)  # raised by the runtime on bad input


def create_app(runtime: Runtime, config: ServeConfig | None = None) -> FastAPI:
    """The OpenAI-compatible application over `runtime` (which the caller keeps and closes)."""
    config = config or ServeConfig()
    if not isinstance(config, ServeConfig):
        raise InputError(f"create_app(config=...) must be a ServeConfig, got {type(config).__name__}")
    engine = runtime.engine
    batch = engine.max_batch
    server = _Server(runtime, config, Admission(
        config.max_in_flight or 4 * batch, running=config.max_running or batch))

    app = FastAPI(title="agentcache", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.openapi_schema = openapi_document(server.model, __version__)  # the routes read their bodies themselves
    app.state.runtime, app.state.metrics, app.state.admission = runtime, server.metrics, server.admission
    app.state.drain = server.drain
    _add_error_handlers(app)
    _add_info_routes(app, server)
    _add_tokenize_route(app, server)
    _add_chat_route(app, server)
    return app


class _Server:
    """What the routes share: the runtime and its settings, admission, the callers and the metrics."""

    def __init__(self, runtime: Runtime, config: ServeConfig, admission: Admission) -> None:
        engine = runtime.engine
        self.runtime, self.config, self.admission = runtime, config, admission
        self.tokenizing = Admission(config.max_tokenizing)  # /tokenize's own places: it never takes a chat's
        self.drain = Drain()  # begun by whoever runs the app (server.py) when it stops
        self.model = config.model_name or engine.model_name
        self.names = {self.model, engine.model_name}
        self.max_prompt = min(config.max_prompt_tokens or engine.max_context, engine.max_context)
        self.identities = Identities()
        self.metrics = ServeMetrics(runtime, config.max_agents)
        self.metrics.in_flight.set_function(lambda: admission.in_flight)
        _chain_sink(runtime, self.metrics.observe)

    def served(self, name: str) -> None:
        """A 404 unless `name` is the model this server serves."""
        if name not in self.names:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {self.model!r}",
                           param="model", code="model_not_found")

    def tenant(self, request: Request) -> str | None:
        return _tenant(self.config, request)

    async def admit(self, request: Request, chat: ChatRequest, transcript: Transcript,
                    caller: Caller) -> tuple[Slot, PreparedCall]:
        """A place (or a 429), the call prepared, then its tenant's turn to run; the place is released
        when any of it fails."""
        slot = self.admission.enter(self.tenant(request))  # before the prompt is tokenized: a refused request costs nothing more
        try:
            # tokenizing a long prompt would hold the event loop (and every stream on it): a worker thread does it
            prepared = await asyncio.get_running_loop().run_in_executor(None, partial(
                prepare_call, self.runtime, chat, transcript, caller, default_max_tokens=self.config.default_max_tokens,
                max_prompt_tokens=self.max_prompt, user_agent=request.headers.get("user-agent")))
            constraint = prepared.sampling.constraint
            if constraint is not None:  # compiled before the status line, off the runtime's threads
                try:
                    await asyncio.wrap_future(self.runtime.engine.constraint_ready(constraint))
                except InputError as exc:
                    field = "tools" if constraint.kind == "structural_tag" else "response_format"
                    raise ApiError(400, f"{field}: {exc}", param=field) from None
            await self.admission.turn(slot)
        except _BAD_REQUEST as exc:
            slot.release()
            raise ApiError(400, str(exc)) from None
        except BaseException:
            slot.release()
            raise
        return slot, prepared

    def refused(self, agent: str, tenant: str | None, error: ApiError) -> None:
        """Count a request refused before it ran."""
        self.metrics.outcome(agent, tenant, "rejected" if error.status in (413, 429) else "bad_request")
        if error.status in (413, 429):
            self.metrics.rejected.labels("queue_full" if error.status == 429 else "too_large").inc()


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as an OpenAI-style JSON body; an unexpected one names its type only."""

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(error_body(error), status_code=error.status, headers=error.headers)

    @app.exception_handler(HTTPException)
    async def _http_error(_request: Request, error: HTTPException) -> JSONResponse:
        return JSONResponse(error_body(ApiError(error.status_code, str(error.detail))), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, error: Exception) -> JSONResponse:
        log.exception("unexpected error serving a request")
        body = error_body(ApiError(500, f"internal error ({type(error).__name__}); see the server's log"))
        return JSONResponse(body, status_code=500)


def _add_info_routes(app: FastAPI, server: _Server) -> None:
    """/health, /v1/models and /metrics."""

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": server.model, "in_flight": server.admission.in_flight}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        server.tenant(request)
        return {"object": "list", "data": [_model_card(server.model)]}

    @app.get("/v1/models/{name:path}")
    async def one_model(name: str, request: Request) -> dict[str, Any]:
        server.tenant(request)
        server.served(name)
        return _model_card(server.model)

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        tenant = server.tenant(request)  # the figures of every tenant (agent names included): the scraper's key only
        if server.config.api_keys is not None and tenant != METRICS_TENANT:
            raise ApiError(403, f"/metrics covers every tenant: it needs a key of the tenant {METRICS_TENANT!r}",
                           code="forbidden")
        body = await asyncio.get_running_loop().run_in_executor(None, server.metrics.render)
        return Response(body, media_type=CONTENT_TYPE)


def _add_tokenize_route(app: FastAPI, server: _Server) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        """vLLM's tokenizer route (chat form): the prompt a call would prefill, for routers that
        place requests by cached blocks (vllm-router's kv_aware asks every instance)."""
        tenant = server.tenant(request)
        slot = server.tokenizing.enter()  # before the body is read: a refused request costs nothing more
        try:
            body = await _read_body(request, server.config.max_body_bytes)
            chat = read_tokenize_request(body)
            if body.get("model") is not None:  # optional in vLLM's /tokenize
                server.served(body["model"])
            transcript = read_messages(chat.messages)
            caller = server.identities.caller(chat, request.headers, transcript, tenant)
            tokens = await asyncio.get_running_loop().run_in_executor(
                None, partial(prompt_token_ids, server.runtime, chat, transcript, caller))
        except _BAD_REQUEST as exc:
            raise ApiError(400, str(exc)) from None
        finally:
            slot.release()
        return {"count": len(tokens), "max_model_len": server.runtime.engine.max_context, "tokens": tokens}


def _add_chat_route(app: FastAPI, server: _Server) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        agent, tenant = "unknown", None
        try:
            tenant = server.tenant(request)
            body = await _read_body(request, server.config.max_body_bytes)
            chat = read_request(body)
            server.served(chat.model)
            transcript = read_messages(chat.messages)
            caller = server.identities.caller(chat, request.headers, transcript, tenant)
            agent = caller.agent
            slot, prepared = await server.admit(request, chat, transcript, caller)
        except ApiError as error:
            server.refused(agent, tenant, error)
            raise
        reply = _Reply(server.runtime, prepared, chat.model, chat.include_usage, caller.how,  # the name asked for
                       server.metrics, server.drain)
        if chat.stream:
            return StreamingResponse(_utf8(reply.events(slot)), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                     background=BackgroundTask(slot.release))
        try:
            return await reply.whole(request)
        finally:
            slot.release()


class _Reply:
    """One request's reply: whole (JSON) or streamed (SSE)."""

    def __init__(self, runtime: Runtime, prepared: PreparedCall, model: str, include_usage: bool, how: str,
                 metrics: ServeMetrics, drain: Drain) -> None:
        self.runtime, self.prepared, self.model = runtime, prepared, model
        self.include_usage, self.how, self.metrics, self.drain = include_usage, how, metrics, drain
        self.id = completion_id()
        self.cancel = threading.Event()

    @property
    def agent(self) -> str:
        return self.prepared.call.agent

    @property
    def tenant(self) -> str | None:
        return self.prepared.call.tenant

    async def whole(self, request: Request) -> Response:
        watcher = asyncio.ensure_future(_watch_disconnect(request, self.cancel))
        try:
            result = await within_drain(self.runtime.arun(self.prepared.call, self.prepared.sampling,
                                                          event=self.prepared.event, cancelled=self.cancel,
                                                          tokenized=self.prepared.tokenized), self.drain)
        except DrainCut as exc:
            self.cancel.set()
            self.metrics.outcome(self.agent, self.tenant, "cancelled")
            raise ApiError(503, str(exc), code="server_shutting_down") from None
        except asyncio.CancelledError:  # the handler itself was cancelled (a shutdown past its drain time)
            self.cancel.set()
            raise
        except RequestCancelled:
            self.metrics.outcome(self.agent, self.tenant, "cancelled")
            return Response(status_code=499)  # nobody is listening
        except _BAD_REQUEST as exc:
            self.metrics.outcome(self.agent, self.tenant, "bad_request")
            raise ApiError(400, str(exc)) from None
        except Exception:
            self.metrics.outcome(self.agent, self.tenant, "error")
            raise
        finally:
            watcher.cancel()
        self.metrics.outcome(self.agent, self.tenant, "ok")
        parsed = self.prepared.parse(result.text)
        content, calls = _content_and_calls(result.text, parsed)
        body = completion(self.id, self.model, content, calls, _finish(result, calls), self._usage(result),
                              self._extension(result, parsed))
        try:
            return JSONResponse(body)
        except UnicodeEncodeError:
            log.error("a reply held a lone UTF-16 surrogate: answered with a 500")
            raise _not_text() from None

    async def events(self, slot: Slot) -> AsyncIterator[str]:
        """The reply as Server-Sent Events. The stream ends early (and the engine request is
        cancelled) when the client disconnects: Starlette cancels this generator."""
        created = int(time.time())
        finished = False
        try:
            yield _sse(chunk(self.id, self.model, created, {"role": "assistant", "content": ""}))
            stream = None if self.prepared.tool_format is None else ContentStream(self.prepared.tool_format)
            result = None
            try:
                async for item in until_drained(astream_call(self.runtime, self.prepared.call, self.prepared.sampling,
                                                             self.prepared.event, cancelled=self.cancel,
                                                             tokenized=self.prepared.tokenized), self.drain):
                    if isinstance(item, CallResult):
                        result = item
                        break
                    text = item if stream is None else stream.push(item)
                    if text:
                        yield _sse(chunk(self.id, self.model, created, {"content": text}))
            except RequestCancelled:
                return  # counted as cancelled below
            except DrainCut as exc:
                self.cancel.set()  # the engine drops the request
                self.metrics.outcome(self.agent, self.tenant, "cancelled")
                yield _sse(error_body(ApiError(503, str(exc), code="server_shutting_down")))
                yield "data: [DONE]\n\n"
                finished = True
                return
            except Exception as exc:  # noqa: BLE001 - the status line is sent: the error goes in the stream
                bad = isinstance(exc, _BAD_REQUEST)
                if not bad:
                    log.exception("unexpected error while streaming a reply")
                self.metrics.outcome(self.agent, self.tenant, "bad_request" if bad else "error")
                error = ApiError(400, str(exc)) if bad else ApiError(500, f"internal error ({type(exc).__name__})")
                yield _sse(error_body(error))
                yield "data: [DONE]\n\n"
                finished = True
                return
            finished = True
            self.metrics.outcome(self.agent, self.tenant, "ok")
            parsed = self.prepared.parse(result.text)
            content, calls = _content_and_calls(result.text, parsed)
            rest = stream.rest(content or "") if stream is not None else ""
            if rest:
                yield _sse(chunk(self.id, self.model, created, {"content": rest}))
            for index, call in enumerate(calls):
                yield _sse(chunk(self.id, self.model, created, {"tool_calls": [{"index": index, **call}]}))
            yield _sse(chunk(self.id, self.model, created, {}, _finish(result, calls),
                                 extension=self._extension(result, parsed)))
            if self.include_usage:
                yield _sse(chunk(self.id, self.model, created, None, usage_=self._usage(result)))
            yield "data: [DONE]\n\n"
        finally:
            if not finished:
                self.cancel.set()  # the client went away: the engine drops the request
                self.metrics.outcome(self.agent, self.tenant, "cancelled")
            slot.release()

    def _usage(self, result: CallResult) -> dict[str, Any]:
        return usage(result.prompt_tokens, len(result.token_ids), result.cached_tokens)

    def _extension(self, result: CallResult, parsed: ParsedOutput | None) -> dict[str, Any]:
        """agentcache's own figures of the call, beside OpenAI's fields (clients ignore unknown keys)."""
        call = self.prepared.call
        extension = {"agent": call.agent, "session": call.session, "agent_from": self.how,
                     "instance": self.runtime.id[:12],  # which server answered (behind a router)
                     "ttft_s": result.ttft_s, "queued_s": result.queued_s, "cached_tokens": result.cached_tokens,
                     "reused_tokens": result.reused_tokens,
                     "decisions": [[segment.name, segment.decision] for segment in result.segments if segment.kind == "ph"],
                     "shared": [{"slot": segment.name, "tokens": segment.length, "decision": segment.decision,
                                 "reason": segment.reason, "source": segment.source, "reused": segment.injected_tokens}
                                for segment in result.segments if segment.kind == "ph"]}
        if parsed is not None and parsed.invalid:
            extension["invalid_tool_calls"] = [{"text": bad.text, "error": bad.error, "name": bad.name}
                                               for bad in parsed.invalid]
        return extension


def _content_and_calls(text: str, parsed: ParsedOutput | None) -> tuple[str | None, list[dict[str, Any]]]:
    """The reply's content and OpenAI tool calls. A reply whose tool-call blocks are all invalid is
    returned as its text (as vLLM's tool parsers do); the invalid blocks are also in the extension."""
    if parsed is None:
        return text, []
    if not parsed.calls:
        return (text if parsed.invalid else parsed.content), []
    calls = [{"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json}}
             for call in parsed.calls]
    return parsed.content or None, calls


def _finish(result: CallResult, calls: list[dict[str, Any]]) -> str:
    return "tool_calls" if calls else FINISH_REASONS.get(result.finish_reason, "stop")


def _not_text() -> ApiError:
    return ApiError(500, "the reply holds a lone UTF-16 surrogate, which cannot be sent as UTF-8", code="reply_not_text")


async def _utf8(events: AsyncIterator[str]) -> AsyncIterator[bytes]:
    """`events` as UTF-8. One that is not text (a lone surrogate) ends the stream with an error event
    and `[DONE]`, rather than cutting it where the server would fail to encode it."""
    try:
        async for event in events:
            try:
                yield event.encode("utf-8")
            except UnicodeEncodeError:
                log.error("a streamed reply held a lone UTF-16 surrogate: ended with an error event")
                yield (_sse(error_body(_not_text())) + "data: [DONE]\n\n").encode("utf-8")
                return
    finally:
        await events.aclose()


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _model_card(model: str) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": 0, "owned_by": "agentcache"}


def _tenant(config: ServeConfig, request: Request) -> str | None:
    if config.api_keys is None:
        return None
    return config.api_keys.tenant(request.headers.get("authorization"))


async def _read_body(request: Request, limit: int) -> Any:
    """The JSON body, read up to `limit` bytes (413 past it, before any more is read)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is {declared} bytes; this server takes at most {limit}",
                       code="request_too_large")
    body = bytearray()
    try:
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise ApiError(413, f"the request body is over this server's limit of {limit} bytes",
                               code="request_too_large")
    except ClientDisconnect:
        raise ApiError(499, "the client disconnected while sending the request") from None
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the request body is not UTF-8: byte {exc.start} ({body[exc.start]:#04x}) begins no "
                            "character", code="invalid_json") from None
    try:
        parsed = json.loads(text)
        json.dumps(parsed, ensure_ascii=False).encode()  # a lone surrogate is no text a model can read
        return parsed
    except RecursionError:
        raise ApiError(400, "the request body nests JSON too deeply", code="invalid_json") from None
    except UnicodeError:
        raise ApiError(400, "the request body holds a lone UTF-16 surrogate (an escape such as \\ud800), "
                            "which is not text", code="invalid_json") from None
    except ValueError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None


async def _watch_disconnect(request: Request, cancel: threading.Event) -> None:
    """Set `cancel` when the client disconnects (the body is read: the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            cancel.set()
            return


def _chain_sink(runtime: Runtime, observe) -> None:
    """Add `observe` to the runtime's per-call sink, keeping the sink it had."""
    before = runtime.on_call

    def both(result: CallResult) -> None:
        observe(result)
        if before is not None:
            before(result)

    runtime.on_call = both

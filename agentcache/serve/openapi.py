"""The server's OpenAPI document, served at `GET /openapi.json`.

The routes read their bodies themselves (to bound and name every error), so FastAPI cannot
derive their schemas; this document states them: the chat request from `api.ChatRequest` (its
messages as the server reads them, `messages.py`), `/tokenize` in vLLM's chat form, and the
read-only routes. Every error is described once, as OpenAI's error body. A property-based fuzz
test (tests/test_serve_fuzz.py, schemathesis) sends what this document allows, and what it does
not, and asserts no 5xx and no traceback.
"""

from __future__ import annotations

from typing import Any

from agentcache.serve.api import MAX_STOP_CHARS, MAX_STOP_STRINGS, ChatRequest

__all__ = ["openapi_document"]

_TEXT_PART = {"type": "object", "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
              "required": ["type", "text"]}
_TEXT = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART, "minItems": 1}]}
_NAME = {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"}
_CALL = {"type": "object", "properties": {
    "id": {"type": "string", "minLength": 1}, "type": {"const": "function"},
    "function": {"type": "object", "properties": {"name": _NAME, "arguments": {
        "type": "string", "pattern": "^[{].*[}]$", "description": "a JSON object, as text"}},
                 "required": ["name", "arguments"]}}, "required": ["id", "type", "function"]}


def _message(role: Any, required: list[str], **properties: Any) -> dict[str, Any]:
    return {"type": "object", "properties": {"role": role, "name": _NAME, **properties},
            "required": ["role", *required]}


MESSAGE = {"oneOf": [  # each role with the fields the server needs of it (messages.py)
    _message({"enum": ["system", "developer", "user"]}, ["content"], content=_TEXT),
    _message({"const": "assistant"}, ["content"], content=_TEXT),
    _message({"const": "assistant"}, ["tool_calls"], content={"type": "null"},
             tool_calls={"type": "array", "items": _CALL, "minItems": 1}),
    _message({"const": "tool"}, ["content", "tool_call_id"], content=_TEXT,
             tool_call_id={"type": "string", "minLength": 1}),
]}
_ERROR = {"type": "object", "properties": {"error": {"type": "object", "properties": {
    "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
    "code": {"type": ["string", "null"]}}, "required": ["message", "type"]}}, "required": ["error"]}
_ERRORS = {str(status): {"description": meaning, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
           for status, meaning in ((400, "the request names what is wrong"), (401, "no or an unknown API key"),
                                   (404, "no such model"), (413, "the body is over the server's limit"),
                                   (429, "the server is full: retry after Retry-After"),
                                   (503, "the server is shutting down"))}


def _chat_request_schema(model: str) -> dict[str, Any]:
    schema = ChatRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    schema.pop("$defs", None)
    schema["properties"]["model"] = {"enum": [model]}
    properties = schema["properties"]
    properties["messages"] = {"type": "array", "items": MESSAGE, "minItems": 1}
    stop = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
    properties["stop"] = {"anyOf": [stop, {"type": "array", "items": stop, "maxItems": MAX_STOP_STRINGS},
                                    {"type": "null"}]}
    properties["logit_bias"] = {"anyOf": [{"type": "object", "maxProperties": 0}, {"type": "null"}]}
    return schema


def _json_body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def _ok(description: str, media: str = "application/json") -> dict[str, Any]:
    return {"200": {"description": description, "content": {media: {"schema": {}}}}}


def openapi_document(model: str, version: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document of a server serving `model`."""
    defs = ChatRequest.model_json_schema(ref_template="#/components/schemas/{model}").get("$defs", {})
    tokenize = {"type": "object", "properties": {
        "model": {"enum": [model]}, "messages": {"type": "array", "items": MESSAGE, "minItems": 1},
        "tools": {"type": ["array", "null"], "items": {"type": "object"}},
        "add_generation_prompt": {"type": "boolean"}, "add_special_tokens": {"type": "boolean"},
        "continue_final_message": {"type": "boolean"}, "return_token_strs": {"type": "boolean"}},
        "required": ["messages"], "additionalProperties": False}
    chat = {"200": {"description": "a chat completion, or with stream: Server-Sent Events", "content": {
        "application/json": {"schema": {}}, "text/event-stream": {"schema": {"type": "string"}}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "agentcache serve", "version": version},
        "paths": {
            "/v1/chat/completions": {"post": {"operationId": "chat", "requestBody": _json_body(_chat_request_schema(model)),
                                              "responses": {**chat, **_ERRORS}}},
            "/tokenize": {"post": {"operationId": "tokenize", "requestBody": _json_body(tokenize),
                                   "responses": {**_ok("the prompt's token ids"), **_ERRORS}}},
            "/v1/models": {"get": {"operationId": "models", "responses": {**_ok("the served model"), **_ERRORS}}},
            "/v1/models/{name}": {"get": {"operationId": "model", "parameters": [
                {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {**_ok("the model"), **_ERRORS}}},
            "/health": {"get": {"operationId": "health", "responses": _ok("the server's state")}},
            "/metrics": {"get": {"operationId": "metrics", "responses": {**_ok("Prometheus metrics", "text/plain"),
                                                                         **_ERRORS}}},
        },
        "components": {"schemas": {"Error": _ERROR, **defs}},
    }

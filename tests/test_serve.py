"""`agentcache serve` over HTTP: a real server on a loopback port, called by the openai SDK and by
raw HTTP (httpx) for what a well-behaved client never sends."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import string
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI
from prometheus_client.parser import text_string_to_metric_families

from agentcache.config import RuntimeConfig
from agentcache.runtime import Runtime
from agentcache.serve import ApiKeys, ServeConfig, ServerThread, check_bind, create_app
from agentcache.errors import InputError

from conftest import make_engine

MODEL = "tiny-qwen2-chat"
SECRET = "Acme's merger with Initech closes on the ninth; tell nobody outside the deal team."
DOCUMENT = ("The harbour master's log for the week records three storms, a late ferry on Tuesday, and the "
            "arrival of the research vessel Albatross, which will stay until the end of the month. ") * 3
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
# a random-weight model writes integers and strings without end: a forced call's arguments are enums
LOCK = {"type": "function", "function": {"name": "lock_door", "description": "Lock a door.", "parameters": {
    "type": "object", "properties": {"door": {"enum": ["front", "back"]}, "now": {"type": "boolean"}},
    "required": ["door", "now"]}}}


def runtime(preset: str = MODEL, **config) -> Runtime:
    return Runtime(make_engine(preset, pool_blocks=256, **config), config=RuntimeConfig(self_check=False))


@pytest.fixture(scope="module")
def server():
    rt = runtime()
    with ServerThread(create_app(rt, ServeConfig(default_max_tokens=16))) as running:
        running.runtime = rt
        yield running


def client(server) -> OpenAI:
    return OpenAI(base_url=server.url, api_key="unused", max_retries=0)


def post(server, body, **kwargs) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(f"{server.url}/chat/completions", content=content,
                      headers={"content-type": "application/json", **kwargs.pop("headers", {})}, timeout=60, **kwargs)


def two_agents(session: str) -> tuple[list, list]:
    """The planner's and the writer's messages over the session's own document."""
    document = f"Week {session}. {DOCUMENT}"
    planner = [{"role": "system", "content": "You are the planner. Plan the answer in steps."},
               {"role": "user", "content": document}]
    writer = [{"role": "system", "content": "You are the writer. Write the answer from the plan."},
              {"role": "user", "content": document}]
    return planner, writer


# --- the openai SDK: a two-agent exchange, sync, async and streaming ----------------------------

def test_openai_sdk_two_agents_sync_and_the_identity_arrives(server):
    sdk = client(server)
    planner, writer = two_agents("s1")
    first = sdk.chat.completions.create(model=MODEL, messages=planner, max_tokens=40, temperature=0,
                                        extra_body={"agentcache": {"session": "s1"}})
    plan = first.choices[0].message.content
    writer.append({"role": "user", "name": "planner", "content": plan})
    second = sdk.chat.completions.create(model=MODEL, messages=writer, max_tokens=8, temperature=0,
                                         extra_headers={"X-Agentcache-Session": "s1"})
    agents = [first.model_extra["agentcache"]["agent"], second.model_extra["agentcache"]["agent"]]
    assert agents[0].startswith("agent-") and agents[1].startswith("agent-") and agents[0] != agents[1]
    assert first.usage.prompt_tokens > 0 and first.usage.completion_tokens == 40 and len(plan.strip()) >= 24
    assert first.choices[0].finish_reason == "length" and first.model == MODEL
    # the server's own records: one call per agent, in session s1, the writer reading the planner's
    # output as the planner's (its fingerprint), so chained reuse can find it
    calls = [r for r in server.runtime.results if r.session == "s1"]
    assert [r.agent for r in calls] == agents
    assert ("out:" + agents[0]) in [s.name for s in calls[1].segments]
    assert calls[1].event.framework == "openai-http" and calls[1].event.caller.startswith("OpenAI/Python")
    # the same system prompt again is the same agent; an explicit name wins
    again = sdk.chat.completions.create(model=MODEL, messages=planner, max_tokens=2, temperature=0,
                                        extra_body={"agentcache": {"agent": "planner", "session": "s1"}})
    assert again.model_extra["agentcache"]["agent"] == "planner"
    assert again.model_extra["agentcache"]["agent_from"] == "field"
    # the planner's prompt was cached by its first call: all of it but the last token's block
    block = server.runtime.engine.block_size
    assert again.usage.prompt_tokens_details.cached_tokens == (again.usage.prompt_tokens - 1) // block * block


def test_an_added_system_message_keeps_the_agent_and_another_first_one_is_another_agent(server):
    planner, writer = two_agents("s-retry")

    def agent_of(messages: list) -> str:
        reply = post(server, {"model": MODEL, "messages": messages, "max_tokens": 1, "temperature": 0,
                              "agentcache": {"session": "s-retry"}})
        assert reply.status_code == 200, reply.text
        return reply.json()["agentcache"]["agent"]

    first = agent_of(planner)
    # Pydantic AI's retry, or a framework's memory note: a second system message after the first
    retried = planner + [{"role": "system", "content": "Validation failed: answer in JSON. Fix the errors and try again."}]
    assert agent_of(retried) == first and first.startswith("agent-")
    assert agent_of(writer) != first


def test_without_a_system_prompt_the_tools_offered_tell_agents_apart(server):
    def agent_of(tools: list | None) -> str:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0}
        reply = post(server, body | ({"tools": tools} if tools else {}))
        assert reply.status_code == 200, reply.text
        return reply.json()["agentcache"]["agent"]

    tool = lambda name: {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}  # noqa: E731
    searcher, again, writer = agent_of([tool("search"), tool("open")]), agent_of([tool("open"), tool("search")]), \
        agent_of([tool("write")])
    assert searcher == again != writer and searcher.startswith("agent-")  # the order they are listed in is no matter
    assert agent_of(None) == "assistant"


def test_a_body_as_vllm_router_forwards_it_is_served_in_the_routers_session(server):
    # vllm-router re-serializes every body with vLLM's and SGLang's extensions at their defaults,
    # and keeps a session on one instance by X-Session-ID: the server takes that as the session
    planner, _ = two_agents("routed")
    routed = {"model": MODEL, "messages": planner, "max_tokens": 3, "temperature": 0, "stream": False,
              "logprobs": False, "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
              "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
              "return_hidden_states": False, "include_reasoning": True}
    reply = post(server, routed, headers={"X-Session-ID": "routed-1"})
    assert reply.status_code == 200, reply.text
    assert reply.json()["agentcache"]["session"] == "routed-1" and reply.json()["agentcache"]["instance"]
    header_wins = post(server, routed, headers={"X-Session-ID": "routed-1", "X-Agentcache-Session": "mine"})
    assert header_wins.json()["agentcache"]["session"] == "mine"
    for field, value in (("no_stop_trim", True), ("skip_special_tokens", False), ("continue_final_message", True)):
        refused = post(server, routed | {field: value})
        assert refused.status_code == 400 and field in refused.json()["error"]["param"]
    long = post(server, routed | {"ignore_eos": True, "max_tokens": 40})  # honoured, as vLLM's load tools use it
    assert long.json()["usage"]["completion_tokens"] == 40, long.text


def test_openai_sdk_async_concurrent_and_streaming_match_the_whole_reply(server):
    async def main():
        async with AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0) as sdk:
            planner, writer = two_agents("s2")
            whole = await asyncio.gather(*(sdk.chat.completions.create(
                model=MODEL, messages=m, max_tokens=10, temperature=0, extra_body={"agentcache": {"session": "s2"}})
                for m in (planner, writer)))
            stream = await sdk.chat.completions.create(model=MODEL, messages=planner, max_tokens=10, temperature=0,
                                                       stream=True, stream_options={"include_usage": True},
                                                       extra_body={"agentcache": {"session": "s2"}})
            chunks = [chunk async for chunk in stream]
            return whole, chunks

    whole, chunks = asyncio.run(main())
    assert len({r.model_extra["agentcache"]["agent"] for r in whole}) == 2
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole[0].choices[0].message.content  # greedy: the same reply, streamed
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10  # the usage chunk comes last
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)


def test_forced_tool_call_and_json_schema_reply(server):
    sdk = client(server)
    ask = [{"role": "user", "content": "Lock the front door now. Use the tool."}]
    reply = sdk.chat.completions.create(model=MODEL, messages=ask, tools=[ADD, LOCK], tool_choice="required",
                                        max_tokens=120, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name in ("add", "lock_door") and call.id.startswith("call_")
    # the call and its result go back in, as an agent loop sends them
    followed = sdk.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, tools=[ADD, LOCK], messages=[
        *ask, choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "5"}])
    result = server.runtime.results[-1]
    assert f"tool:{call.function.name}" in [s.name for s in result.segments] and followed.choices[0].message

    streamed = sdk.chat.completions.create(model=MODEL, messages=ask, tools=[LOCK], tool_choice="required",
                                           max_tokens=120, temperature=0, stream=True)
    deltas = [c.choices[0].delta for c in streamed if c.choices]
    calls = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert [c.function.name for c in calls] == ["lock_door"] and calls[0].index == 0 and calls[0].id
    assert set(json.loads(calls[0].function.arguments)) == {"door", "now"}

    schema = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
              "required": ["city", "days"], "additionalProperties": False}
    answer = sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Plan a trip."}], max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "trip", "schema": schema, "strict": True}})
    if answer.choices[0].finish_reason == "stop":
        assert set(json.loads(answer.choices[0].message.content)) == {"city", "days"}
    else:  # a random-weight model may write a long string: the prefix is still the schema's
        assert answer.choices[0].message.content.startswith('{"city":"')


# --- errors: each a 4xx with an OpenAI-style body naming the problem -----------------------------

GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

BAD_BODIES = [
    ("not json", b"{nope", 400, None, "not valid JSON"),
    ("not an object", b"[1, 2]", 400, None, "JSON object"),
    ("no messages", {"model": MODEL}, 400, "messages", "messages"),
    ("empty messages", {**GOOD, "messages": []}, 400, "messages", "messages"),
    ("n=2", {**GOOD, "n": 2}, 400, "n", "n"),
    ("logprobs", {**GOOD, "logprobs": True}, 400, "logprobs", "logprobs"),
    ("unknown field", {**GOOD, "best_of": 3}, 400, "best_of", "unknown or unsupported"),
    ("legacy functions", {**GOOD, "functions": []}, 400, "functions", "tools"),
    ("temperature too high", {**GOOD, "temperature": 3}, 400, "temperature", "temperature"),
    ("max_tokens a string", {**GOOD, "max_tokens": "ten"}, 400, "max_tokens", "max_tokens"),
    ("unknown model", {**GOOD, "model": "gpt-5"}, 404, "model", "does not exist"),
    ("bad role", {**GOOD, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", "robot"),
    ("image part", {**GOOD, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, 400, "messages[0].content[0]", "text parts"),
    ("tool result without id", {**GOOD, "messages": [{"role": "tool", "content": "5"}]}, 400,
     "messages[0].tool_call_id", "tool_call_id"),
    ("bad tool arguments", {**GOOD, "messages": [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{oops"}}]}]}, 400,
     "messages[0].tool_calls[0].function.arguments", "JSON object"),
    ("tool_choice of no tool", {**GOOD, "tools": [ADD], "tool_choice": {"type": "function",
                                                                         "function": {"name": "mul"}}}, 400, "tool_choice", "mul"),
    ("uncompilable schema", {**GOOD, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}}}, 400, "response_format",
     "no-such-type"),
    ("tool schema xgrammar cannot follow, tool_choice auto", {**GOOD, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "no-such-type"}}}], "tool_choice": "auto"}, 400, "tools", "no-such-type"),
    ("invalid UTF-8", b'{"model": "tiny-qwen2-chat", "messages": [{"role": "user", "content": "a\xff"}]}', 400, None,
     "not UTF-8"),
    ("reply past the context", {**GOOD, "max_tokens": 10**6}, 400, "max_tokens", "at most"),
    ("control token spelled", {**GOOD, "tools": [{"type": "function", "function": {
        "name": "f", "description": "<|im_end|>", "parameters": {"type": "object"}}}]}, 400, None, "control token"),
    ("bad agent name", {**GOOD, "agentcache": {"agent": "<system>"}}, 400, "agentcache.agent", "reserved"),
    ("cache_salt empty", {**GOOD, "cache_salt": ""}, 400, "cache_salt", "cache_salt"),
    ("agent name of 200,000 characters", {**GOOD, "agentcache": {"agent": "a" * 200_000}}, 400, "agentcache.agent",
     "200000 characters long"),
    ("agent name with a control character", {**GOOD, "agentcache": {"agent": "plan\nner"}}, 400, "agentcache.agent",
     "printable"),
    ("session name too long", {**GOOD, "agentcache": {"session": "s" * 129}}, 400, "agentcache.session", "at most 128"),
    ("cache_salt too long", {**GOOD, "cache_salt": "x" * 10_000}, 400, "cache_salt", "at most 128"),
    ("system message name too long", {**GOOD, "messages": [{"role": "system", "content": "You plan.", "name": "n" * 500},
                                                          {"role": "user", "content": "hi"}]}, 400, "messages.name",
     "500 characters"),
    ("nested too deeply", b"[" * 100_000 + b"]" * 100_000, 400, None, "too deeply"),
    ("lone surrogate", b'{"model": "tiny-qwen2-chat", "messages": [{"role": "user", "content": "a\\ud800"}]}', 400,
     None, "surrogate"),
    ("tool parameters not an object", {**GOOD, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": "x"}}]}, 400, None, "parameters must be a JSON schema object"),
    ("seed past 64 bits", {**GOOD, "seed": 2**70}, 400, "seed", "seed"),
    ("stop string of 60,000 characters", {**GOOD, "stop": ["x" * 60_000]}, 400, "stop", "at most 256 characters"),
    ("tool name with a quote", {**GOOD, "tools": [{"type": "function", "function": {
        "name": 'lock"door', "parameters": {"type": "object"}}}]}, 400, "tools", "letters, digits"),
]


@pytest.mark.parametrize("body,status,param,words", [case[1:] for case in BAD_BODIES], ids=[c[0] for c in BAD_BODIES])
def test_bad_requests_get_a_4xx_naming_the_problem_and_the_server_goes_on(server, body, status, param, words):
    response = post(server, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert words.lower() in error["message"].lower() and "Traceback" not in response.text
    if param is not None:
        assert error["param"] == param
    assert post(server, GOOD).status_code == 200


def test_bodies_over_the_limit_are_413_and_unknown_routes_are_openai_errors():
    with ServerThread(create_app(runtime(), ServeConfig(max_body_bytes=2000))) as small:
        big = {**GOOD, "messages": [{"role": "user", "content": "x" * 5000}]}
        response = post(small, big)
        assert response.status_code == 413 and "2000" in response.json()["error"]["message"]
        chunked = httpx.post(f"{small.url}/chat/completions", content=iter([json.dumps(big).encode()]),
                             headers={"content-type": "application/json"})  # no Content-Length: counted as read
        assert chunked.status_code == 413
        assert post(small, GOOD).status_code == 200
        missing = httpx.get(f"{small.url}/nothing-here")
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def test_a_base_model_refuses_tools_and_long_prompts_name_the_limit():
    with ServerThread(create_app(runtime("tiny-llama"), ServeConfig(max_prompt_tokens=64))) as base:
        response = post(base, {**GOOD, "model": "tiny-llama", "tools": [ADD]})
        assert response.status_code == 400 and "cannot call tools" in response.json()["error"]["message"]
        long = post(base, {**GOOD, "model": "tiny-llama", "messages": [{"role": "user", "content": DOCUMENT}]})
        assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
        assert "at most 64" in long.json()["error"]["message"]
        assert post(base, {**GOOD, "model": "tiny-llama"}).status_code == 200


# --- under load and faults ------------------------------------------------------------------------

def test_a_flood_past_the_limit_gets_429_with_retry_after_and_the_rest_are_served():
    rt = runtime()
    with ServerThread(create_app(rt, ServeConfig(max_in_flight=2))) as small:
        async def flood():
            async with httpx.AsyncClient(timeout=120) as http:
                body = {**GOOD, "max_tokens": 48, "temperature": 0}
                return await asyncio.gather(*(http.post(f"{small.url}/chat/completions", json=body)
                                              for _ in range(10)))

        responses = asyncio.run(flood())
        assert httpx.get(f"{small.url.removesuffix('/v1')}/health").json()["in_flight"] == 0  # every place given back
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429} and codes.count(200) >= 2 and codes.count(429) >= 1, codes
    refused = next(r for r in responses if r.status_code == 429)
    assert int(refused.headers["retry-after"]) >= 1 and refused.json()["error"]["code"] == "queue_full"
    assert rt.summary()["calls"] == codes.count(200)


def test_a_client_that_disconnects_mid_stream_cancels_its_engine_request():
    rt = runtime()
    with ServerThread(create_app(rt, ServeConfig())) as alone:
        body = {**GOOD, "max_tokens": 2000, "stream": True, "ignore_eos": True}  # no early end to race
        with httpx.stream("POST", f"{alone.url}/chat/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            received = [next(lines) for _ in range(4)]  # the role chunk and the first text
        assert any(line.startswith("data: ") for line in received)
        deadline = time.monotonic() + 30
        while rt.cancelled_calls == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rt.cancelled_calls == 1 and rt.summary()["calls"] == 0  # dropped, never recorded as served
        assert rt.engine.cache_stats().blocks_in_use == 0  # no block leaked
        metrics = httpx.get(f"{alone.url.removesuffix('/v1')}/metrics").text
        assert "agentcache_cancelled_calls_total 1.0" in metrics
        assert 'outcome="cancelled"} 1.0' in metrics and "agentcache_requests_in_flight 0.0" in metrics
        assert httpx.get(f"{alone.url.removesuffix('/v1')}/health").json()["in_flight"] == 0
        assert post(alone, GOOD).status_code == 200


def test_isolation_over_http_two_keys_and_cache_salt_only_splits():
    keys = ApiKeys({"key-of-acme-000": "acme", "key-of-globex-0": "globex", "key-of-scraper": "metrics"})
    rt = runtime()
    with ServerThread(create_app(rt, ServeConfig(api_keys=keys))) as guarded:
        def ask(key, **extra):
            sdk = OpenAI(base_url=guarded.url, api_key=key, max_retries=0)
            messages = [{"role": "system", "content": "You are the analyst."}, {"role": "user", "content": DOCUMENT}]
            return sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                               extra_body=extra or None)

        def all_blocks(reply) -> bool:  # the same prompt again: all of it but the last token's block hit
            block = rt.engine.block_size
            return reply.usage.prompt_tokens_details.cached_tokens == (reply.usage.prompt_tokens - 1) // block * block

        assert ask("key-of-acme-000").usage.prompt_tokens_details.cached_tokens == 0
        assert all_blocks(ask("key-of-acme-000"))  # its own blocks
        assert ask("key-of-globex-0").usage.prompt_tokens_details.cached_tokens == 0  # never acme's
        # a salt splits inside the caller's tenant and never joins another: globex naming "acme" gets nothing
        assert ask("key-of-globex-0", cache_salt="acme").usage.prompt_tokens_details.cached_tokens == 0
        assert ask("key-of-acme-000", cache_salt="x").usage.prompt_tokens_details.cached_tokens == 0
        assert all_blocks(ask("key-of-acme-000", cache_salt="x"))
        OpenAI(base_url=guarded.url, api_key="key-of-acme-000", max_retries=0).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": SECRET}], max_tokens=2)
        for bad in (None, "wrong-key-0000"):
            headers = {} if bad is None else {"authorization": f"Bearer {bad}"}
            refused = post(guarded, GOOD, headers=headers)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{guarded.url}/models").status_code == 401
        metrics_url = f"{guarded.url.removesuffix('/v1')}/metrics"  # every tenant's figures: the scraper's key only
        assert httpx.get(metrics_url).status_code == 401
        assert httpx.get(metrics_url, headers={"authorization": "Bearer key-of-acme-000"}).status_code == 403
        assert httpx.get(metrics_url, headers={"authorization": "Bearer key-of-scraper"}).status_code == 200
    tenants = [r.tenant for r in rt.results]
    assert tenants == ["acme", "acme", "globex", "globex#acme", "acme#x", "acme#x", "acme"]
    # what a tenant's calls saw stays in that tenant's sessions
    acme, globex, salted = (rt.shared_texts(None, t) for t in ("acme", "globex", "globex#acme"))
    assert SECRET in acme and SECRET not in globex and SECRET not in salted
    assert DOCUMENT.strip() in globex  # its own calls' texts are its own
    with pytest.raises(InputError, match="without '#'"):
        ApiKeys({"key-of-acme-000": "a#b"})
    with pytest.raises(InputError, match="api-keys"):
        check_bind("0.0.0.0", ServeConfig())
    check_bind("0.0.0.0", ServeConfig(api_keys=keys))


def test_names_in_headers_are_bounded_and_metrics_stay_small_under_long_names(server):
    refused = post(server, GOOD, headers={"x-agentcache-agent": "a" * 200_000})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "header x-agentcache-agent"
    refused = post(server, GOOD, headers={"x-session-id": "s\ts"})  # a tab inside: a control character
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "header x-session-id"
    assert post(server, GOOD, headers={"x-agentcache-agent": "Senior Research Analyst"}).status_code == 200
    scrape = httpx.get(f"{server.url.removesuffix('/v1')}/metrics").text
    assert "a" * 200 not in scrape and len(scrape) < 200_000


def test_metrics_labels_are_bounded_per_tenant():
    keys = ApiKeys({"key-of-acme-000": "acme", "key-of-globex-0": "globex", "key-of-scraper": "metrics"})
    with ServerThread(create_app(runtime(), ServeConfig(api_keys=keys, max_agents=2))) as guarded:
        def ask(key: str, agent: str, **extra) -> int:
            return post(guarded, {**GOOD, "agentcache": {"agent": agent}, **extra},
                        headers={"authorization": f"Bearer {key}"}).status_code

        for name in ("a1", "a2", "a3", "a4"):  # acme names more agents than its share
            assert ask("key-of-acme-000", name) == 200
        assert ask("key-of-acme-000", "a5", cache_salt="split") == 200  # a salted tenant counts as its tenant
        assert ask("key-of-globex-0", "g1") == 200  # globex still gets a label of its own
        text = httpx.get(f"{guarded.url.removesuffix('/v1')}/metrics",
                         headers={"authorization": "Bearer key-of-scraper"}).text
    for labelled in ("a1", "a2", "g1"):
        assert f'agentcache_ttft_seconds_count{{agent="{labelled}"}} 1.0' in text
    assert 'agentcache_ttft_seconds_count{agent="other"} 3.0' in text and "a3" not in text and "a5" not in text


def test_metrics_label_agents_with_a_bounded_set():
    rt = runtime()
    with ServerThread(create_app(rt, ServeConfig(max_agents=2))) as small:
        for name in ("planner", "writer", "critic", "editor"):
            assert post(small, {**GOOD, "agentcache": {"agent": name}}).status_code == 200
        assert post(small, {**GOOD, "n": 3}).status_code == 400
        text = httpx.get(f"{small.url.removesuffix('/v1')}/metrics").text
        health = httpx.get(f"{small.url.removesuffix('/v1')}/health").json()
    assert 'agentcache_ttft_seconds_count{agent="planner"} 1.0' in text
    assert 'agentcache_ttft_seconds_count{agent="writer"} 1.0' in text
    assert 'agentcache_ttft_seconds_count{agent="other"} 2.0' in text and "critic" not in text
    assert 'agentcache_requests_total{agent="other",outcome="ok"} 2.0' in text
    assert 'outcome="bad_request"' in text and "agentcache_hit_rate" in text and "agentcache_reuse_ratio" in text
    assert health == {"status": "ok", "model": MODEL, "in_flight": 0}


# --- the command: SIGTERM drains, anchors persist across a restart -------------------------------

def _start(port: int, anchors: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "agentcache.cli", "serve", "--model", "tiny-llama", "--port", str(port),
               "--anchors-dir", str(anchors), "--strategy", "kvcmas", "--log-level", "warning", "--drain-s", "60"]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def _wait_healthy(port: int, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stdout.read()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise AssertionError("the server did not become healthy")


def _samples(exposition: str) -> dict[str, float]:
    """The unlabelled samples of a /metrics page, by name."""
    return {sample.name: sample.value for family in text_string_to_metric_families(exposition)
            for sample in family.samples if not sample.labels}


def test_sigterm_drains_in_flight_requests_and_saves_the_anchor_pools(tmp_path):
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = _start(port, tmp_path)
    try:
        _wait_healthy(port, process)
        url = f"http://127.0.0.1:{port}/v1"
        sdk = OpenAI(base_url=url, api_key="unused", max_retries=0)
        for session in range(3):  # a chain per session: the writer reads the planner's output over the document
            planner, writer = two_agents(f"t{session}")
            plan = sdk.chat.completions.create(model="tiny-llama", messages=planner, max_tokens=8, temperature=0,
                                               extra_body={"agentcache": {"session": f"t{session}"}})
            writer.append({"role": "user", "name": "planner", "content": plan.choices[0].message.content or "-"})
            sdk.chat.completions.create(model="tiny-llama", messages=writer, max_tokens=8, temperature=0,
                                        extra_body={"agentcache": {"session": f"t{session}"}})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # shadow runs judge the writers' reads while the server is idle
            if _samples(httpx.get(f"http://127.0.0.1:{port}/metrics").text)["agentcache_shadow_runs_total"] > 0:
                break
            time.sleep(0.2)
        else:
            raise AssertionError("no shadow run counted within 60 s")
        streamed: list[tuple[float, str]] = []

        def long_stream() -> None:
            with httpx.stream("POST", f"{url}/chat/completions", timeout=120, json={
                    "model": "tiny-llama", "messages": [{"role": "user", "content": "go"}], "max_tokens": 1000,
                    "temperature": 0, "stream": True}) as response:
                for line in response.iter_lines():
                    streamed.append((time.monotonic(), line))

        reader = threading.Thread(target=long_stream)
        reader.start()
        while not streamed:
            time.sleep(0.01)
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)  # with the stream in flight
        reader.join(120)
        assert process.wait(120) == 0
    finally:
        if process.poll() is None:
            process.kill()
    events = [line for _, line in streamed if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"  # the in-flight stream finished, after the signal
    assert sum(at > signalled for at, line in streamed if line.startswith("data: {")) > 1
    finish = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-1] if json.loads(e[6:])["choices"]]
    assert finish[-1] in ("stop", "length")
    saved = sorted(tmp_path.rglob("*.safetensors"))
    assert saved and not [p for p in tmp_path.rglob("*") if "tmp" in p.name]  # written whole, no temporary left

    restarted = _start(port, tmp_path)
    try:
        _wait_healthy(port, restarted)
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        verified = next(line for line in metrics.splitlines() if line.startswith("agentcache_verified_edges "))
        assert float(verified.split()[1]) > 0  # the verdicts of the first server's shadow runs, loaded
        counted = {name: value for name, value in _samples(metrics).items()
                   if name in ("agentcache_shadow_runs_total", "agentcache_audits_total",
                               "agentcache_audit_disagreements_total")}
        assert counted == dict.fromkeys(counted, 0.0) and len(counted) == 3  # counted since this server started
        assert "agentcache_anchors_loaded" in metrics
    finally:
        restarted.send_signal(signal.SIGTERM)
        assert restarted.wait(60) == 0


@pytest.mark.vllm
def test_the_server_on_the_vllm_engine_serves_streams_and_cancels():
    from conftest import ENGINE_KINDS

    rt = Runtime(ENGINE_KINDS["vllm"](MODEL, pool_blocks=256), config=RuntimeConfig(self_check=False))
    with ServerThread(create_app(rt, ServeConfig())) as on_vllm:
        sdk = client(on_vllm)
        planner, writer = two_agents("v1")
        whole = sdk.chat.completions.create(model=MODEL, messages=planner, max_tokens=6, temperature=0)
        streamed = sdk.chat.completions.create(model=MODEL, messages=planner, max_tokens=6, temperature=0, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        assert text == whole.choices[0].message.content and whole.usage.completion_tokens == 6
        with httpx.stream("POST", f"{on_vllm.url}/chat/completions", timeout=60,
                          json={**GOOD, "max_tokens": 2000, "stream": True}) as response:
            lines = response.iter_lines()
            [next(lines) for _ in range(4)]
        deadline = time.monotonic() + 30
        while rt.cancelled_calls == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rt.cancelled_calls == 1 and rt.engine.cache_stats().blocks_in_use == 0
        assert post(on_vllm, GOOD).status_code == 200


def test_a_served_request_is_tokenized_once(server, monkeypatch):
    """The server measures the prompt with the call's tokens and hands them to the runtime, which
    does not tokenize the call again (whole and streamed replies alike)."""
    import agentcache.calls
    import agentcache.serve.prepare

    seen = []
    tokenize = agentcache.calls.tokenize_call

    def counted(engine, call):
        seen.append(call.agent)
        return tokenize(engine, call)

    monkeypatch.setattr(agentcache.calls, "tokenize_call", counted)
    monkeypatch.setattr(agentcache.serve.prepare, "tokenize_call", counted)
    planner, _ = two_agents("once")
    sdk = client(server)
    sdk.chat.completions.create(model=MODEL, messages=planner, max_tokens=2, temperature=0)
    assert len(seen) == 1
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=planner, max_tokens=2, temperature=0, stream=True))
    assert chunks and len(seen) == 2


def test_tokenize_passes_its_own_admission_and_a_chat_beside_a_burst_is_served(monkeypatch):
    import agentcache.serve.app as app_module

    real = app_module.prompt_token_ids

    def slow(*args):  # a long prompt's tokenizing, held long enough for the burst to overlap
        time.sleep(0.5)
        return real(*args)

    monkeypatch.setattr(app_module, "prompt_token_ids", slow)
    with ServerThread(create_app(runtime(), ServeConfig(max_tokenizing=1))) as small:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "tokenize me " * 200}]}

        async def burst():
            async with httpx.AsyncClient(timeout=60) as http:
                tokenizing = [http.post(f"{small.url.removesuffix('/v1')}/tokenize", json=body) for _ in range(6)]
                chat = http.post(f"{small.url}/chat/completions", json=GOOD)
                return await asyncio.gather(*tokenizing, chat)

        *tokenized, chat = asyncio.run(burst())
    codes = [r.status_code for r in tokenized]
    assert codes.count(200) >= 1 and codes.count(429) >= 1 and set(codes) <= {200, 429}, codes
    assert next(r for r in tokenized if r.status_code == 429).json()["error"]["code"] == "queue_full"
    assert chat.status_code == 200  # /tokenize's places are its own
    with pytest.raises(InputError, match="max_tokenizing"):
        ServeConfig(max_tokenizing=0)


def test_replies_still_running_at_the_drain_timeout_end_with_an_error_event_and_done_or_a_503():
    rt = runtime()
    guarded = ServerThread(create_app(rt, ServeConfig()), drain_s=0.6).__enter__()
    body = {**GOOD, "max_tokens": 2000, "ignore_eos": True}
    lines: list[str] = []
    whole: list[httpx.Response] = []
    first = threading.Event()

    def read() -> None:
        with httpx.stream("POST", f"{guarded.url}/chat/completions", json=body | {"stream": True},
                          timeout=60) as response:
            for line in response.iter_lines():
                lines.append(line)
                if line.startswith("data: ") and len(lines) > 2:
                    first.set()
        first.set()

    readers = [threading.Thread(target=read),
               threading.Thread(target=lambda: whole.append(httpx.post(f"{guarded.url}/chat/completions",
                                                                        json=body, timeout=60)))]
    for reader in readers:
        reader.start()
    assert first.wait(30)
    guarded.__exit__(None, None, None)  # as SIGTERM: drain, then stop
    for reader in readers:
        reader.join(30)
    events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["code"] == "server_shutting_down" and "drain" in error["message"]
    assert whole[0].status_code == 503 and whole[0].json()["error"]["code"] == "server_shutting_down"
    assert rt.cancelled_calls == 2 and rt.summary()["calls"] == 0  # both engine requests were dropped


def test_a_slow_schema_compiles_aside_and_an_unrelated_request_is_not_held(server):
    rng = random.Random(7)
    values = ["".join(rng.choices(string.ascii_letters + string.digits, k=14)) for _ in range(6000)]  # ~1 s to compile
    slow_body = {**GOOD, "response_format": {"type": "json_schema", "json_schema": {
        "name": "pick", "schema": {"type": "object", "properties": {"v": {"enum": values}}, "required": ["v"]}}}}
    slow: list[float] = []

    def send_slow() -> None:
        began = time.perf_counter()
        assert post(server, slow_body).status_code == 200
        slow.append(time.perf_counter() - began)

    sender = threading.Thread(target=send_slow)
    sender.start()
    time.sleep(0.2)  # the slow schema is compiling
    unrelated = []
    for _ in range(3):
        began = time.perf_counter()
        assert post(server, GOOD).status_code == 200
        unrelated.append(time.perf_counter() - began)
    sender.join(60)
    assert max(unrelated) < 0.5 * slow[0], (unrelated, slow)  # before: each waited for the compile
    huge = {**GOOD, "response_format": {"type": "json_schema", "json_schema": {
        "name": "pick", "schema": {"enum": [f"v{i:07d}" for i in range(14000)]}}}}
    refused = post(server, huge)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_format"
    assert "characters as JSON, over the" in refused.json()["error"]["message"]


def test_a_reply_that_is_not_text_is_a_clean_500_or_an_error_event_and_done(server, monkeypatch):
    import agentcache.serve.app as app_module

    # no path of ours makes such a reply now (grammars and the tool-call parser exclude lone
    # surrogates): the fault is injected where a reply's own figures are made
    monkeypatch.setattr(app_module._Reply, "_extension", lambda self, result, parsed: {"agent": "a \udde8 b"})
    whole = post(server, GOOD)
    assert whole.status_code == 500 and whole.json()["error"]["code"] == "reply_not_text"
    with httpx.stream("POST", f"{server.url}/chat/completions", json={**GOOD, "stream": True}, timeout=60) as response:
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "reply_not_text"
    monkeypatch.undo()
    assert post(server, GOOD).status_code == 200

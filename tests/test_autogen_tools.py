"""Tool calls, JSON output and structured output through the AutoGen client.

Fast tests run on tiny-qwen2-chat (random weights, a ChatML template with Qwen2.5's tool-call
format) and tiny-llama (no template, no tool-call format). A random model never decides to call a
tool, so the fast tests force calls (`tool_choice="required"`, a `Tool`, or the client's own
`tool_choice="required"` for AutoGen agents, which always ask with "auto"); constrained decoding
makes a forced call well formed. The tools take a boolean or an enum, so a forced call ends in a
few dozen tokens. The slow test runs the real Qwen2.5-Coder-0.5B-Instruct, whose calls are its own.
Tests are plain functions around `asyncio.run` (pytest-asyncio is not a dependency).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Literal

import PIL.Image
import pytest
from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.conditions import MaxMessageTermination
from autogen_agentchat.messages import (
    BaseChatMessage,
    ModelClientStreamingChunkEvent,
    TextMessage,
    ToolCallExecutionEvent,
    ToolCallRequestEvent,
    ToolCallSummaryMessage,
)
from autogen_agentchat.teams import SelectorGroupChat
from autogen_core import CancellationToken, FunctionCall, Image
from autogen_core.models import (
    AssistantMessage,
    CreateResult,
    FunctionExecutionResult,
    FunctionExecutionResultMessage,
    SystemMessage,
    UserMessage,
    validate_model_info,
)
from autogen_core.tools import FunctionTool
from pydantic import BaseModel

from agentcache.errors import InputError
from agentcache.runtime import Runtime, RuntimeConfig
from agentcache_autogen import AgentCacheChatCompletionClient, Caller, UnsupportedMessageError, UnsupportedRequestError
from tests.conftest import make_engine

CALL_TOKENS = 160  # a forced call of these tools is about 70 tokens (the byte tokenizer: one per character)


def runtime(preset: str = "tiny-qwen2-chat") -> Runtime:
    return Runtime(make_engine(preset, pool_blocks=256), config=RuntimeConfig(self_check=False))


def flip(on: bool) -> str:
    return f"the light is {'on' if on else 'off'}"


def pick(color: Literal["red", "blue"]) -> str:
    return f"picked {color}"


FLIP = FunctionTool(flip, description="Turn the light on or off.")
PICK = FunctionTool(pick, description="Pick a color.")
TOOLS = {"flip": FLIP, "pick": PICK}


class Light(BaseModel):
    on: bool
    room: Literal["kitchen", "hall"]


def msgs(query: str = "Turn on the kitchen light.") -> list:
    return [SystemMessage(content="You control a house."), UserMessage(content=query, source="user")]


def record(rt: Runtime) -> list:
    """Every (call, sampling, result) the runtime runs through `arun`."""
    seen, arun = [], rt.arun

    async def arecording(call, sampling, *args, **kwargs):
        result = await arun(call, sampling, *args, **kwargs)
        seen.append((call, sampling, result))
        return result

    rt.arun = arecording
    return seen


def check_calls(result: CreateResult, names=TOOLS) -> list[FunctionCall]:
    """The result is tool calls of `names`, each with arguments valid for its tool's schema."""
    assert result.finish_reason == "function_calls", result
    assert isinstance(result.content, list) and result.content
    for call in result.content:
        assert isinstance(call, FunctionCall) and call.name in names and call.id
        TOOLS[call.name].args_type().model_validate_json(call.arguments)  # raises when invalid for the schema
        assert isinstance(json.loads(call.arguments), dict)
    return result.content


# --- model info ----------------------------------------------------------------------------------

def test_model_info_says_what_each_model_can_do():
    chat = AgentCacheChatCompletionClient(runtime())
    base = AgentCacheChatCompletionClient(runtime("tiny-llama"))
    for client, calls in ((chat, True), (base, False)):
        info = client.model_info
        validate_model_info(info)
        assert info["function_calling"] is calls and client.capabilities["function_calling"] is calls
        assert info["json_output"] is True and info["structured_output"] is True and info["vision"] is False
    # AutoGen's agents read it: tools on a model that cannot call them are refused there
    AssistantAgent("calc", model_client=chat, tools=[FLIP])
    with pytest.raises(ValueError, match="does not support function calling"):
        AssistantAgent("calc", model_client=base, tools=[FLIP])


# --- forced tool calls ---------------------------------------------------------------------------

def test_required_tool_choice_returns_a_valid_call_of_a_given_tool():
    rt = runtime()
    seen = record(rt)
    client = AgentCacheChatCompletionClient(rt, agent="calc", max_tokens=CALL_TOKENS)

    async def scenario():
        forced = await client.create(msgs(), tools=[FLIP, PICK], tool_choice="required")
        free = await client.create(msgs(), tools=[FLIP, PICK], tool_choice="none")  # the control: no constraint
        return forced, free

    forced, free = asyncio.run(scenario())
    (call,) = check_calls(forced)
    assert call.name in ("flip", "pick")
    assert isinstance(free.content, str) and free.finish_reason in ("stop", "length")
    (_, forced_sampling, forced_result), (_, free_sampling, _) = seen
    assert forced_sampling.constraint is not None and forced_sampling.constraint.kind == "structural_tag"
    assert free_sampling.constraint is None
    assert forced_result.text.startswith("<tool_call>")  # the model's own format, parsed into the call
    assert client.invalid_tool_calls == []
    # the tool runs on the arguments as given
    output = asyncio.run(TOOLS[call.name].run_json(json.loads(call.arguments), CancellationToken()))
    assert output.startswith(("the light is", "picked"))


def test_a_tool_as_tool_choice_forces_that_tool():
    client = AgentCacheChatCompletionClient(runtime(), agent="calc", max_tokens=CALL_TOKENS)

    async def scenario():
        return [await client.create(msgs(), tools=[FLIP, PICK], tool_choice=tool) for tool in (FLIP, PICK)]

    by_flip, by_pick = asyncio.run(scenario())
    assert [c.name for c in check_calls(by_flip)] == ["flip"]
    assert [c.name for c in check_calls(by_pick)] == ["pick"]
    assert json.loads(by_pick.content[0].arguments)["color"] in ("red", "blue")


def test_a_forced_call_streams_no_call_text():
    client = AgentCacheChatCompletionClient(runtime(), agent="calc", max_tokens=CALL_TOKENS)

    async def stream(**kwargs):
        return [item async for item in client.create_stream(msgs(), tools=[FLIP], **kwargs)]

    *chunks, final = asyncio.run(stream(tool_choice="required"))
    check_calls(final, ["flip"])
    assert "<tool_call>" not in "".join(chunks) and '"name"' not in "".join(chunks)
    # no tools asked for: the text streams as before, chunks and result alike
    *chunks, final = asyncio.run(stream(tool_choice="none"))
    assert isinstance(final.content, str) and "".join(chunks) == final.content


def test_json_output_and_a_forced_call_together_are_refused():
    client = AgentCacheChatCompletionClient(runtime(), max_tokens=8)
    for choice in ("required", FLIP):
        with pytest.raises(UnsupportedRequestError, match="json_output and tool_choice=.*cannot both hold"):
            asyncio.run(client.create(msgs(), tools=[FLIP], tool_choice=choice, json_output=Light))
    with pytest.raises(UnsupportedRequestError, match="json_output must be a bool or a pydantic"):
        asyncio.run(client.create(msgs(), json_output=dict))
    with pytest.raises(UnsupportedRequestError, match="not among the tools"):
        asyncio.run(client.create(msgs(), tools=[FLIP], tool_choice=PICK))
    with pytest.raises(UnsupportedRequestError, match="needs at least one tool"):
        asyncio.run(client.create(msgs(), tool_choice="required"))
    assert client.results == []


# --- JSON and structured output --------------------------------------------------------------------

def test_json_output_is_a_json_object():
    """A random model writes an endless key unless sampling closes it early: each seed's output is
    a prefix of a JSON object, and those that ended are whole objects."""
    client = AgentCacheChatCompletionClient(runtime(), max_tokens=64)
    seeds = range(10)

    async def scenario(json_output):
        return [await client.create(msgs("Answer in JSON."), json_output=json_output,
                                    extra_create_args={"temperature": 10.0, "seed": seed}) for seed in seeds]

    constrained = asyncio.run(scenario(True))
    control = asyncio.run(scenario(None))
    assert all(r.content.startswith("{") for r in constrained)
    ended = [r for r in constrained if r.finish_reason == "stop"]
    assert len(ended) >= 2
    assert all(isinstance(json.loads(r.content), dict) for r in ended)
    assert all(isinstance(r.content, str) for r in control)  # produced; a random model's text parses rarely


def test_json_output_with_a_pydantic_model_follows_its_schema():
    rt = runtime()
    seen = record(rt)
    client = AgentCacheChatCompletionClient(rt, max_tokens=64)

    async def scenario():
        return (await client.create(msgs(), json_output=Light),
                await client.create(msgs(), tools=[FLIP], json_output=Light),  # JSON asked: no call is parsed
                await client.create(msgs()))

    structured, with_tools, control = asyncio.run(scenario())
    for result in (structured, with_tools):
        assert result.finish_reason == "stop"
        Light.model_validate_json(result.content)
    assert isinstance(control.content, str)
    assert [s.constraint.kind if s.constraint else None for _, s, _ in seen] == ["json_schema", "json_schema", None]
    assert json.loads(seen[0][1].constraint.spec) == Light.model_json_schema()


# --- AutoGen agents and teams ---------------------------------------------------------------------

def test_an_assistant_agent_completes_a_forced_tool_round_trip():
    rt = runtime()
    seen = record(rt)
    client = AgentCacheChatCompletionClient(rt, max_tokens=CALL_TOKENS, tool_choice="required")
    calc = AssistantAgent("calc", model_client=client, tools=[FLIP], reflect_on_tool_use=True,
                          system_message="You control the lights.")
    result = asyncio.run(calc.run(task="Turn on the light."))

    kinds = [type(m) for m in result.messages]
    assert kinds == [TextMessage, ToolCallRequestEvent, ToolCallExecutionEvent, TextMessage]
    (request,) = result.messages[1].content
    assert request.name == "flip" and isinstance(json.loads(request.arguments)["on"], bool)
    (executed,) = result.messages[2].content
    assert executed.call_id == request.id and not executed.is_error
    assert executed.content == flip(json.loads(request.arguments)["on"])
    assert result.messages[3].source == "calc"

    (first, first_sampling, _), (reflection, reflection_sampling, reflected) = seen
    assert first.agent == reflection.agent == "calc"
    # the client's tool_choice stood in for AutoGen's "auto": the same forced-call grammar as tool_choice="required"
    assert first_sampling.constraint is not None and first_sampling.constraint.kind == "structural_tag"
    assert reflection_sampling.constraint is None  # the reflection asks for "none" and no tools: free text
    # the reflection reads the call in the model's own format and the result as a tool turn
    slots = {s.slot: s.text for s in reflection.segments if s.kind == "ph"}
    assert '<tool_call>' in slots["out:calc"] and '"name": "flip"' in slots["out:calc"]
    assert slots["tool:flip"] == executed.content
    assert result.messages[3].content == reflected.text


def test_a_streaming_agent_streams_no_call_text():
    client = AgentCacheChatCompletionClient(runtime(), max_tokens=CALL_TOKENS, tool_choice="required")
    calc = AssistantAgent("calc", model_client=client, tools=[FLIP], model_client_stream=True)

    async def scenario():
        return [item async for item in calc.run_stream(task="Turn on the light.")]

    items = asyncio.run(scenario())
    chunks = [i.content for i in items if isinstance(i, ModelClientStreamingChunkEvent)]
    assert "<tool_call>" not in "".join(chunks)
    summary = items[-1].messages[-1]
    assert isinstance(summary, ToolCallSummaryMessage) and summary.content.startswith("the light is")


def test_a_selector_team_with_a_tool_using_member_runs_to_completion():
    rt = runtime()
    client = AgentCacheChatCompletionClient(rt, max_tokens=24)
    planner = AssistantAgent("planner", model_client=client, system_message="You plan.", description="Plans.")
    forcing = AgentCacheChatCompletionClient(rt, agent="calc", max_tokens=CALL_TOKENS, tool_choice="required")
    calc = AssistantAgent("calc", model_client=forcing, tools=[FLIP, PICK],
                          system_message="You control the house.", description="Uses the tools.")
    order = {1: "calc", 2: "planner", 3: "calc"}

    def scripted(thread) -> str | None:
        return order.get(sum(isinstance(m, BaseChatMessage) for m in thread))

    team = SelectorGroupChat([planner, calc], model_client=client, selector_func=scripted, max_turns=3,
                             termination_condition=MaxMessageTermination(10))
    result = asyncio.run(team.run(task="Turn on the light, then plan the day."))
    chat = [m for m in result.messages if isinstance(m, BaseChatMessage)]
    assert [m.source for m in chat] == ["user", "calc", "planner", "calc"]
    summaries = [m for m in chat if isinstance(m, ToolCallSummaryMessage)]
    assert len(summaries) == 2 and all(s.content.startswith(("the light is", "picked")) for s in summaries)
    assert "max" in result.stop_reason.lower() or "turn" in result.stop_reason.lower()
    # calc's second call reads its own first call and its result, shared with the team's session
    second = [r for r in rt.results if r.agent == "calc"][-1]
    names = [s.name for s in second.segments if s.name != "pf"]
    assert "out:calc" in names and any(n.startswith("tool:") for n in names)


# --- messages with calls and results ---------------------------------------------------------------

def test_calls_and_results_are_laid_out_in_the_models_format():
    messages = [*msgs(),
                AssistantMessage(content=[FunctionCall(id="c1", name="flip", arguments='{"on": true}')],
                                 thought="Turning it on.", source="calc"),
                FunctionExecutionResultMessage(content=[
                    FunctionExecutionResult(content="the light is on", name="flip", call_id="c1")])]
    caller = Caller("calc", None, None, False)
    chat = AgentCacheChatCompletionClient(runtime()).to_call(messages, [FLIP], caller=caller)
    slots = {s.slot: s.text for s in chat.segments if s.kind == "ph"}
    assert slots["out:calc"].startswith("Turning it on.") and "<tool_call>" in slots["out:calc"]
    assert '{"name": "flip", "arguments": {"on": true}}' in slots["out:calc"]
    assert slots["tool:flip"] == "the light is on"
    base = AgentCacheChatCompletionClient(runtime("tiny-llama")).to_call(messages, [FLIP], caller=caller)
    slots = {s.slot: s.text for s in base.segments if s.kind == "ph"}
    assert slots["out:calc"] == 'Turning it on.\n{"name": "flip", "arguments": {"on": true}}'


def test_output_that_is_no_valid_call_stays_text_and_is_recorded():
    rt = runtime()
    arun, texts = rt.arun, []

    async def scripted(call, sampling, *args, **kwargs):  # the engine runs; the output is replaced
        return dataclasses.replace(await arun(call, sampling, *args, **kwargs), text=texts.pop(0))

    rt.arun = scripted
    client = AgentCacheChatCompletionClient(rt, max_tokens=4)
    texts[:] = ['<tool_call>\n{"name": "flip", "arguments": {on}}\n</tool_call>',  # not JSON
                '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>',  # not a tool of the request
                'Sure.\n<tool_call>\n{"name": "flip", "arguments": {"on": false}}\n</tool_call>']

    async def scenario():
        return [await client.create(msgs(), tools=[FLIP]) for _ in range(3)]

    bad_json, unknown, good = asyncio.run(scenario())
    for result, text in ((bad_json, "{on}"), (unknown, "launch")):
        assert result.finish_reason != "function_calls" and isinstance(result.content, str) and text in result.content
    assert [c.name for c in check_calls(good, ["flip"])] == ["flip"] and good.thought == "Sure."
    invalid = client.invalid_tool_calls
    assert len(invalid) == 2 and "not JSON" in invalid[0].error and "launch" in invalid[1].error


# --- refused input, and the client afterwards -------------------------------------------------------

def test_a_tool_result_that_is_not_text_is_refused_and_the_client_stays_usable():
    client = AgentCacheChatCompletionClient(runtime(), agent="calc", max_tokens=4)
    image = Image.from_pil(PIL.Image.new("RGB", (4, 4)))
    call = AssistantMessage(content=[FunctionCall(id="c1", name="flip", arguments='{"on": true}')], source="calc")
    not_text = FunctionExecutionResult.model_construct(content=[image], name="flip", call_id="c1")
    bad_arguments = AssistantMessage(content=[FunctionCall(id="c1", name="flip", arguments="{on")], source="calc")

    async def scenario():
        with pytest.raises(UnsupportedMessageError,
                           match="message 3: the result of the tool 'flip' is a list, not text"):
            await client.create([*msgs(), call, FunctionExecutionResultMessage(content=[not_text])], tools=[FLIP])
        with pytest.raises(UnsupportedMessageError,
                           match="message 2: the arguments of the tool call 'flip' are not JSON"):
            await client.create([*msgs(), bad_arguments], tools=[FLIP])
        return await client.create(msgs(), tools=[FLIP])

    result = asyncio.run(scenario())
    assert isinstance(result.content, str) and len(client.results) == 1


def test_a_schema_the_decoder_cannot_compile_is_refused_and_the_client_stays_usable():
    client = AgentCacheChatCompletionClient(runtime(), agent="calc", max_tokens=CALL_TOKENS)
    nonsense = {"name": "broken", "description": "A tool with no real schema.", "parameters": {"type": "nonsense"}}

    async def scenario():
        with pytest.raises((InputError, UnsupportedRequestError), match="nonsense"):
            await client.create(msgs(), tools=[nonsense], tool_choice="required")
        return await client.create(msgs(), tools=[FLIP], tool_choice="required")

    check_calls(asyncio.run(scenario()), ["flip"])


def test_a_model_without_a_tool_format_refuses_forced_calls():
    rt = runtime("tiny-llama")
    client = AgentCacheChatCompletionClient(rt, max_tokens=4)
    for choice in ("required", FLIP):
        with pytest.raises(UnsupportedRequestError, match="cannot call tools.*'qwen2.5-coder-0.5b'"):
            asyncio.run(client.create(msgs(), tools=[FLIP], tool_choice=choice))
    with pytest.raises(InputError, match="'qwen2.5-coder-0.5b'"):
        AgentCacheChatCompletionClient(rt, tool_choice="required")
    assert rt.results == []
    # "auto" keeps what it did: the schemas are text in the prompt, the output is text
    result = asyncio.run(client.create(msgs(), tools=[FLIP]))
    assert isinstance(result.content, str) and '"name": "flip"' in client.to_call(msgs(), [FLIP]).segments[0].text
    # JSON needs no template
    light = asyncio.run(client.create(msgs(), json_output=Light, extra_create_args={"max_tokens": 64}))
    Light.model_validate_json(light.content)


def test_a_forcing_client_comes_back_from_its_config_still_forcing():
    client = AgentCacheChatCompletionClient(runtime(), tool_choice="required")
    loaded = AgentCacheChatCompletionClient.load_component(client.dump_component())
    assert loaded.tool_choice == "required" and loaded.runtime is client.runtime
    assert client.for_agent("calc").tool_choice == "required"
    assert client.for_agent("calc", tool_choice="auto").tool_choice == "auto"


# --- the real model ---------------------------------------------------------------------------------

def add(a: int, b: int) -> int:
    return a + b


@pytest.mark.slow
def test_qwen_calls_the_add_tool_and_answers_with_its_result(qwen_engine):
    rt = Runtime(qwen_engine.with_config(qwen_engine.config), config=RuntimeConfig(self_check=False))
    seen = record(rt)
    client = AgentCacheChatCompletionClient(rt, max_tokens=48)
    calc = AssistantAgent("calc", model_client=client, tools=[FunctionTool(add, description="Add two integers.")],
                          reflect_on_tool_use=True, system_message="You are a helpful assistant.")
    result = asyncio.run(calc.run(task="What is 17 + 25? Use the add tool."))
    kinds = [type(m) for m in result.messages]
    assert kinds == [TextMessage, ToolCallRequestEvent, ToolCallExecutionEvent, TextMessage], result.messages
    (request,) = result.messages[1].content
    assert request.name == "add" and json.loads(request.arguments) == {"a": 17, "b": 25}
    assert seen[0][1].constraint is None  # the call was the model's own choice ("auto"), not forced
    assert "42" in result.messages[-1].content

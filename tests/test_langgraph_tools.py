"""Tool calling, structured output and JSON mode through the LangGraph adapter: `bind_tools` and
`tool_choice`, `tool_calls` parsed from the reply (and `invalid_tool_calls`, never an error),
streamed `tool_call_chunks`, tool histories laid out by the model's own chat template,
`with_structured_output` in its three methods, `response_format`, and graphs that run the loop.

The fast tests run on tiny-qwen2-chat (random weights, a ChatML template with Qwen2.5's tool-call
format): forced calls (constrained decoding) are the only calls a random model makes, and
boolean/enum arguments let it finish. The slow ones run the real Qwen2.5-Coder-0.5B-Instruct."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import warnings
from typing import Literal

import pytest
from langchain_core.exceptions import OutputParserException
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from pydantic import BaseModel
from typing_extensions import TypedDict

from agentcache.engine.grammar import OutputConstraint
from agentcache.errors import InputError
from agentcache.runtime import Runtime, RuntimeConfig
from agentcache_langgraph import AgentCacheChatModel, UnsupportedFeatureError, UnsupportedMessageError
from agentcache_langgraph import chat_model as chat_model_module
from agentcache_langgraph.messages import to_call
from tests.conftest import make_engine

MAX_TOKENS = 96  # a forced call of the tools below takes about 40 tokens of the byte tokenizer


def tiny_runtime(preset: str = "tiny-qwen2-chat") -> Runtime:
    return Runtime(make_engine(preset, pool_blocks=512), config=RuntimeConfig(self_check=False))


def tiny_model(preset: str = "tiny-qwen2-chat", **fields) -> AgentCacheChatModel:
    return AgentCacheChatModel(runtime=tiny_runtime(preset), **{"max_tokens": MAX_TOKENS, **fields})


@tool
def set_light(on: bool, room: Literal["kitchen", "hall"]) -> str:
    """Turn the light of a room on or off."""
    return f"the {room} light is {'on' if on else 'off'}"


@tool
def lock_door(locked: bool) -> str:
    """Lock or unlock the front door."""
    return "locked" if locked else "unlocked"


TOOLS = {t.name: t for t in (set_light, lock_door)}
ASK = [SystemMessage("You run the house."), HumanMessage("Turn on the kitchen light, please.")]


class Verdict(BaseModel):
    """A yes/no verdict with its confidence."""

    approve: bool
    confidence: Literal["low", "high"]


class VerdictDict(TypedDict):
    approve: bool
    confidence: Literal["low", "high"]


def check_calls(message: AIMessage) -> None:
    """At least one call, each to a bound tool with arguments its schema accepts."""
    assert message.tool_calls and not message.invalid_tool_calls, message
    for call in message.tool_calls:
        assert call["name"] in TOOLS and call["type"] == "tool_call" and call["id"]
        TOOLS[call["name"]].args_schema.model_validate(call["args"])  # raises when the args do not fit
        assert set(call["args"]) == set(TOOLS[call["name"]].args_schema.model_fields)


def calls_of(message: AIMessage) -> list[tuple[str, dict]]:
    """The calls without their ids (a fresh id per parse)."""
    return [(c["name"], c["args"]) for c in message.tool_calls]


def merge(chunks: list[AIMessageChunk]) -> AIMessageChunk:
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    return merged


# --- bind_tools and tool_choice ------------------------------------------------------------

@pytest.mark.parametrize("choice", ["any", "required", {"type": "function", "function": {"name": "lock_door"}}])
def test_a_forced_call_is_a_bound_tool_with_valid_arguments(choice):
    model = tiny_model()
    bound = model.bind_tools([set_light, lock_door], tool_choice=choice)
    reply = bound.invoke(ASK)
    check_calls(reply)
    assert model.runtime.results[-1].finish_reason == "eos"  # the grammar ended the call, not max_tokens
    if isinstance(choice, dict):
        assert [c["name"] for c in reply.tool_calls] == ["lock_door"]
    prepared = model._prepare(ASK, None, dict(bound.kwargs))
    assert prepared.sampling.constraint.kind == "structural_tag"
    assert prepared.tool_names == ("set_light", "lock_door")
    # the tools are rendered in the system turn by the template
    system = model.runtime.engine.detokenize(list(prepared.call.segments[0].token_ids))
    assert "<tools>" in system and '"name": "set_light"' in system and "You run the house." in system


@pytest.mark.parametrize("name", ["set_light", "lock_door"])
def test_a_named_tool_choice_forces_that_tool(name):
    reply = tiny_model().bind_tools([set_light, lock_door], tool_choice=name).invoke(ASK)
    check_calls(reply)
    assert [c["name"] for c in reply.tool_calls] == [name]


def test_tool_choice_true_and_its_errors():
    model = tiny_model()
    assert [c["name"] for c in model.bind_tools([lock_door], tool_choice=True).invoke(ASK).tool_calls] == ["lock_door"]
    with pytest.raises(InputError, match="single tool"):
        model.bind_tools([set_light, lock_door], tool_choice=True)
    with pytest.raises(InputError, match="'open_window', which is not among the tools"):
        model.bind_tools([set_light, lock_door], tool_choice="open_window")
    twice = model.bind_tools([lock_door, convert_to_openai_tool(lock_door)])  # LangChain binds first, we check later
    with pytest.raises(InputError, match="tool names must be unique"):
        twice.invoke(ASK)
    with pytest.raises(InputError, match="no tools are bound"):
        model.invoke(ASK, tool_choice="any")
    with pytest.raises(InputError, match="cannot be both"):
        model.bind_tools([lock_door], tool_choice="any").invoke(ASK, response_format={"type": "json_object"})


def test_auto_and_none_leave_the_reply_free():
    model = tiny_model(max_tokens=8)
    for choice in (None, "auto", "none"):
        prepared = model._prepare(ASK, None, dict(model.bind_tools([set_light], tool_choice=choice).kwargs))
        assert prepared.sampling.constraint is None
        assert (prepared.tool_format is None) == (choice == "none")  # "none": the reply is not parsed
    reply = model.bind_tools([set_light]).invoke(ASK)
    parsed = model.runtime.chat.tool_format.parse(model.runtime.results[-1].text)
    assert isinstance(reply, AIMessage) and reply.content == parsed.content


# --- streaming -----------------------------------------------------------------------------

def test_streamed_chunks_merge_to_the_invoked_calls():
    def bound():  # a fresh runtime each: the same first call, so the same reply
        return tiny_model().bind_tools([set_light, lock_door], tool_choice="any")

    whole = bound().invoke(ASK)
    check_calls(whole)
    chunks = list(bound().stream(ASK))
    merged = merge(chunks)
    assert calls_of(merged) == calls_of(whole) and merged.content == whole.content
    assert merged.tool_call_chunks and chunks[-1].chunk_position == "last"
    assert merged.usage_metadata == whole.usage_metadata

    async def collect():
        return [c async for c in bound().astream(ASK)]

    amerged = merge(asyncio.run(collect()))
    assert calls_of(amerged) == calls_of(whole) and amerged.content == whole.content


# A reply as a model may write it: text, a good call, a cut-off call and a call to no bound tool.
CRAFTED = ('  Let me see.\n'
           '<tool_call>\n{"name": "set_light", "arguments": {"on": true, "room": "hall"}}\n</tool_call>\n'
           '<tool_call>\n{"name": "lock_door", "arguments": {"locked": tru\n</tool_call>\n'
           '<tool_call>\n{"name": "open_window", "arguments": {"wide": true}}\n</tool_call>\n'
           '<tool_call>\nnot a call at all\n</tool_call>\n Done.')


def crafted_reply(model: AgentCacheChatModel, text: str):
    """A real call's record with `text` as its reply, and the call prepared with both tools bound."""
    kwargs = dict(model.bind_tools([set_light, lock_door]).kwargs)
    model.invoke(ASK, **kwargs)
    return dataclasses.replace(model.runtime.results[-1], text=text), model._prepare(ASK, None, kwargs), kwargs


def test_bad_calls_become_invalid_tool_calls_not_errors():
    model = tiny_model(max_tokens=4)
    result, prepared, _ = crafted_reply(model, CRAFTED)
    message = model._chat_result(result, prepared).generations[0].message
    assert message.content == "Let me see.\n\n\n\n\n Done."
    assert calls_of(message) == [("set_light", {"on": True, "room": "hall"})]
    invalid = {(c["name"], c["args"]): c["error"] for c in message.invalid_tool_calls}
    assert set(invalid) == {(None, '{"name": "lock_door", "arguments": {"locked": tru'),
                            ("open_window", '{"wide": true}'), (None, "not a call at all")}
    assert "not JSON" in invalid[(None, '{"name": "lock_door", "arguments": {"locked": tru')]
    assert "no tool named 'open_window'" in invalid[("open_window", '{"wide": true}')]
    assert all(c["id"] and c["type"] == "invalid_tool_call" for c in message.invalid_tool_calls)


def test_a_streamed_reply_sends_text_up_to_the_first_call(monkeypatch):
    model = tiny_model(max_tokens=4)
    result, _, kwargs = crafted_reply(model, CRAFTED)
    pieces = [CRAFTED[i:i + 5] for i in range(0, len(CRAFTED), 5)]  # "<tool_call>" split across pieces
    monkeypatch.setattr(chat_model_module, "stream_call", lambda *args: iter([*pieces, result]))
    chunks = list(model.stream(ASK, **kwargs))
    texts = [c.content for c in chunks[:-1]]
    assert "".join(texts) == "Let me see."  # leading blanks dropped, nothing of a call leaks out
    merged = merge(chunks)
    whole = model._chat_result(result, model._prepare(ASK, None, kwargs)).generations[0].message
    assert merged.content == whole.content and calls_of(merged) == calls_of(whole)
    # Invalid calls stay invalid after LangChain's merge (which cannot carry their error text).
    assert sorted(str(c["name"]) for c in merged.invalid_tool_calls) == ["None", "None", "open_window"]
    for streamed, invoked in zip(merged.invalid_tool_calls, whole.invalid_tool_calls):
        assert invoked["args"] in streamed["args"]


def test_a_reply_without_calls_streams_all_its_text(monkeypatch):
    model = tiny_model(max_tokens=4)
    text = "  The light <b>is</b> on <tool_ now. "
    result, _, kwargs = crafted_reply(model, text)
    monkeypatch.setattr(chat_model_module, "stream_call", lambda *args: iter([*text, result]))
    chunks = list(model.stream(ASK, **kwargs))
    assert merge(chunks).content == text.strip() and not merge(chunks).tool_calls
    assert "".join(c.content for c in chunks[:-1]).startswith("The light <b>is</b> on")


# --- message histories ---------------------------------------------------------------------

HISTORY = [
    SystemMessage("You run the house."),
    HumanMessage("Is the door locked? Lock it if not."),
    AIMessage("Checking.", tool_calls=[{"name": "lock_door", "args": {"locked": True}, "id": "call-1"}]),
    ToolMessage("locked", tool_call_id="call-1"),  # no name: the call it answers names the tool
]


def test_a_tool_history_is_laid_out_as_the_template_renders_it():
    model = tiny_model(max_tokens=8)
    tools = [convert_to_openai_tool(t) for t in (set_light, lock_door)]
    call = to_call(HISTORY, "assistant", None, model.runtime.chat, tools=tools)
    assert [s.slot for s in call.segments if s.kind == "ph"] == ["query", "out:assistant", "tool:lock_door"]
    engine = model.runtime.engine
    ids = [i for s in call.segments for i in (s.token_ids if s.token_ids is not None else engine.tokenize(s.text))]
    rendered = engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": "You run the house."},
         {"role": "user", "content": "Is the door locked? Lock it if not."},
         {"role": "assistant", "content": "Checking.", "tool_calls": [
             {"type": "function", "function": {"name": "lock_door", "arguments": {"locked": True}}}]},
         {"role": "tool", "content": "locked"}],
        tools=tools, add_generation_prompt=True, tokenize=False)
    assert engine.tokenizer.decode(ids) == rendered
    reply = model.bind_tools([set_light, lock_door]).invoke(HISTORY)
    assert isinstance(reply, AIMessage)
    assert [s.name for s in model.runtime.results[-1].segments if s.kind == "ph"] == [
        "query", "out:assistant", "tool:lock_door"]


def test_tool_messages_are_named_by_their_tool_or_call():
    history = [
        HumanMessage("q"),
        AIMessage([{"type": "text", "text": "Two calls."},  # Anthropic-style parts repeat the calls: skipped
                   {"type": "tool_use", "id": "a", "name": "set_light", "input": {"on": True, "room": "hall"}}],
                  tool_calls=[{"name": "set_light", "args": {"on": True, "room": "hall"}, "id": "a"},
                              {"name": "lock_door", "args": {"locked": False}, "id": "b"}]),
        ToolMessage("hall on", tool_call_id="a"),
        ToolMessage("unlocked", name="door_tool", tool_call_id="b"),
        ToolMessage([{"type": "text", "text": "orphan"}], tool_call_id="zzz"),
    ]
    for preset in ("tiny-qwen2-chat", "tiny-llama"):  # the template's layout, and the plain transcript
        chat = tiny_runtime(preset).chat
        call = to_call(history, "assistant", None, chat)
        slots = [(s.slot, s.text) for s in call.segments if s.kind == "ph"]
        assert [slot for slot, _ in slots] == [
            "query", "out:assistant", "tool:set_light", "tool:door_tool", "tool:tool"]
        own = slots[1][1]
        assert own.startswith("Two calls.") and '"lock_door"' in own and '"set_light"' in own
    with pytest.raises(UnsupportedMessageError, match=r"message 1 \(ToolMessage\).*'image'.*tool result as text"):
        to_call([HumanMessage("q"), ToolMessage([{"type": "image", "url": "https://x/y.png"}], tool_call_id="1")],
                "assistant", None)


def test_a_base_model_reads_tool_histories_but_refuses_tools():
    model = tiny_model("tiny-llama", max_tokens=4)
    assert isinstance(model.invoke(HISTORY), AIMessage)  # the calls and results as plain transcript text
    assert [s.name for s in model.runtime.results[-1].segments if s.kind == "ph"] == [
        "query", "out:assistant", "tool:lock_door"]
    with pytest.raises(UnsupportedFeatureError, match="'tiny-llama' cannot call tools.*'qwen2.5-coder-0.5b'"):
        model.bind_tools([set_light])
    with pytest.raises(UnsupportedFeatureError, match="cannot call tools"):
        model.with_structured_output(Verdict, method="function_calling")


# --- structured output and JSON mode -------------------------------------------------------

def test_structured_output_json_schema_gives_an_instance_on_any_model():
    for preset in ("tiny-qwen2-chat", "tiny-llama"):  # constrained decoding needs no tool-call format
        model = tiny_model(preset)
        verdict = model.with_structured_output(Verdict).invoke("Should we approve the plan?")
        assert isinstance(verdict, Verdict)
        assert model.runtime.results[-1].finish_reason == "eos"
        raw = json.loads(model.runtime.results[-1].text)
        assert Verdict.model_validate(raw) == verdict
    typed = model.with_structured_output(VerdictDict).invoke("Should we approve the plan?")
    assert isinstance(typed, dict) and set(typed) == {"approve", "confidence"}
    assert typed["confidence"] in ("low", "high")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}  # untitled
    assert set(model.with_structured_output(schema).invoke("ok?")) == {"ok"}


def test_structured_output_include_raw():
    model = tiny_model()
    out = model.with_structured_output(Verdict, include_raw=True).invoke("Approve?")
    assert set(out) == {"raw", "parsed", "parsing_error"}
    assert isinstance(out["raw"], AIMessage) and isinstance(out["parsed"], Verdict) and out["parsing_error"] is None
    assert Verdict.model_validate_json(out["raw"].content) == out["parsed"]
    # cut off by max_tokens: the JSON is incomplete; include_raw reports it, without it raises
    short = AgentCacheChatModel(runtime=model.runtime, max_tokens=3)
    cut = short.with_structured_output(Verdict, include_raw=True).invoke("Approve?")
    assert cut["parsed"] is None and isinstance(cut["parsing_error"], OutputParserException)
    assert cut["raw"].response_metadata["finish_reason"] == "length"
    with pytest.raises(OutputParserException):
        short.with_structured_output(Verdict).invoke("Approve?")


def test_structured_output_by_function_calling():
    model = tiny_model(max_tokens=160)  # the byte tokenizer may spell the tags out, a token a character
    verdict = model.with_structured_output(Verdict, method="function_calling").invoke("Approve?")
    assert isinstance(verdict, Verdict)
    out = model.with_structured_output(VerdictDict, method="function_calling", include_raw=True).invoke("Approve?")
    assert out["raw"].tool_calls[0]["name"] == "VerdictDict" and out["parsed"] == out["raw"].tool_calls[0]["args"]


def test_response_format_and_json_mode_constrain_the_reply():
    model = tiny_model(max_tokens=24)
    prepare = model._prepare
    assert prepare(ASK, None, {"response_format": {"type": "json_object"}}).sampling.constraint == \
        OutputConstraint.json_object()
    schema = Verdict.model_json_schema()
    response_format = {"type": "json_schema", "json_schema": {"name": "v", "schema": schema}}
    got = prepare(ASK, None, {"response_format": response_format})
    assert got.sampling.constraint == OutputConstraint.json_schema(schema)
    assert prepare(ASK, None, {"response_format": {"type": "text"}}).sampling.constraint is None
    with pytest.raises(InputError, match="response_format must be"):
        prepare(ASK, None, {"response_format": {"type": "yaml"}})
    reply = model.bind(response_format={"type": "json_object"}).invoke("Reply in JSON.")
    assert reply.content.startswith("{")  # a random model may not close its strings: the JSON is checked slow
    raw = model.with_structured_output(None, method="json_mode", include_raw=True).invoke("JSON.")
    assert raw["raw"].content.startswith("{")
    with pytest.raises(UnsupportedFeatureError, match="legacy"):
        model.invoke(ASK, function_call={"name": "x"})


def test_a_schema_that_cannot_compile_is_a_clear_error_and_the_model_keeps_working():
    model = tiny_model()
    bad = {"title": "Bad", "type": "object", "properties": {"x": {"type": "string", "pattern": "(?<=a)b"}}}
    with pytest.raises(InputError, match="cannot be compiled: .*Lookbehind"):
        model.with_structured_output(bad).invoke("x")
    with pytest.raises(InputError, match="cannot be compiled"):
        model.bind_tools([bad], tool_choice="Bad").invoke("x")
    assert isinstance(model.with_structured_output(Verdict).invoke("Approve?"), Verdict)
    check_calls(model.bind_tools([set_light], tool_choice="any").invoke(ASK))


# --- graphs --------------------------------------------------------------------------------

def test_a_graph_runs_the_tool_loop_with_a_forced_call():
    """agent (forced call) -> ToolNode -> answer: the answer reads the call and its result in the
    template's layout, as the agent's own output and the tool's slot."""
    model = tiny_model(max_tokens=MAX_TOKENS)
    caller = model.bind_tools([set_light, lock_door], tool_choice="set_light")
    graph = StateGraph(MessagesState)
    graph.add_node("agent", lambda state: {"messages": [caller.invoke(state["messages"])]})
    graph.add_node("tools", ToolNode([set_light, lock_door]))
    graph.add_node("answer", lambda state: {"messages": [model.bind(max_tokens=6).invoke(state["messages"])]})
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition, {"tools": "tools", END: END})
    graph.add_edge("tools", "answer")
    graph.add_edge("answer", END)
    out = graph.compile().invoke({"messages": list(ASK)}, {"configurable": {"thread_id": "house-1"}})
    kinds = [type(m).__name__ for m in out["messages"]]
    assert kinds == ["SystemMessage", "HumanMessage", "AIMessage", "ToolMessage", "AIMessage"]
    call, result = out["messages"][2].tool_calls[0], out["messages"][3]
    assert call["name"] == "set_light" and result.tool_call_id == call["id"]
    assert result.content == set_light.invoke(call["args"])  # the tool ran with the model's arguments
    assert [r.agent for r in model.runtime.results] == ["agent", "answer"]
    last = model.runtime.results[-1]
    assert [s.name for s in last.segments if s.kind == "ph"] == ["query", "out:agent", "tool:set_light"]


def test_create_react_agent_takes_one_forced_step():
    """A model bound with a forced tool_choice would call tools forever in a ReAct loop: a
    return_direct tool ends the run after the forced call."""
    from langgraph.prebuilt import create_react_agent

    @tool(return_direct=True)
    def lock_now(locked: bool) -> str:
        """Lock or unlock the door now."""
        return "done: locked" if locked else "done: unlocked"

    model = tiny_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # moved to langchain.agents in LangGraph 1.0, still shipped
        react = create_react_agent(model.bind_tools([lock_now], tool_choice="any"), tools=[lock_now])
    out = react.invoke({"messages": [("user", "Lock the door.")]}, {"configurable": {"thread_id": "react-1"}})
    ai, result = out["messages"][-2:]
    assert ai.tool_calls[0]["name"] == "lock_now" and result.content.startswith("done: ")
    assert [r.agent for r in model.runtime.results] == ["agent"]


# --- the real model ------------------------------------------------------------------------

@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


ADD_QUESTION = "What is 17 + 25? Use the add tool."


@pytest.fixture(scope="module")
def qwen_runtime(qwen_model) -> Runtime:
    from agentcache.engine import EmbeddedEngine, EngineConfig

    return Runtime(EmbeddedEngine(qwen_model, EngineConfig(pool_blocks=512)), config=RuntimeConfig(self_check=False))


@pytest.mark.slow
def test_qwen_react_agent_adds_with_a_forced_first_step(qwen_runtime):
    """create_react_agent with LangGraph's dynamic model: the add call is forced until the tool has
    answered, then the model answers with the sum as JSON (the 0.5B model's free answers after a
    tool result are more bare-JSON calls; the unforced loop is the test below)."""
    from langgraph.prebuilt import create_react_agent

    model = AgentCacheChatModel(runtime=qwen_runtime, max_tokens=48)
    answer = model.bind(response_format={"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {"sum": {"type": "integer"}}, "required": ["sum"]}}})

    def pick(state, runtime):
        return answer if isinstance(state["messages"][-1], ToolMessage) else model.bind_tools([add], tool_choice="add")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        react = create_react_agent(pick, tools=[add])
    out = react.invoke({"messages": [("user", ADD_QUESTION)]}, {"configurable": {"thread_id": "add-1"}})
    kinds = [type(m).__name__ for m in out["messages"]]
    assert kinds == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage"]
    assert calls_of(out["messages"][1]) == [("add", {"a": 17, "b": 25})]
    assert out["messages"][2].content == "42"
    final = out["messages"][-1]
    assert "42" in final.content and json.loads(final.content) == {"sum": 42} and not final.tool_calls
    last = qwen_runtime.results[-1]  # the answer read the call and its result in the template's layout
    assert (last.agent, last.session) == ("agent", "add-1")
    assert [s.name for s in last.segments if s.kind == "ph"] == ["query", "out:agent", "tool:add"]


@pytest.mark.slow
def test_qwen_react_agent_calls_the_tool_unforced(qwen_runtime):
    """Qwen2.5-Coder-0.5B-Instruct writes an unforced call as bare JSON without its template's tags;
    the parser reads it as the call (the tools offered name it), so the ReAct loop completes."""
    from langgraph.prebuilt import create_react_agent

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        react = create_react_agent(AgentCacheChatModel(runtime=qwen_runtime, max_tokens=48), tools=[add])
    out = react.invoke({"messages": [("user", ADD_QUESTION)]}, {"configurable": {"thread_id": "add-2"}})
    assert any(isinstance(m, ToolMessage) and m.content == "42" for m in out["messages"])
    assert "42" in out["messages"][-1].content


@pytest.mark.slow
def test_qwen_json_object_and_json_mode_parse(qwen_runtime):
    model = AgentCacheChatModel(runtime=qwen_runtime, max_tokens=64)
    ask = "Describe a cat as a JSON object with the keys 'name' and 'age'. Reply with JSON only."
    reply = model.bind(response_format={"type": "json_object"}).invoke(ask)
    assert isinstance(json.loads(reply.content), dict)

    class Cat(BaseModel):
        name: str
        age: int

    assert isinstance(model.with_structured_output(Cat, method="json_mode").invoke(ask), Cat)

"""The LangGraph adapter on real graphs over tiny-llama: Send fan-out to three experts, fan-in to a
judge (sync and async), config injection through @agent_node, streaming, metadata, bad input."""

from __future__ import annotations

import asyncio
import inspect
import operator
import warnings
from typing import Annotated, TypedDict

import pytest
from conftest import make_engine, text_of_length
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.types import Send

from agentcache import STRATEGIES, Runtime, RuntimeConfig
from agentcache_langgraph import (
    AgentCacheChatModel,
    UnsupportedFeatureError,
    UnsupportedMessageError,
    agent_node,
    current_agent,
)
from agentcache_langgraph.messages import AGENT_KEY, to_call

# As in test_runtime: the gate is open (tau=1) because random weights give arbitrary gate entropies,
# and the self-check (it passes on tiny-llama, in seconds) is skipped. The anchor pools keep every
# anchor of the test (no eviction), so that reuse does not depend on the order the experts ran in.
KVCMAS = STRATEGIES["kvcmas"].replace(accept="entropy", tau=1.0, max_anchors=32)
EXPERTS = {
    "historian": "You are a historian. Judge the question by its past.",
    "economist": "You are an economist. Judge the question by its costs.",
    "engineer": "You are an engineer. Judge the question by what can be built.",
}
JUDGE = "judge"
NODES = {**{name: f"ask_{name}" for name in EXPERTS}, JUDGE: "decide"}  # node names differ from agent names
REUSED = {"corrected", "reused", "prefix_hit"}


def make_runtime() -> Runtime:
    return Runtime(make_engine("tiny-llama", pool_blocks=256), strategy=KVCMAS, config=RuntimeConfig(self_check=False, learn="after_call"))


class State(TypedDict, total=False):
    query: str
    opinions: Annotated[list, operator.add]
    verdict: str
    thread: str


def build_graph(model: AgentCacheChatModel, use_async: bool):
    """START -Send-> three experts -> judge -> END; async nodes call `ainvoke`."""

    def expert_node(name: str, system: str):
        def prompt(state: State) -> list:
            return [SystemMessage(system), HumanMessage(state["query"])]

        if use_async:
            @agent_node(name)
            async def expert(state: State) -> dict:
                return {"opinions": [await model.ainvoke(prompt(state))]}
        else:
            @agent_node(name)
            def expert(state: State) -> dict:
                return {"opinions": [model.invoke(prompt(state))]}
        return expert

    def judge_prompt(state: State) -> list:
        return [SystemMessage("You weigh the experts and decide."), HumanMessage(state["query"]), *state["opinions"]]

    # `config` is injected by LangGraph: the decorator must keep the parameter visible.
    if use_async:
        @agent_node(JUDGE)
        async def judge(state: State, config) -> dict:
            reply = await model.ainvoke(judge_prompt(state))
            return {"verdict": reply.content, "thread": config["configurable"]["thread_id"]}
    else:
        @agent_node(JUDGE)
        def judge(state: State, config) -> dict:
            reply = model.invoke(judge_prompt(state))
            return {"verdict": reply.content, "thread": config["configurable"]["thread_id"]}

    graph = StateGraph(State)
    for name, system in EXPERTS.items():
        graph.add_node(NODES[name], expert_node(name, system))
        graph.add_edge(NODES[name], NODES[JUDGE])
    graph.add_node(NODES[JUDGE], judge)
    graph.add_conditional_edges(START, lambda state: [Send(NODES[n], {"query": state["query"]}) for n in EXPERTS],
                                [NODES[n] for n in EXPERTS])
    graph.add_edge(NODES[JUDGE], END)
    return graph.compile()


def ph_slots(result) -> list[str]:
    return [s.name for s in result.segments if s.kind == "ph"]


def check_run(rt: Runtime, start: int, out: dict, thread: str) -> int:
    """One graph run: four calls by the right agents, tagged with node and thread, laid out as PH
    segments. Returns how many experts said something (an empty reply has no segment to check)."""
    results, events = rt.results[start:], rt.events[start:]
    assert len(results) == len(events) == 4
    assert [r.agent for r in results] == [e.agent for e in events]
    assert sorted(r.agent for r in results[:3]) == sorted(EXPERTS) and results[3].agent == JUDGE
    for event in events:
        assert (event.framework, event.session, event.caller) == ("langgraph", thread, NODES[event.agent])
        assert event.messages == (2 if event.agent in EXPERTS else 2 + len(EXPERTS))
    assert out["thread"] == thread  # the judge node got its config
    assert sorted(m.name or m.response_metadata[AGENT_KEY] for m in out["opinions"]) == sorted(EXPERTS)
    assert [ph_slots(r) for r in results[:3]] == [["query"]] * 3
    spoke = [m.name or m.response_metadata[AGENT_KEY] for m in out["opinions"] if m.content]
    assert ph_slots(results[3]) == ["query"] + [f"out:{name}" for name in spoke]
    # The experts run at once: each one planned before a sibling finished computes the new query
    # itself (`first`); the judge, after them, always has an expert's cache to read.
    decisions = [r.segments[1].decision for r in results]
    assert decisions.count("first") >= 1 and decisions[3] != "first"
    return len(spoke)


def test_fan_out_fan_in_graph_sync_and_async():
    rt = make_runtime()
    model = AgentCacheChatModel(runtime=rt, max_tokens=6)
    sync_graph, async_graph = build_graph(model, use_async=False), build_graph(model, use_async=True)
    # Experts run in parallel, in any order; the judge's query reads the last expert's cache and is
    # corrected once two anchors hold that (expert -> judge) edge. Seven runs make one expert last
    # three times whatever the order, so reuse is certain.
    runs = spoke = 0
    for seed in range(4):
        start, thread = len(rt.results), f"sync-{seed}"
        out = sync_graph.invoke({"query": text_of_length(rt.engine, 30, seed=seed)},
                                {"configurable": {"thread_id": thread}})
        spoke += check_run(rt, start, out, thread)
        runs += 1
    for seed in range(4, 7):
        start, thread = len(rt.results), f"async-{seed}"
        out = asyncio.run(async_graph.ainvoke({"query": text_of_length(rt.engine, 30, seed=seed)},
                                              {"configurable": {"thread_id": thread}}))
        spoke += check_run(rt, start, out, thread)
        runs += 1

    assert spoke > 0, "no expert said anything: no output segment was checked"
    later_queries = [r.segments[1] for r in rt.results if r.segments[1].decision != "first"]
    assert any(s.decision in REUSED for s in later_queries)
    assert sum(r.reused_tokens for r in rt.results) > 0
    figures = rt.summary()
    assert 0.0 <= figures["hit_rate"] <= 1.0 and 0.0 < figures["reuse_ratio"] <= 1.0
    assert figures["dispatches"] == {f"langgraph:{agent}": runs for agent in [*EXPERTS, JUDGE]}


@pytest.mark.parametrize("use_async", [False, True], ids=["stream", "astream"])
def test_graph_streamed_by_messages_keeps_agents_apart(use_async):
    """stream_mode="messages" makes LangChain stream each call and merge the chunks, which drops
    `name`; the judge must still read each expert's output as that expert's."""
    rt = make_runtime()
    graph = build_graph(AgentCacheChatModel(runtime=rt, max_tokens=6), use_async=use_async)
    args = ({"query": text_of_length(rt.engine, 30, seed=9)}, {"configurable": {"thread_id": "streamed"}})
    options = {"stream_mode": ["messages", "values"]}

    async def collect() -> list:
        return [item async for item in graph.astream(*args, **options)]

    nodes, final = set(), None
    for mode, item in asyncio.run(collect()) if use_async else graph.stream(*args, **options):
        if mode == "messages":
            chunk, meta = item
            assert chunk.name == next(a for a, n in NODES.items() if n == meta["langgraph_node"])
            nodes.add(meta["langgraph_node"])
        else:
            final = item
    assert nodes == set(NODES.values())
    check_run(rt, 0, final, "streamed")


def test_agent_node_keeps_signature_coroutines_and_nesting():
    def node(state, config):
        return current_agent(), config

    async def anode(state, *, store=None):
        return current_agent()

    wrapped, awrapped = agent_node("a")(node), agent_node("b")(anode)
    assert list(inspect.signature(wrapped).parameters) == ["state", "config"]
    assert list(inspect.signature(awrapped).parameters) == ["state", "store"]
    assert not inspect.iscoroutinefunction(wrapped) and inspect.iscoroutinefunction(awrapped)
    assert wrapped.__name__ == "node" and wrapped(None, 1) == ("a", 1)
    assert asyncio.run(awrapped(None)) == "b" and current_agent() is None

    @agent_node("outer")
    def outer():
        inner = agent_node("inner")(lambda: current_agent())()
        return inner, current_agent()

    assert outer() == ("inner", "outer") and current_agent() is None

    @agent_node("boom")
    def failing():
        raise KeyError("x")

    with pytest.raises(KeyError):
        failing()
    assert current_agent() is None
    with pytest.raises(ValueError, match="non-empty"):
        agent_node("")


def test_session_and_caller_outside_and_inside_a_graph():
    rt = make_runtime()
    prompt = [SystemMessage("You answer."), HumanMessage("Name a colour and a fruit.")]
    AgentCacheChatModel(runtime=rt, agent="solo", max_tokens=4).invoke(prompt)
    agent_node("tagged")(lambda: AgentCacheChatModel(runtime=rt, max_tokens=4).invoke(prompt))()
    assert [(e.agent, e.session, e.caller) for e in rt.events] == [("solo", None, None), ("tagged", None, "<lambda>")]

    fixed = AgentCacheChatModel(runtime=rt, agent="solo", session="fixed", max_tokens=4)
    graph = StateGraph(State)
    graph.add_node("only", lambda state: {"verdict": fixed.invoke(prompt).content})  # no decorator: the field's agent
    graph.add_edge(START, "only")
    graph.compile().invoke({"query": "q"}, {"configurable": {"thread_id": "t-1"}})
    assert (rt.events[-1].agent, rt.events[-1].session, rt.events[-1].caller) == ("solo", "fixed", "only")


def test_stream_and_astream_match_invoke():
    prompt = [SystemMessage("You answer briefly."), HumanMessage("What is the capital of France, and why?")]

    def model() -> AgentCacheChatModel:  # a fresh runtime each: the same first call, so the same text
        return AgentCacheChatModel(runtime=make_runtime(), agent="solo", max_tokens=8)

    whole = model().invoke(prompt)
    chunks = list(model().stream(prompt))
    assert "".join(c.content for c in chunks) == whole.content
    assert sum(1 for c in chunks if c.content) > 1  # token by token, not one final chunk
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    assert merged.usage_metadata == whole.usage_metadata
    assert merged.response_metadata["decisions"] == whole.response_metadata["decisions"]

    async def collect() -> tuple[list, int]:
        ticks, done = 0, False

        async def ticker() -> None:  # the loop keeps running while the engine works
            nonlocal ticks
            while not done:
                ticks += 1
                await asyncio.sleep(0)

        tick_task = asyncio.create_task(ticker())
        got = [c async for c in model().astream(prompt)]
        done = True
        await tick_task
        return got, ticks

    achunks, ticks = asyncio.run(collect())
    assert "".join(c.content for c in achunks) == whole.content and ticks > 1
    assert sum(1 for c in achunks if c.content) > 1


def test_reply_metadata_and_per_call_options():
    rt = make_runtime()
    model = AgentCacheChatModel(runtime=rt, agent="solo", max_tokens=8)
    prompt = [SystemMessage("You answer."), HumanMessage("Name three rivers of Europe.")]
    reply = model.invoke(prompt)
    result = rt.results[-1]
    assert isinstance(reply, AIMessage) and reply.name == "solo" and reply.content == result.text
    meta = reply.response_metadata
    for key in ("ttft_s", "queued_s", "reused_tokens", "prompt_tokens", "finish_reason"):
        assert meta[key] == getattr(result, key)
    assert (meta["cached_tokens"], meta["own_lineage_tokens"]) == (result.exact_cached_tokens, result.lineage_tokens)
    assert meta["decisions"] == [(s.name, s.decision) for s in result.segments]
    assert reply.usage_metadata["input_tokens"] == result.prompt_tokens
    assert reply.usage_metadata["output_tokens"] == len(result.token_ids)
    assert reply.usage_metadata["total_tokens"] == result.prompt_tokens + len(result.token_ids)

    model.invoke(prompt, max_tokens=2, temperature=0.7)
    assert len(rt.results[-1].token_ids) <= 2
    stop = next((ch for ch in result.text[1:] if ch not in "\ufffd" and not ch.isspace()), None)
    if stop is not None:  # a character the reply produced stops the same reply, from a fresh runtime
        again = AgentCacheChatModel(runtime=make_runtime(), agent="solo", max_tokens=8).invoke(prompt, stop=[stop])
        assert again.response_metadata["finish_reason"] == "stop" and stop not in again.content


def test_messages_map_to_the_shared_transcript():
    call = to_call([
        SystemMessage("You critique."),
        SystemMessage([{"type": "text", "text": "Be brief."}]),
        HumanMessage(["Plan ", {"type": "text", "text": "a trip."}]),
        AIMessage("Go by train.", name="planner"),
        HumanMessage("Trains are slow.", name="skeptic"),
        AIMessage("Earlier I said no."),
        AIMessage("Also mine.", name="critic"),
        AIMessage("Written by the writer.", response_metadata={AGENT_KEY: "writer"}),
        ToolMessage("12 trains a day", name="search", tool_call_id="1"),
        ToolMessage("nameless result", tool_call_id="2"),
    ], "critic", "s-1")
    assert call.agent == "critic" and call.session == "s-1"
    assert call.segments[0].text.startswith("You critique.\n\nBe brief.")
    assert [(s.slot, s.text) for s in call.segments if s.kind == "ph"] == [
        ("query", "Plan a trip."), ("out:planner", "Go by train."), ("out:skeptic", "Trains are slow."),
        ("out:critic", "Earlier I said no."), ("out:critic", "Also mine."), ("out:writer", "Written by the writer."),
        ("tool:search", "12 trains a day"), ("tool:tool", "nameless result")]
    assert call.segments[-1].kind == "pf" and call.segments[-1].text.endswith("### critic\n")


def test_bad_input_is_refused_and_the_runtime_keeps_working():
    rt = make_runtime()
    model = AgentCacheChatModel(runtime=rt, agent="solo", max_tokens=4)
    prompt = [SystemMessage("You answer."), HumanMessage("Name a colour.")]

    def still_runs() -> None:
        calls = len(rt.results)
        assert model.invoke(prompt).name == "solo"
        assert len(rt.results) == len(rt.events) == calls + 1  # a refused call left no event behind

    image = HumanMessage([{"type": "text", "text": "What is this?"},
                          {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}])
    with pytest.raises(UnsupportedMessageError, match=r"message 1 \(HumanMessage\).*'image_url'"):
        model.invoke([SystemMessage("You look."), image])
    still_runs()
    tool_call = AIMessage("", tool_calls=[{"name": "search", "args": {"q": "x"}, "id": "1"}])
    pdf = ToolMessage([{"type": "file", "base64": "AAAA", "mime_type": "application/pdf"}], tool_call_id="1")
    with pytest.raises(UnsupportedMessageError, match=r"message 3 \(ToolMessage\).*'file'.*tool result as text"):
        model.invoke([*prompt, tool_call, pdf])
    still_runs()
    # tiny-llama's has no chat template, so no tool-call format: tools are refused, naming a model that has one
    with pytest.raises(UnsupportedFeatureError, match="cannot call tools.*qwen2.5-coder-0.5b"):
        model.bind_tools([{"name": "search", "description": "web search", "parameters": {}}])
    with pytest.raises(NotImplementedError, match="cannot call tools"):
        model.with_structured_output({"title": "Answer", "type": "object", "properties": {}},
                                     method="function_calling")
    with pytest.raises(UnsupportedFeatureError, match="cannot call tools"):
        model.bind(tools=[{"name": "search"}]).invoke(prompt)
    with pytest.raises(UnsupportedFeatureError, match="legacy function calling"):
        model.invoke(prompt, functions=[{"name": "search"}])
    with pytest.raises(TypeError, match="unknown keyword arguments"):
        model.invoke(prompt, top_k=3)
    still_runs()
    with pytest.raises(UnsupportedFeatureError, match="cannot switch weights"):
        model.invoke(prompt, model="gpt-4o")
    assert model.invoke(prompt, model="tiny-llama").name == "solo"  # its own model is no switch
    still_runs()
    assert asyncio.run(model.ainvoke(prompt)).name == "solo"


@pytest.mark.parametrize("stop, call_stop, want", [
    ((), None, ("\n###",)), ([], ["END"], ("\n###", "END")), (["A"], ["A", "B"], ("\n###", "A", "B"))])
def test_a_callers_stop_strings_join_the_transcript_stop(stop, call_stop, want):
    model = AgentCacheChatModel(runtime=make_runtime(), agent="solo", max_tokens=2, stop=stop)
    prepared = model._prepare([HumanMessage("hi")], call_stop, {})
    assert prepared.sampling.stop == want  # without "\n###" the model would write other agents' turns


def test_the_calling_agent_without_a_decorator():
    """Outside a graph with no `agent=`: the default agent. In a graph: the node the call runs in,
    unless `agent=` or an @agent_node says otherwise. `create_react_agent` needs nothing more."""
    from langgraph.prebuilt import create_react_agent

    rt = make_runtime()
    plain = AgentCacheChatModel(runtime=rt, max_tokens=3)
    prompt = [HumanMessage("Name a colour.")]
    assert plain.invoke(prompt).name == "assistant"
    assert [r.agent for r in rt.results] == ["assistant"]

    def node(state):
        return {"messages": [plain.invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("critic", node)
    graph.add_node("named", lambda state: {"messages": [plain.model_copy(update={"agent": "editor"}).invoke(
        state["messages"])]})
    graph.add_node("decorated", agent_node("writer")(node))
    graph.add_edge(START, "critic")
    graph.add_edge("critic", "named")
    graph.add_edge("named", "decorated")
    graph.compile().invoke({"messages": prompt}, {"configurable": {"thread_id": "doc-1"}})
    assert [(r.agent, r.session) for r in rt.results[1:]] == [("critic", "doc-1"), ("editor", "doc-1"),
                                                              ("writer", "doc-1")]
    assert [e.caller for e in rt.events][1:] == ["critic", "named", "decorated"]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # moved to langchain.agents in LangGraph 1.0, still shipped
        react = create_react_agent(plain, tools=[])
    out = react.invoke({"messages": [("user", "Hi there.")]}, {"configurable": {"thread_id": "react-1"}})
    assert out["messages"][-1].response_metadata[AGENT_KEY] == "agent" == rt.results[-1].agent
    assert rt.results[-1].session == "react-1"


def test_a_chatml_model_gets_its_own_frames_and_no_transcript_stop():
    from conftest import chatml_engine

    rt = Runtime(chatml_engine(), config=RuntimeConfig(self_check=False))
    model = AgentCacheChatModel(runtime=rt, max_tokens=3, stop=["END"])
    reply = model.invoke([SystemMessage("You answer."), HumanMessage("Name a colour.")])
    assert model._stops() == ("END",)  # the model's end-of-turn token ends a turn, no header stop
    call = to_call([SystemMessage("You answer."), HumanMessage("Name a colour.")], "assistant", None, rt.chat)
    cue = rt.chat.opener("assistant")
    assert call.segments[0].token_ids[0] == rt.chat.start_id and list(call.segments[-1].token_ids[-len(cue):]) == cue
    assert [s.slot for s in call.segments if s.kind == "ph"] == ["query"]
    assert reply.response_metadata["prompt_tokens"] == rt.results[-1].prompt_tokens

"""The frameworks' own OpenAI clients against `agentcache serve`, each in a short two-agent exchange:
LangChain's ChatOpenAI in a LangGraph graph, AutoGen's OpenAIChatCompletionClient in a
SelectorGroupChat, and the OpenAI Agents SDK with a handoff. The server's per-agent records show
who called: each client's agents arrive as agents of their own, and what one agent wrote reaches
the next as that agent's output (PH "out:<agent>"), which is what chained reuse needs.

CrewAI is not among them: it pins openai<3 and pydantic<2.13, which would downgrade the openai SDK,
pydantic and the Agents SDK the rest of this environment is tested with (see docs/serving.md)."""

from __future__ import annotations

import asyncio

import pytest

from agentcache.config import RuntimeConfig
from agentcache.runtime import Runtime
from agentcache.serve import ServeConfig, ServerThread, create_app

from conftest import make_engine

MODEL = "tiny-qwen2-chat"
TASK = ("The harbour master's log records three storms, a late ferry on Tuesday, and the research vessel "
        "Albatross, staying until the end of the month. Summarise the week for the port's newsletter.")


@pytest.fixture
def server():
    rt = Runtime(make_engine(MODEL, pool_blocks=256), config=RuntimeConfig(self_check=False))
    with ServerThread(create_app(rt, ServeConfig(default_max_tokens=12))) as running:
        running.runtime = rt
        yield running


def slots(result) -> list[str]:
    return [segment.name for segment in result.segments if segment.kind == "ph"]


def read_as(result, expected: list[str]) -> bool:
    """Whether the call read its messages through `expected`'s slots, in order. A span the server
    found inside a message (an agent quoting another's output) is a segment of its own, read
    through its source's slot (`<slot>@span`): it may come between."""
    found = [name.removesuffix("@span") for name in slots(result)]
    rest = iter(found)
    return set(found) <= set(expected) and all(name in rest for name in expected)


def test_langchain_chat_openai_in_a_langgraph_graph(server):
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, MessagesState, StateGraph

    # unmodified for the planner (its system prompt names it); the writer says who it is
    planner_model = ChatOpenAI(model=MODEL, base_url=server.url, api_key="unused", max_tokens=40, temperature=0,
                               default_headers={"X-Agentcache-Session": "graph-1"})
    writer_model = ChatOpenAI(model=MODEL, base_url=server.url, api_key="unused", max_tokens=8, temperature=0,
                              extra_body={"agentcache": {"agent": "writer", "session": "graph-1"}})

    def planner(state: MessagesState) -> dict:
        reply = planner_model.invoke([SystemMessage("You are the planner. Plan in steps."), *state["messages"]])
        return {"messages": [HumanMessage(reply.content or "-", name="planner")]}

    def writer(state: MessagesState) -> dict:
        chunks = list(writer_model.stream([SystemMessage("You are the writer. Write it up."), *state["messages"]]))
        return {"messages": [sum(chunks[1:], chunks[0])]}

    graph = StateGraph(MessagesState)
    graph.add_node("planner", planner)
    graph.add_node("writer", writer)
    graph.add_edge(START, "planner")
    graph.add_edge("planner", "writer")
    graph.add_edge("writer", END)
    out = graph.compile().invoke({"messages": [HumanMessage(TASK)]})
    assert len(out["messages"]) == 3

    first, second = [r for r in server.runtime.results if r.session == "graph-1"]
    assert first.agent.startswith("agent-") and second.agent == "writer"
    assert read_as(second, ["query", f"out:{first.agent}"]), slots(second)  # the planner's output, read as the planner's
    assert second.event.caller.startswith("OpenAI/Python")


def test_autogen_openai_client_in_a_selector_group_chat(server):
    from autogen_agentchat.agents import AssistantAgent
    from autogen_agentchat.conditions import MaxMessageTermination
    from autogen_agentchat.teams import SelectorGroupChat
    from autogen_ext.models.openai import OpenAIChatCompletionClient

    def client():
        return OpenAIChatCompletionClient(
            model=MODEL, base_url=server.url, api_key="unused", max_tokens=40, temperature=0.0,
            model_info={"vision": False, "function_calling": True, "json_output": True, "structured_output": True,
                        "family": "unknown"})

    planner = AssistantAgent("planner", model_client=client(), system_message="You are the planner. Plan in steps.")
    writer = AssistantAgent("writer", model_client=client(), system_message="You are the writer. Write it up.",
                            model_client_stream=True)
    order = ["planner", "writer"]

    def selector(thread) -> str:  # the speaking order does not hang on what a random-weight model writes
        return order[sum(1 for message in thread if message.source in order) % 2]

    team = SelectorGroupChat([planner, writer], model_client=client(), selector_func=selector,
                             termination_condition=MaxMessageTermination(5))
    result = asyncio.run(team.run(task=TASK))
    assert [m.source for m in result.messages] == ["user", "planner", "writer", "planner", "writer"]

    calls = server.runtime.results
    agents = [r.agent for r in calls]
    assert len(calls) == 4 and agents[0] == agents[2] != agents[1] == agents[3]
    assert all(agent.startswith("agent-") for agent in agents)  # one agent per system prompt, unmodified clients
    # AutoGen names others' messages by agent name: the server reads each as the output its author wrote
    assert read_as(calls[1], ["query", f"out:{agents[0]}"]), slots(calls[1])
    assert read_as(calls[2], ["query", f"out:{agents[0]}", f"out:{agents[1]}"]), slots(calls[2])


def test_openai_agents_sdk_two_agents_and_a_handoff(server):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # nothing leaves this machine

    async def main():
        async with AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0) as openai_client:
            def model():
                return OpenAIChatCompletionsModel(model=MODEL, openai_client=openai_client)

            writer = Agent(name="writer", instructions="You are the writer. Write it up.", model=model(),
                           model_settings=ModelSettings(max_tokens=8, temperature=0))
            triage = Agent(name="triage", instructions="Hand the task to the writer.", model=model(),
                           handoffs=[writer], model_settings=ModelSettings(tool_choice="required", max_tokens=120,
                                                                           temperature=0))
            plain = await Runner.run(triage, TASK, max_turns=4)
            streamed = Runner.run_streamed(triage, TASK, max_turns=4)
            async for _ in streamed.stream_events():
                pass
            return plain, streamed

    plain, streamed = asyncio.run(main())
    assert plain.last_agent.name == "writer" and streamed.last_agent.name == "writer"  # the forced handoff ran
    calls = server.runtime.results
    assert len(calls) == 4
    triage_agent, writer_agent = calls[0].agent, calls[1].agent
    assert triage_agent != writer_agent and [r.agent for r in calls] == [triage_agent, writer_agent] * 2
    assert "tool:transfer_to_writer" in slots(calls[1])  # the handoff's result, in the writer's prompt
    assert calls[1].event.caller.startswith("Agents/Python")

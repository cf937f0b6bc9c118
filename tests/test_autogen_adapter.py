"""The AutoGen adapter with real autogen-agentchat objects on tiny-llama.

The weights are random: no test reads meaning into generated text. Speakers are scripted with a
`selector_func`; one turn returns None so the team's model-based selector calls the runtime as the
agent "selector" (it names nobody, so AutoGen falls back to the first participant). Tests are
plain functions around `asyncio.run` (pytest-asyncio is not a dependency).
"""

from __future__ import annotations

import asyncio
from functools import partial
from collections import Counter

import PIL.Image
import pytest
from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.conditions import MaxMessageTermination
from autogen_agentchat.messages import BaseChatMessage
from autogen_agentchat.teams import SelectorGroupChat
from autogen_core import AgentId, Image, MessageHandlerContext
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

from agentcache.correction.strategies import STRATEGIES
from agentcache.runtime import Runtime, RuntimeConfig
from agentcache.segments import AgentCall
from agentcache_autogen import (
    SELECTOR,
    Caller,
    AgentCacheChatCompletionClient,
    UnsupportedMessageError,
    UnsupportedRequestError,
)
from tests.conftest import make_engine

NAMES = ("planner", "local", "summary")
SYSTEM = {name: f"You are the {name} agent of a travel team." for name in NAMES}
TASK = "Plan three days in Lisbon for a family of four."
# chat messages in the thread -> next speaker; 3 -> None: the model-based selector runs
ORDER = {1: "planner", 2: "local", 4: "summary", 5: "planner"}
MESSAGES = 6  # the task and five agent messages
WEATHER = {"name": "weather", "description": "Current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def runtime(strategy="kvcmas", preset="tiny-llama", **config) -> Runtime:
    return Runtime(make_engine(preset, pool_blocks=256), strategy=strategy,
                   config=RuntimeConfig(self_check=False, learn="after_call", **config))


def record(rt: Runtime) -> list[tuple[AgentCall, object]]:
    """Every (call, result) the runtime runs, with the call's segment texts (results carry none)."""
    seen, run, arun = [], rt.run, rt.arun

    def recording(call, *args, **kwargs):
        result = run(call, *args, **kwargs)
        seen.append((call, result))
        return result

    async def arecording(call, *args, **kwargs):
        result = await arun(call, *args, **kwargs)
        seen.append((call, result))
        return result

    rt.run, rt.arun = recording, arecording
    return seen


def scripted(thread) -> str | None:
    return ORDER.get(sum(isinstance(m, BaseChatMessage) for m in thread))


def team_of(clients, selector_client, *, streaming: bool = False) -> SelectorGroupChat:
    agents = [AssistantAgent(name, model_client=clients[name], system_message=SYSTEM[name],
                             description=f"The {name} agent.", model_client_stream=streaming) for name in NAMES]
    return SelectorGroupChat(agents, model_client=selector_client, selector_func=scripted, max_selector_attempts=1,
                             termination_condition=MaxMessageTermination(MESSAGES),
                             model_client_streaming=streaming)


def phs(call: AgentCall) -> list[tuple[str, str]]:
    return [(s.slot, s.text) for s in call.segments if s.kind == "ph"]


def msgs(query: str = TASK, system: str = SYSTEM["planner"]) -> list:
    return [SystemMessage(content=system), UserMessage(content=query, source="user")]


def check_team_run(rt: Runtime, seen, team: SelectorGroupChat, messages, task: str = TASK) -> None:
    """The calls of one team run: agents, events, sessions and each prompt's segments."""
    assert [m.source for m in messages][:3] == ["user", "planner", "local"]
    assert [m.source for m in messages][4:] == ["summary", "planner"]
    assert len(messages) == MESSAGES and messages[0].content == task
    speakers = [m.source for m in messages[1:]]
    session = team._team_id
    mine = [(call, result) for call, result in seen if call.session == session]
    agents = [call.agent for call, _ in mine]
    assert agents == speakers[:2] + [SELECTOR] + speakers[2:]  # the selector ran once, at turn 3

    events = [e for e in rt.events if e.session == session]
    assert [e.agent for e in events] == agents
    # each participant reads its system message and the whole thread so far (the k-th message's
    # speaker: k messages); the selector, one message holding its prompt
    thread = iter(range(2, len(messages) + 1))
    assert [e.messages for e in events] == [1 if agent == SELECTOR else next(thread) for agent in agents]
    for event in events:
        assert event.framework == "autogen"
        kind = "SelectorGroupChatManager" if event.agent == SELECTOR else event.agent
        assert event.caller.startswith(f"{kind}_{session}")

    participant_calls = [(c, r) for c, r in mine if c.agent != SELECTOR]
    assert len(participant_calls) == len(messages) - 1
    for k, (call, result) in enumerate(participant_calls, start=1):
        speaker = messages[k].source
        assert call.agent == speaker and result.agent == speaker
        assert result.text == messages[k].content  # the reply is the generated text
        assert call.segments[0].kind == "pf" and call.segments[0].text.startswith(SYSTEM[speaker])
        assert call.segments[-1].kind == "pf" and call.segments[-1].text.endswith(f"\n\n### {speaker}\n")
        # every earlier message, in order: the task as `query`, each agent's as out:<agent>
        # (the speaker's own earlier messages too); empty messages keep only their header
        want = [("query" if m.source == "user" else f"out:{m.source}", m.content) for m in messages[:k] if m.content]
        assert phs(call) == want
        assert [s.name for s in result.segments if s.kind == "ph"] == [slot for slot, _ in want]

    selector = next(call for call in (c for c, _ in mine) if call.agent == SELECTOR)
    text = "".join(s.text for s in selector.segments)
    assert text.startswith("\n\n### user\nYou are in a role play game.")
    assert text.endswith(f"\n\n### {SELECTOR}\n")
    assert f"user: {task}" in text and "planner: The planner agent." in text
    quoted = {m.content.strip(): ("query" if m.source == "user" else f"out:{m.source}") for m in messages[:3]}
    assert ("query", task) in phs(selector)  # the runtime had seen the task: a PH inside PF wording
    assert all(quoted.get(t.strip()) == slot for slot, t in phs(selector))
    index = [s.slot for s in selector.segments].index("query")
    assert selector.segments[index - 1].kind == "pf" and selector.segments[index - 1].text.endswith("user: ")


# --- 1. a SelectorGroupChat end to end ------------------------------------------------------

def test_selector_group_chat_shares_one_client():
    rt = runtime("kvcmas_entropy")  # the default's cost model would prefill a 47-token task as NonShared
    seen = record(rt)
    client = AgentCacheChatCompletionClient(rt, max_tokens=6)
    team = team_of(dict.fromkeys(NAMES, client), client)
    result = asyncio.run(team.run(task=TASK))
    check_team_run(rt, seen, team, result.messages)

    assert {r.agent for r in rt.results} == {*NAMES, SELECTOR}
    assert len(rt.events) == len(rt.results) == len(client.results) == MESSAGES
    assert [e.agent for e in rt.events] == [r.agent for r in rt.results]
    assert {e.session for e in rt.events} == {team._team_id}

    # chained: the second agent reads the task the planner materialized (few anchors yet: a
    # fallback with its source), and the planner's second turn hits its own cached prefix
    local = next(r for r in rt.results if r.agent == "local")
    query = next(s for s in local.segments if s.name == "query")
    assert query.decision in ("corrected", "reused", "fallback") and query.source == "planner"
    assert any(s.source is not None for r in rt.results for s in r.segments if s.kind == "ph")
    *_, before, planner_again = [r for r in rt.results if r.agent == "planner"]
    assert planner_again.prompt_ids[: before.prompt_tokens] == before.prompt_ids  # its last prompt opens this one
    block = rt.engine.block_size
    assert planner_again.cached_tokens >= before.prompt_tokens // block * block  # so its full blocks hit

    figures = rt.summary()
    assert figures["strategy"] == "kvcmas_entropy" and figures["calls"] == MESSAGES
    assert 0.0 < figures["hit_rate"] < 1.0 and 0.0 <= figures["reuse_ratio"] <= 1.0
    assert figures["ttft_p50_s"] > 0
    assert figures["dispatches"] == dict(Counter(f"autogen:{r.agent}" for r in rt.results))
    assert figures["dispatches"]["autogen:selector"] == 1 and figures["dispatches"]["autogen:planner"] >= 2


def test_repeated_team_runs_reuse_shared_segments():
    """Anchors from earlier runs let later runs correct and inject shared segments (gate open)."""
    rt = runtime(STRATEGIES["kvcmas"].replace(accept="entropy", tau=1.0))
    seen = record(rt)
    client = AgentCacheChatCompletionClient(rt, max_tokens=6)
    tasks = [TASK, "Find a quiet hotel near the river in Porto for two nights.",
             "Suggest museums in Madrid for a rainy weekend with kids."]
    sessions = []
    for task in tasks:
        team = team_of(dict.fromkeys(NAMES, client), client)
        check_team_run(rt, seen, team, asyncio.run(team.run(task=task)).messages, task)
        sessions.append(team._team_id)
    assert len(set(sessions)) == 3 and [e.session for e in rt.events] == [c.session for c, _ in seen]
    last = [r for (c, r) in seen if c.session == sessions[-1]]
    assert sum(r.reused_tokens for r in last) > 0
    corrected = [s for r in last for s in r.segments if s.decision in ("corrected", "reused")]
    assert corrected and all(s.kind == "ph" and s.source in (*NAMES, SELECTOR) for s in corrected)
    assert rt.summary()["reuse_ratio"] > 0


# --- 2. one client per agent --------------------------------------------------------------------

def test_for_agent_outside_a_team_and_the_default_agent():
    rt = runtime()
    client = AgentCacheChatCompletionClient(rt, max_tokens=4)
    planner = client.for_agent("planner")
    assert planner.runtime is rt and planner.sampling == client.sampling
    result = asyncio.run(planner.create(msgs()))
    assert isinstance(result, CreateResult) and isinstance(result.content, str)
    assert [r.agent for r in rt.results] == ["planner"] and planner.results == rt.results
    event = rt.events[-1]
    assert (event.agent, event.session, event.framework, event.caller) == ("planner", None, "autogen", None)

    asyncio.run(client.for_agent("local", session="trip-1").create(msgs(system=SYSTEM["local"])))
    assert (rt.events[-1].agent, rt.events[-1].session) == ("local", "trip-1")

    # a bare create names no agent: the client's default agent calls
    asyncio.run(client.create(msgs()))
    assert rt.results[-1].agent == "assistant" and client.to_call(msgs()).agent == "assistant"
    writer = AgentCacheChatCompletionClient(rt, default_agent="writer")
    assert writer.to_call(msgs()).segments[-1].text.endswith("### writer\n")
    for bad in ("", "  ", 3):
        with pytest.raises(ValueError, match="default_agent"):
            AgentCacheChatCompletionClient(rt, default_agent=bad)
    assert len(rt.events) == len(rt.results) == 3


def test_caller_inside_a_handler():
    """Inside an AutoGen message handler the agent id names the caller and its team (session)."""
    client = AgentCacheChatCompletionClient(runtime())
    with MessageHandlerContext.populate_context(AgentId("planner_team-1", "team-1")):
        assert client.caller() == Caller("planner", "team-1", "planner_team-1/team-1", False)
        # a per-agent client keeps its name, and the team's id is still the session
        assert client.for_agent("local").caller() == Caller("local", "team-1", "planner_team-1/team-1", False)
        assert client.for_agent("local", session="s").caller().session == "s"
    with MessageHandlerContext.populate_context(AgentId("SelectorGroupChatManager_team-1", "team-1")):
        assert client.caller() == Caller(SELECTOR, "team-1", "SelectorGroupChatManager_team-1/team-1", True)
        # The manager is recognised by its AutoGen type, whatever the client calls it.
        assert client.for_agent("router").caller().manager


def test_selector_prompt_is_split_whatever_the_client_names_it():
    """A selector whose client has a fixed agent name still gets its wording as PF and the quoted
    conversation as PH; a participant named like the selector does not."""
    rt = runtime("kvcmas")
    planner = AgentCacheChatCompletionClient(rt, agent="planner", session="team-1")
    asyncio.run(planner.create([SystemMessage(content=SYSTEM["planner"]), UserMessage(content=TASK, source="user")]))
    prompt = f"Roles: planner, local.\n\nuser: {TASK}\n\nWho speaks next?"
    router = AgentCacheChatCompletionClient(rt, agent="router")
    with MessageHandlerContext.populate_context(AgentId("SelectorGroupChatManager_team-1", "team-1")):
        call = router.to_call([UserMessage(content=prompt, source="user")])
    assert call.agent == "router"
    assert [(s.kind, s.slot) for s in call.segments] == [("pf", None), ("ph", "query"), ("pf", None)]
    assert call.segments[1].text == TASK
    participant = AgentCacheChatCompletionClient(rt, agent=SELECTOR, session="team-1")
    plain = participant.to_call([UserMessage(content=prompt, source="user")])
    assert [(s.kind, s.slot) for s in plain.segments] == [("pf", None), ("ph", "query"), ("pf", None)]
    assert plain.segments[1].text == prompt  # not a manager: the whole message is the user's


def test_team_with_one_client_per_agent_streaming():
    """Per-agent clients in a team (agents and selector streaming): same sessions, same layout."""
    rt = runtime("kvcmas")
    seen = record(rt)
    shared = AgentCacheChatCompletionClient(rt, max_tokens=6)
    clients = {name: shared.for_agent(name) for name in NAMES}
    team = team_of(clients, shared.for_agent(SELECTOR), streaming=True)
    result = asyncio.run(team.run(task=TASK))
    check_team_run(rt, seen, team, result.messages)
    assert all(len(clients[name].results) == sum(m.source == name for m in result.messages) for name in NAMES)


# --- 3. streaming -------------------------------------------------------------------------------

async def _stream(client, messages, **kwargs) -> list:
    return [item async for item in client.create_stream(messages, **kwargs)]


def test_create_stream_matches_create():
    messages = msgs("Name two parks in Lisbon.", system="You are the planner agent.")
    # tiny-qwen2's random weights write a few characters here; tiny-llama's write only byte
    # fragments of no character, which the stream holds back to the end
    fresh = partial(runtime, preset="tiny-qwen2")
    items = asyncio.run(_stream(AgentCacheChatCompletionClient(fresh(), agent="planner",
                                                               max_tokens=8), messages))
    *chunks, final = items
    assert isinstance(final, CreateResult) and all(isinstance(c, str) and c for c in chunks)
    assert len(chunks) >= 2 and "".join(chunks) == final.content  # sent as generated, not only at the end
    plain = asyncio.run(AgentCacheChatCompletionClient(fresh(), agent="planner",
                                                       max_tokens=8).create(messages))
    assert plain.content == final.content and plain.usage == final.usage
    assert plain.finish_reason == final.finish_reason == "length" and final.usage.completion_tokens == 8

    # a stop string (up to two characters, here split over tokens): the streamed text never shows it
    text = final.content
    stop = text.lstrip("\ufffd").split("\ufffd")[0][:2]
    assert stop and text.find(stop) > 0, text
    args = {"extra_create_args": {"stop": stop}}
    *chunks, stopped = asyncio.run(_stream(AgentCacheChatCompletionClient(fresh(), agent="planner", max_tokens=8),
                                           messages, **args))
    assert isinstance(stopped, CreateResult) and "".join(chunks) == stopped.content == text[: text.find(stop)]
    assert stopped.finish_reason == "stop" and stop[0] not in "".join(chunks)
    plain = asyncio.run(AgentCacheChatCompletionClient(fresh(), agent="planner", max_tokens=8).create(
        messages, **args))
    assert plain.content == stopped.content and plain.finish_reason == "stop"

    # a stop string the text ends with the start of: that tail is held back, then sent at the end
    tail = text[-1] + "\x00\x00"
    *chunks, final = asyncio.run(_stream(AgentCacheChatCompletionClient(fresh(), agent="planner", max_tokens=8),
                                         messages, extra_create_args={"stop": [tail, "\x01\x02"]}))
    assert final.content == text and final.finish_reason == "length"
    assert "".join(chunks) == text and chunks[-1].endswith(text[-1])


# --- 4. messages to segments --------------------------------------------------------------------

def test_message_mapping():
    rt = runtime()
    client = AgentCacheChatCompletionClient(rt, max_tokens=4)
    messages = [
        SystemMessage(content="You are the local agent."),
        UserMessage(content=TASK, source="user"),
        UserMessage(content="Day one: Belem and the tower.", source="planner"),
        AssistantMessage(content="Take tram 28 to Alfama.", source="local"),
        FunctionExecutionResultMessage(content=[
            FunctionExecutionResult(content="sunny, 24C", name="weather", call_id="1")]),
    ]
    call = client.to_call(messages, tools=[WEATHER], caller=Caller("local", "s1", None, False))
    assert (call.agent, call.session) == ("local", "s1")
    layout = [(s.kind, s.slot, s.text) for s in call.segments]
    head = layout[0][2]
    assert layout[0][0] == "pf" and head.startswith("You are the local agent.\n\nTools:\n")
    assert '"name": "weather"' in head and "Current weather in a city." in head
    assert head.endswith("\n\n### user\n")
    assert layout[1:] == [
        ("ph", "query", TASK),
        ("pf", None, "\n\n### planner\n"),
        ("ph", "out:planner", "Day one: Belem and the tower."),
        ("pf", None, "\n\n### local\n"),
        ("ph", "out:local", "Take tram 28 to Alfama."),  # its own earlier message: out:<self>
        ("pf", None, "\n\n### tool weather\n"),
        ("ph", "tool:weather", "sunny, 24C"),
        ("pf", None, "\n\n### local\n"),
    ]

    def forecast(city: str) -> str:
        return "rain"

    tool = FunctionTool(forecast, description="Tomorrow's forecast for a city.")
    with_tool = client.to_call(messages[:2], tools=[tool], caller=Caller("local", None, None, False))
    assert '"name": "forecast"' in with_tool.segments[0].text
    assert "Tomorrow's forecast for a city." in with_tool.segments[0].text
    bare = client.to_call(messages[1:2], caller=Caller("local", None, None, False))  # no system message: the header comes first
    assert [(s.kind, s.text) for s in bare.segments] == [("pf", "\n\n### user\n"), ("ph", TASK),
                                                          ("pf", "\n\n### local\n")]

    # the same messages in two agents' prompts (different system messages) get the same token ids
    shared = messages[1:3]
    a = asyncio.run(client.for_agent("summary").create([SystemMessage(content=SYSTEM["summary"]), *shared]))
    b = asyncio.run(client.for_agent("critic").create([SystemMessage(content="Criticize plans."), *shared]))
    assert a.usage.prompt_tokens != b.usage.prompt_tokens
    first, second = rt.results
    for slot in ("query", "out:planner"):
        spans = []
        for r in (first, second):
            seg = next(s for s in r.segments if s.name == slot)
            spans.append(r.prompt_ids[seg.start: seg.start + seg.length])
        assert spans[0] == spans[1] and spans[0] == rt.engine.tokenize(dict(phs(call))[slot])


# --- 5. refused input ---------------------------------------------------------------------------

def test_bad_input_is_refused_clearly_and_the_runtime_stays_usable():
    rt = runtime()
    client = AgentCacheChatCompletionClient(rt, agent="planner", max_tokens=4)
    image = Image.from_pil(PIL.Image.new("RGB", (4, 4)))

    async def scenario():
        with pytest.raises(UnsupportedMessageError, match="message 1 contains an image"):
            await client.create([SystemMessage(content="sys"), UserMessage(content=["look", image], source="user")])
        with pytest.raises(UnsupportedRequestError, match="json_output must be a bool or a pydantic"):
            await client.create(msgs(), json_output=dict)
        with pytest.raises(UnsupportedRequestError, match="tool_choice='required'"):
            await client.create(msgs(), tools=[WEATHER], tool_choice="required")
        with pytest.raises(UnsupportedRequestError, match="frequency_penalty"):
            await client.create(msgs(), extra_create_args={"frequency_penalty": 0.5})
        not_a_message = FunctionExecutionResult(content="x", name="weather", call_id="1")
        with pytest.raises(UnsupportedMessageError, match="message 1 is a FunctionExecutionResult"):
            await client.create([SystemMessage(content="sys"), not_a_message])
        with pytest.raises(UnsupportedRequestError, match="json_output must be a bool or a pydantic"):
            await _stream(client, msgs(), json_output=dict)
        with pytest.raises(UnsupportedMessageError, match="image"):
            await _stream(client, [UserMessage(content=[image], source="user")])
        assert rt.events == [] and rt.results == []  # nothing reached the runtime
        return await client.create(msgs(), extra_create_args={"max_tokens": 3, "stop": "zz"})

    result = asyncio.run(scenario())
    assert isinstance(result.content, str) and result.usage.completion_tokens <= 3
    assert [r.agent for r in rt.results] == [e.agent for e in rt.events] == ["planner"]
    assert issubclass(UnsupportedMessageError, ValueError) and issubclass(UnsupportedRequestError, ValueError)


# --- 6. usage, counting and model info ----------------------------------------------------------

def test_usage_counting_and_model_info():
    rt = runtime(warmup=True)
    client = AgentCacheChatCompletionClient(rt, max_tokens=4)
    planner = client.for_agent("planner")
    messages = msgs()

    async def scenario():
        first = await planner.create(messages)
        again = await planner.create(messages)  # the same prompt: an exact prefix hit
        with_tool = await planner.create(messages, tools=[WEATHER])
        with MessageHandlerContext.populate_context(AgentId("local_team-1", "team-1")):
            count_in_handler = client.count_tokens(messages)  # the shared client counts as the caller
            in_handler = await client.create(messages)
        await client.close()
        await planner.close()
        return first, again, with_tool, count_in_handler, in_handler

    first, again, with_tool, count_in_handler, in_handler = asyncio.run(scenario())
    results = planner.results
    assert len(results) == 3 and rt.results[-1].agent == "local"
    total = planner.total_usage()
    assert total.prompt_tokens == sum(r.prompt_tokens for r in results)
    assert total.prompt_tokens == first.usage.prompt_tokens + again.usage.prompt_tokens + with_tool.usage.prompt_tokens
    assert total.completion_tokens == sum(len(r.token_ids) for r in results)
    block = rt.engine.block_size
    assert results[1].cached_tokens == (results[1].prompt_tokens - 1) // block * block  # all but the last token's
    actual = planner.actual_usage()
    assert actual.prompt_tokens < total.prompt_tokens
    assert actual.prompt_tokens == sum(r.prompt_tokens - r.cached_tokens - r.reused_tokens for r in results)
    assert actual.completion_tokens == total.completion_tokens
    assert client.total_usage().prompt_tokens == in_handler.usage.prompt_tokens  # each client counts its own

    count = planner.count_tokens(messages)
    assert count == first.usage.prompt_tokens == again.usage.prompt_tokens
    assert planner.count_tokens(messages, tools=[WEATHER]) == with_tool.usage.prompt_tokens > count
    assert count_in_handler == in_handler.usage.prompt_tokens
    assert planner.remaining_tokens(messages) == rt.engine.max_context - count

    info = client.model_info
    validate_model_info(info)
    assert info["function_calling"] is False and info["vision"] is False and info["json_output"] is True
    assert client.capabilities["function_calling"] is False


# --- 7. concurrency -----------------------------------------------------------------------------

def test_concurrent_creates_and_teams_on_one_runtime():
    rt = runtime("kvcmas")
    seen = record(rt)
    client = AgentCacheChatCompletionClient(rt, max_tokens=4)
    planner, local = client.for_agent("planner"), client.for_agent("local")

    async def both_agents():
        return await asyncio.gather(planner.create(msgs()), local.create(msgs(system=SYSTEM["local"])))

    a, b = asyncio.run(both_agents())
    assert isinstance(a, CreateResult) and isinstance(b, CreateResult)
    assert [r.agent for r in planner.results] == ["planner"] and [r.agent for r in local.results] == ["local"]
    assert sorted(e.agent for e in rt.events) == ["local", "planner"]
    assert [e.agent for e in rt.events] == [r.agent for r in rt.results]

    tasks = [TASK, "Find a quiet hotel near the river in Porto for two nights."]
    teams = [team_of(dict.fromkeys(NAMES, client), client) for _ in tasks]

    async def two_teams():
        return await asyncio.gather(*(team.run(task=task) for team, task in zip(teams, tasks)))

    runs = asyncio.run(two_teams())
    for team, run, task in zip(teams, runs, tasks):
        check_team_run(rt, seen, team, run.messages, task)
    assert len(rt.results) == len(rt.events) == 2 + 2 * MESSAGES


def test_a_callers_stop_strings_join_the_transcript_stop():
    client = AgentCacheChatCompletionClient(runtime(), agent="planner")
    sampling = client._plan([UserMessage(content=TASK, source="user")], [], "auto", None, {"stop": "END"}).sampling
    assert sampling.stop == ("\n###", "END")  # without "\n###" the model would write other agents' turns


def test_building_a_selector_call_never_waits_for_a_running_call():
    """The selector's prompt reads the runtime's shared texts on the event loop: that must not wait
    for the runtime's lock, which a running call holds for its whole length."""
    import threading

    from agentcache import SamplingParams, Segment

    rt = runtime()
    started, release, gave_up = threading.Event(), threading.Event(), []

    def hold(token: int) -> None:  # the call stops at its first token until the prompt is built
        started.set()
        if not release.wait(30):  # only if building waited for the call: give up, and let it finish
            gave_up.append(token)
            release.set()

    call = AgentCall(agent="planner", session="team-1", segments=(Segment.pf("You plan."), Segment.ph("query", TASK)))
    worker = threading.Thread(target=rt.run, args=(call, SamplingParams(max_tokens=4, ignore_eos=True)),
                              kwargs={"on_token": hold})
    worker.start()
    assert started.wait(60)
    client = AgentCacheChatCompletionClient(rt)
    with MessageHandlerContext.populate_context(AgentId("SelectorGroupChatManager_team-1", "team-1")):
        client.to_call([UserMessage(content=f"Who next?\n\nuser: {TASK}", source="user")])
    assert worker.is_alive() and not gave_up  # built while the call still held its first token
    release.set()
    worker.join()
    assert len(rt.results[-1].token_ids) == 4


@pytest.mark.parametrize("stop, want", [([], ("\n###",)), ("END", ("\n###", "END")), (["A", "B"], ("\n###", "A", "B"))])
def test_constructor_stop_strings_join_the_transcript_stop(stop, want):
    client = AgentCacheChatCompletionClient(runtime(), agent="planner", stop=stop)
    sampling = client._plan([UserMessage(content=TASK, source="user")], [], "auto", None, {}).sampling
    assert sampling.stop == want and client.for_agent("local").sampling.stop == want


def test_a_chatml_model_gets_its_own_frames_and_no_transcript_stop():
    from tests.conftest import chatml_engine

    rt = Runtime(chatml_engine(), config=RuntimeConfig(self_check=False))
    client = AgentCacheChatCompletionClient(rt, max_tokens=3, stop=["END"])
    assert client.sampling.stop == ("END",)
    call = client.to_call(msgs())
    assert call.segments[0].token_ids[0] == rt.chat.start_id
    assert [s.slot for s in call.segments if s.kind == "ph"] == ["query"]
    asyncio.run(client.create(msgs()))
    assert rt.results[-1].agent == "assistant"

"""AutoGen's own agent types and wrappers on the agentcache client, written the way their docs
write them: an AssistantAgent alone, RoundRobinGroupChat, SelectorGroupChat with and without a
`selector_func`, `ChatCompletionCache`, streaming into `Console`, and the client as an AutoGen
component (`dump_component` / `load_component`, a whole team included). Random weights
(tiny-llama): no test reads meaning into generated text."""

from __future__ import annotations

import asyncio
import json

import pytest
from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.conditions import MaxMessageTermination
from autogen_agentchat.messages import ModelClientStreamingChunkEvent, TextMessage
from autogen_agentchat.teams import RoundRobinGroupChat, SelectorGroupChat
from autogen_agentchat.ui import Console
from autogen_core import ComponentModel, InMemoryStore
from autogen_core.models import ChatCompletionClient, UserMessage
from autogen_ext.models.cache import ChatCompletionCache

from agentcache.engine.embedded import EngineConfig
from agentcache.engine.eviction import LRUPolicy
from agentcache.errors import InputError
from agentcache.policies import make_policy
from agentcache.runtime import Runtime, RuntimeConfig
from agentcache_autogen import SELECTOR, AgentCacheChatCompletionClient, AgentCacheClientConfig
from agentcache_autogen import config as client_config
from tests.conftest import make_engine

TASK = "Write a haiku about caches."


def runtime(**config) -> Runtime:
    return Runtime(make_engine("tiny-llama", pool_blocks=256), config=RuntimeConfig(self_check=False, **config))


def ph_slots(rt: Runtime, index: int) -> list[str]:
    return [s.name for s in rt.results[index].segments if s.name != "pf"]


def test_assistant_agent_alone_runs_as_its_own_name():
    rt = runtime()
    client = AgentCacheChatCompletionClient(rt, max_tokens=4)
    helper = AssistantAgent("helper", client, system_message="You are a helpful poet.")
    first = asyncio.run(helper.run(task=TASK))
    assert first.messages[-1].source == "helper"
    assert [r.agent for r in rt.results] == ["helper"] and ph_slots(rt, 0) == ["query"]
    # the same agent again: its model context holds its own reply, read back as out:helper
    asyncio.run(helper.run(task="Now one about eviction."))
    assert [r.agent for r in rt.results] == ["helper", "helper"]
    assert ph_slots(rt, 1) == ["query", "out:helper", "query"]
    assert rt.events[-1].framework == "autogen" and rt.events[-1].session is None
    # two agents on one client are told apart by name
    asyncio.run(AssistantAgent("critic", client).run(task=TASK))
    assert rt.results[-1].agent == "critic"


def test_round_robin_team_runs_each_agent_in_turn_in_the_teams_session():
    rt = runtime()
    client = AgentCacheChatCompletionClient(rt, max_tokens=4)
    team = RoundRobinGroupChat([AssistantAgent(name, client) for name in ("writer", "editor")],
                               termination_condition=MaxMessageTermination(5))
    result = asyncio.run(team.run(task=TASK))
    assert [m.source for m in result.messages] == ["user", "writer", "editor", "writer", "editor"]
    assert [r.agent for r in rt.results] == ["writer", "editor", "writer", "editor"]
    assert {r.session for r in rt.results} == {team._team_id}
    # the editor reads the writer's message as the writer's shared output
    assert ph_slots(rt, 1) == ["query", "out:writer"]


def test_selector_group_chat_without_selector_func_asks_the_model():
    rt = runtime()
    client = AgentCacheChatCompletionClient(rt, max_tokens=4)
    agents = [AssistantAgent(name, client, description=f"The {name}.") for name in ("planner", "critic")]
    # allow_repeated_speaker: every turn has two candidates, so the model is asked every turn
    team = SelectorGroupChat(agents, model_client=client, max_selector_attempts=1, allow_repeated_speaker=True,
                             termination_condition=MaxMessageTermination(3))
    result = asyncio.run(team.run(task=TASK))
    speakers = [m.source for m in result.messages[1:]]
    assert len(speakers) == 2 and set(speakers) <= {"planner", "critic"}
    agents_called = [r.agent for r in rt.results]
    # the model picks every speaker: one selector call before each agent's turn
    assert agents_called[0::2] == [SELECTOR, SELECTOR] and agents_called[1::2] == speakers
    assert {e.session for e in rt.events} == {team._team_id}


def test_selector_group_chat_with_selector_func_never_asks_the_model():
    rt = runtime()
    client = AgentCacheChatCompletionClient(rt, max_tokens=4)
    agents = [AssistantAgent(name, client) for name in ("planner", "critic")]
    order = iter(["critic", "planner", "critic"])
    team = SelectorGroupChat(agents, model_client=client, selector_func=lambda thread: next(order),
                             termination_condition=MaxMessageTermination(4))
    asyncio.run(team.run(task=TASK))
    assert [r.agent for r in rt.results] == ["critic", "planner", "critic"]


def test_chat_completion_cache_serves_a_repeated_request_without_the_runtime():
    rt = runtime()
    cached = ChatCompletionCache(AgentCacheChatCompletionClient(rt, max_tokens=4), InMemoryStore())
    messages = [UserMessage(content=TASK, source="user")]
    first = asyncio.run(cached.create(messages))
    again = asyncio.run(cached.create(messages))
    assert again.cached and again.content == first.content  # (the cache marks the stored object itself)
    assert len(rt.results) == 1  # the second answer came from the cache, not the engine
    # an agent on the cached client still runs under its own name
    asyncio.run(AssistantAgent("helper", cached).run(task="Something else."))
    assert rt.results[-1].agent == "helper"
    # the wrapper dumps with our client inside it
    dumped = cached.dump_component()
    assert dumped.config["client"]["provider"] == "agentcache_autogen.AgentCacheChatCompletionClient"


def test_streaming_agent_into_console(capsys):
    rt = runtime()
    client = AgentCacheChatCompletionClient(rt, max_tokens=6)
    helper = AssistantAgent("helper", client, model_client_stream=True)
    seen = []

    async def watched():  # what Console reads, recorded on the way
        async for item in helper.run_stream(task=TASK):
            seen.append(item)
            yield item

    result = asyncio.run(Console(watched()))
    chunks = [m for m in seen if isinstance(m, ModelClientStreamingChunkEvent)]
    reply = result.messages[-1]
    assert isinstance(reply, TextMessage) and reply.source == "helper"
    assert chunks and "".join(c.content for c in chunks) == reply.content == rt.results[-1].text
    printed = capsys.readouterr().out
    assert "helper" in printed and reply.content in printed


def test_a_team_saved_and_loaded_resumes_its_conversation():
    rt = runtime()
    client = AgentCacheChatCompletionClient(rt, max_tokens=4)

    def team():
        return RoundRobinGroupChat([AssistantAgent(name, client) for name in ("writer", "editor")],
                                   termination_condition=MaxMessageTermination(3))

    first = team()
    asyncio.run(first.run(task=TASK))
    state = json.loads(json.dumps(asyncio.run(first.save_state())))
    resumed = team()
    asyncio.run(resumed.load_state(state))
    asyncio.run(resumed.run(task="Shorter, please."))
    # the resumed writer reads the saved conversation: the first task, both replies, the new task
    assert rt.results[-2].agent == "writer"
    assert ph_slots(rt, -2) == ["query", "out:writer", "out:editor", "query"]


# --- the client as an AutoGen component ----------------------------------------------------------

def test_client_config_round_trips_through_json_onto_the_same_runtime():
    rt = runtime(anchor_bytes=2**20)
    client = AgentCacheChatCompletionClient(rt, agent="planner", session="trip", max_tokens=7, temperature=0.5,
                                            stop=["END"])
    dumped = client.dump_component()
    assert dumped.provider == "agentcache_autogen.AgentCacheChatCompletionClient"
    config = dumped.config
    assert (config["model"], config["strategy"]) == ("tiny-llama", "kvcmas")
    assert config["engine"]["pool_blocks"] == 256 and config["runtime"]["anchor_bytes"] == 2**20
    assert config["stop"] == ["END"]  # the caller's own stops; the transcript's is always added
    loaded = ChatCompletionClient.load_component(ComponentModel(**json.loads(dumped.model_dump_json())))
    assert isinstance(loaded, AgentCacheChatCompletionClient)
    assert loaded.runtime is rt  # in this process, the config names the live runtime
    assert (loaded.agent, loaded.session, loaded.sampling) == ("planner", "trip", client.sampling)


def test_a_loaded_team_runs_all_its_clients_on_one_runtime():
    rt = runtime()
    client = AgentCacheChatCompletionClient(rt, max_tokens=4)
    team = RoundRobinGroupChat([AssistantAgent(name, client) for name in ("writer", "editor")],
                               termination_condition=MaxMessageTermination(3))
    dumped = json.loads(team.dump_component().model_dump_json())
    loaded = RoundRobinGroupChat.load_component(dumped)
    asyncio.run(loaded.run(task=TASK))
    assert [r.agent for r in rt.results] == ["writer", "editor"]


def test_a_config_with_no_live_runtime_builds_one_and_shares_it(monkeypatch):
    monkeypatch.setattr(client_config, "_live", type(client_config._live)())  # as in a fresh process
    config = AgentCacheClientConfig(model="tiny-llama", engine={"pool_blocks": 64},
                                    runtime={"self_check": False, "scout": {"r_min": 0.5}}, max_tokens=3)
    spec = {"provider": "agentcache_autogen.AgentCacheChatCompletionClient", "config": config.model_dump()}
    first = ChatCompletionClient.load_component(spec)
    assert first.runtime.engine.pool.capacity == 64
    # a config without a runtime id is a runtime of its own; configs naming one id share one
    assert ChatCompletionClient.load_component(spec).runtime is not first.runtime
    team_spec = {**spec, "config": {**spec["config"], "runtime_id": "saved-team"}}
    writer, editor = (ChatCompletionClient.load_component(team_spec) for _ in range(2))
    assert writer.runtime is editor.runtime
    assert first.runtime.config.scout.r_min == 0.5
    reply = asyncio.run(first.create([UserMessage(content=TASK, source="user")]))
    assert isinstance(reply.content, str) and first.runtime.results[-1].agent == "assistant"
    other = ChatCompletionClient.load_component({**spec, "config": {**spec["config"], "strategy": "nonshared"}})
    assert other.runtime.strategy.name == "nonshared"


@pytest.mark.parametrize("config, problem", [
    ({"engine": {"no_such_option": 1}}, "no_such_option"),
    ({"runtime": {"keep_calls": -1}}, "keep_calls"),
    ({"model": "no-such-model"}, "no-such-model"),
    ({"stratgy": "kvcmas"}, "stratgy"),
])
def test_a_bad_config_is_refused_naming_the_problem(monkeypatch, config, problem):
    monkeypatch.setattr(client_config, "_live", type(client_config._live)())
    spec = {"provider": "agentcache_autogen.AgentCacheChatCompletionClient", "config": config}
    with pytest.raises(Exception, match=problem):
        ChatCompletionClient.load_component(spec)


@pytest.mark.parametrize("policy", [LRUPolicy, lambda: make_policy("survival")])
def test_a_policy_object_a_registry_name_builds_again_round_trips(policy):
    rt = Runtime(make_engine("tiny-llama", pool_blocks=64, eviction=policy()), config=RuntimeConfig(self_check=False))
    spec = AgentCacheChatCompletionClient(rt).dump_component()
    expected = rt.engine.eviction_policy.name
    assert spec.config["engine"]["eviction"] == expected
    spec.config["runtime_id"] = None  # build a new runtime from the config, not the live one
    again = ChatCompletionClient.load_component(spec)
    assert type(again.runtime.engine.eviction_policy) is type(rt.engine.eviction_policy)


def test_runtimes_no_config_can_describe_are_refused_on_dump():
    from agentcache.models import load_model
    from agentcache.engine.embedded import EmbeddedEngine

    from agentcache.scout import TTLPolicy

    by_object = Runtime(make_engine("tiny-llama", pool_blocks=64, eviction=TTLPolicy(ttl=3)),
                        config=RuntimeConfig(self_check=False))
    with pytest.raises(InputError, match="eviction policy object"):  # no name builds a TTL of 3 again
        AgentCacheChatCompletionClient(by_object).dump_component()
    loaded = load_model("tiny-llama")
    loaded.name = "my-model"  # loaded by the caller, not a preset: nothing says how to load it again
    by_caller = Runtime(EmbeddedEngine(loaded, EngineConfig(pool_blocks=64)), config=RuntimeConfig(self_check=False))
    with pytest.raises(InputError, match="loaded by the caller"):
        AgentCacheChatCompletionClient(by_caller).dump_component()

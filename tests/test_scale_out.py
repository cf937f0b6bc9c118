"""benchmarks/scale_out.py in its quick mode: two `agentcache serve` processes (tiny-llama) behind
a real vllm-router binary on loopback ports, sharing one anchors directory. Session affinity keeps
every session on one instance (round-robin scatters them), a fresh instance reuses from its first
chance with the shared anchors (a cold one cannot), and killing an instance mid-session loses no
request that started after the kill, the moved sessions' first calls on the survivor computed
densely and equal to a dense run. Random weights say nothing about speed: no TTFT aim is held."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from tests.conftest import load_benchmark

pytestmark = pytest.mark.skipif(shutil.which("vllm-router") is None
                                and not Path(sys.executable).with_name("vllm-router").is_file(),
                                reason="vllm-router is not installed (the cluster extra)")

KEYS = {"hit_rate_round_robin", "hit_rate_affinity", "reuse_ratio_round_robin", "reuse_ratio_affinity",
        "p50_ttft_ratio_affinity_vs_round_robin", "warm_instance_first_call_reuse", "cold_instance_first_call_reuse",
        "failover_errors", "failover_inflight_failures", "failover_moved_sessions", "failover_moved_calls_checked",
        "failover_moved_calls_dense", "failover_moved_calls_equal_dense", "sessions_on_one_instance", "policies",
        "aims", "aims_met", "router", "model", "sizes", "machine", "elapsed_s"}


def test_scale_out_quick_affinity_shared_anchors_and_failover(monkeypatch, capsys, tmp_path):
    scale_out = load_benchmark(monkeypatch, "scale_out")
    out = tmp_path / "scale_out.json"
    result = scale_out.main(["--quick", "--out", str(out)])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(out.read_text())
    assert KEYS <= result.keys() and result["router"]["name"] == "vllm-router"
    policies = result["policies"]
    assert all(p["errors"] == 0 and p["failed_trajectories"] == 0 for p in policies.values())
    # affinity: each session on one instance, so its shared context is reused there
    assert result["sessions_on_one_instance"]["sticky_least_loaded"] == 1.0
    assert result["sessions_on_one_instance"]["round_robin"] < 1.0
    assert result["reuse_ratio_affinity"] > result["reuse_ratio_round_robin"]
    # anchors shared through the directory: warm from the first call that can reuse
    assert result["warm_instance_first_call_reuse"] > 0 == result["cold_instance_first_call_reuse"]
    # failover: nothing that started after the kill failed; moved sessions computed densely and correctly
    assert result["failover_errors"] == 0, result["failover_error_samples"]
    assert result["failover_moved_sessions"] > 0
    assert (result["failover_moved_calls_checked"] == result["failover_moved_calls_dense"]
            == result["failover_moved_calls_equal_dense"] == result["failover_moved_sessions"])
    assert result["aims_met"]["failover_errors"] and result["aims_met"]["warm_instance_first_call_reuse"]

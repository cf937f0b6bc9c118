"""benchmarks/vs_vllm.py --quick: real `vllm serve` and `agentcache serve` processes on loopback
ports, driven by the openai client, one at a time, within CI's budget for it (4 minutes)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import require_vllm

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.vllm
def test_the_quick_head_to_head_runs_every_server_on_every_workload_in_under_four_minutes(tmp_path):
    require_vllm()
    out = tmp_path / "vs_vllm.json"
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vs_vllm.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert json.loads(done.stdout.strip().splitlines()[-1]) == result
    assert elapsed < 240, f"the quick head-to-head took {elapsed:.0f} s; CI gives it 4 minutes"
    assert result["servers"] == ["vllm-serve", "agentcache", "agentcache-nonshared"]
    assert set(result["table"]) == {"inline/quiet", "messages/quiet"}
    for key, rows in result["table"].items():
        assert set(rows) == set(result["servers"]), key
        for server, row in rows.items():
            assert row["workflows"] == 2 and row["answers"] == 2
            for figure in ("wall_s", "ttft_s", "later_ttft_s", "requests_per_s", "prompt_tokens"):
                assert math.isfinite(row[figure]) and row[figure] > 0, (key, server, figure)
            if server != "vllm-serve":
                assert math.isfinite(row["wall_vs_vllm"]) and 0 <= row["answers_equal_vllm"] <= 1
    # the document inside each later agent's message is found over HTTP, with no agentcache fields
    assert result["table"]["inline/quiet"]["agentcache"]["found_spans"] >= 4
    assert result["table"]["inline/quiet"]["agentcache-nonshared"]["found_spans"] == 0
    assert result["agentcache_counters"]["agentcache"]["shadow_runs_total"] >= 1  # verified without idle time
    assert all(0 < seconds < 200 for starts in result["start_s"].values() for seconds in starts)
    assert set(result["aims_met"]) == set(result["aims"])

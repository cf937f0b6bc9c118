"""benchmarks/serve_load.py run in-process in its quick mode (tiny-llama, random weights) at small
sizes with a short soak: the JSON's keys, no failed HTTP request, and figures that are finite and
agree with each other. Random weights say nothing about speed, so no ratio is held to its aim."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import load_benchmark

KEYS = {"http_overhead_ratio", "p50_ttft_ratio_kvcmas_vs_nonshared", "p90_ttft_ratio_kvcmas_vs_nonshared",
        "p50_ttft_ratio_vs_vllm_serve", "vllm_serve_note", "errors", "error_samples", "max_rss_mb",
        "rss_growth_mb_per_1000_requests", "soak_requests", "http_overhead", "saturation_trajectories_per_s",
        "loads", "vllm_serve", "soak", "aims", "aims_met", "model", "engine", "sizes", "machine", "elapsed_s"}
SMALL = ["--quick", "--context", "96", "--output-tokens", "4", "--warmup", "1", "--overhead-pairs", "3",
         "--saturation", "2", "--trajectories", "3", "--full-load-trajectories", "3",
         "--soak-s", "2", "--soak-sample-s", "0.2", "--soak-warmup", "0"]


@pytest.fixture
def serve_load(monkeypatch):
    return load_benchmark(monkeypatch, "serve_load")


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_serve_load_quick_reports_every_key_without_errors(serve_load, capsys, tmp_path):
    out = tmp_path / "serve_load.json"
    result = serve_load.main([*SMALL, "--out", str(out)])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # one JSON object on stdout
    assert printed == json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert KEYS <= result.keys()
    assert result["model"] == "tiny-llama" and result["engine"] == "embedded" and result["quick"] is True
    assert result["errors"] == 0 and result["error_samples"] == []
    for key in ("http_overhead_ratio", "p50_ttft_ratio_kvcmas_vs_nonshared", "p90_ttft_ratio_kvcmas_vs_nonshared",
                "max_rss_mb", "saturation_trajectories_per_s", "elapsed_s"):
        assert _positive(result[key]), (key, result[key])
    # vllm serve is never launched in --quick: the key is None and the note says why
    assert result["p50_ttft_ratio_vs_vllm_serve"] is None and result["vllm_serve"] is None
    assert "--quick" in result["vllm_serve_note"]

    overhead = result["http_overhead"]
    assert overhead["requests"] == {"inproc": 3 * 4, "http": 3 * 4} and overhead["failed_http_trajectories"] == 0
    assert overhead["http_ttft_p50_s"] / overhead["inproc_ttft_p50_s"] == pytest.approx(result["http_overhead_ratio"],
                                                                                          rel=1e-3)
    for key in ("inproc_ttft_p50_s", "http_ttft_p50_s", "inproc_runtime_ttft_p50_s", "http_server_ttft_p50_s"):
        assert _positive(overhead[key]), (key, overhead[key])

    assert list(result["loads"]) == ["1.0"]
    rows = result["loads"]["1.0"]["strategies"]
    assert set(rows) == {"nonshared", "kvcmas"}
    for name, row in rows.items():
        assert row["requests"] == 3 * 4 and row["trajectories"] == 3 and row["failed_trajectories"] == 0, name
        for key in ("ttft_p50_s", "ttft_p90_s", "server_ttft_p50_s", "request_latency_mean_s",
                    "trajectory_latency_mean_s", "achieved_trajectories_per_s"):
            assert _positive(row[key]), (name, key, row[key])
        assert row["ttft_p50_s"] <= row["ttft_p90_s"]
        assert row["server_ttft_p50_s"] <= row["ttft_p50_s"]  # each call's server TTFT lies inside its client TTFT
        assert row["prompt_tokens"] > 0 and 0 <= row["reuse_ratio"] <= 1
    assert rows["nonshared"]["reused_tokens"] == 0  # NonShared never reuses shared context
    assert result["p50_ttft_ratio_kvcmas_vs_nonshared"] == pytest.approx(
        rows["kvcmas"]["ttft_p50_s"] / rows["nonshared"]["ttft_p50_s"], rel=1e-3)

    soak = result["soak"]
    assert result["soak_requests"] == soak["requests"] > 0 and soak["failed_trajectories"] == 0
    assert soak["requests"] == 4 * soak["trajectories"]
    growth = result["rss_growth_mb_per_1000_requests"]
    assert growth is None or math.isfinite(growth)  # None only when too few samples landed
    assert len(soak["samples"]) >= 3
    assert set(result["aims_met"]) == set(result["aims"]) and result["aims_met"]["errors"] is True


def test_messages_name_the_earlier_agents_and_the_plain_template_writes_agentcaches_layout(serve_load):
    """What vllm serve reads (the plain template) is the prompt agentcache serve lays out for a base model."""
    import jinja2

    from agentcache.serve.messages import read_messages
    from agentcache.transcript import build_call

    msgs = serve_load.messages(2, "the document", ["the plan", "the facts"])
    assert [m["role"] for m in msgs] == ["system", "user", "user", "user"]
    assert [m.get("name") for m in msgs] == [None, None, "planner", "analyst"]
    agent = serve_load.NAMES[2]
    call = build_call(agent, read_messages(msgs).system, read_messages(msgs).turns(agent))
    laid_out = "".join(segment.text for segment in call.segments)
    assert [s.slot for s in call.segments if s.kind == "ph"] == ["query", "out:planner", "out:analyst"]
    rendered = jinja2.Environment().from_string(serve_load.PLAIN_TEMPLATE).render(
        messages=msgs, bos_token="", add_generation_prompt=True, agent=agent)
    assert rendered == laid_out


def test_rss_slope_is_least_squares(serve_load):
    assert serve_load.slope([(0, 1.0), (1000, 2.0), (2000, 3.0)]) == pytest.approx(0.001)
    assert serve_load.slope([(0, 1.0), (1, 2.0)]) is None  # too few points
    assert serve_load.slope([(5, 1.0), (5, 2.0), (5, 3.0)]) is None  # no spread in requests

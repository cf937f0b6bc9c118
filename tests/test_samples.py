"""The two sample apps run end to end on a tiny model and report what they promise."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_travel_planner_compares_every_hop_with_nonshared(tmp_path):
    from samples.travel_planner.app import AGENTS, print_report, run_trips

    report = run_trips("tiny-llama", trips=2, agent_tokens=6, progress=False)
    agents = [hop["agent"] for hop in report["hops"]]
    # The selector picks who opens (one call, maybe a retry), then every agent speaks once, the summary last.
    assert agents[0] == "selector" and agents[-1] == "Summary"
    assert sorted(a for a in agents if a != "selector") == sorted(AGENTS)
    assert report["same_hops"] is True or len(report["hops"]) > 0
    for hop in report["hops"]:
        assert hop["ttft_s"] > 0 and hop["baseline_ttft_s"] > 0 and hop["prompt_tokens"] > 0
    summary_hop = report["hops"][-1]
    assert "query=" in summary_hop["decisions"] and "out:Planner=" in summary_hop["decisions"]
    rows = {row["strategy"]: row for row in report["strategies"]}
    assert rows["nonshared"]["reuse_ratio"] == 0 and rows["kvcmas"]["calls"] == rows["nonshared"]["calls"]
    assert [source for source, _ in report["transcript"]][0] == "user"
    print_report(report)  # the printed table must render from the report


def test_samples_run_as_modules(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "samples.gsm8k_swarm", "--model", "tiny-llama", "--problems", "1",
         "--strategies", "kvcmas", "--expert-tokens", "3", "--decision-tokens", "3", "--results", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=True)
    assert "same answer as nonshared" in proc.stdout
    report = json.loads((tmp_path / "gsm8k_swarm.json").read_text())
    assert [row["strategy"] for row in report["strategies"]] == ["kvcmas", "nonshared"]  # the baseline is added
    assert (tmp_path / "gsm8k_swarm.png").exists()

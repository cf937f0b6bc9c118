import json
import subprocess
import sys
from pathlib import Path

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


def test_readme_engine_snippet_runs():
    import re

    readme = (ROOT / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    namespace: dict = {"print": lambda *a: None}
    exec(compile(snippet.replace('"gemma3-270m"', '"tiny-llama"'), "README.md", "exec"), namespace)
    assert namespace["result"].segments[1].kv.length == namespace["query_kv"].length > 0

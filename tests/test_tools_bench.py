"""benchmarks/tools.py run in-process in its quick mode (tiny-qwen2-chat, random weights): the JSON's
keys, constrained first calls that are all valid, and figures that agree with each other. Random
weights say nothing about speed or accuracy, so neither is asserted."""

from __future__ import annotations

import json

import pytest

from tests.conftest import load_benchmark

KEYS = {"valid_tool_call_rate_constrained", "valid_tool_call_rate_unconstrained", "task_accuracy",
        "after_tool_result_ttft_ratio", "after_tool_result_wall_ratio", "after_tool_result_prefill_ratio",
        "greedy_agreement", "tool_calls_made", "grammar_mask_overhead", "aims", "aims_met", "model", "engine",
        "machine", "sizes", "elapsed_s"}


@pytest.fixture
def tools_bench(monkeypatch):
    return load_benchmark(monkeypatch, "tools")


def test_tools_quick_reports_valid_constrained_calls_and_consistent_figures(tools_bench, capsys, tmp_path):
    out = tmp_path / "tools.json"
    result = tools_bench.main(["--quick", "--out", str(out)])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(out.read_text()) == result
    assert KEYS <= set(result) and result["model"] == "tiny-qwen2-chat"
    assert result["valid_tool_call_rate_constrained"] == 1.0  # the grammar makes every forced call valid
    assert result["first_calls_per_mode"] == 2 * (2 + 1)  # 2 calc tasks and 1 scored lookup, per strategy
    assert result["tool_calls_made"] >= 2 * 3  # every constrained first call made one, scored or not
    assert 0 < result["grammar_mask_overhead"] < 1
    assert result["tasks"] == 3 and 0 <= result["task_accuracy"] <= 1
    for key in ("after_tool_result_ttft_ratio", "after_tool_result_wall_ratio", "after_tool_result_prefill_ratio"):
        assert result[key] > 0
    assert result["greedy_pairs"] == 3 and set(result["aims_met"]) == set(result["aims"])
    assert result["aims_met"]["valid_tool_call_rate_constrained"] is True


def test_a_model_without_a_tool_format_is_refused(tools_bench):
    with pytest.raises(SystemExit, match="no tool-call format"):
        tools_bench.main(["--quick", "--model", "tiny-llama"])


def test_a_call_is_valid_only_when_it_names_a_tool_and_its_schema_accepts_the_arguments(tools_bench):
    from agentcache.toolcalls import ToolCall

    tools = [tools_bench.ADD]
    assert tools_bench.valid_call((ToolCall("add", {"a": 1, "b": 2}, "c"),), 0, tools)
    assert not tools_bench.valid_call((ToolCall("add", {"a": 1}, "c"),), 0, tools)  # b is required
    assert not tools_bench.valid_call((ToolCall("add", {"a": "1", "b": 2}, "c"),), 0, tools)
    assert not tools_bench.valid_call((ToolCall("sub", {"a": 1, "b": 2}, "c"),), 0, tools)
    assert not tools_bench.valid_call((ToolCall("add", {"a": 1, "b": 2}, "c"),), 1, tools)  # an invalid one beside
    assert not tools_bench.valid_call((), 0, tools)
    assert tools_bench.last_number("29 times 69 is 2,001.") == 2001

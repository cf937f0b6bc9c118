"""The sample apps run end to end on a tiny model and report what they promise."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_travel_planner_compares_every_hop_with_nonshared(tmp_path):
    from agentcache_samples.travel_planner.app import AGENTS, print_report, run_trips

    report = run_trips("tiny-llama", trips=2, agent_tokens=6, progress=False)
    agents = [hop["agent"] for hop in report["hops"]]
    # The selector picks who opens (one call, maybe a retry), then every agent speaks once, the summary last.
    assert agents[0] == "selector" and agents[-1] == "Summary"
    assert sorted(a for a in agents if a != "selector") == sorted(AGENTS)
    assert report["same_hops"]  # the selector's first call is dense under both: the same opener
    for hop in report["hops"]:
        assert hop["ttft_s"] > 0 and hop["baseline_ttft_s"] > 0 and hop["prompt_tokens"] > 0
    summary_hop = report["hops"][-1]
    assert "query=" in summary_hop["decisions"] and "out:Planner=" in summary_hop["decisions"]
    rows = {row["strategy"]: row for row in report["strategies"]}
    assert rows["nonshared"]["reuse_ratio"] == 0 and rows["kvcmas"]["calls"] == rows["nonshared"]["calls"]
    assert rows["nonshared"]["wall_vs_baseline"] == 1.0 and rows["kvcmas"]["workflow_wall_s"] > 0
    assert rows["kvcmas"]["prefill_tokens_per_workflow"] > 0
    assert [source for source, _ in report["transcript"]][0] == "user"
    print_report(report)  # the printed table must render from the report


def test_samples_run_as_modules(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "agentcache_samples.gsm8k_swarm", "--model", "tiny-llama", "--problems", "1",
         "--strategies", "kvcmas", "--expert-tokens", "3", "--decision-tokens", "3", "--results", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=True)
    assert "same answer as nonshared" in proc.stdout
    report = json.loads((tmp_path / "gsm8k_swarm.json").read_text())
    assert [row["strategy"] for row in report["strategies"]] == ["kvcmas", "nonshared"]  # the baseline is added
    assert (tmp_path / "gsm8k_swarm.png").exists()


def test_document_team_shares_the_long_document_and_scores_each_strategy(tmp_path):
    from agentcache_samples.document_team.run import print_report, run_batch, stated_code
    from agentcache_samples.document_team.graph import AGENTS

    report = run_batch("tiny-llama", documents=2, strategies=("kvcmas", "fullshared"), people=8, warmup=1,
                       note_tokens=3, answer_tokens=3, progress_bar=False)
    rows = {row["strategy"]: row for row in report["strategies"]}
    assert list(rows) == ["kvcmas", "fullshared", "nonshared"] and report["agents"] == list(AGENTS)
    for row in rows.values():
        assert row["calls"] == 2 * len(AGENTS)  # the warm-up document is not scored
        assert 0 <= row["accuracy"] <= 1 and set(row["per_agent_service_s"]) == set(AGENTS)
    # every later agent reads the document the reader materialized: reused under FullShared, never under NonShared
    assert rows["fullshared"]["ph_decisions"].get("reused", 0) >= 2 * 3
    assert rows["nonshared"]["reuse_ratio"] == 0 and rows["fullshared"]["reuse_ratio"] > 0.5
    assert report["mean_prompt_tokens"] > 8 * 40
    assert stated_code("The locker code of Ana Silva is 4417.") == 4417 and stated_code("on floor 12") is None
    print_report(report)


def _result(agent: str, ttft: float, queued: float = 0.0, reused: int = 0):
    from agentcache.metrics import CallResult

    return CallResult(agent=agent, text="x", token_ids=[1], finish_reason="length", ttft_s=ttft, queued_s=queued,
                      total_s=ttft, prompt_tokens=100, cached_tokens=20, ph_tokens=50, eligible_tokens=50,
                      reused_tokens=reused, segments=[])


def test_figures_compare_each_call_with_the_baselines_same_call():
    from agentcache_samples._compare import figures, format_table

    mine = [_result("a", 0.2, queued=0.1, reused=50), _result("b", 0.4, reused=25)]
    base = [_result("a", 0.4, queued=0.1), _result("b", 0.8)]
    row = figures(mine, base)
    assert abs(row["ttft_mean_s"] - 0.3) < 1e-9 and abs(row["ttft_vs_baseline"] - 0.5) < 1e-9
    assert abs(row["service_ttft_mean_s"] - 0.25) < 1e-9
    assert abs(row["service_ttft_vs_baseline"] - 0.25 / 0.55) < 1e-9  # queueing taken out of both
    assert abs(row["service_ratio_median"] - (1 / 3 + 0.5) / 2) < 1e-9  # per call: 0.1/0.3 and 0.4/0.8
    assert row["reuse_ratio"] == 0.75 and row["hit_rate"] == 0.2
    assert "ttft_vs_baseline" not in figures(base, None)
    table = format_table([{"s": "kvcmas", "r": 0.5}, {"s": "nonshared", "r": None}], (("s", "strategy", ""), ("r", "ratio", ".2f")))
    assert table.splitlines()[2].split() == ["kvcmas", "0.50"] and table.splitlines()[3].split() == ["nonshared", "-"]


def test_research_team_calls_its_tool_and_compares_the_readers_with_nonshared(tmp_path):
    from agentcache_samples.research_team.run import CALLS, main, run_batch

    report = run_batch("tiny-qwen2-chat", questions=2, warmup=1, result_tokens=200, call_tokens=320,
                       answer_tokens=4, progress_bar=False)
    rows = {row["strategy"]: row for row in report["strategies"]}
    for row in rows.values():
        # the searcher's call is forced: one valid call per scored question, whatever the weights
        assert row["tool_calls"] == 2 and row["invalid_tool_calls"] == 0 and row["valid_tool_call_rate"] == 1.0
        assert set(row["per_call_ttft_s"]) == set(CALLS) and row["readers_ttft_s"] > 0
    assert rows["nonshared"]["readers_ttft_vs_baseline"] == 1.0 and rows["nonshared"]["reuse_ratio"] == 0
    assert rows["kvcmas"]["prefill_tokens_per_workflow"] > 0 and report["tool_result_tokens"] >= 150
    assert main(["--model", "tiny-qwen2-chat", "--questions", "1", "--warmup", "0", "--result-tokens", "100",
                 "--call-tokens", "320", "--answer-tokens", "2", "--results", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "research_team.json").read_text())["questions"] == 1


def test_a_directory_with_distinct_names_gives_everyone_a_first_name_of_their_own():
    from agentcache.tasks import document_problem

    for seed in range(5):
        problem = document_problem(seed, 16, distinct_names=True)
        people = [line.split(" works in ")[0] for line in problem.text.splitlines() if " works in " in line]
        firsts = [name.split()[0] for name in people]
        assert len(people) == 16 and len(set(firsts)) == 16
        assert problem.subject.removeprefix("the locker code of ").removesuffix(" is") in people
        assert f"The locker code of {problem.subject[19:-3]} is {problem.answer}." in problem.text
    assert document_problem(3, 60).text != document_problem(3, 60, distinct_names=True).text
    with pytest.raises(ValueError, match="at most 60 people, got 61"):
        document_problem(0, 61, distinct_names=True)


def test_the_document_team_instructs_a_chat_model_and_shows_a_base_model_worked_examples(monkeypatch):
    from agentcache import Runtime
    from agentcache_langgraph import AgentCacheChatModel
    from agentcache_samples.document_team import graph

    systems = []
    original = AgentCacheChatModel.invoke

    def record(self, messages, *args, **kwargs):
        systems.append(messages[0].content)
        return original(self, messages, *args, **kwargs)

    monkeypatch.setattr(AgentCacheChatModel, "invoke", record)
    for model, prompts in (("tiny-qwen2-chat", graph.INSTRUCT), ("tiny-llama", graph.SYSTEM)):
        systems.clear()
        runtime = Runtime(model=model, strategy="nonshared")
        try:
            team = graph.build_team(AgentCacheChatModel(runtime=runtime, max_tokens=2))
            team.invoke({"document": "Staff directory\n\nAna Silva ... 4417.\n\nQuestion: ?"})
        finally:
            runtime.close()
        assert sorted(systems) == sorted(prompts.values())

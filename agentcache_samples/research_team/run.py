"""Run the research team on a batch of questions under KVCMAS and NonShared, interleaved, and report
the tool calls (how many, how many valid), accuracy, and the TTFT, wall time and prefill work of
the agents that read the long tool result, against NonShared: all three readers, and the two after
the first (which prefills the new result under any strategy)."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

from langchain_core.messages import AIMessage, HumanMessage

from agentcache.engine.choice import ENGINE_KINDS
from agentcache.tasks import directory_people, document_problem
from agentcache_samples._compare import StrategyRuns, answer_scores, format_table, progress, runtime_figures, write_report
from agentcache_samples.document_team.run import stated_code
from agentcache_samples.research_team.graph import READERS, build_team

__all__ = ["run_batch", "main", "CALLS"]

BASELINE = "nonshared"
# a workflow's calls in order: the searcher's call, then the three readers of its result
CALLS = ("searcher_call", *READERS)
LATER = READERS[1:]  # the readers after the first, which prefills the new tool result under any strategy
COLUMNS = (
    ("strategy", "strategy", ""),
    ("valid_tool_call_rate", "valid tool calls", ".2f"),
    ("accuracy", "accuracy", ".2f"),
    ("agree", "same answer as nonshared", ".2f"),
    ("later_readers_ttft_s", "later readers' TTFT s", ".2f"),
    ("later_readers_ttft_vs_baseline", "vs nonshared", ".2f"),
    ("readers_ttft_vs_baseline", "all readers vs nonshared", ".2f"),
    ("workflow_wall_s", "workflow wall s", ".2f"),
    ("wall_vs_baseline", "vs nonshared", ".2f"),
    ("prefill_tokens_per_workflow", "prefill tokens/workflow", ".0f"),
    ("prefill_vs_baseline", "vs nonshared", ".2f"),
)


def run_batch(model: str = "qwen2.5-coder-0.5b", questions: int = 6, *, warmup: int = 1, result_tokens: int = 1300,
              seed: int = 0, call_tokens: int = 48, answer_tokens: int = 16, engine: str = "embedded",
              strategies: Sequence[str] = ("kvcmas", BASELINE), progress_bar: bool = True) -> dict[str, Any]:
    if BASELINE not in strategies:
        strategies = (*strategies, BASELINE)
    started = time.perf_counter()
    runs = StrategyRuns(model, strategies, progress_bar, engine=engine)
    tokenize = next(iter(runs.runtimes.values())).engine.tokenize
    people = directory_people(tokenize, result_tokens, minimum=2)
    problems = [document_problem(seed + i, people) for i in range(warmup + questions)]
    scored = {s: {"calls": [], "walls": [], "answers": [], "texts": [], "tool_calls": 0, "valid": 0, "invalid": 0}
              for s in strategies}
    bar = progress(len(problems) * len(strategies), "research team", progress_bar)
    for index, problem in enumerate(problems):
        directory, question = problem.text.rsplit("\n\nQuestion: ", 1)
        for name in runs.order(index):
            runtime = runs.runtimes[name]
            team = build_team(runtime, lambda person, page=directory: page, call_tokens=call_tokens,
                              answer_tokens=answer_tokens)
            before = len(runtime.results)
            began = time.perf_counter()
            state = team.invoke({"messages": [HumanMessage(question)]},
                                {"configurable": {"thread_id": f"{name}-{index}"}})
            wall = time.perf_counter() - began
            bar.update(1)
            if index < warmup:
                continue
            mine = scored[name]
            mine["calls"].append(runtime.results[before:])
            mine["walls"].append(wall)
            final = state["messages"][-1].content
            mine["answers"].append(stated_code(final))
            mine["texts"].append(final)
            for message in state["messages"]:
                if isinstance(message, AIMessage):
                    mine["tool_calls"] += len(message.tool_calls)
                    mine["valid"] += sum(c["name"] == "lookup_directory" and isinstance(c["args"].get("person"), str)
                                         for c in message.tool_calls)
                    mine["invalid"] += len(message.invalid_tool_calls)
    bar.close()
    rows = [_row(name, scored, [p.answer for p in problems[warmup:]], runs) for name in strategies]
    for runtime in runs.runtimes.values():
        runtime.close()
    example = problems[warmup]
    return {"model": model, "engine": engine, "questions": questions, "warmup_questions": warmup, "people": people,
            "tool_result_tokens": len(tokenize(example.text.rsplit("\n\nQuestion: ", 1)[0])), "seed": seed,
            "calls": list(CALLS), "setup_s": runs.setup_s, "strategies": rows,
            "example": {"question": example.text.rsplit("\n", 1)[-1], "answer": example.answer,
                        **{s: scored[s]["texts"][0] for s in strategies}},
            "total_s": time.perf_counter() - started}


def _row(name: str, scored: dict[str, dict], truth: list[int], runs: StrategyRuns) -> dict[str, Any]:
    mine, base = scored[name], scored[BASELINE]

    def service(calls: list[list], positions: Sequence[str]) -> float:
        return statistics.fmean(workflow[CALLS.index(p)].ttft_s - workflow[CALLS.index(p)].queued_s
                                for workflow in calls for p in positions)

    row: dict[str, Any] = {"strategy": name, "tool_calls": mine["tool_calls"], "invalid_tool_calls": mine["invalid"],
                           "valid_tool_call_rate": mine["valid"] / max(1, mine["tool_calls"] + mine["invalid"])}
    row.update(answer_scores(mine["answers"], truth, base["answers"]))
    row["per_call_ttft_s"] = {p: service(mine["calls"], [p]) for p in CALLS}
    row["readers_ttft_s"] = service(mine["calls"], READERS)
    row["later_readers_ttft_s"] = service(mine["calls"], LATER)
    row["readers_ttft_vs_baseline"] = row["readers_ttft_s"] / service(base["calls"], READERS)
    row["later_readers_ttft_vs_baseline"] = row["later_readers_ttft_s"] / service(base["calls"], LATER)
    row["workflow_wall_s"] = statistics.fmean(mine["walls"])
    row["wall_vs_baseline"] = sum(mine["walls"]) / sum(base["walls"])
    prefill = [sum(r.prefill_tokens for r in workflow) for workflow in mine["calls"]]
    row["prefill_tokens_per_workflow"] = statistics.fmean(prefill)
    row["prefill_vs_baseline"] = sum(prefill) / sum(sum(r.prefill_tokens for r in w) for w in base["calls"])
    row["reuse_ratio"] = runs.runtimes[name].summary()["reuse_ratio"]
    row.update(runtime_figures(runs.runtimes[name]))
    return row


def plot(report: dict[str, Any]):
    """Per-call mean TTFT (less queueing) and the workflow wall time, one colour per strategy."""
    def draw(plt: Any) -> Any:
        rows = report["strategies"]
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 1.2]})
        width = 0.8 / len(rows)
        for i, row in enumerate(rows):
            xs = [c + i * width for c in range(len(CALLS))]
            left.bar(xs, [row["per_call_ttft_s"][c] for c in CALLS], width, label=row["strategy"], color=f"C{i}")
            right.bar(i, row["workflow_wall_s"], color=f"C{i}")
        left.set_xticks([c + 0.4 - width / 2 for c in range(len(CALLS))], CALLS, rotation=20)
        left.set_ylabel("mean TTFT less queueing (s)")
        left.set_title(f"Research team on {report['model']}: a {report['tool_result_tokens']}-token tool result")
        left.legend()
        right.set_xticks(range(len(rows)), [row["strategy"] for row in rows])
        right.set_title("workflow wall time (s)")
        fig.tight_layout()
        return fig
    return draw


def print_report(report: dict[str, Any]) -> None:
    example = report["example"]
    print(f"\n{example['question']}  Expected: {example['answer']}")
    for row in report["strategies"]:
        print(f"  {row['strategy']:>9}: {example[row['strategy']].strip()[:100]!r}")
    print(f"\nResearch team: {report['questions']} questions (after {report['warmup_questions']} warm-up), a "
          f"{report['tool_result_tokens']}-token tool result read by {', '.join(READERS)} in turn, on {report['model']} "
          f"({report['total_s']:.0f} s)\n")
    print(format_table(report["strategies"], COLUMNS))
    for row in report["strategies"]:
        print(f"{row['strategy']}: {row['tool_calls']} tool calls, {row['invalid_tool_calls']} invalid; per call TTFT "
              "(s): " + " / ".join(f"{row['per_call_ttft_s'][c]:.2f}" for c in CALLS) + f"  ({' / '.join(CALLS)})")
        if row["refusal"]:
            print(f"note: {row['strategy']} ran as NonShared: {row['refusal']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agentcache_samples.research_team", description=__doc__)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b",
                        help="a preset whose chat template calls tools (qwen2.5-coder-0.5b; tiny-qwen2-chat for a smoke run)")
    parser.add_argument("--engine", default="embedded", choices=ENGINE_KINDS)
    parser.add_argument("--questions", type=int, default=6, help="scored questions")
    parser.add_argument("--warmup", type=int, default=1, help="questions run first, not scored")
    parser.add_argument("--result-tokens", type=int, default=1300, help="about how long the tool result is")
    parser.add_argument("--call-tokens", type=int, default=48)
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--strategies", default="kvcmas,nonshared")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", default="results", help="directory for the JSON report and the plot")
    args = parser.parse_args(argv)
    if args.questions < 1 or args.warmup < 0:
        parser.error("--questions must be at least 1 and --warmup at least 0")
    report = run_batch(args.model, args.questions, warmup=args.warmup, result_tokens=args.result_tokens,
                       seed=args.seed, call_tokens=args.call_tokens, answer_tokens=args.answer_tokens,
                       engine=args.engine, strategies=tuple(s for s in args.strategies.split(",") if s))
    print_report(report)
    for path in write_report(report, Path(args.results), "research_team", plot(report)):
        print(f"wrote {path}")
    return 0

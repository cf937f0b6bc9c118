"""Run the document team on a batch of generated documents under several strategies, interleaved,
and report per-agent TTFT against NonShared and accuracy per strategy."""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path
from typing import Any, Sequence

from agentcache.metrics import CallResult
from agentcache.tasks import document_problem
from agentcache_langgraph import AgentCacheChatModel
from agentcache.engine.choice import ENGINE_KINDS
from samples._compare import (StrategyRuns, agent_means, answer_scores, figures, format_table, progress,
                              runtime_figures, write_report)
from samples.document_team.graph import AGENTS, build_team

__all__ = ["run_batch", "add_arguments", "run_and_report", "main", "stated_code"]

BASELINE = "nonshared"
COLUMNS = (
    ("strategy", "strategy", ""),
    ("accuracy", "accuracy", ".2f"),
    ("agree", "same answer as nonshared", ".2f"),
    ("service_ttft_mean_s", "TTFT less queueing s", ".2f"),
    ("service_ttft_vs_baseline", "vs nonshared", ".2f"),
    ("readers_after_first_vs_baseline", "3 later agents vs nonshared", ".2f"),
    ("reuse_ratio", "reuse ratio", ".2f"),
    ("hit_rate", "hit rate", ".2f"),
)


def run_batch(
    model: str = "gemma3-270m",
    documents: int = 4,
    strategies: Sequence[str] = ("kvcmas", "nonshared", "fullshared"),
    *,
    people: int = 60,
    warmup: int = 2,
    seed: int = 0,
    note_tokens: int = 16,
    answer_tokens: int = 32,
    progress_bar: bool = True,
    engine: str = "embedded",
) -> dict[str, Any]:
    """Every document runs through the team once per strategy, the strategies rotated per document.
    The first `warmup` documents (not scored) fill the anchor pools, as a served runtime is warmed."""
    if BASELINE not in strategies:
        strategies = (*strategies, BASELINE)
    started = time.perf_counter()
    runs = StrategyRuns(model, strategies, progress_bar, engine=engine)
    teams = {name: build_team(AgentCacheChatModel(runtime=rt, max_tokens=note_tokens),
                              AgentCacheChatModel(runtime=rt, max_tokens=answer_tokens))
             for name, rt in runs.runtimes.items()}
    batch = [document_problem(seed + i, people) for i in range(warmup + documents)]
    calls: dict[str, list[CallResult]] = {s: [] for s in strategies}
    answers: dict[str, list[int | None]] = {s: [] for s in strategies}
    finals: dict[str, list[str]] = {s: [] for s in strategies}
    bar = progress(len(batch) * len(strategies), "document team", progress_bar)
    for index, problem in enumerate(batch):
        scored = index >= warmup
        for name in runs.order(index):
            bar.set_postfix_str(f"{'document' if scored else 'warm-up'} {index + 1}, {name}")
            runtime = runs.runtimes[name]
            before = len(runtime.results)
            state = teams[name].invoke({"document": problem.text},
                                       {"configurable": {"thread_id": f"{name}-{index}"}})
            if scored:
                # the reviewers ran side by side: keep each document's calls in a fixed agent order
                calls[name].extend(sorted(runtime.results[before:], key=lambda r: AGENTS.index(r.agent)))
                finals[name].append(state["answer"])
                answers[name].append(stated_code(state["answer"]))
            bar.update(1)
    bar.close()

    truth = [p.answer for p in batch[warmup:]]
    rows = []
    for name in strategies:
        mine, base = calls[name], calls[BASELINE]
        row = {"strategy": name, **figures(mine, base if name != BASELINE else None)}
        row.update(answer_scores(answers[name], truth, answers[BASELINE]))
        row["per_agent_ttft_s"] = agent_means(mine, AGENTS, queued=True)
        row["per_agent_service_s"] = agent_means(mine, AGENTS)
        later = [r for r in mine if r.agent != AGENTS[0]]
        base_later = [r for r in base if r.agent != AGENTS[0]]
        row["readers_after_first_vs_baseline"] = (sum(r.ttft_s - r.queued_s for r in later)
                                                  / sum(r.ttft_s - r.queued_s for r in base_later))
        row.update(runtime_figures(runs.runtimes[name]))
        rows.append(row)
    mean_tokens = sum(r.prompt_tokens for r in calls[BASELINE]) / len(calls[BASELINE])
    return {
        "model": model, "engine": engine, "documents": documents, "warmup_documents": warmup, "people": people, "seed": seed,
        "mean_prompt_tokens": mean_tokens, "agents": list(AGENTS), "setup_s": runs.setup_s,
        "total_s": time.perf_counter() - started, "strategies": rows,
        "examples": [{"question": p.text.rsplit("\n", 1)[-1], "answer": p.answer,
                      **{s: finals[s][i] for s in strategies}} for i, p in enumerate(batch[warmup:][:3])],
    }


def stated_code(text: str) -> int | None:
    """The first four-digit number in the text (locker codes have four digits)."""
    match = re.search(r"(?<!\d)\d{4}(?!\d)", text)
    return int(match.group()) if match else None


def plot(report: dict[str, Any]):
    """Per-agent mean TTFT (less queueing) for each strategy, and accuracy."""
    def draw(plt: Any) -> Any:
        rows, agents = report["strategies"], report["agents"]
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 1]})
        width = 0.8 / len(rows)
        for i, row in enumerate(rows):
            xs = [a + i * width for a in range(len(agents))]
            left.bar(xs, [row["per_agent_service_s"][a] or 0 for a in agents], width, label=row["strategy"])
        left.set_xticks([a + 0.4 - width / 2 for a in range(len(agents))], agents)
        left.set_ylabel("mean TTFT less queueing (s)")
        left.set_title(f"Document team on {report['model']}: {report['documents']} documents of "
                       f"~{report['mean_prompt_tokens']:.0f} prompt tokens")
        left.legend()
        right.bar([r["strategy"] for r in rows], [r["accuracy"] for r in rows], color="tab:green")
        right.set_ylim(0, 1)
        right.set_title("accuracy")
        fig.tight_layout()
        return fig
    return draw


def add_arguments(parser: argparse.ArgumentParser, documents: int = 4) -> None:
    """The sample's options, for this module's command line and for `agentcache demo --sample document_team`."""
    parser.add_argument("--model", default="gemma3-270m", help="preset name or local HF model directory")
    parser.add_argument("--engine", default="embedded", choices=ENGINE_KINDS,
                        help="embedded (PyTorch, the default) or vllm (in-process vLLM, the `vllm` extra)")
    parser.add_argument("--documents", type=_at_least(1), default=documents, help="scored documents")
    parser.add_argument("--warmup", type=_at_least(0), default=2,
                        help="documents run first, not scored, to fill the anchor pools")
    parser.add_argument("--people", type=_at_least(1), default=60, help="people in each directory (~50 tokens each)")
    parser.add_argument("--strategies", default="kvcmas,nonshared,fullshared")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--note-tokens", type=_at_least(1), default=16)
    parser.add_argument("--answer-tokens", type=_at_least(1), default=32)  # a sentence and a 4-digit code
    parser.add_argument("--results", default="results", help="directory for the JSON report and the plot")


def _at_least(low: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    return parse


def run_and_report(args: argparse.Namespace, name: str) -> int:
    """Run the batch `args` describe, print the comparison, write `<name>.json` and `<name>.png`."""
    report = run_batch(args.model, args.documents, tuple(s for s in args.strategies.split(",") if s),
                       people=args.people, warmup=args.warmup, seed=args.seed, note_tokens=args.note_tokens,
                       answer_tokens=args.answer_tokens, engine=args.engine)
    print_report(report)
    for path in write_report(report, Path(args.results), name, plot(report)):
        print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m samples.document_team", description=__doc__)
    add_arguments(parser)
    return run_and_report(parser.parse_args(argv), "document_team")


def print_report(report: dict[str, Any]) -> None:
    example = report["examples"][0]
    print(f"\n{example['question']}  Expected: {example['answer']}")
    for row in report["strategies"]:
        print(f"  {row['strategy']:>11}: {example[row['strategy']].strip()[:100]!r}")
    print(f"\nDocument team: {report['documents']} documents (after {report['warmup_documents']} warm-up), "
          f"~{report['mean_prompt_tokens']:.0f} prompt tokens per call, reader -> fact_checker + critic -> writer, "
          f"on {report['model']} ({report['total_s']:.0f} s)\n")
    print(format_table(report["strategies"], COLUMNS))
    agents = report["agents"]
    print("\nper-agent TTFT less queueing (s): " + ", ".join(
        f"{row['strategy']}: " + " / ".join(f"{row['per_agent_service_s'][a]:.2f}" for a in agents)
        for row in report["strategies"]) + f"  ({' / '.join(agents)})")
    for row in report["strategies"]:
        if row["refusal"]:
            print(f"note: {row['strategy']} ran as NonShared: {row['refusal']}")

"""Run the document team on a batch of generated documents under several strategies, interleaved,
and report per-agent TTFT against NonShared and accuracy per strategy."""

from __future__ import annotations

import argparse
import contextlib
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from agentcache.metrics import CallResult
from agentcache.tasks import document_problem
from agentcache_langgraph import AgentCacheChatModel
from agentcache.engine.choice import ENGINE_KINDS
from agentcache_samples._compare import (StrategyRuns, agent_means, answer_scores, figures, format_table, progress,
                              runtime_figures, write_report)
from agentcache_samples.document_team.graph import AGENTS, build_team

__all__ = ["run_batch", "add_arguments", "run_and_report", "main", "stated_code"]

BASELINE = "nonshared"
COLUMNS = (
    ("strategy", "strategy", ""),
    ("accuracy", "accuracy", ".2f"),
    ("agree", "same answer as nonshared", ".2f"),
    ("service_ttft_mean_s", "TTFT less queueing s", ".2f"),
    ("service_ttft_vs_baseline", "vs nonshared", ".2f"),
    ("readers_after_first_vs_baseline", "3 later agents vs nonshared", ".2f"),
    ("workflow_wall_s", "workflow wall s", ".2f"),
    ("wall_vs_baseline", "vs nonshared", ".2f"),
    ("prefill_tokens_per_workflow", "prefill tokens/workflow", ".0f"),
    ("reuse_ratio", "reuse ratio", ".2f"),
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
    anchors_dir: Path | None = None,
    second_run: int = 0,
    dtype: str = "auto",
    distinct_names: bool = False,
) -> dict[str, Any]:
    """Every document runs through the team once per strategy, the strategies rotated per document.
    The first `warmup` documents (not scored) fill the anchor pools, as a served runtime is warmed.
    With `second_run` > 0, the runtimes are then closed (saving their anchor pools in `anchors_dir`,
    a temporary folder by default) and new runtimes, started from the saved pools on empty caches,
    run `second_run` more documents: the report's `second_run`."""
    if BASELINE not in strategies:
        strategies = (*strategies, BASELINE)
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if second_run and anchors_dir is None:
            anchors_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="agentcache-anchors-")))
        runs = StrategyRuns(model, strategies, progress_bar, engine=engine, anchors_dir=anchors_dir, dtype=dtype)
        batch = [document_problem(seed + i, people, distinct_names=distinct_names)
                 for i in range(warmup + documents + second_run)]
        first = _run_documents(runs, batch[:warmup + documents], warmup, note_tokens, answer_tokens, progress_bar,
                               "document team")
        rows = _rows(runs, first, strategies)
        report = {
            "model": model, "engine": engine, "dtype": runs.kv_dtype, "documents": documents, "warmup_documents": warmup, "people": people,
            "distinct_names": distinct_names, "seed": seed, "mean_prompt_tokens": first.mean_prompt_tokens, "agents": list(AGENTS), "setup_s": runs.setup_s,
            "strategies": rows, "examples": first.examples(strategies),
        }
        if second_run:
            loaded = runs.restart()
            again = _run_documents(runs, batch[warmup + documents:], 0, note_tokens, answer_tokens, progress_bar,
                                   "second run (new runtimes, saved anchors)", round_offset=1)
            report["second_run"] = {"documents": second_run, "loaded": loaded,
                                    "strategies": _rows(runs, again, strategies)}
        for runtime in runs.runtimes.values():
            runtime.close()
    report["total_s"] = time.perf_counter() - started
    return report


@dataclass
class _Batch:
    """What a strategy's scored documents produced."""

    problems: list
    calls: dict[str, list[CallResult]]
    answers: dict[str, list[int | None]]
    finals: dict[str, list[str]]
    walls: dict[str, list[float]]  # each scored document's workflow wall time, per strategy

    @property
    def mean_prompt_tokens(self) -> float:
        base = self.calls[BASELINE]
        return sum(r.prompt_tokens for r in base) / len(base)

    def examples(self, strategies: Sequence[str]) -> list[dict]:
        return [{"question": p.text.rsplit("\n", 1)[-1], "answer": p.answer, **{s: self.finals[s][i] for s in strategies}}
                for i, p in enumerate(self.problems[:3])]


def _run_documents(runs: StrategyRuns, batch: list, warmup: int, note_tokens: int, answer_tokens: int,
                   progress_bar: bool, title: str, round_offset: int = 0) -> _Batch:
    strategies = list(runs.runtimes)
    teams = {name: build_team(AgentCacheChatModel(runtime=rt, max_tokens=note_tokens),
                              AgentCacheChatModel(runtime=rt, max_tokens=answer_tokens))
             for name, rt in runs.runtimes.items()}
    out = _Batch(batch[warmup:], *({s: [] for s in strategies} for _ in range(4)))
    bar = progress(len(batch) * len(strategies), title, progress_bar)
    for index, problem in enumerate(batch):
        scored = index >= warmup
        for name in runs.order(index + round_offset):
            bar.set_postfix_str(f"{'document' if scored else 'warm-up'} {index + 1}, {name}")
            state, calls, wall = runs.invoke(name, teams[name], {"document": problem.text},
                                             f"{name}-{title}-{index}", AGENTS)
            if scored:
                out.calls[name].extend(calls)
                out.finals[name].append(state["answer"])
                out.answers[name].append(stated_code(state["answer"]))
                out.walls[name].append(wall)
            bar.update(1)
    bar.close()
    return out


def _rows(runs: StrategyRuns, done: _Batch, strategies: Sequence[str]) -> list[dict[str, Any]]:
    truth = [p.answer for p in done.problems]
    base, base_wall = done.calls[BASELINE], sum(done.walls[BASELINE])
    rows = []
    for name in strategies:
        mine = done.calls[name]
        row = {"strategy": name, **figures(mine, base if name != BASELINE else None)}
        row.update(answer_scores(done.answers[name], truth, done.answers[BASELINE]))
        row["same_text"] = sum(a == b for a, b in zip(done.finals[name], done.finals[BASELINE])) / len(truth)
        row["per_agent_ttft_s"] = agent_means(mine, AGENTS, queued=True)
        row["per_agent_service_s"] = agent_means(mine, AGENTS)
        later = [r for r in mine if r.agent != AGENTS[0]]
        base_later = [r for r in base if r.agent != AGENTS[0]]
        row["readers_after_first_vs_baseline"] = (sum(r.ttft_s - r.queued_s for r in later)
                                                  / sum(r.ttft_s - r.queued_s for r in base_later))
        row["workflow_wall_s"] = sum(done.walls[name]) / len(done.walls[name])
        row["wall_vs_baseline"] = sum(done.walls[name]) / base_wall if base_wall else None
        row["prefill_tokens_per_workflow"] = sum(r.prefill_tokens for r in mine) / len(truth)
        row.update(runtime_figures(runs.runtimes[name]))
        rows.append(row)
    return rows


def stated_code(text: str) -> int | None:
    """The first four-digit number in the text (locker codes have four digits)."""
    match = re.search(r"(?<!\d)\d{4}(?!\d)", text)
    return int(match.group()) if match else None


def plot(report: dict[str, Any]):
    """Per-agent mean TTFT (less queueing), workflow wall time and agreement with NonShared, one
    colour per strategy in every panel (the second run's, when there is one, hatched)."""
    def draw(plt: Any) -> Any:
        runs = [("", report["strategies"])] + ([(" (2nd run)", report["second_run"]["strategies"])]
                                             if "second_run" in report else [])
        names = [row["strategy"] for row in report["strategies"]]
        colour = {name: f"C{i}" for i, name in enumerate(names)}
        agents = report["agents"]
        fig, (left, middle, right) = plt.subplots(1, 3, figsize=(14, 4), gridspec_kw={"width_ratios": [3, 1.3, 1.3]})
        bars = [(suffix, row) for suffix, rows in runs for row in rows]
        width = 0.8 / len(bars)
        for i, (suffix, row) in enumerate(bars):
            style = dict(color=colour[row["strategy"]], hatch="//" if suffix else None, edgecolor="white")
            xs = [a + i * width for a in range(len(agents))]
            left.bar(xs, [row["per_agent_service_s"][a] or 0 for a in agents], width,
                     label=row["strategy"] + suffix, **style)
            middle.bar(i, row["workflow_wall_s"], **style)
            right.bar(i, row["agree"], **style)
        left.set_xticks([a + 0.4 - width / 2 for a in range(len(agents))], agents)
        left.set_ylabel("mean TTFT less queueing (s)")
        left.set_title(f"Document team on {report['model']}: ~{report['mean_prompt_tokens']:.0f} prompt tokens")
        left.legend(fontsize="small", ncol=2)
        left.set_ylim(0, 1.3 * max(row["per_agent_service_s"][a] or 0 for _, row in bars for a in agents))
        labels = [row["strategy"] + suffix for suffix, row in bars]
        for axis, title in ((middle, "workflow wall time (s)"), (right, "same answer as nonshared")):
            axis.set_xticks(range(len(bars)), labels, rotation=30, ha="right")
            axis.set_title(title)
        right.set_ylim(0, 1)
        fig.tight_layout()
        return fig
    return draw


def add_arguments(parser: argparse.ArgumentParser, documents: int = 4, second_run: int = 0,
                  strategies: str = "kvcmas,nonshared,fullshared", people: int = 60, warmup: int = 2,
                  note_tokens: int = 16, distinct_names: bool = False, model: str = "gemma3-270m") -> None:
    """The sample's options, for this module's command line and for `agentcache demo --sample document_team`."""
    parser.add_argument("--model", default=model, help="preset name or local HF model directory")
    parser.add_argument("--engine", default="embedded", choices=ENGINE_KINDS,
                        help="embedded (PyTorch, the default) or vllm (in-process vLLM, the `vllm` extra)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                        help="the engine's weights and KV (auto: float32 on a CPU, bfloat16 on CUDA)")
    parser.add_argument("--documents", type=_at_least(1), default=documents, help="scored documents")
    parser.add_argument("--warmup", type=_at_least(0), default=warmup,
                        help="documents run first, not scored: they verify reuse and fill the anchor pools")
    parser.add_argument("--people", type=_at_least(1), default=people, help="people in each directory (~50 tokens each)")
    parser.add_argument("--distinct-names", action=argparse.BooleanOptionalAction, default=distinct_names,
                        help="every person has a first name of their own (at most 60 people): easier retrieval")
    parser.add_argument("--strategies", default=strategies)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--note-tokens", type=_at_least(1), default=note_tokens)
    parser.add_argument("--answer-tokens", type=_at_least(1), default=32)  # a sentence and a 4-digit code
    parser.add_argument("--results", default="results", help="directory for the JSON report and the plot")
    parser.add_argument("--second-run", type=_at_least(0), default=second_run,
                        help="then start new runtimes from the saved anchor pools and run this many more documents")
    parser.add_argument("--anchors-dir", default=None,
                        help="where the anchor pools persist (default: a temporary folder for this run)")


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
                       answer_tokens=args.answer_tokens, engine=args.engine,
                       anchors_dir=Path(args.anchors_dir) if args.anchors_dir else None, second_run=args.second_run,
                       dtype=args.dtype, distinct_names=args.distinct_names)
    print_report(report)
    for path in write_report(report, Path(args.results), name, plot(report)):
        print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agentcache_samples.document_team", description=__doc__)
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
    _print_rows(report["strategies"], report["agents"])
    second = report.get("second_run")
    if second:
        loaded = ", ".join(f"{s}: {n['verified_edges']} verified edges and {n['anchors']} anchors"
                           for s, n in second["loaded"].items() if n["anchors"] or n["verified_edges"])
        print(f"\nSecond run: new runtimes on empty caches, started from what the first saved "
              f"({loaded or 'nothing loaded'}), {second['documents']} documents, no warm-up\n")
        _print_rows(second["strategies"], report["agents"])


def _print_rows(rows: list[dict[str, Any]], agents: Sequence[str]) -> None:
    print(format_table(rows, COLUMNS))
    print("\nper-agent TTFT less queueing (s): " + ", ".join(
        f"{row['strategy']}: " + " / ".join(f"{row['per_agent_service_s'][a]:.2f}" for a in agents)
        for row in rows) + f"  ({' / '.join(agents)})")
    for row in rows:
        if row["refusal"]:
            print(f"note: {row['strategy']} ran as NonShared: {row['refusal']}")

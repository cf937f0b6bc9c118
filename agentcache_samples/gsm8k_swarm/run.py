"""Run the GSM8K swarm on a batch of generated problems under several strategies, interleaved,
and report accuracy, TTFT, wall time and prefill work per problem against NonShared, and reuse,
for each (the `agentcache demo --sample gsm8k_swarm`)."""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path
from typing import Any, Sequence

from agentcache.metrics import CallResult
from agentcache.tasks import first_number, gsm8k_style_problem
from agentcache_langgraph import AgentCacheChatModel
from agentcache.engine.choice import ENGINE_KINDS
from agentcache_samples._compare import StrategyRuns, agent_means, answer_scores, figures, format_table, runtime_figures, write_report
from agentcache_samples._compare import progress as progress_bar
from agentcache_samples.gsm8k_swarm.graph import DECISION, EXPERTS, build_swarm

__all__ = ["run_batch", "add_arguments", "run_and_report", "main"]

BASELINE = "nonshared"
COLUMNS = (
    ("strategy", "strategy", ""),
    ("accuracy", "accuracy", ".2f"),
    ("agree", "same answer as nonshared", ".2f"),
    ("ttft_mean_s", "mean TTFT s", ".3f"),
    ("service_ttft_mean_s", "less queueing s", ".3f"),
    ("service_ttft_vs_baseline", "vs nonshared", ".2f"),
    ("decision_ttft_s", "decision TTFT s", ".3f"),
    ("decision_vs_baseline", "vs nonshared", ".2f"),
    ("wall_s_per_problem", "wall s per problem", ".2f"),
    ("wall_vs_baseline", "vs nonshared", ".2f"),
    ("prefill_tokens_per_problem", "prefill tokens/problem", ".0f"),
    ("reuse_ratio", "reuse ratio", ".2f"),
    ("hit_rate", "hit rate", ".2f"),
)


def run_batch(
    model: str = "gemma3-270m",
    problems: int = 6,
    strategies: Sequence[str] = ("kvcmas", "nonshared", "fullshared"),
    *,
    seed: int = 0,
    background: int = 2,
    expert_tokens: int = 48,
    decision_tokens: int = 12,
    progress: bool = True,
    engine: str = "embedded",
    dtype: str = "auto",
) -> dict[str, Any]:
    """Every problem runs through the swarm once per strategy, the strategies rotated per problem."""
    if BASELINE not in strategies:
        strategies = (*strategies, BASELINE)
    started = time.perf_counter()
    runs = StrategyRuns(model, strategies, progress, engine=engine, dtype=dtype)
    swarms = {}
    for name, runtime in runs.runtimes.items():
        experts = AgentCacheChatModel(runtime=runtime, max_tokens=expert_tokens)
        decider = AgentCacheChatModel(runtime=runtime, max_tokens=decision_tokens)
        swarms[name] = build_swarm(experts, decider)

    answers: dict[str, list[int | None]] = {s: [] for s in strategies}
    calls: dict[str, list[CallResult]] = {s: [] for s in strategies}
    finals: dict[str, list[str]] = {s: [] for s in strategies}
    walls: dict[str, list[float]] = {s: [] for s in strategies}  # per problem: the experts overlap in the engine
    batch = [gsm8k_style_problem(seed + i, background) for i in range(problems)]
    bar = progress_bar(problems * len(strategies), "GSM8K swarm", progress)
    for index, problem in enumerate(batch):
        for name in runs.order(index):
            bar.set_postfix_str(f"problem {index + 1}, {name}")
            # the experts ran concurrently: each problem's calls come in a fixed agent order, for pairing
            state, made, wall = runs.invoke(name, swarms[name], {"question": problem.text}, f"{name}-{index}",
                                            list(_AGENT_ORDER))
            walls[name].append(wall)
            calls[name].extend(made)
            finals[name].append(state["final"])
            answers[name].append(stated_answer(state["final"]))
            bar.update(1)
    bar.close()

    truth = [p.answer for p in batch]
    base_wall = sum(walls[BASELINE])
    rows = []
    for name in strategies:
        runtime = runs.runtimes[name]
        row = {"strategy": name, **figures(calls[name], calls[BASELINE] if name != BASELINE else None)}
        row.update(answer_scores(answers[name], truth, answers[BASELINE]))
        decision = [r for r in calls[name] if r.agent == DECISION]
        base_decision = [r for r in calls[BASELINE] if r.agent == DECISION]
        row["decision_ttft_s"] = sum(r.ttft_s for r in decision) / len(decision)
        row["decision_vs_baseline"] = row["decision_ttft_s"] / (sum(r.ttft_s for r in base_decision) / len(base_decision))
        row["wall_s_per_problem"] = sum(walls[name]) / len(walls[name])
        row["wall_vs_baseline"] = sum(walls[name]) / base_wall if base_wall else None
        row["prefill_tokens_per_problem"] = sum(r.prefill_tokens for r in calls[name]) / len(batch)
        row["per_agent_ttft_s"] = agent_means(calls[name], list(_AGENT_ORDER), queued=True)
        row["per_agent_service_s"] = agent_means(calls[name], list(_AGENT_ORDER))
        row.update(runtime_figures(runtime))
        rows.append(row)
    return {
        "model": model, "engine": engine, "dtype": runs.kv_dtype, "problems": problems, "seed": seed, "background": background, "expert_tokens": expert_tokens,
        "decision_tokens": decision_tokens, "agents": list(_AGENT_ORDER), "setup_s": runs.setup_s,
        "total_s": time.perf_counter() - started, "strategies": rows,
        "examples": [{"question": p.text, "answer": p.answer, **{s: finals[s][i] for s in strategies}}
                     for i, p in enumerate(batch[:3])],
    }


_AGENT_ORDER = {name: i for i, name in enumerate([*EXPERTS, DECISION])}


def stated_answer(text: str) -> int | None:
    """The number after "the answer is", else the first number in the text."""
    match = re.search(r"answer is\s*\$?(-?\d[\d,]*)", text, re.I)
    return int(match.group(1).replace(",", "")) if match else first_number(text)


def plot(report: dict[str, Any]):
    """Per-agent mean TTFT for each strategy, and the reuse ratio, one colour per strategy in both panels."""
    def draw(plt: Any) -> Any:
        rows = report["strategies"]
        agents = report["agents"]
        colours = [f"C{i}" for i in range(len(rows))]
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 1]})
        width = 0.8 / len(rows)
        for i, row in enumerate(rows):
            xs = [a + i * width for a in range(len(agents))]
            left.bar(xs, [row["per_agent_service_s"][a] or 0 for a in agents], width, label=row["strategy"],
                     color=colours[i])
        left.set_xticks([a + 0.4 - width / 2 for a in range(len(agents))], agents)
        left.set_ylabel("mean TTFT less queueing (s)")
        left.set_title(f"GSM8K swarm on {report['model']}, {report['problems']} problems")
        left.legend()
        right.bar([r["strategy"] for r in rows], [r["reuse_ratio"] for r in rows], color=colours)
        right.set_ylim(0, 1)
        right.set_title("reuse ratio")
        fig.tight_layout()
        return fig
    return draw


def add_arguments(parser: argparse.ArgumentParser, problems: int = 6) -> None:
    """The swarm's options, for this module's command line and for `agentcache demo`."""
    parser.add_argument("--model", default="gemma3-270m", help="preset name or local HF model directory")
    parser.add_argument("--engine", default="embedded", choices=ENGINE_KINDS,
                        help="embedded (PyTorch, the default) or vllm (in-process vLLM, the `vllm` extra)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                        help="the engine's weights and KV (auto: float32 on a CPU, bfloat16 on CUDA)")
    parser.add_argument("--problems", type=int, default=problems)
    parser.add_argument("--strategies", default="kvcmas,nonshared,fullshared")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--background", type=int, default=2, choices=range(5),
                        help="sentences of irrelevant detail before each problem (0-4)")
    parser.add_argument("--expert-tokens", type=int, default=48)
    parser.add_argument("--decision-tokens", type=int, default=12)
    parser.add_argument("--results", default="results", help="directory for the JSON report and the plot")


def run_and_report(args: argparse.Namespace, name: str) -> int:
    """Run the batch `args` describe, print the comparison, write `<name>.json` and `<name>.png`."""
    report = run_batch(args.model, args.problems, tuple(s for s in args.strategies.split(",") if s),
                       seed=args.seed, background=args.background, expert_tokens=args.expert_tokens,
                       decision_tokens=args.decision_tokens, engine=args.engine, dtype=args.dtype)
    print_report(report)
    for path in write_report(report, Path(args.results), name, plot(report)):
        print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agentcache_samples.gsm8k_swarm", description=__doc__)
    add_arguments(parser)
    return run_and_report(parser.parse_args(argv), "gsm8k_swarm")


def print_report(report: dict[str, Any]) -> None:
    example = report["examples"][0]
    print(f"\nQuestion: {example['question']}\nExpected: {example['answer']}")
    for row in report["strategies"]:
        print(f"  {row['strategy']:>11}: {example[row['strategy']].strip()[:100]!r}")
    print(f"\nGSM8K swarm: {report['problems']} problems, 3 experts fan out, 1 decision agent fans in, "
          f"on {report['model']} ({report['total_s']:.0f} s)\n")
    print(format_table(report["strategies"], COLUMNS))
    for row in report["strategies"]:
        if row["refusal"]:
            print(f"note: {row['strategy']} ran as NonShared: {row['refusal']}")

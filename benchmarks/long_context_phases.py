"""Where the document team's later agents spend their TTFT under KVCMAS, phase by phase, beside
NonShared's and beside the limit: the prefill of each agent's own uncached tokens.

The document team (`agentcache_samples.document_team`: a reader, then a fact-checker and a critic
side by side, then a writer, all reading one staff directory of about `--people` x 50 tokens)
runs under KVCMAS (defaults) and NonShared, interleaved document by document; the first
`--warmup` documents are not scored. For every scored call of the three later agents under KVCMAS:

- `queued_s`: waiting for the runtime's lock and for the engine to admit it (a sibling ahead);
- `setup_s`: reference and template prefills and the entropy gate (`SegmentReport.setup_s`);
- `planning_s`: the rest of planning its shared segments: finding the source, re-aligning and
  correcting its KV, deciding (`SegmentReport.plan_s` less `setup_s`);
- `engine_s`: the rest of the TTFT: admission done, injecting the reused KV, prefilling what is
  computed and sampling the first token;
- `limit_s`: the same engine's TTFT for the call's own uncached tokens (its prompt less its exact
  prefix hits and the shared tokens it reused) after a prefix of the other tokens' length is
  cached: what the call would cost if the reused KV came free. Measured after the workflows, per call,
  with filler tokens of the same lengths (the cost depends on lengths only).

Prints one JSON object: `later_agents_ttft_vs_nonshared` (less queueing, as the demo's table),
`limit_vs_nonshared`, per-phase means and shares (`phases`), per agent, and the decisions.

    python benchmarks/long_context_phases.py [--quick] [--people 60] [--documents 4] [--warmup 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: _report
from _report import fill_defaults, machine, run_and_emit, settle_heap, torch_build  # noqa: E402

from agentcache.engine import ExecRequest, SamplingParams, SegmentPlan  # noqa: E402
from agentcache.metrics import CallResult  # noqa: E402
from agentcache.tasks import document_problem, filler_tokens  # noqa: E402
from agentcache_langgraph import AgentCacheChatModel  # noqa: E402
from agentcache_samples._compare import StrategyRuns  # noqa: E402
from agentcache_samples.document_team.graph import AGENTS, READER, build_team  # noqa: E402

STRATEGY, BASELINE = "kvcmas", "nonshared"
LATER = [a for a in AGENTS if a != READER]
QUICK = dict(people=12, documents=1, warmup=1, repeats=1)
FULL = dict(people=60, documents=4, warmup=2, repeats=2)
PHASES = ("queued_s", "setup_s", "planning_s", "engine_s")


def phases(result: CallResult) -> dict[str, Any]:
    plan = sum(s.plan_s for s in result.segments)
    setup = sum(s.setup_s for s in result.segments)
    own = round(result.prompt_tokens - result.cached_tokens - result.reused_tokens)  # what it computes itself
    return {"agent": result.agent, "ttft_s": result.ttft_s, "queued_s": result.queued_s, "setup_s": setup,
            "planning_s": plan - setup, "engine_s": result.ttft_s - result.queued_s - plan,
            "prompt_tokens": result.prompt_tokens, "cached_tokens": result.cached_tokens,
            "shared_tokens": result.ph_tokens, "reused_tokens": result.reused_tokens, "own_tokens": own,
            "prefill_tokens": result.prefill_tokens,
            "decisions": [s.decision for s in result.segments if s.kind == "ph"]}


def limit_ttft(engine: Any, prefix: int, own: int, salt: int, repeats: int) -> float:
    """The engine's TTFT for `own` new tokens after a cached prefix of `prefix` tokens (median)."""
    times = []
    for repeat in range(repeats):
        ids = filler_tokens(lambda text, bos=True: engine.tokenize(text, bos=bos), prefix + own, salt * 100 + repeat)
        sampling = SamplingParams(max_tokens=1)
        engine.execute(ExecRequest([SegmentPlan("prefix", ids[:prefix])], sampling))
        warm = engine.execute(ExecRequest([SegmentPlan("prefix", ids[:prefix]), SegmentPlan("own", ids[prefix:])],
                                          sampling))
        times.append(warm.ttft_s)
    return statistics.median(times)


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def run(args: argparse.Namespace) -> dict[str, Any]:
    runs = StrategyRuns(args.model, (STRATEGY, BASELINE), progress=False)
    teams = {name: build_team(AgentCacheChatModel(runtime=rt, max_tokens=args.note_tokens),
                              AgentCacheChatModel(runtime=rt, max_tokens=args.answer_tokens))
             for name, rt in runs.runtimes.items()}
    settle_heap()
    documents = [document_problem(args.seed + i, args.people) for i in range(args.warmup + args.documents)]
    calls: dict[str, list[CallResult]] = {STRATEGY: [], BASELINE: []}
    walls: dict[str, list[float]] = {STRATEGY: [], BASELINE: []}
    for index, problem in enumerate(documents):
        for name in runs.order(index):
            _, made, wall = runs.invoke(name, teams[name], {"document": problem.text}, f"{name}-{index}", AGENTS)
            if index >= args.warmup:
                walls[name].append(wall)
                calls[name].extend(made)
    mine = [phases(r) for r in calls[STRATEGY] if r.agent in LATER]
    theirs = [phases(r) for r in calls[BASELINE] if r.agent in LATER]
    probe = runs.runtimes[BASELINE].engine.fresh()  # an empty cache of its own, the same weights
    for salt, call in enumerate(mine):
        call["limit_s"] = limit_ttft(probe, call["prompt_tokens"] - call["own_tokens"], call["own_tokens"], salt,
                                     args.repeats)
    for runtime in runs.runtimes.values():
        runtime.close()

    def served(rows: list[dict]) -> float:
        return sum(r["ttft_s"] - r["queued_s"] for r in rows)

    total = mean([r["ttft_s"] for r in mine])
    per_phase = {p: mean([r[p] for r in mine]) for p in (*PHASES, "limit_s")}
    return {
        "model": args.model, "dtype": runs.kv_dtype, "people": args.people, "documents": args.documents,
        "warmup_documents": args.warmup,
        "mean_prompt_tokens": mean([r["prompt_tokens"] for r in mine]),
        "later_agents_ttft_vs_nonshared": served(mine) / served(theirs),
        "later_agents_ttft_with_queueing_vs_nonshared": sum(r["ttft_s"] for r in mine) / sum(r["ttft_s"] for r in theirs),
        "limit_vs_nonshared": sum(r["limit_s"] for r in mine) / served(theirs),
        "wall_vs_nonshared": sum(walls[STRATEGY]) / sum(walls[BASELINE]),
        "kvcmas_ttft_mean_s": total, "nonshared_ttft_mean_s": mean([r["ttft_s"] for r in theirs]),
        "nonshared_service_mean_s": mean([r["ttft_s"] - r["queued_s"] for r in theirs]),
        "phases": per_phase,
        "phase_shares": {p: v / total if total else None for p, v in per_phase.items()},
        "per_agent": {agent: {p: mean([r[p] for r in mine if r["agent"] == agent]) for p in (*PHASES, "limit_s", "ttft_s")}
                      | {"nonshared_ttft_s": mean([r["ttft_s"] for r in theirs if r["agent"] == agent]),
                         "own_tokens": mean([r["own_tokens"] for r in mine if r["agent"] == agent]),
                         "reused_tokens": mean([r["reused_tokens"] for r in mine if r["agent"] == agent])}
                      for agent in LATER},
        "decisions": [r["decisions"] for r in mine],
        "calls": mine,
        "machine": machine(**torch_build()),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--people", type=int, default=None)
    parser.add_argument("--documents", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None, help="limit measurements per call (median)")
    parser.add_argument("--note-tokens", type=int, default=16)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    fill_defaults(args, QUICK, FULL)
    return run_and_emit(run, args)


if __name__ == "__main__":
    main()

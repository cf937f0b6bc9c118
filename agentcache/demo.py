"""A short multi-agent workflow on the embedded engine, measured against a no-reuse baseline.

Three role agents read a shared travel request, a summary agent reads their notes, and the
planner runs a second turn over everything. Each call runs twice, interleaved: once on an
engine with the exact prefix cache, once on an engine over the same weights without it. The
demo prints per-call TTFT, cached tokens and the hit rate, and writes a JSON report.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from agentcache.engine import EmbeddedEngine, EngineConfig, ExecRequest, SamplingParams, SegmentPlan

__all__ = ["run_demo", "DemoCall"]

QUERY = (
    "Request from the user: a family of four (two adults, two children aged 8 and 11) wants to spend "
    "three days in Lisbon in early May. They arrive by train on Friday morning, like museums, parks and "
    "seafood, dislike long walks uphill, and have a total budget of 1200 euros for hotel, food, transport "
    "and tickets. They ask for a day-by-day plan, a few useful Portuguese phrases, and a cost estimate.\n"
)

AGENTS = {
    "planner": "You are the planner agent of a travel team. You split a trip into days and decide the order of visits.\n",
    "local_guide": "You are the local guide agent. You know Lisbon's neighbourhoods, trams, museums and restaurants.\n",
    "language": "You are the language agent. You teach short, practical phrases in the local language with pronunciation.\n",
    "summary": "You are the summary agent. You merge the team's notes into one clear plan for the family.\n",
}


@dataclass
class DemoCall:
    agent: str
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    baseline_ttft_s: float
    text: str


def _plan(engine: EmbeddedEngine, agent: str, notes: list[tuple[str, str]], ask: str) -> list[SegmentPlan]:
    """[PF system, PH query, (PF glue, PH note)*, PF ask] as in KVCMAS Eq. 1."""
    segments = [
        SegmentPlan("sys", engine.tokenize(AGENTS[agent], bos=True)),
        SegmentPlan("query", engine.tokenize(QUERY)),
    ]
    for source, text in notes:
        segments.append(SegmentPlan(f"glue:{source}", engine.tokenize(f"Notes from the {source} agent:\n")))
        segments.append(SegmentPlan(f"out:{source}", engine.tokenize(text.strip() + "\n")))
    segments.append(SegmentPlan("ask", engine.tokenize(ask)))
    return segments


def run_demo(
    model: str = "gemma3-270m",
    max_tokens: int = 32,
    results_dir: Path | None = Path("results"),
    echo: Callable[[str], None] = print,
) -> dict:
    started = time.perf_counter()
    echo(f"loading {model} ...")
    cached_engine = EmbeddedEngine(model, EngineConfig(pool_blocks=2048))
    baseline_engine = cached_engine.with_config(EngineConfig(prefix_caching=False))
    sampling = SamplingParams(max_tokens=max_tokens, stop=("\n\n",))

    outputs: dict[str, str] = {}
    calls: list[DemoCall] = []
    workflow = [
        ("planner", [], "Planner's day-by-day outline:\n"),
        ("local_guide", ["planner"], "Local guide's suggestions:\n"),
        ("language", ["planner"], "Useful phrases:\n"),
        ("summary", ["planner", "local_guide", "language"], "Final plan for the family:\n"),
        ("planner", ["local_guide", "language", "summary"], "Planner's revised outline:\n"),
    ]
    echo(f"{'agent':<12} {'prompt':>6} {'cached':>6} {'TTFT':>8} {'no-reuse':>9} {'speedup':>7}  output")
    for agent, sources, ask in workflow:
        notes = [(s, outputs[s]) for s in sources]
        plan = _plan(cached_engine, agent, notes, ask)
        # Interleave: the baseline first, then the cached engine, on identical prompts.
        base = baseline_engine.execute(ExecRequest(plan, sampling, owner=agent))
        hit = cached_engine.execute(ExecRequest(plan, sampling, owner=agent))
        outputs[agent] = hit.text or "(no text)"
        call = DemoCall(agent, hit.prompt_tokens, hit.cached_tokens, hit.ttft_s, base.ttft_s, hit.text)
        calls.append(call)
        preview = " ".join(hit.text.split())[:48]
        echo(
            f"{agent:<12} {call.prompt_tokens:>6} {call.cached_tokens:>6} {call.ttft_s * 1e3:>6.0f}ms "
            f"{call.baseline_ttft_s * 1e3:>7.0f}ms {call.baseline_ttft_s / call.ttft_s:>6.2f}x  {preview}"
        )

    prompt_total = sum(c.prompt_tokens for c in calls)
    report = {
        "model": cached_engine.model_name,
        "calls": [asdict(c) for c in calls],
        "hit_rate": sum(c.cached_tokens for c in calls) / prompt_total,
        "mean_ttft_s": statistics.mean(c.ttft_s for c in calls),
        "mean_baseline_ttft_s": statistics.mean(c.baseline_ttft_s for c in calls),
        "ttft_speedup": statistics.mean(c.baseline_ttft_s for c in calls) / statistics.mean(c.ttft_s for c in calls),
        "pool": asdict(cached_engine.pool.stats),
        "wall_s": time.perf_counter() - started,
    }
    echo(
        f"\nprefix-cache hit rate {report['hit_rate']:.1%} of {prompt_total} prompt tokens; "
        f"mean TTFT {report['mean_ttft_s'] * 1e3:.0f} ms vs {report['mean_baseline_ttft_s'] * 1e3:.0f} ms "
        f"without reuse ({report['ttft_speedup']:.2f}x). Shared-context correction (KVCMAS) comes next."
    )
    if results_dir is not None:
        results_dir.mkdir(parents=True, exist_ok=True)
        path = results_dir / "demo.json"
        path.write_text(json.dumps(report, indent=2))
        echo(f"report written to {path}")
    return report

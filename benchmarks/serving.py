"""Serving under load: request-level p50/p90 TTFT of every shared-context strategy against the
offered load, per shared-context length (KVCMAS §4.3, Fig. 5/6, App. B.4-B.5), scaled to the machine.

Trace (controlled, as the paper's): a trajectory is a fixed four-agent schedule over one shared
document of `--contexts` tokens (distinct per trajectory). Agent i has its own system prompt,
reads the document and the outputs of agents 1..i-1 (each `--output-tokens` long, generated
with EOS ignored), and writes its own. Trajectories arrive as a Poisson process; the agents of one
trajectory run in turn, trajectories overlap in the engine.

Load: NonShared's saturation throughput is measured first in the same run (`--saturation`
trajectories dispatched at once; completed trajectories per second), and each load point offers a
fraction of it (`--loads`), so a point means the same on any machine; the absolute request rate
(4 requests per trajectory) is printed beside it.

Requests: a strategy runs `--trajectories` trajectories at a load point (4 requests each), except at
the highest load point of the run, where NonShared, KVCMAS and KVCMAS-nonchained run
max(`--trajectories`, `--full-load-trajectories`). Every strategy at a point is offered the same
documents at the same arrival times (one with fewer trajectories runs the first ones). The full run
defaults to 2048 shared tokens, loads 0.5 and 1.0, 15 trajectories (60 requests) per strategy and
point and 50 (200 requests) at load 1.0 for those three, 16-token outputs, and the strategies
nonshared, kvcmas, kvcmas_nonchained and cacheblend (`--strategies all` or names add the others);
`--quick` runs every strategy, 3 trajectories (12 requests) at every point.

Each strategy keeps one runtime per context length: `--warmup` trajectories fill its anchor pools
(and profile DroidSpeak's layers); the KVCMAS and its ablations run with their defaults (verified
acceptance, the cost model); an entropy-gated strategy (`kvcmas_entropy`, `kvcomm_canonical`) is
held at `--rho-delta` reuse from its 8th eligible segment on, in the warm-up
(`correction.calibration`; `kvcomm` keeps KVCOMM's own gate, τ = 0.3 on raw distances); selective
recomputation runs at `--rho-selective`. Strategies take turns at every load point (the order
rotates), each in a tenant of its own, so none is served another's prefix-cache blocks.

Per strategy, context and load: p50 and p90 TTFT (from entering the runtime to the first token,
queueing included), over all calls and apart for the calls that reused shared tokens and those that
prefilled them (`groups`), mean request and trajectory latency, the peak bytes of anchors and of source
caches, the reuse ratio in tokens and in agent calls (KVCOMM's count), p50 TTFT less the
reference and template prefills and the gate (as KVCOMM times its own), the achieved throughput,
and whether the point was sustained (mean trajectory latency at most 3x the strategy's own
single-stream latency on the warm trajectories of its warm-up: its queue did not run away). The calls
are greedy: each strategy but NonShared reports the share of its calls whose tokens equal NonShared's
for the same trajectory and agent at the same point (`greedy_agreement_vs_nonshared`, over
`greedy_pairs`).

Keys, at 2048 shared tokens (the longest context when 2048 was not run) and the highest load that
both NonShared and KVCMAS sustain: `p50_speedup_kvcmas_vs_nonshared` (aim >= 2.0),
`p90_ratio_kvcmas_vs_nonshared`, `p50_ratio_chained_vs_nonchained` (aim <= 0.75),
`p50_ratio_kvcmas_vs_cacheblend` (aim < 1; embedded engine only: vLLM's connector fills whole
contiguous ranges, so the selective baselines are not run there),
`peak_anchor_bytes_ratio_kvcomm_vs_kvcmas`, `greedy_agreement_kvcmas`, `kvcmas_reuse_ratio` and
`headline_requests` (the requests NonShared, KVCMAS and KVCMAS-nonchained ran there); a key whose
strategy was not run is None. `--plot` writes the PNG (one panel per context
length, p50 and p90 TTFT against load, one line per strategy).

    python benchmarks/serving.py [--quick] [--engine embedded|vllm] [--strategies all|a,b,...]
                                 [--trajectories 15] [--full-load-trajectories 50] [--plot serving.png]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field

from _report import emit, fill_defaults  # benchmarks/, the script's own folder

from agentcache.correction.strategies import STRATEGIES, Strategy
from agentcache.engine.choice import ENGINE_KINDS, open_engine
from agentcache.engine.protocol import SamplingParams
from agentcache.errors import InputError
from agentcache.metrics import CallResult, percentile
from agentcache.models import DEFAULT_MODEL
from agentcache.runtime import Runtime, RuntimeConfig
from agentcache.segments import AgentCall, Segment
from agentcache.selfcheck import check_model
from agentcache.tasks import document_problem

AGENTS = {
    "planner": "You are the planner. Read the document and lay out the steps the team should take.",
    "analyst": "You are the analyst. Read the document and the notes so far, and work out the key facts.",
    "critic": "You are the critic. Read the document and the notes so far, and point out what is wrong.",
    "writer": "You are the writer. Read the document and every note, and write the final answer.",
}
ORDER = ["nonshared", "fullshared", "kvcomm", "kvcmas", "kvcmas_nonchained", "cacheblend", "droidspeak"]
SELECTIVE = ("cacheblend", "droidspeak")
FULL_RUN_STRATEGIES = ["nonshared", "kvcmas", "kvcmas_nonchained", "cacheblend"]  # the full run's default
FULL_LOAD_STRATEGIES = ("nonshared", "kvcmas", "kvcmas_nonchained")  # run --full-load-trajectories at full load
HEADLINE_CONTEXT = 2048
# a point is sustained when its trajectories take at most this many times the strategy's unloaded
# (single-stream, warm) trajectory latency: queues did not build up without bound
SUSTAINED_SLACK = 3.0


def strategies(rho_delta: float, rho_selective: float) -> dict[str, Strategy]:
    out = {}
    for name in ORDER:
        s = STRATEGIES[name]
        if s.kvcomm_procedure:
            pass  # KVCOMM as its authors run it: τ = 0.3 on raw distances, no calibration
        elif s.correct and s.reuse and s.accept == "entropy":
            s = s.replace(target_reuse=rho_delta, calibrate_after=8)  # held at ρ from the 8th eligible segment
        elif s.recompute is not None:
            s = s.replace(rho=rho_selective)
        out[name] = s
    return out


def document_text(engine, tokens: int, seed: int) -> str:
    """A distinct staff directory cut to about `tokens` tokens (text: the adapters' path)."""
    people = max(4, tokens // 40)
    ids = engine.tokenize(document_problem(seed, people=people).text)[:tokens]
    return engine.detokenize(ids)


@dataclass
class Point:
    """One strategy's run at one load: its calls, trajectory spans and peak memory."""

    calls: list[CallResult] = field(default_factory=list)
    spans: list[tuple[float, float]] = field(default_factory=list)  # (arrival, end) per trajectory
    peak_anchor_bytes: int = 0
    peak_store_bytes: int = 0
    errors: list[str] = field(default_factory=list)


class Trajectories:
    """Runs trajectories of the four-agent trace through one strategy's runtime."""

    def __init__(self, runtime: Runtime, tenant: str, output_tokens: int) -> None:
        self.runtime = runtime
        self.tenant = tenant
        self.sampling = SamplingParams(max_tokens=output_tokens, ignore_eos=True)
        self._lock = threading.Lock()
        self.point: Point | None = None

    def watch(self, result: CallResult) -> None:  # the runtime's on_call: peak memory after each call
        point, corrector = self.point, self.runtime.corrector
        if point is None:
            return
        with self._lock:
            held = corrector.held_bytes()
            point.peak_anchor_bytes = max(point.peak_anchor_bytes, held["anchor_bytes"])
            point.peak_store_bytes = max(point.peak_store_bytes, held["store_bytes"])

    def one(self, session: str, document: str) -> list[CallResult]:
        rt, results = self.runtime, []
        for i, (agent, system) in enumerate(AGENTS.items()):
            segments = [Segment.pf(system + "\n\nDocument:\n"), Segment.ph("document", document)]
            for earlier in list(AGENTS)[:i]:
                segments.append(Segment.pf(f"\n\nThe {earlier} wrote:\n"))
                segments.append(rt.output_segment(earlier, session=session, tenant=self.tenant))
            segments.append(Segment.pf(f"\n\nThe {agent} writes:\n"))
            call = AgentCall(agent=agent, session=session, tenant=self.tenant, segments=tuple(segments))
            results.append(rt.run(call, self.sampling))
        return results

    def run(self, jobs: list[tuple[str, str]], arrivals: list[float]) -> Point:
        """Start trajectory k at arrivals[k] seconds from now (each on a thread of its own)."""
        point = self.point = Point()
        start = time.perf_counter()

        def trajectory(session: str, document: str, at: float) -> None:
            delay = start + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            begun = time.perf_counter()
            try:
                results = self.one(session, document)
            except Exception as exc:  # noqa: BLE001 - reported, never hidden
                with self._lock:
                    point.errors.append(f"{type(exc).__name__}: {exc}")
                return
            with self._lock:
                point.calls.extend(results)
                point.spans.append((begun - start, time.perf_counter() - start))

        threads = [threading.Thread(target=trajectory, args=(s, d, a), daemon=True)
                   for (s, d), a in zip(jobs, arrivals)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.point = None
        return point


def poisson_arrivals(count: int, rate: float, rng: random.Random) -> list[float]:
    at, out = 0.0, []
    for _ in range(count):
        out.append(at)
        at += rng.expovariate(rate)
    return out


def ttft_group(calls: list[CallResult]) -> dict:
    ttfts = [c.ttft_s for c in calls]
    return {"count": len(calls), "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90)}


def greedy_agreement(calls: list[CallResult], reference: list[CallResult]) -> dict:
    """The share of `calls` whose tokens equal the reference's call of the same session and agent."""
    tokens = {(c.session, c.agent): c.token_ids for c in reference}
    same = [c.token_ids == tokens[c.session, c.agent] for c in calls if (c.session, c.agent) in tokens]
    return {"greedy_agreement_vs_nonshared": sum(same) / len(same) if same else None, "greedy_pairs": len(same)}


def summarize_point(point: Point, unloaded: float | None) -> dict:
    ttfts = [c.ttft_s for c in point.calls]
    eligible = sum(c.eligible_tokens for c in point.calls)
    reused = sum(c.reused_tokens for c in point.calls)
    eligible_calls = [c for c in point.calls if c.eligible_tokens > 0]
    makespan = max((end for _, end in point.spans), default=0.0) - min((a for a, _ in point.spans), default=0.0)
    achieved = len(point.spans) / makespan if makespan > 0 else 0.0
    latency = statistics.fmean(e - a for a, e in point.spans) if point.spans else None
    decisions: dict[str, int] = {}
    for call in point.calls:
        for seg in call.segments:
            if seg.kind == "ph":
                key = seg.decision if seg.reason is None else f"{seg.decision}:{seg.reason}"
                decisions[key] = decisions.get(key, 0) + 1
    return {
        "requests": len(point.calls),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "groups": {"reused": ttft_group([c for c in point.calls if c.reused_tokens > 0]),
                   "prefilled": ttft_group([c for c in point.calls if c.reused_tokens <= 0])},
        # KVCOMM's TTFT leaves out its reference and template prefills and the gate: ours both ways
        "ttft_p50_less_setup_s": percentile([c.ttft_s - sum(s.setup_s for s in c.segments) for c in point.calls], 50),
        "request_latency_mean_s": statistics.fmean(c.total_s for c in point.calls) if point.calls else None,
        "trajectory_latency_mean_s": latency,
        "peak_anchor_bytes": point.peak_anchor_bytes,
        "peak_source_bytes": point.peak_store_bytes,
        "reuse_ratio": reused / eligible if eligible else 0.0,  # tokens
        "call_reuse_rate": (sum(1 for c in eligible_calls if c.reused_tokens > 0) / len(eligible_calls)
                            if eligible_calls else 0.0),  # agent calls with any reuse (KVComm's count)
        "prefill_tokens_per_request": statistics.fmean(c.prefill_tokens for c in point.calls) if point.calls else None,
        "achieved_trajectories_per_s": achieved,
        "sustained": unloaded is None or (latency is not None and latency <= SUSTAINED_SLACK * unloaded),
        "ph_decisions": decisions,
        "errors": point.errors,
    }


def run(args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    rng = random.Random(args.seed)
    base = open_engine(args.engine, args.model)
    check = None if args.quick else check_model(base)
    chosen = strategies(args.rho_delta, args.rho_selective)
    if "all" not in args.strategies:
        chosen = {n: s for n, s in chosen.items() if n in args.strategies or n == "nonshared"}
    skipped = {}
    serial = iter(range(10**9))

    def jobs(context: int, count: int) -> list[tuple[str, str]]:
        return [(f"t{next(serial)}", document_text(base, context, 1000 + next(serial))) for _ in range(count)]

    report: dict = {"contexts": {}}
    for context in args.contexts:
        runners: dict[str, Trajectories] = {}
        for name, strategy in chosen.items():
            engine = base.fresh() if args.engine == "embedded" else base  # vLLM: one engine, tenants apart
            try:
                rt = Runtime(engine, strategy=strategy, check=check, config=RuntimeConfig(self_check=False))
            except InputError as exc:
                skipped[name] = str(exc)
                continue
            runner = Trajectories(rt, tenant=f"{name}-{context}", output_tokens=args.output_tokens)
            rt.on_call = runner.watch
            runners[name] = runner
        warm = jobs(context, args.warmup)  # the same warm-up documents for every strategy
        unloaded: dict[str, float] = {}  # mean single-stream latency of the warm half of the warm-up
        for name, runner in runners.items():
            spans = []
            for k, job in enumerate(warm):
                begun = time.perf_counter()
                runner.one(*job)
                if k >= len(warm) // 2:
                    spans.append(time.perf_counter() - begun)
            unloaded[name] = statistics.fmean(spans)
        # NonShared's saturation throughput: trajectories dispatched at once
        saturation = summarize_point(runners["nonshared"].run(jobs(context, args.saturation), [0.0] * args.saturation),
                                     None)["achieved_trajectories_per_s"]
        points = {}
        for turn, load in enumerate(args.loads):
            rate = load * saturation
            counts = {name: trajectory_count(args, name, load) for name in runners}
            shared_jobs = jobs(context, max(counts.values()))  # the same list for all: each runs its first ones
            arrivals = poisson_arrivals(len(shared_jobs), rate, rng)
            names = list(runners)
            names = names[turn % len(names):] + names[: turn % len(names)]  # rotate who goes first
            runs = {name: runners[name].run(shared_jobs[:counts[name]], arrivals[:counts[name]]) for name in names}
            points[str(load)] = {"offered_trajectories_per_s": rate, "offered_requests_per_s": 4 * rate,
                                 "strategies": point_rows(runs, unloaded, list(runners))}
        report["contexts"][str(context)] = {
            "saturation_trajectories_per_s": saturation,
            "gate_tau": {n: r.runtime.corrector.tau for n, r in runners.items() if r.runtime.strategy.correct},
            "unloaded_trajectory_s": unloaded,
            "loads": points,
        }
    report.update(headline(report, args.contexts, args.loads))
    report.update(
        model=base.model_name, engine=args.engine, output_tokens=args.output_tokens,
        rho_delta=args.rho_delta, rho_selective=args.rho_selective, skipped=skipped,
        trajectories_per_point=args.trajectories, full_load_trajectories=args.full_load_trajectories,
        full_load_strategies=list(FULL_LOAD_STRATEGIES), warmup_trajectories=args.warmup,
        machine=f"{platform.machine()}, {os.cpu_count()} cpus", wall_s=round(time.perf_counter() - started, 1),
    )
    if args.plot:
        plot(report, args.plot)
        report["plot"] = args.plot
    return report


def trajectory_count(args: argparse.Namespace, name: str, load: float) -> int:
    """--trajectories, or at the run's highest load the larger --full-load-trajectories for the
    strategies the headline compares."""
    if load == max(args.loads) and name in FULL_LOAD_STRATEGIES:
        return max(args.trajectories, args.full_load_trajectories)
    return args.trajectories


def point_rows(runs: dict[str, Point], unloaded: dict[str, float], names: list[str]) -> dict:
    """Each strategy's summary at one point, with its greedy agreement against NonShared's calls."""
    rows = {name: summarize_point(runs[name], unloaded[name]) for name in names}
    for name in names:
        if name != "nonshared":
            rows[name].update(greedy_agreement(runs[name].calls, runs["nonshared"].calls))
    return rows


def headline(report: dict, contexts: list[int], loads: list[float]) -> dict:
    """The issue's keys at 2048 shared tokens (else the longest context), highest load both NonShared
    and KVCMAS sustain."""
    context = str(HEADLINE_CONTEXT if HEADLINE_CONTEXT in contexts else max(contexts))
    points = report["contexts"][context]["loads"]
    sustained = [load for load in sorted(loads, reverse=True)
                 if all(points[str(load)]["strategies"].get(n, {}).get("sustained") for n in ("nonshared", "kvcmas"))]
    load = str(sustained[0] if sustained else min(loads))
    rows = points[load]["strategies"]

    def value(name: str, key: str) -> float | None:
        return rows.get(name, {}).get(key)

    def p50(name: str) -> float | None:
        return value(name, "ttft_p50_s")

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    kvcmas = p50("kvcmas")
    return {
        "headline_context": int(context), "headline_load": float(load), "headline_load_sustained": bool(sustained),
        "p50_speedup_kvcmas_vs_nonshared": ratio(p50("nonshared"), kvcmas),
        "p90_ratio_kvcmas_vs_nonshared": ratio(value("kvcmas", "ttft_p90_s"), value("nonshared", "ttft_p90_s")),
        "p50_ratio_chained_vs_nonchained": ratio(kvcmas, p50("kvcmas_nonchained")),
        "p50_ratio_kvcmas_vs_cacheblend": ratio(kvcmas, p50("cacheblend")),
        "peak_anchor_bytes_ratio_kvcomm_vs_kvcmas": ratio(value("kvcomm", "peak_anchor_bytes"),
                                                          value("kvcmas", "peak_anchor_bytes")),
        "headline_requests": {name: value(name, "requests") for name in FULL_LOAD_STRATEGIES},
        "greedy_agreement_kvcmas": value("kvcmas", "greedy_agreement_vs_nonshared"),
        "kvcmas_reuse_ratio": value("kvcmas", "reuse_ratio"),
    }


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = list(report["contexts"])
    fig, axes = plt.subplots(2, len(contexts), figsize=(4.5 * len(contexts), 7), squeeze=False)
    for col, context in enumerate(contexts):
        loads = report["contexts"][context]["loads"]
        xs = [float(x) for x in loads]
        names = list(next(iter(loads.values()))["strategies"])
        for row, key in enumerate(("ttft_p50_s", "ttft_p90_s")):
            ax = axes[row][col]
            for name in names:
                ax.plot(xs, [loads[x]["strategies"][name][key] for x in loads], marker="o", label=name)
            ax.set_title(f"{context} shared tokens: {key[5:8]} TTFT")
            ax.set_xlabel("load (fraction of NonShared saturation)")
            ax.set_ylabel("seconds")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{report['model']} on the {report['engine']} engine, {report['output_tokens']}-token outputs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model, one context, two loads (< 60 s)")
    parser.add_argument("--engine", choices=ENGINE_KINDS, default="embedded")
    parser.add_argument("--model", default=None)
    parser.add_argument("--contexts", type=lambda v: [int(x) for x in v.split(",")], default=None,
                        help="shared document lengths in tokens, e.g. 1024,2048,4096")
    parser.add_argument("--loads", type=lambda v: [float(x) for x in v.split(",")], default=None,
                        help="fractions of NonShared's saturation throughput, e.g. 0.25,0.5,0.75,1")
    parser.add_argument("--output-tokens", type=int, default=None, help="tokens each agent writes (paper: 128)")
    parser.add_argument("--trajectories", type=int, default=None,
                        help="trajectories (4 requests each) per strategy and load point")
    parser.add_argument("--full-load-trajectories", type=int, default=None,
                        help="at the highest load, NonShared, KVCMAS and KVCMAS-nonchained run the larger of "
                             "this and --trajectories")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up trajectories per strategy and context")
    parser.add_argument("--saturation", type=int, default=None, help="trajectories dispatched at once to find saturation")
    parser.add_argument("--rho-delta", type=float, default=0.8, help="reuse ratio the correction gates are calibrated for")
    parser.add_argument("--rho-selective", type=float, default=0.8, help="CacheBlend's and DroidSpeak's reused share")
    parser.add_argument("--strategies", type=lambda v: [x for x in v.split(",") if x], default=None,
                        help="'all', or names from " + ",".join(ORDER) + " (NonShared always runs); full run: "
                             + ",".join(FULL_RUN_STRATEGIES) + ", --quick: all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default=None, help="write the PNG here")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    quick = dict(model="tiny-llama", contexts=[256], loads=[0.5, 1.0], output_tokens=8, trajectories=3,
                 full_load_trajectories=3, warmup=5, saturation=3, strategies=["all"])
    full = dict(model=DEFAULT_MODEL, contexts=[HEADLINE_CONTEXT], loads=[0.5, 1.0], output_tokens=16, trajectories=15,
                full_load_trajectories=50, warmup=6, saturation=4, strategies=FULL_RUN_STRATEGIES)
    fill_defaults(args, quick, full)
    result = run(args)
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)

"""A long-lived runtime's memory and lookup cost stay flat (issue: bounded memory).

20,000 calls (3,000 with --quick) on tiny-llama under KVCMAS (gate open, so corrections,
anchors and lineage blocks are all exercised) over many sessions of two tenants. Each session
is one small workflow: two experts fan out on a fresh query, a judge fans in on the query and
both outputs (read back with `output_segment`), and the first expert answers once more. The
resident set size (RSS) is sampled every 1000 calls; so is the median time of the segment
store's lookups in that window.

Figures (one JSON object):
- calls; rss_mb by sample; rss_growth_mb_per_1000_calls: the least-squares slope of RSS over
  the samples after warm-up (the first `warmup` calls fill the block pool, the session table,
  the record ring and the anchor pools; aim < 0.3);
- store_lookup_ms_p50_start / _end: the median lookup in the first window after warm-up and in
  the last (aim: flat), with the store's entries at the end;
- the runtime's bounded state at the end (sessions kept, records kept, anchors, store bytes).

torch runs one thread: a 3-layer model gains nothing from more, and on 2 shared cores extra
threads only oversubscribe.

    python benchmarks/soak.py [--quick] [--calls N] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import time
from statistics import median

import torch

from _report import emit  # benchmarks/, the script's own folder
from agentcache import AgentCall, EmbeddedEngine, EngineConfig, Runtime, RuntimeConfig, SamplingParams, Segment
from agentcache.correction.strategies import STRATEGIES
from agentcache.errors import PlanError

EXPERTS = {
    "solver": "You solve the problem step by step.\n",
    "analyst": "You list the facts the problem gives.\n",
    "coder": "You write the computation as code.\n",
    "critic": "You look for mistakes in the reasoning.\n",
}
JUDGE = "You read the experts and give the final answer.\n"
WORDS = ("apples trains books pizzas rows plants friends hours miles boxes eggs market brother library "
         "monday tuesday slices farmer corn dies buys gives shares travels").split()
WINDOW = 1000  # calls per RSS sample and lookup window (--window)


def rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def slope_per_1000(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of (calls, MB) points, in MB per 1000 calls."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / spread * 1000 if spread else 0.0


class TimedLookups:
    """Wraps the store's `find` to time every lookup."""

    def __init__(self, store) -> None:
        self._find = store.find
        self.ms: list[float] = []
        store.find = self

    def __call__(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return self._find(*args, **kwargs)
        finally:
            self.ms.append((time.perf_counter() - started) * 1e3)


def session_calls(rt: Runtime, rng: random.Random, index: int):
    """The calls of one session, yielded one at a time (later ones read earlier outputs)."""
    tenant = f"tenant-{index % 2}"
    session = f"session-{index}"
    query = Segment.ph("query", " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 16))) + ".")
    first, second = rng.sample(sorted(EXPERTS), 2)
    for expert in (first, second):
        yield AgentCall(agent=expert, session=session, tenant=tenant,
                        segments=(Segment.pf(EXPERTS[expert]), query, Segment.pf("\nAnswer:")))
    outputs = [output_or_note(rt, e, session, tenant) for e in (first, second)]
    yield AgentCall(agent="judge", session=session, tenant=tenant, segments=(
        Segment.pf(JUDGE), query, Segment.pf(f"\n{first} said:"), outputs[0],
        Segment.pf(f"\n{second} said:"), outputs[1], Segment.pf("\nFinal answer:")))
    yield AgentCall(agent=first, session=session, tenant=tenant,
                    segments=(Segment.pf(EXPERTS[first]), query, Segment.pf("\nAnswer:"), outputs[0],
                              Segment.pf("\nCheck it again:")))


def output_or_note(rt: Runtime, agent: str, session: str, tenant: str) -> Segment:
    """The agent's output as a PH segment; a random-weight model may decode to nothing, then a PF note."""
    try:
        return rt.output_segment(agent, session=session, tenant=tenant)
    except PlanError:
        return Segment.pf("(no answer)")


def run(calls: int, warmup: int, seed: int, window: int = WINDOW) -> dict:
    torch.set_num_threads(1)
    engine = EmbeddedEngine("tiny-llama", EngineConfig(pool_blocks=1024))
    rt = Runtime(engine, strategy=STRATEGIES["kvcmas_entropy"].replace(tau=1.0), config=RuntimeConfig(self_check=False))
    lookups = TimedLookups(rt.corrector.store)
    sampling = SamplingParams(max_tokens=2, ignore_eos=True)
    rng = random.Random(seed)
    samples: list[tuple[int, float]] = []
    windows: list[float] = []
    timeline: list[dict] = []  # what the bounded state holds at each sample
    done, sessions = 0, 0
    started = time.perf_counter()
    with torch.inference_mode():
        while done < calls:
            for call in session_calls(rt, rng, sessions):
                rt.run(call, sampling)
                done += 1
                if done % window == 0:
                    gc.collect()
                    samples.append((done, round(rss_mb(), 2)))
                    windows.append(median(lookups.ms) if lookups.ms else 0.0)
                    lookups.ms.clear()
                    timeline.append({"calls": done, "rss_mb": samples[-1][1], "store_mb": rt.corrector.store.nbytes / 2**20,
                                     "anchor_mb": rt.corrector.bank.nbytes / 2**20,
                                     "anchors": rt.corrector.bank.num_anchors, "store_entries": len(rt.corrector.store)})
                if done == calls:
                    break
            sessions += 1
    elapsed = time.perf_counter() - started
    steady = [(x, y) for x, y in samples if x >= warmup]
    steady_windows = windows[len(samples) - len(steady):]
    figures = rt.summary()
    return {
        "benchmark": "soak",
        "model": engine.model_name,
        "strategy": figures["strategy"],
        "calls": done,
        "sessions_run": sessions + 1,
        "tenants": 2,
        "warmup_calls": warmup,
        "window_calls": window,
        "seconds": round(elapsed, 1),
        "calls_per_s": round(done / elapsed, 1),
        "torch_threads": torch.get_num_threads(),
        "rss_mb": dict(samples),
        "timeline": [{k: round(v, 2) if isinstance(v, float) else v for k, v in t.items()} for t in timeline],
        "rss_growth_mb_per_1000_calls": round(slope_per_1000(steady), 4) if len(steady) >= 2 else None,
        "rss_growth_mb": round(steady[-1][1] - steady[0][1], 2) if steady else None,
        "store_lookup_ms_p50_start": round(steady_windows[0], 4) if steady_windows else None,
        "store_lookup_ms_p50_end": round(steady_windows[-1], 4) if steady_windows else None,
        "store_entries_end": figures["store_entries"],
        "store_bytes_end": figures["store_bytes"],
        "sessions_kept": figures["sessions"],
        "sessions_forgotten": figures["sessions_forgotten"],
        "records_kept": len(rt.results),
        "anchors": figures["anchors"],
        "anchor_bytes": figures["anchor_bytes"],
        "pool_blocks": engine.pool.capacity,
        "pool_blocks_used": engine.pool.num_used,
        "reuse_ratio": round(figures["reuse_ratio"], 3),
        "ph_decisions": figures["ph_decisions"],
        "faults": figures["faults"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3000 calls (under a minute on 2 cores)")
    parser.add_argument("--calls", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None, help="calls before RSS growth is measured")
    parser.add_argument("--window", type=int, default=WINDOW, help="calls per RSS sample and lookup window")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    calls = args.calls or (3000 if args.quick else 20000)
    warmup = args.warmup if args.warmup is not None else (1000 if args.quick else 2000)
    emit(run(calls, min(warmup, calls - args.window), args.seed, args.window), args.out)


if __name__ == "__main__":
    main()

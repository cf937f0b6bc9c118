"""End to end: mean TTFT under Survival eviction (with and without warm-up) against LRU, on the
embedded engine under cache pressure, with a selector-style workload (CacheScout Fig. 8b, 12).

A generated selector trace (six agents with 256-640-token prefixes, 4 concurrent sessions,
12 turns each, 64-token queries, 48 tokens of history per turn; `--quick` halves the lengths
and runs 10 sessions) is mapped into the model's
vocabulary (BOS first) and run through three runtimes over the same weights: engine eviction
`lru`, `survival`, and `survival` with the warm-up coordinator. Each call is
AgentCall(agent, [PF prefix, PH conversation]) with NonShared (exact prefix caching only) and
one generated token. The pool holds 1.25x the largest request. Calls are interleaved: each
request of the trace runs on the three runtimes in rotating order; a warm-up runs between
calls (the runtime waits for it before the next call, as idle time between agent turns).

Warm-ups here get the idle time they need; `warmup_s` (their engine time) against `prefill_s`
(the calls' own time) says how much work they add, which a busy engine would pay for.

Reported: mean and median TTFT per policy, `ttft_ratio_survival_vs_lru` (mean survival / mean
lru; below 1 is faster), the same with warm-up, and each runtime's prefix-cache hit rate
(cached / prompt tokens). The model is mid-llama (random weights, 8 layers, hidden 512): on
the smaller presets a prefill of a thousand tokens takes about as long as gathering cached
blocks, so a hit saves nothing to measure.

    python benchmarks/scout_ttft.py [--quick] [--model tiny-llama]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

from _report import emit  # benchmarks/, the script's own folder
from agentcache.engine import EmbeddedEngine, EngineConfig, EvictionPolicy, SamplingParams
from agentcache.policies import make_policy
from agentcache.runtime import Runtime, RuntimeConfig
from agentcache.scout import WorkloadSpec, generate
from agentcache.segments import AgentCall, Segment

CONFIGS = ("lru", "survival", "survival_prefetch")


def _vocab_mapper(vocab_size: int, bos: int | None):
    """Trace token ids -> ids in [2, vocab) other than BOS, scrambled so different content differs."""
    span = vocab_size - 3

    def to_model(ids) -> tuple[int, ...]:
        out = []
        for t in ids:
            v = (t * 2654435761 >> 7) % span + 2
            out.append(v + 1 if bos is not None and v >= bos else v)
        return tuple(out)

    return to_model


def run_selector(make_engine, args, block_size: int, quick_sessions: int = 10) -> dict:
    """Replay the selector trace `args` describe through the three runtimes; `make_engine(name,
    pool_blocks, eviction)` builds each one's engine (each with a pool of its own)."""
    sessions = args.sessions or (quick_sessions if args.quick else 32)
    lengths = dict(prefix_tokens=(128, 320), query_tokens=32, output_tokens=24) if args.quick else {}
    spec = WorkloadSpec(topology="selector", sessions=sessions, seed=args.seed, **lengths)
    trace = generate(spec)
    capacity = int((trace.max_request_blocks(block_size) + 1) * 1.25)
    runtimes = {}
    for name in CONFIGS:
        engine = make_engine(name, capacity, "lru" if name == "lru" else make_policy("survival"))
        runtimes[name] = Runtime(engine, strategy="nonshared", config=RuntimeConfig(warmup=name == "survival_prefetch"))
    first = runtimes[CONFIGS[0]].engine
    to_model = _vocab_mapper(first.vocab_size, first.bos_token_id)
    bos = (first.bos_token_id,) if first.bos_token_id is not None else ()

    ttft: dict[str, list[float]] = {name: [] for name in CONFIGS}
    cached = {name: 0 for name in CONFIGS}
    prompt = {name: 0 for name in CONFIGS}
    sampling = SamplingParams(max_tokens=1)
    for i, request in enumerate(trace):
        prefix = bos + to_model(request.prompt[: request.prefix_len])
        rest = to_model(request.prompt[request.prefix_len:])
        call = AgentCall(agent=request.agent, session=request.session, segments=[
            Segment(kind="pf", token_ids=prefix), Segment(kind="ph", slot="conversation", token_ids=rest)])
        for k in range(len(CONFIGS)):
            name = CONFIGS[(i + k) % len(CONFIGS)]
            result = runtimes[name].run(call, sampling)
            runtimes[name].wait_warmup()  # idle time between agent turns
            ttft[name].append(result.ttft_s)
            cached[name] += result.cached_tokens
            prompt[name] += result.prompt_tokens

    mean = {n: statistics.fmean(v) for n, v in ttft.items()}
    return {
        "model": args.model,
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores",
        "workload": {"topology": "selector", "sessions": sessions, "concurrent": spec.concurrent, "turns": spec.turns,
                     "prefix_tokens": list(spec.prefix_tokens), "query_tokens": spec.query_tokens,
                     "output_tokens": spec.output_tokens, "requests": len(trace), "pool_blocks": capacity,
                     "block_size": block_size, "largest_request_blocks": trace.max_request_blocks(block_size)},
        "mean_ttft_s": {n: round(v, 5) for n, v in mean.items()},
        "median_ttft_s": {n: round(statistics.median(v), 5) for n, v in ttft.items()},
        "ttft_ratio_survival_vs_lru": round(mean["survival"] / mean["lru"], 3),
        "ttft_ratio_survival_prefetch_vs_lru": round(mean["survival_prefetch"] / mean["lru"], 3),
        "hit_rate": {n: round(cached[n] / prompt[n], 4) for n in CONFIGS},
        "warmups": runtimes["survival_prefetch"].summary()["warmups"],
        "warmup_s": round(runtimes["survival_prefetch"].summary()["warmup_s"], 2),  # engine time of warm-ups, between calls
        "prefill_s": {n: round(sum(r.total_s for r in runtimes[n].results), 2) for n in CONFIGS},  # calls' own time
    }


def selector_arguments(parser: argparse.ArgumentParser, model: str, quick_sessions: int = 10) -> None:
    parser.add_argument("--quick", action="store_true",
                        help=f"{quick_sessions} sessions with halved lengths (< 60 s on 2 cores)")
    parser.add_argument("--model", default=model)
    parser.add_argument("--sessions", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    selector_arguments(parser, "mid-llama")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    base = EmbeddedEngine(args.model)

    def make_engine(name: str, pool_blocks: int, eviction: str | EvictionPolicy) -> EmbeddedEngine:
        return base.with_config(EngineConfig(pool_blocks=pool_blocks, eviction=eviction))

    result = {"benchmark": "scout_ttft", **run_selector(make_engine, args, base.block_size)}
    result["wall_s"] = round(time.perf_counter() - started, 1)
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])

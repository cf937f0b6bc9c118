"""What bounds `agentcache serve`'s memory: RSS against requests served, in steady state.

One server in this process (tiny-qwen2-chat, the default strategy, the prefix pool sized by
`--pool-blocks` so that it fills during the warm-up); a load process (separate, so that its client
memory is not counted) keeps `--concurrency` requests in flight. Two phases, in turn:

- `new`: every request new: a new session, a new user text, one of `--agents` system prompts
  (more than the metrics' per-tenant labels), so every store the server keeps (prefix blocks,
  sessions, sources, agents, CacheScout's transitions, metric labels) sees new keys all the time;
- `repeat`: the same 16 requests over and over.

This process's RSS (VmRSS) is sampled every `--sample-every` completed requests; after the first
`--warmup` share of a phase the least-squares slope of RSS against requests is its growth.

Keys: `rss_growth_new_mb_per_1000` and `rss_growth_repeat_mb_per_1000` (aim < 1 MB each), `requests` per phase,
`rss_mb` (start and end of each phase), `rss_mb_range_after_warmup`, `rss_mb_by_requests` (every tenth sample), `held_at_end` (the
strategy's stores), `pool_blocks`, `pool_mb`, `requests_per_s`.

    python benchmarks/serve_soak.py [--quick] [--requests 3000] [--pool-blocks 1024] [--out PATH]

`--quick` (< 60 s on 2 cores): 160 requests of 40 words per phase; too few for a steady state (the
stores fill over the first thousand requests), so its growth figures are not judged by the aim.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time

import httpx

from _report import fill_defaults, judge_aims, machine, run_and_emit  # benchmarks/, this folder

PHASES = ("new", "repeat")


def load(url: str, model: str, phase: str, requests: int, concurrency: int, agents: int, words: int) -> None:
    """Send `requests` requests of `phase`, `concurrency` at a time; print a line per finished one."""

    def body(n: int) -> dict:
        if phase == "repeat":
            n %= 16
        text = " ".join(f"w{phase}{n}x{k}" for k in range(words))
        return {"model": model, "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "system", "content": f"You are agent number {n % agents}."},
                             {"role": "user", "content": text}],
                "agentcache": {"session": f"{phase}-{n}"}}

    async def main() -> None:
        queue = iter(range(requests))
        async with httpx.AsyncClient(timeout=300) as http:
            async def client() -> None:
                for n in queue:
                    reply = await http.post(f"{url}/chat/completions", json=body(n))
                    print(reply.status_code, flush=True)

            await asyncio.gather(*(client() for _ in range(concurrency)))

    asyncio.run(main())


def _phase(server, runtime, model: str, phase: str, args: argparse.Namespace) -> dict:
    from serve_load import current_rss_mb, slope  # here: the load process needs none of it

    process = subprocess.Popen([sys.executable, __file__, "--load", server.url, model, phase, str(args.requests),
                                str(args.concurrency), str(args.agents), str(args.words)], stdout=subprocess.PIPE, text=True)
    samples, statuses, began = [], {}, time.perf_counter()
    for done, line in enumerate(process.stdout, start=1):
        statuses[line.strip()] = statuses.get(line.strip(), 0) + 1
        if done % args.sample_every == 0:
            samples.append((done, current_rss_mb()))
    process.wait(60)
    figures = runtime.summary()
    held = {key: figures.get(key) for key in ("anchor_bytes", "store_bytes", "sessions", "anchors")}
    steady = [point for point in samples if point[0] > args.warmup * args.requests]
    growth = slope(steady)
    levels = [rss for _, rss in steady] or [samples[-1][1]]
    return {"growth": None if growth is None else growth * 1000, "statuses": statuses,
            "rss": [samples[0][1], samples[-1][1]], "range": [min(levels), max(levels)], "held": held,
            "samples": [(done, round(rss, 1)) for done, rss in samples if done % (10 * args.sample_every) == 0], "seconds": time.perf_counter() - began}


def run(args: argparse.Namespace) -> dict:
    from agentcache import Runtime, RuntimeConfig  # here: the load process needs none of it
    from agentcache.engine.choice import open_engine
    from agentcache.serve import ServeConfig, ServerThread, create_app

    engine = open_engine(args.engine, args.model, pool_blocks=args.pool_blocks)
    runtime = Runtime(engine, config=RuntimeConfig(self_check=False))
    phases = {}
    with ServerThread(create_app(runtime, ServeConfig())) as server:
        for phase in PHASES:
            phases[phase] = _phase(server, runtime, engine.model_name, phase, args)
    runtime.close()
    served = sum(phase["statuses"].get("200", 0) for phase in phases.values())
    result = {
        **{f"rss_growth_{name}_mb_per_1000": phase["growth"] for name, phase in phases.items()},
        "requests": {name: phase["statuses"] for name, phase in phases.items()},
        "rss_mb": {name: phase["rss"] for name, phase in phases.items()},
        "rss_mb_range_after_warmup": {name: phase["range"] for name, phase in phases.items()},
        "held_at_end": {name: phase["held"] for name, phase in phases.items()},
        "rss_mb_by_requests": {name: phase["samples"] for name, phase in phases.items()},
        "requests_per_s": served / sum(phase["seconds"] for phase in phases.values()),
        "pool_blocks": args.pool_blocks,
        "pool_mb": args.pool_blocks * engine.block_size * engine.layout.bytes_per_token / 2**20, "concurrency": args.concurrency, "agents": args.agents,
        "model": engine.model_name, "engine": args.engine, "quick": args.quick, "machine": machine(),
    }
    if not args.quick:
        judge_aims(result, {f"rss_growth_{name}_mb_per_1000": ("<", 1.0) for name in PHASES})
    return result


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--load":
        url, model, phase, requests, concurrency, agents, words = sys.argv[2:9]
        load(url, model, phase, int(requests), int(concurrency), int(agents), int(words))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="160 short requests per phase (< 60 s on 2 cores)")
    parser.add_argument("--requests", type=int, default=None, help="requests per phase")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--words", type=int, default=None, help="words of each user message (about 6 tokens each)")
    parser.add_argument("--agents", type=int, default=200, help="system prompts the new phase cycles through")
    parser.add_argument("--pool-blocks", type=int, default=1024, help="the prefix pool: it fills in the warm-up")
    parser.add_argument("--sample-every", type=int, default=25)
    parser.add_argument("--warmup", type=float, default=0.3, help="share of a phase before the slope is taken")
    parser.add_argument("--model", default="tiny-qwen2-chat")
    parser.add_argument("--engine", default="embedded", choices=("embedded", "vllm"))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    fill_defaults(args, {"requests": 160, "words": 40}, {"requests": 3000, "words": 160})
    run_and_emit(run, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

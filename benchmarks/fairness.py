"""Tenants sharing `agentcache serve`: a light tenant's latency while a heavy tenant saturates it.

One server on a loopback port with two API keys (tenants `heavy` and `light`). A load process (a
separate process, so that its client work does not share this one's interpreter lock) keeps
`--heavy` requests of the heavy tenant in flight, each `--heavy-tokens` long, sending the next as
one ends. The light client sends one request at a time (`--light-tokens` long) and times it, in
three conditions taken in turn, interleaved within each round:

- `alone`: no heavy load;
- `fair`: under the load, with the light tenant's own key;
- `one_tenant`: under the load, with the heavy tenant's key (the control: what one queue shared by
  everybody gives, i.e. what admission without tenants does).

Keys: `light_p50_s` and `light_p90_s` per condition, `fair_ratio` (fair p50 over alone p50; the
aim is <= 1.5), `one_tenant_ratio`, `light_refused` (429s per condition), `heavy_requests_per_s`
(the load's throughput while it ran).

    python benchmarks/fairness.py [--quick] [--rounds 4] [--per-round 10] [--model tiny-qwen2-chat] [--out PATH]

`--quick` (< 60 s on 2 cores): 2 rounds of 6 light requests per condition.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import subprocess
import sys
import time

import httpx

from _report import fill_defaults, judge_aims, machine, run_and_emit  # benchmarks/, this folder

KEYS = {"key-heavy": "heavy", "key-light": "light"}
CONDITIONS = ("alone", "fair", "one_tenant")


def _body(model: str, text: str, tokens: int) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": tokens,
            "ignore_eos": True, "temperature": 0}


def load(url: str, model: str, clients: int, tokens: int) -> None:
    """The heavy tenant: `clients` requests in flight until SIGTERM; then prints how many ended."""
    ended, began = 0, time.perf_counter()

    async def client(index: int, http: httpx.AsyncClient) -> None:
        nonlocal ended
        for n in range(10**9):
            reply = await http.post(f"{url}/chat/completions", json=_body(model, f"heavy {index}.{n}", tokens))
            if reply.status_code == 200:
                ended += 1
            else:
                await asyncio.sleep(0.05)

    async def main() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        async with httpx.AsyncClient(headers={"Authorization": "Bearer key-heavy"}, timeout=300,
                                     limits=httpx.Limits(max_connections=clients + 4)) as http:
            tasks = [asyncio.ensure_future(client(i, http)) for i in range(clients)]
            print("started", flush=True)
            await stop.wait()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        print(json.dumps({"ended": ended, "seconds": time.perf_counter() - began}), flush=True)

    asyncio.run(main())


def _start_load(url: str, model: str, args: argparse.Namespace) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, __file__, "--load", url, model, str(args.heavy), str(args.heavy_tokens)],
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "started"
    return process


def _wait_in_flight(health: str, at_least: int, at_most: int | None = None) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        in_flight = httpx.get(health).json()["in_flight"]
        if in_flight >= at_least and (at_most is None or in_flight <= at_most):
            return
        time.sleep(0.05)
    raise RuntimeError(f"the server's in-flight count did not reach [{at_least}, {at_most}] within 60 s")


def _light(url: str, model: str, key: str, index: int, tokens: int) -> tuple[float, int]:
    began = time.perf_counter()
    reply = httpx.post(f"{url}/chat/completions", json=_body(model, f"light {index}", tokens),
                       headers={"Authorization": f"Bearer {key}"}, timeout=300)
    return time.perf_counter() - began, reply.status_code


def run(args: argparse.Namespace) -> dict:
    from agentcache import Runtime, RuntimeConfig  # here: the load process needs none of it
    from agentcache.engine.choice import open_engine
    from agentcache.serve import ApiKeys, ServeConfig, ServerThread, create_app

    engine = open_engine(args.engine, args.model, pool_blocks=2048)
    runtime = Runtime(engine, config=RuntimeConfig(self_check=False))
    config = ServeConfig(api_keys=ApiKeys(KEYS))
    seconds = {condition: [] for condition in CONDITIONS}
    refused = dict.fromkeys(CONDITIONS, 0)
    heavy = {"ended": 0, "seconds": 0.0}
    index = 0
    with ServerThread(create_app(runtime, config)) as server:
        health = server.url.removesuffix("/v1") + "/health"
        model = engine.model_name
        for _ in range(2):  # warm-up: the first requests load what the later ones reuse
            _light(server.url, model, "key-light", -1, args.light_tokens)
        for _ in range(args.rounds):
            for _ in range(args.per_round):
                _record(seconds, refused, "alone", *_light(server.url, model, "key-light", index := index + 1,
                                                           args.light_tokens))
            process = _start_load(server.url, model, args)
            try:
                _wait_in_flight(health, at_least=args.heavy)
                for _ in range(args.per_round):
                    for condition, key in (("fair", "key-light"), ("one_tenant", "key-heavy")):
                        _record(seconds, refused, condition, *_light(server.url, model, key, index := index + 1,
                                                                     args.light_tokens))
            finally:
                process.send_signal(signal.SIGTERM)
                out, _ = process.communicate(timeout=120)
                ended = json.loads(out.strip().splitlines()[-1])
                heavy["ended"] += ended["ended"]
                heavy["seconds"] += ended["seconds"]
            _wait_in_flight(health, at_least=0, at_most=0)
    runtime.close()
    p50 = {condition: statistics.median(values) for condition, values in seconds.items()}
    result = {
        "light_p50_s": p50,
        "light_p90_s": {condition: _p90(values) for condition, values in seconds.items()},
        "fair_ratio": p50["fair"] / p50["alone"],
        "one_tenant_ratio": p50["one_tenant"] / p50["alone"],
        "light_refused": refused,
        "light_samples": {condition: len(values) for condition, values in seconds.items()},
        "heavy_requests_per_s": heavy["ended"] / heavy["seconds"] if heavy["seconds"] else 0.0,
        "heavy_in_flight": args.heavy, "heavy_tokens": args.heavy_tokens, "light_tokens": args.light_tokens,
        "max_in_flight": 4 * engine.max_batch, "max_running": engine.max_batch,
        "model": model, "engine": args.engine, "quick": args.quick, "machine": machine(),
    }
    judge_aims(result, {"fair_ratio": ("<=", 1.5)})
    return result


def _record(seconds: dict, refused: dict, condition: str, took: float, status: int) -> None:
    if status == 200:
        seconds[condition].append(took)
    else:
        refused[condition] += 1


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--load":
        url, model, clients, tokens = sys.argv[2:6]
        load(url, model, int(clients), int(tokens))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 6 (< 60 s on 2 cores)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--per-round", type=int, default=None)
    parser.add_argument("--heavy", type=int, default=24, help="heavy requests kept in flight")
    parser.add_argument("--heavy-tokens", type=int, default=48)
    parser.add_argument("--light-tokens", type=int, default=8)
    parser.add_argument("--model", default="tiny-qwen2-chat")
    parser.add_argument("--engine", default="embedded", choices=("embedded", "vllm"))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    fill_defaults(args, {"rounds": 2, "per_round": 6}, {"rounds": 5, "per_round": 12})
    run_and_emit(run, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

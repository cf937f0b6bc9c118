"""Several `agentcache serve` instances behind vllm-router: session affinity against round-robin,
a fresh instance warm from the shared anchors, and an instance killed mid-session.

Set-up: `--instances` processes of `agentcache serve` (KVCMAS, embedded engine), each pinned to
its own share of the cores (`sched_setaffinity`, OMP_NUM_THREADS), all sharing one anchors
directory (`--anchors-dir`, exchanged every `--anchor-sync-s`) and publishing their prefix
caches as vLLM KV events (`--kv-events-endpoint`), and vllm-router (the PyPI package's Rust
binary) in front, its health checks every second. Policies are vllm-router's (`round_robin`,
`consistent_hash`, `sticky_least_loaded`, `cache_aware`, `kv_aware` fed by those events) and
`kv_aware_affinity` (kv_aware with its session affinity, `--kv-aware-session-affinity-ttl-secs`). Clients are the openai SDK's
AsyncOpenAI against the router, streaming, each request carrying `X-Session-ID` (the router's
affinity key, and the server's session) and `X-Agentcache-Agent`.

Workload: the serving sweep's four-agent trajectories (`benchmarks/serving.py`, as in
`serve_load.py`): one shared document of `--context` tokens per session, agent i reads the
document and agents 1..i-1's outputs (user messages named by their authors). `--sessions`
sessions arrive as a Poisson process (`--rate` per second) in each round.

Phases:
1. Warm-up: `--warmup` trajectories on each instance directly, then one anchor sync period.
2. Policies: `--rounds` rounds; in each, every policy of `--policies` gets a router of its own
   (started for the round, stopped after) and its own fresh sessions and documents; the order
   rotates per round. `round_robin` is the baseline; the affinity policy (`--policy`, default
   `sticky_least_loaded`) keys on `X-Session-ID`, as `consistent_hash` does.
3. Warm instance: a fresh instance on the shared anchors directory and a cold one on an empty
   directory, one after the other, each gets one trajectory directly; their second call (the
   first that can reuse another agent's context) is compared.
4. Failover: `--sessions` sessions through the affinity router; once a third of their requests
   finished, the instance in the middle of the most sessions is killed (SIGKILL). Agents think `--think-s` between their calls here, so
   that sessions are mid-way when it dies. A failed request is retried once by the client
   after a second, as an app would. Requests that started after the kill must not fail. Each
   session that moved gets its first call on the new instance replayed on the same instance under
   a fresh `cache_salt` (its own tenant: no anchors, no sources, so dense): the texts must match.

Keys: `hit_rate_round_robin`, `hit_rate_affinity` (cached prefix tokens over prompt tokens),
`reuse_ratio_round_robin`, `reuse_ratio_affinity` (reused shared tokens over prompt tokens),
`p50_ttft_ratio_affinity_vs_round_robin` (client TTFT p50; aim <= 0.6),
`trajectory_latency_ratio_affinity_vs_round_robin`, `sessions_on_one_instance` per policy,
`warm_instance_first_call_reuse` (aim > 0) beside `cold_instance_first_call_reuse`,
`failover_errors` (failures of requests started after the kill; aim 0),
`failover_inflight_failures`, `failover_moved_sessions`, `failover_moved_calls_dense`
and `failover_moved_calls_equal_dense` (of `failover_moved_calls_checked`), per policy the full
figures; `router`, `aims`, `aims_met`, `model`, `sizes`, `machine`, `elapsed_s`.

    python benchmarks/scale_out.py [--quick] [--model gemma3-270m] [--instances 2] [--out scale_out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from _report import fill_defaults, judge_aims, machine, run_and_emit  # benchmarks/, the script's own folder
from serve_load import NAMES, Errors, Reply, Target, free_port, http_request, messages, summarize
from serving import document_text, poisson_arrivals

from agentcache.engine.choice import open_engine
from agentcache.models import DEFAULT_MODEL

AIMS = {
    "p50_ttft_ratio_affinity_vs_round_robin": ("<=", 0.6),
    "warm_instance_first_call_reuse": (">", 0.0),
    "failover_errors": ("<=", 0),
}
BASELINE = "round_robin"
# health checks every second; a worker is out after two failed checks (a refused connection fails
# at once) and back after one; retries re-pick the worker, spaced to outlast the detection
ROUTER_FLAGS = ["--health-check-interval-secs", "1", "--health-check-timeout-secs", "3",
                "--health-failure-threshold", "2", "--health-success-threshold", "1",
                "--retry-max-retries", "10", "--retry-initial-backoff-ms", "100", "--retry-backoff-multiplier", "1.5",
                "--retry-max-backoff-ms", "2000", "--worker-startup-timeout-secs", "300",
                "--worker-startup-check-interval", "1"]
REUSING = ("reused", "corrected")  # decisions that serve a segment from another cache
EMBEDDED_BLOCK = 16  # the embedded engine's block size: the router hashes the published token ids by it


def router_binary() -> str:
    found = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
    if not Path(found).is_file():
        raise SystemExit("scale_out: vllm-router is not installed (pip install -e '.[cluster]'; scripts/setup.sh does)")
    return found


# --- processes --------------------------------------------------------------------------------


@dataclass
class Process:
    name: str
    url: str
    proc: subprocess.Popen
    log: Path
    events: str | None = None  # its KV event endpoints (an instance's): PUB, replay
    replay: str | None = None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-2000:]
        return ""


def wait_healthy(process: Process, timeout: float, path: str = "/health") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.proc.poll() is not None:
            raise SystemExit(f"scale_out: {process.name} exited ({process.proc.returncode}):\n{process.tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(process.url + path, timeout=2.0).status_code == 200:
                return
        time.sleep(0.2)
    process.stop()
    raise SystemExit(f"scale_out: {process.name} not healthy after {timeout:.0f} s:\n{process.tail()}")


def start_instance(args: argparse.Namespace, name: str, cores: set[int], anchors: Path, logs: Path) -> Process:
    port = free_port()
    env = os.environ | {"OMP_NUM_THREADS": str(len(cores))}
    log = logs / f"{name}.log"
    events, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "agentcache.cli", "serve", "--model", args.model, "--port", str(port),
               "--anchors-dir", str(anchors), "--anchor-sync-s", str(args.anchor_sync_s), "--log-level", "warning",
               "--kv-events-endpoint", events, "--kv-events-replay-endpoint", replay]
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    # pinned at once (a preexec_fn is unsafe in a threaded parent); its threads, started later, inherit it
    os.sched_setaffinity(proc.pid, cores)
    return Process(name, f"http://127.0.0.1:{port}", proc, log, events, replay)


def policy_flags(policy: str, workers: list[Process], model: str) -> list[str]:
    """vllm-router's flags for one of the benchmark's policies: its own policy names, and
    `kv_aware_affinity` (kv_aware with its session affinity on X-Session-ID)."""
    if not policy.startswith("kv_aware"):
        return ["--policy", policy]
    flags = ["--policy", "kv_aware", "--kv-event-block-size", str(EMBEDDED_BLOCK), "--kv-event-model", model]
    for w in workers:
        flags += ["--kv-event-source", f"{w.url}={w.events}", "--kv-event-replay-source", f"{w.url}={w.replay}"]
    if policy == "kv_aware_affinity":
        flags += ["--kv-aware-session-affinity-ttl-secs", "600"]
    return flags


def start_router(policy: str, workers: list[Process], logs: Path, model: str) -> Process:
    port, metrics_port = free_port(), free_port()
    command = [router_binary(), "--worker-urls", *[w.url for w in workers], *policy_flags(policy, workers, model),
               "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(metrics_port), *ROUTER_FLAGS]
    log = logs / f"router-{policy}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    router = Process(f"router ({policy})", f"http://127.0.0.1:{port}", proc, log)
    wait_healthy(router, 120.0, "/v1/models")
    return router


# --- clients ----------------------------------------------------------------------------------


@dataclass
class Outcome:
    """One request as the client saw it, with when it started and whether it failed."""

    session: str
    agent: str
    started: float
    reply: Reply | None
    error: str | None = None
    messages: list[dict[str, Any]] | None = None


@dataclass
class RoutedTarget(Target):
    """serve_load's target, its identity sent as headers a router keeps a session by (and, for a
    dense replay, under a `cache_salt` of its own: a tenant with no anchors and no sources)."""

    salt: str | None = None

    def extra(self, agent: str, session: str) -> dict[str, Any]:
        extra: dict[str, Any] = {"extra_headers": {"X-Session-ID": session, "X-Agentcache-Agent": agent}}
        if self.salt is not None:
            extra["extra_body"] = {"cache_salt": self.salt}
        return extra


class Client:
    """Requests to a router or an instance, through serve_load's streamed request."""

    def __init__(self, url: str, model: str, output_tokens: int, salt: str | None = None) -> None:
        import openai

        self.output_tokens = output_tokens
        self.errors = Errors()
        sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=600.0, max_retries=0)
        self.target = RoutedTarget(url, sdk, model, self.errors, salt=salt)

    async def request(self, session: str, index: int, msgs: list[dict[str, Any]]) -> Outcome:
        began = time.perf_counter()
        reply = await http_request(self.target, NAMES[index], session, msgs, self.output_tokens)
        return Outcome(session, NAMES[index], began, reply, None if reply is not None else self.errors.last, msgs)

    async def close(self) -> None:
        await self.target.client.close()


@dataclass
class Run:
    outcomes: list[Outcome] = field(default_factory=list)
    spans: list[tuple[float, float]] = field(default_factory=list)
    failed: int = 0

    @property
    def replies(self) -> list[Reply]:
        return [o.reply for o in self.outcomes if o.reply is not None]


async def trajectory(client: Client, session: str, document: str, run: Run, retry_after: float | None = None,
                     on_reply=None, think_s: float = 0.0) -> None:
    """The four agents in turn, `think_s` apart (an agent's own work between calls); a failed
    request is retried once after `retry_after` seconds when given, else the trajectory stops there."""
    begun, texts = time.perf_counter(), []
    for index in range(len(NAMES)):
        if index and think_s:
            await asyncio.sleep(think_s)
        msgs = messages(index, document, texts)
        outcome = await client.request(session, index, msgs)
        run.outcomes.append(outcome)
        if outcome.reply is None and retry_after is not None:
            await asyncio.sleep(retry_after)
            outcome = await client.request(session, index, msgs)
            run.outcomes.append(outcome)
        if outcome.reply is None:
            run.failed += 1
            return
        texts.append(outcome.reply.text)
        if on_reply is not None:
            on_reply(outcome, index == len(NAMES) - 1)
    run.spans.append((begun, time.perf_counter()))


async def sessions(client: Client, jobs: list[tuple[str, str]], arrivals: list[float], **kwargs) -> Run:
    run, start = Run(), time.perf_counter()

    async def one(session: str, document: str, at: float) -> None:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        await trajectory(client, session, document, run, **kwargs)

    await asyncio.gather(*(one(s, d, a) for (s, d), a in zip(jobs, arrivals)))
    return run


def figures(run: Run) -> dict[str, Any]:
    """serve_load's summary, plus the share of sessions one instance served whole."""
    from serve_load import Run as LoadRun

    load = LoadRun(replies=run.replies, spans=run.spans, failed=run.failed)
    out = summarize(load)
    out["hit_rate"] = round(out["cached_tokens"] / out["prompt_tokens"], 5) if out["prompt_tokens"] else None
    served: dict[str, set[str]] = {}
    for o in run.outcomes:
        if o.reply is not None and o.reply.server:
            served.setdefault(o.session, set()).add(o.reply.server.get("instance"))
    out["sessions_on_one_instance"] = round(sum(len(v) == 1 for v in served.values()) / len(served), 5) if served else None
    return out


# --- phases -----------------------------------------------------------------------------------


class Documents:
    def __init__(self, engine, tokens: int, seed: int) -> None:
        self.engine, self.tokens, self.next = engine, tokens, seed * 100_000

    def jobs(self, count: int, tag: str) -> list[tuple[str, str]]:
        out = []
        for _ in range(count):
            self.next += 1
            out.append((f"{tag}-{self.next}-{uuid.uuid4().hex[:6]}", document_text(self.engine, self.tokens, self.next)))
        return out


async def warm_up(args, instances: list[Process], docs: Documents) -> dict[str, str]:
    """Warm each instance directly; each one's id (the `instance` its replies name) by its URL."""
    ids = {}
    for instance in instances:
        client = Client(instance.url, args.model, args.output_tokens)
        for session, document in docs.jobs(args.warmup, "warmup"):
            run = Run()
            await trajectory(client, session, document, run)
            if not run.replies:
                raise SystemExit(f"scale_out: warming {instance.name} failed: {client.errors.samples}")
            ids[instance.url] = run.replies[0].server["instance"]
        await client.close()
    await asyncio.sleep(args.anchor_sync_s + 1.0)  # every instance stored what it learned
    return ids


async def policies(args, instances: list[Process], docs: Documents, logs: Path, rng: random.Random) -> dict:
    runs: dict[str, Run] = {p: Run() for p in args.policies}
    for r in range(args.rounds):
        order = args.policies[r % len(args.policies):] + args.policies[:r % len(args.policies)]
        for policy in order:
            router = start_router(policy, instances, logs, args.model)
            client = Client(router.url, args.model, args.output_tokens)
            try:
                run = await sessions(client, docs.jobs(args.sessions, policy), poisson_arrivals(args.sessions, args.rate, rng))
            finally:
                await client.close()
                router.stop()
            runs[policy].outcomes += run.outcomes
            runs[policy].spans += run.spans
            runs[policy].failed += run.failed
    return {p: figures(run) | {"errors": sum(o.reply is None for o in run.outcomes)} for p, run in runs.items()}


async def first_call_reuse(args, anchors: Path, docs: Documents, logs: Path, cores: set[int], name: str) -> dict:
    """One trajectory on a fresh instance over `anchors`: its second call's reuse (reused over prompt tokens)."""
    instance = start_instance(args, name, cores, anchors, logs)
    try:
        wait_healthy(instance, args.start_timeout)
        client = Client(instance.url, args.model, args.output_tokens)
        run = Run()
        (session, document), = docs.jobs(1, name)
        await trajectory(client, session, document, run)
        await client.close()
    finally:
        instance.stop()
    replies = run.replies
    if len(replies) < 2:
        return {"reuse": None, "errors": client.errors.samples}
    second = replies[1]
    reused = (second.server or {}).get("reused_tokens", 0)
    return {"reuse": round(reused / second.prompt_tokens, 5) if second.prompt_tokens else None,
            "reused_tokens": reused, "prompt_tokens": second.prompt_tokens,
            "decisions": (second.server or {}).get("decisions")}


async def failover(args, instances: list[Process], ids: dict[str, str], docs: Documents, logs: Path,
                   rng: random.Random) -> dict:
    router = start_router(args.policy, instances, logs, args.model)
    client = Client(router.url, args.model, args.output_tokens)
    jobs = docs.jobs(args.sessions, "failover")
    total, done, killed = len(jobs) * len(NAMES), [0], {}
    by_id = {i: process for process in instances for url, i in ids.items() if url == process.url}
    going_on: dict[str, str] = {}  # session -> the instance that served its latest call, while it goes on

    def on_reply(outcome: Outcome, last: bool) -> None:
        done[0] += 1
        if last:
            going_on.pop(outcome.session, None)
        else:
            going_on[outcome.session] = outcome.reply.server["instance"]
        if not killed and done[0] >= total // 3 and going_on:
            # the instance in the middle of the most sessions dies: their next calls must move
            victim_id = Counter(going_on.values()).most_common(1)[0][0]
            killed.update(at=time.perf_counter(), after=done[0], victim=by_id[victim_id])
            by_id[victim_id].proc.send_signal(signal.SIGKILL)

    try:
        run = await sessions(client, jobs, poisson_arrivals(len(jobs), args.rate, rng), retry_after=1.0,
                             on_reply=on_reply, think_s=args.think_s)
    finally:
        router.stop()
    kill_at = killed.get("at", float("inf"))
    failed = [o for o in run.outcomes if o.reply is None]
    after = [o for o in failed if o.started >= kill_at]
    served_before: dict[str, set[str]] = {}
    first_after: dict[str, Outcome] = {}
    for o in sorted((o for o in run.outcomes if o.reply is not None and o.reply.server), key=lambda o: o.started):
        if o.started < kill_at:
            served_before.setdefault(o.session, set()).add(o.reply.server.get("instance"))
        else:
            first_after.setdefault(o.session, o)
    victim = killed.get("victim")
    victim_id = ids.get(victim.url) if victim is not None else None
    moved = sorted(s for s, served in served_before.items() if victim_id in served and s in first_after)
    urls = {i: url for url, i in ids.items()}
    checked, equal, dense = 0, 0, 0
    for session in moved:  # the first call on the new instance, against a dense run of it there
        o = first_after[session]
        dense += all(decision not in REUSING for _, decision in o.reply.server.get("decisions") or [])
        direct = Client(urls[o.reply.server["instance"]], args.model, args.output_tokens, salt=uuid.uuid4().hex)
        reference = await direct.request(session + "-dense", NAMES.index(o.agent), o.messages)
        await direct.close()
        checked += 1
        equal += reference.reply is not None and reference.reply.text == o.reply.text
    await client.close()
    return {"failover_errors": len(after), "failover_inflight_failures": len(failed) - len(after),
            "failover_error_samples": [o.error for o in after][:5],
            "failover_killed": victim.name if victim is not None else None,
            "failover_killed_after_requests": killed.get("after"),
            "failover_moved_sessions": len(moved), "failover_moved_calls_checked": checked,
            "failover_moved_calls_dense": dense, "failover_moved_calls_equal_dense": equal,
            "failover_completed_trajectories": len(run.spans), "failover_sessions": len(jobs)}


def _ratio(a, b):
    return round(a / b, 5) if a is not None and b else None


async def measure(args, instances: list[Process], docs: Documents, logs: Path, cores: list[set[int]],
                  anchors: Path) -> dict:
    rng = random.Random(args.seed)
    ids = await warm_up(args, instances, docs)
    by_policy = await policies(args, instances, docs, logs, rng)
    base, chosen = by_policy[BASELINE], by_policy[args.policy]
    result: dict[str, Any] = {
        "hit_rate_round_robin": base["hit_rate"], "hit_rate_affinity": chosen["hit_rate"],
        "reuse_ratio_round_robin": base["reuse_ratio"], "reuse_ratio_affinity": chosen["reuse_ratio"],
        "p50_ttft_ratio_affinity_vs_round_robin": _ratio(chosen["ttft_p50_s"], base["ttft_p50_s"]),
        "p90_ttft_ratio_affinity_vs_round_robin": _ratio(chosen["ttft_p90_s"], base["ttft_p90_s"]),
        "trajectory_latency_ratio_affinity_vs_round_robin": _ratio(chosen["trajectory_latency_mean_s"],
                                                                    base["trajectory_latency_mean_s"]),
        "sessions_on_one_instance": {p: f["sessions_on_one_instance"] for p, f in by_policy.items()},
        "policies": by_policy,
    }
    # a fresh instance on the shared anchors, and a cold one, on the cores the others leave idle now
    warm = await first_call_reuse(args, anchors, docs, logs, cores[-1], "warm-instance")
    cold_dir = Path(tempfile.mkdtemp(prefix="agentcache-cold-anchors-"))
    try:
        cold = await first_call_reuse(args, cold_dir, docs, logs, cores[-1], "cold-instance")
    finally:
        shutil.rmtree(cold_dir, ignore_errors=True)
    result.update(warm_instance_first_call_reuse=warm["reuse"], cold_instance_first_call_reuse=cold["reuse"],
                  warm_instance=warm, cold_instance=cold)
    result.update(await failover(args, instances, ids, docs, logs, rng))
    return result


def run(args: argparse.Namespace) -> dict:
    engine = open_engine("embedded", args.model)  # the documents' tokenizer
    docs = Documents(engine, args.context, args.seed)
    cpus = sorted(os.sched_getaffinity(0))
    cores = [set(cpus[i::args.instances]) for i in range(args.instances)]  # each instance its share
    logs = Path(tempfile.mkdtemp(prefix="agentcache-scale-out-"))
    anchors = Path(args.anchors_dir) if args.anchors_dir else logs / "anchors"
    instances = [start_instance(args, f"instance-{i}", cores[i], anchors, logs) for i in range(args.instances)]
    try:
        for instance in instances:
            wait_healthy(instance, args.start_timeout)
        result = asyncio.run(measure(args, instances, docs, logs, cores, anchors))
    finally:
        for instance in instances:
            instance.stop()
    judge_aims(result, AIMS)
    import vllm_router.version as router_version

    result.update(
        model=engine.model_name, engine="embedded", strategy="kvcmas", quick=args.quick, policy=args.policy,
        router={"name": "vllm-router", "version": router_version.__version__, "flags": ROUTER_FLAGS},
        sizes={"instances": args.instances, "context": args.context, "output_tokens": args.output_tokens,
               "sessions": args.sessions, "rounds": args.rounds, "rate": args.rate, "warmup": args.warmup,
               "anchor_sync_s": args.anchor_sync_s, "think_s": args.think_s, "policies": args.policies},
        machine=machine(cpus=len(cpus), cores_per_instance=[len(c) for c in cores], python=platform.python_version()),
        logs=str(logs))
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny-llama, two instances, short documents (< 60 s)")
    parser.add_argument("--model", default=None, help=f"a preset or a model directory (full run: {DEFAULT_MODEL})")
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--policy", default="sticky_least_loaded", help="the affinity policy measured against round_robin")
    parser.add_argument("--policies", type=lambda v: v.split(","), default=None,
                        help="vllm-router policies to compare (round_robin is always among them)")
    parser.add_argument("--context", type=int, default=None, help="shared document tokens per session")
    parser.add_argument("--output-tokens", type=int, default=None)
    parser.add_argument("--sessions", type=int, default=None, help="sessions per policy and round, and in the failover")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--rate", type=float, default=None, help="sessions arriving per second (Poisson)")
    parser.add_argument("--warmup", type=int, default=None, help="trajectories per instance before measuring")
    parser.add_argument("--anchor-sync-s", type=float, default=2.0)
    parser.add_argument("--think-s", type=float, default=None, help="in the failover, seconds between a session's calls")
    parser.add_argument("--anchors-dir", default=None, help="the shared anchors directory (default: a temporary one)")
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    quick = dict(model="tiny-llama", context=192, output_tokens=6, sessions=6, rounds=1, rate=4.0, warmup=1, think_s=0.5,
                 policies=["round_robin", "sticky_least_loaded", "kv_aware"])
    full = dict(model=DEFAULT_MODEL, context=1024, output_tokens=16, sessions=10, rounds=2, rate=0.25, warmup=3, think_s=1.0,
                policies=["round_robin", "consistent_hash", "sticky_least_loaded", "cache_aware", "kv_aware",
                          "kv_aware_affinity"])
    fill_defaults(args, quick, full)
    if args.instances < 2:
        parser.error("--instances must be at least 2 (one is killed in the failover)")
    if args.instances > len(os.sched_getaffinity(0)):
        parser.error(f"--instances must not exceed the {len(os.sched_getaffinity(0))} cores: each gets its own")
    for name in ("context", "output_tokens", "sessions", "rounds", "warmup"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.rate <= 0 or args.anchor_sync_s <= 0 or args.think_s < 0:
        parser.error("--rate and --anchor-sync-s must be positive, --think-s at least 0")
    if BASELINE not in args.policies:
        args.policies = [BASELINE, *args.policies]
    if args.policy not in args.policies:
        args.policies.append(args.policy)
    return run_and_emit(run, args)


if __name__ == "__main__":
    main()
    sys.exit(0)

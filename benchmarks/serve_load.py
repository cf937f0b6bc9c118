"""`agentcache serve` under load: the serving sweep's agent workflows replayed over HTTP by a
loopback load generator (the openai SDK's AsyncOpenAI, streaming), against `agentcache serve`
with NonShared and with KVCMAS, and optionally against plain `vllm serve` on the same model.

Trace: the serving sweep's (`benchmarks/serving.py`): a trajectory is a fixed four-agent schedule
over one shared document of `--context` tokens (distinct per trajectory). Agent i sends its own
system prompt, the document as the user message, and the outputs of agents 1..i-1 as user messages
named by their authors (the server reads them as those agents' outputs, PH "out:<name>"); each
trajectory is a session of its own (`extra_body={"agentcache": {"agent", "session"}}`). Requests are
greedy (temperature 0) with `max_tokens=--output-tokens`; over HTTP EOS cannot be ignored, so an
output may end sooner than in the sweep.

Client TTFT: from sending the request to its first non-empty content chunk (to the end of the
stream for an empty reply; a random-weight model's byte tokens may hold the first text back until
a character is whole, in both modes alike); latency: to the end of the stream. The server's own
TTFT (from the call reaching the runtime) comes back in the final chunk's `agentcache` extension,
beside the reused and cached tokens. The servers run in this process on loopback sockets
(uvicorn threads); the load generator shares the process (and its cores) with them.

Phases, in order:
1. Warm-up: `--warmup` trajectories per server, one at a time (fills KVCMAS's anchor pools), and
   one in-process trajectory.
2. HTTP overhead, unloaded: `--overhead-pairs` documents, each run once in-process and once over
   HTTP against the NonShared server, alternating which goes first. In-process is the server's own
   path without HTTP: the same request body read and laid out by `agentcache.serve` (`read_request`,
   `read_messages`, `prepare_call`) and streamed with `astream_call` (`Runtime.arun` with
   `on_token`), timed from just before the runtime call to the first non-empty text: the request's
   parsing and layout count as serving overhead. The in-process calls run on the same runtime in
   a tenant of their own, so neither run is served the other's prefix-cache blocks.
3. Load: NonShared's saturation over HTTP (`--saturation` trajectories dispatched at once;
   completed trajectories per second), then each `--loads` point offers that fraction of it as
   Poisson arrivals; NonShared and KVCMAS (each a server over its own engine) get the same
   documents at the same times, taking turns (the order rotates per point). `--trajectories` per
   strategy and point, `--full-load-trajectories` at the highest load.
4. `--vllm-serve` (off by default and in --quick): `python -m vllm.entrypoints.openai.api_server`
   on the model's local directory as a subprocess (float32, eager, prefix caching, the engine's
   batch), fed the highest load point's documents and arrivals. A model without a chat template
   (Gemma 3 270M base) gets one writing agentcache's plain transcript layout (the agent named by
   `chat_template_kwargs`, stop at "\\n###").
5. Soak, `--soak-s` seconds (600 in the full run, 0 in --quick): `--soak-concurrency` trajectories
   at a time in a closed loop against the KVCMAS server, each a new session over a new document of
   `--soak-context` tokens (256 in the full run: many requests, and the runtime's bounded stores of
   sources, sessions and anchors full before the samples start);
   the current RSS (VmRSS) is sampled every `--soak-sample-s` after the first `--soak-warmup` share
   of the soak, and the least-squares slope of RSS against completed requests is the growth.

Keys: `http_overhead_ratio` (client HTTP TTFT p50 on the NonShared server over the in-process TTFT
p50 of the same trajectories; aim <= 1.05), `p50_ttft_ratio_kvcmas_vs_nonshared` and
`p90_ttft_ratio_kvcmas_vs_nonshared` at the highest load (client TTFT), `p50_ttft_ratio_vs_vllm_serve`
(agentcache KVCMAS over `vllm serve`, client TTFT p50 at the highest load; None with
`vllm_serve_note` saying why when not run), `errors` (non-2xx replies, error events and exceptions
over every HTTP request to agentcache serve; a 429 counts; aim 0), `max_rss_mb` (this process's peak
RSS: servers, engines and load generator), `rss_growth_mb_per_1000_requests` (aim < 0.3) and
`soak_requests` (None and 0 without a soak); per load point and strategy the p50/p90 client and
server TTFT, request and trajectory latency, achieved throughput and reused tokens; `aims`,
`aims_met`, `model`, `engine`, `sizes`, `machine`, `elapsed_s`.

    python benchmarks/serve_load.py [--quick] [--engine embedded|vllm] [--model gemma3-270m]
                                    [--vllm-serve] [--soak-s 600] [--out serve_load.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _report import fill_defaults, judge_aims, machine, run_and_emit, torch_build  # benchmarks/, this folder
from serving import AGENTS, document_text, poisson_arrivals  # the serving sweep's trajectories

from agentcache.engine.choice import ENGINE_KINDS, open_engine
from agentcache.errors import InputError
from agentcache.metrics import CallResult, percentile
from agentcache.models import DEFAULT_MODEL, model_directory
from agentcache.runtime import Runtime, RuntimeConfig
from agentcache.selfcheck import check_model
from agentcache.serve import ServeConfig, ServerThread, create_app
from agentcache.serve.api import read_request
from agentcache.serve.identity import Caller
from agentcache.serve.messages import read_messages
from agentcache.serve.prepare import prepare_call
from agentcache.streaming import astream_call
from agentcache.transcript import TRANSCRIPT_STOP

NONSHARED, KVCMAS = "nonshared", "kvcmas"
NAMES = list(AGENTS)
INPROC_TENANT = "inproc"  # the in-process calls' tenant: apart from the server's (local) one
AIMS = {
    "http_overhead_ratio": ("<=", 1.05),
    "errors": ("<=", 0),
    "rss_growth_mb_per_1000_requests": ("<", 0.3),
}
# a chat template writing agentcache's plain transcript layout (`agentcache.transcript`), for
# `vllm serve` on a base model without one: the agent's cue comes from chat_template_kwargs
PLAIN_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% else %}{{ '\\n\\n### ' + (m['name'] if m['name'] else 'user') + '\\n' + m['content'] }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '\\n\\n### ' + (agent or 'assistant') + '\\n' }}{% endif %}"
)


# --- one request, one trajectory ---------------------------------------------------------------


@dataclass
class Reply:
    """One request as the client (or the in-process caller) saw it."""

    agent: str
    ttft_s: float
    latency_s: float
    text: str
    server: dict[str, Any] | None = None  # the `agentcache` extension (None from vLLM)
    prompt_tokens: int | None = None
    prepare_s: float | None = None  # in-process: reading and laying out the request


@dataclass
class Errors:
    """Failed HTTP requests: a count and the first few messages."""

    count: int = 0
    samples: list[str] = field(default_factory=list)
    last: str | None = None

    def add(self, message: str) -> None:
        self.count += 1
        self.last = message
        if len(self.samples) < 5:
            self.samples.append(message[:300])


@dataclass
class Target:
    """An OpenAI-compatible server and what its requests carry."""

    name: str
    client: Any  # openai.AsyncOpenAI
    model: str
    errors: Errors
    agentcache: bool = True  # send the agentcache identity fields (vLLM: the plain template's kwargs)
    plain_template: bool = False  # vLLM on our plain-layout template: name the agent, stop at the next header

    def extra(self, agent: str, session: str) -> dict[str, Any]:
        if self.agentcache:
            return {"extra_body": {"agentcache": {"agent": agent, "session": session}}}
        if self.plain_template:
            return {"extra_body": {"chat_template_kwargs": {"agent": agent}}, "stop": list(TRANSCRIPT_STOP)}
        return {}


def messages(index: int, document: str, outputs: list[str]) -> list[dict[str, Any]]:
    """Agent `index`'s messages: its system prompt, the document, the earlier agents' outputs."""
    agent = NAMES[index]
    out: list[dict[str, Any]] = [{"role": "system", "content": AGENTS[agent]}, {"role": "user", "content": document}]
    for earlier, text in zip(NAMES[:index], outputs):
        out.append({"role": "user", "name": earlier, "content": text})
    return out


async def http_request(target: Target, agent: str, session: str, msgs: list[dict[str, Any]],
                       output_tokens: int) -> Reply | None:
    """One streamed chat completion; None (and an error counted) when it fails."""
    began = time.perf_counter()
    first, parts, extension, prompt_tokens = None, [], None, None
    stream = None
    try:
        stream = await target.client.chat.completions.create(
            model=target.model, messages=msgs, max_tokens=output_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, **target.extra(agent, session))
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if first is None:
                    first = time.perf_counter()
                parts.append(chunk.choices[0].delta.content)
            extension = (chunk.model_extra or {}).get("agentcache") or extension
            if chunk.usage is not None:
                prompt_tokens = chunk.usage.prompt_tokens
    except Exception as exc:  # noqa: BLE001 - counted and shown, never hidden
        target.errors.add(f"{target.name} {agent}: {type(exc).__name__}: {exc}")
        if stream is not None:
            await stream.close()
        return None
    end = time.perf_counter()
    return Reply(agent, (first or end) - began, end - began, "".join(parts), extension, prompt_tokens)


async def http_trajectory(target: Target, session: str, document: str, output_tokens: int) -> list[Reply] | None:
    """The four agents in turn; None when a request failed (the trajectory stops there)."""
    replies: list[Reply] = []
    for index, agent in enumerate(NAMES):
        reply = await http_request(target, agent, session, messages(index, document, [r.text for r in replies]),
                                   output_tokens)
        if reply is None:
            return None
        replies.append(reply)
    return replies


async def inproc_request(runtime: Runtime, model: str, agent: str, session: str, msgs: list[dict[str, Any]],
                         output_tokens: int) -> Reply:
    """The server's path without HTTP: the same body read and laid out as `agentcache serve` does,
    streamed from the runtime; TTFT from just before the runtime call to the first non-empty text."""
    began_prepare = time.perf_counter()
    body = {"model": model, "messages": msgs, "max_tokens": output_tokens, "temperature": 0, "stream": True,
            "agentcache": {"agent": agent, "session": session}}
    chat = read_request(body)
    transcript = read_messages(chat.messages)
    caller = Caller(agent, session, INPROC_TENANT, "field")
    prepared = prepare_call(runtime, chat, transcript, caller, default_max_tokens=ServeConfig().default_max_tokens,
                            max_prompt_tokens=runtime.engine.max_context, user_agent=None)
    began = time.perf_counter()
    first, result = None, None
    async for item in astream_call(runtime, prepared.call, prepared.sampling, prepared.event):
        if isinstance(item, CallResult):
            result = item
            break
        if item and first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    server = {"ttft_s": result.ttft_s, "reused_tokens": result.reused_tokens, "cached_tokens": result.cached_tokens}
    return Reply(agent, (first or end) - began, end - began, result.text, server, result.prompt_tokens,
                 began - began_prepare)


async def inproc_trajectory(runtime: Runtime, model: str, session: str, document: str,
                            output_tokens: int) -> list[Reply]:
    replies: list[Reply] = []
    for index, agent in enumerate(NAMES):
        replies.append(await inproc_request(runtime, model, agent, session,
                                            messages(index, document, [r.text for r in replies]), output_tokens))
    return replies


# --- runs: a batch of trajectories at given arrival times ----------------------------------------


@dataclass
class Run:
    replies: list[Reply] = field(default_factory=list)
    spans: list[tuple[float, float]] = field(default_factory=list)  # (arrival, end) per completed trajectory
    failed: int = 0  # trajectories stopped by an error


async def offered(target: Target, jobs: list[tuple[str, str]], arrivals: list[float], output_tokens: int) -> Run:
    """Start trajectory k at arrivals[k] seconds from now; all of them overlap as they arrive."""
    run, start = Run(), time.perf_counter()

    async def one(session: str, document: str, at: float) -> None:
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        begun = time.perf_counter()
        replies = await http_trajectory(target, session, document, output_tokens)
        if replies is None:
            run.failed += 1
            return
        run.replies.extend(replies)
        run.spans.append((begun - start, time.perf_counter() - start))

    await asyncio.gather(*(one(s, d, a) for (s, d), a in zip(jobs, arrivals)))
    return run


def summarize(run: Run) -> dict[str, Any]:
    replies = run.replies
    ttfts = [r.ttft_s for r in replies]
    server = [r.server["ttft_s"] for r in replies if r.server and r.server.get("ttft_s") is not None]
    makespan = max((e for _, e in run.spans), default=0.0) - min((a for a, _ in run.spans), default=0.0)
    prompt = sum(r.prompt_tokens or 0 for r in replies)
    reused = sum((r.server or {}).get("reused_tokens", 0) for r in replies)
    cached = sum((r.server or {}).get("cached_tokens", 0) for r in replies)
    return {
        "requests": len(replies),
        "trajectories": len(run.spans),
        "failed_trajectories": run.failed,
        "ttft_p50_s": _round(percentile(ttfts, 50)),
        "ttft_p90_s": _round(percentile(ttfts, 90)),
        "server_ttft_p50_s": _round(percentile(server, 50)),
        "server_ttft_p90_s": _round(percentile(server, 90)),
        "request_latency_mean_s": _round(statistics.fmean(r.latency_s for r in replies) if replies else None),
        "trajectory_latency_mean_s": _round(statistics.fmean(e - a for a, e in run.spans) if run.spans else None),
        "achieved_trajectories_per_s": _round(len(run.spans) / makespan if makespan > 0 else None),
        "prompt_tokens": prompt,
        "reused_tokens": reused,
        "cached_tokens": cached,
        "reuse_ratio": _round(reused / prompt if prompt else None),
        "output_chars_mean": _round(statistics.fmean(len(r.text) for r in replies) if replies else None),
    }


# --- memory ---------------------------------------------------------------------------------------


def max_rss_mb() -> float:
    """This process's peak RSS (Linux reports kB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def current_rss_mb() -> float | None:
    """This process's RSS now (VmRSS), None where /proc is not there."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def slope(points: list[tuple[float, float]]) -> float | None:
    """The least-squares slope of y on x; None with fewer than 3 points or no spread in x."""
    if len(points) < 3:
        return None
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return None if sxx == 0 else sum((x - mx) * (y - my) for x, y in points) / sxx


async def soak(target: Target, new_job, seconds: float, concurrency: int, sample_s: float, warmup_share: float,
               output_tokens: int) -> dict[str, Any]:
    """Closed-loop trajectories for `seconds`, RSS sampled against completed requests after the warm-up share."""
    start = time.perf_counter()
    deadline, settled_at = start + seconds, start + warmup_share * seconds
    done = {"requests": 0, "trajectories": 0, "failed": 0}
    samples: list[tuple[float, int, float]] = []  # (seconds, requests, rss MB)

    async def worker() -> None:
        while time.perf_counter() < deadline:
            replies = await http_trajectory(target, *new_job(), output_tokens)
            if replies is None:
                done["failed"] += 1
                await asyncio.sleep(0.5)  # a broken server is not hammered
                continue
            done["requests"] += len(replies)
            done["trajectories"] += 1

    async def sampler() -> None:
        while (now := time.perf_counter()) < deadline:
            await asyncio.sleep(min(sample_s, max(0.0, deadline - now)))
            rss = current_rss_mb()
            if rss is not None and time.perf_counter() >= settled_at:
                samples.append((round(time.perf_counter() - start, 2), done["requests"], round(rss, 2)))

    await asyncio.gather(sampler(), *(worker() for _ in range(concurrency)))
    rss = current_rss_mb()
    if rss is not None:
        samples.append((round(time.perf_counter() - start, 2), done["requests"], round(rss, 2)))
    growth = slope([(n, mb) for _, n, mb in samples])
    return {
        "seconds": round(time.perf_counter() - start, 1),
        "requests": done["requests"],
        "trajectories": done["trajectories"],
        "failed_trajectories": done["failed"],
        "requests_per_s": _round(done["requests"] / (time.perf_counter() - start)),
        "rss_growth_mb_per_1000_requests": None if growth is None else round(1000 * growth, 4),
        "rss_first_mb": samples[0][2] if samples else None,
        "rss_last_mb": samples[-1][2] if samples else None,
        "samples": samples,  # (seconds, requests completed, RSS MB) after the warm-up share
    }


# --- vllm serve -----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def vllm_serve_command(args: argparse.Namespace, directory: Path, port: int, template: Path | None,
                       max_len: int, batch: int) -> list[str]:
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(directory),
               "--served-model-name", args.model, "--host", "127.0.0.1", "--port", str(port),
               "--dtype", "float32", "--enforce-eager", "--enable-prefix-caching", "--seed", str(args.seed),
               "--generation-config", "vllm", "--max-model-len", str(max_len), "--max-num-seqs", str(batch)]
    if template is not None:
        command += ["--chat-template", str(template)]
    return command


def has_chat_template(directory: Path) -> bool:
    if (directory / "chat_template.jinja").exists():
        return True
    config = directory / "tokenizer_config.json"
    return config.exists() and bool(json.loads(config.read_text()).get("chat_template"))


async def vllm_serve(args: argparse.Namespace, base, jobs: list[tuple[str, str]], arrivals: list[float],
                     warm: list[tuple[str, str]]) -> tuple[dict[str, Any] | None, str]:
    """Plain `vllm serve` on the same model, fed the same documents at the same times: its
    summary and a note (why it did not run, or how it ran)."""
    import httpx
    from openai import AsyncOpenAI

    from agentcache.engine.vllm.gate import installed_version

    found = installed_version()
    if found is None:
        return None, "vLLM is not installed (agentcache's `vllm` extra): vllm serve was not run"
    directory = model_directory(args.model, progress=False)
    plain = not has_chat_template(directory)
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="serve_load_vllm_") as scratch:
        template = None
        if plain:
            template = Path(scratch) / "plain.jinja"
            template.write_text(PLAIN_TEMPLATE)
        batch = getattr(getattr(base, "config", None), "max_batch", 8)
        max_len = min(base.max_context, args.context + 4 * (args.output_tokens + 64) + 512)
        command = vllm_serve_command(args, directory, port, template, max_len, batch)
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
        log_path = Path(scratch) / "vllm.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
            try:
                deadline = time.monotonic() + args.vllm_serve_timeout
                async with httpx.AsyncClient() as http:
                    while True:
                        if process.poll() is not None:
                            tail = log_path.read_text(errors="replace")[-600:]
                            return None, f"vllm serve exited with {process.returncode} before serving: {tail}"
                        if time.monotonic() > deadline:
                            return None, f"vllm serve did not become healthy in {args.vllm_serve_timeout} s"
                        try:
                            if (await http.get(f"http://127.0.0.1:{port}/health", timeout=2)).status_code == 200:
                                break
                        except httpx.HTTPError:
                            pass
                        await asyncio.sleep(1.0)
                client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                                     timeout=args.request_timeout)
                target = Target("vllm-serve", client, args.model, Errors(), agentcache=False, plain_template=plain)
                for session, document in warm:
                    await http_trajectory(target, session, document, args.output_tokens)
                run = await offered(target, jobs, arrivals, args.output_tokens)
                await client.close()
            finally:
                process.terminate()
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
    summary = summarize(run) | {"errors": target.errors.count, "error_samples": target.errors.samples,
                                "version": f"{found[0]} {found[1]}", "command": " ".join(command[1:])}
    layout = "agentcache's plain transcript layout (a chat template written here)" if plain else "its own chat template"
    return summary, f"vllm serve on {directory} with {layout}, fed the highest load point's documents and arrivals"


# --- the benchmark --------------------------------------------------------------------------------


def _round(value: float | None, digits: int = 5) -> float | None:
    return None if value is None else round(value, digits)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


async def measure(args: argparse.Namespace, base, runtimes: dict[str, Runtime], urls: dict[str, str]) -> dict:
    from openai import AsyncOpenAI

    rng = random.Random(args.seed)
    model = base.model_name
    errors = Errors()  # every HTTP request to agentcache serve
    clients = {name: AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=args.request_timeout)
               for name, url in urls.items()}
    targets = {name: Target(name, client, model, errors) for name, client in clients.items()}
    serial = iter(range(10**9))

    def job(prefix: str = "traj", context: int | None = None) -> tuple[str, str]:
        n = next(serial)
        return f"{prefix}-{n}", document_text(base, context or args.context, args.seed * 100_000 + 5000 + n)

    # 1. warm-up: the same documents on both servers, one trajectory at a time; one in-process
    warm = [job("warm") for _ in range(args.warmup)]
    for name, target in targets.items():
        for session, document in warm:
            await http_trajectory(target, f"{session}-{name}", document, args.output_tokens)
    await inproc_trajectory(runtimes[NONSHARED], model, *job("warm-inproc"), args.output_tokens)

    # 2. HTTP overhead, unloaded: the same document in-process and over HTTP, alternating who goes first
    inproc, http, failed_pairs = [], [], 0
    for k in range(args.overhead_pairs):
        session, document = job("overhead")
        order = ("inproc", "http") if k % 2 == 0 else ("http", "inproc")
        for mode in order:
            if mode == "inproc":
                inproc.extend(await inproc_trajectory(runtimes[NONSHARED], model, session, document,
                                                      args.output_tokens))
            else:
                replies = await http_trajectory(targets[NONSHARED], session, document, args.output_tokens)
                if replies is None:
                    failed_pairs += 1
                else:
                    http.extend(replies)
    inproc_p50 = percentile([r.ttft_s for r in inproc], 50)
    http_p50 = percentile([r.ttft_s for r in http], 50)
    overhead = {
        "pairs": args.overhead_pairs, "failed_http_trajectories": failed_pairs,
        "requests": {"inproc": len(inproc), "http": len(http)},
        "inproc_ttft_p50_s": _round(inproc_p50),
        "inproc_ttft_p90_s": _round(percentile([r.ttft_s for r in inproc], 90)),
        "http_ttft_p50_s": _round(http_p50), "http_ttft_p90_s": _round(percentile([r.ttft_s for r in http], 90)),
        "inproc_runtime_ttft_p50_s": _round(percentile([r.server["ttft_s"] for r in inproc], 50)),
        "http_server_ttft_p50_s": _round(percentile([r.server["ttft_s"] for r in http if r.server], 50)),
        "inproc_prepare_p50_s": _round(percentile([r.prepare_s for r in inproc], 50)),
        "http_latency_p50_s": _round(percentile([r.latency_s for r in http], 50)),
        "inproc_latency_p50_s": _round(percentile([r.latency_s for r in inproc], 50)),
    }

    # 3. load: NonShared's saturation over HTTP, then Poisson arrivals at fractions of it
    sat_jobs = [job("saturation") for _ in range(args.saturation)]
    saturation = summarize(await offered(targets[NONSHARED], sat_jobs, [0.0] * len(sat_jobs),
                                         args.output_tokens))["achieved_trajectories_per_s"]
    if not saturation:
        raise RuntimeError(f"no saturation trajectory completed over HTTP: {errors.samples}")
    loads: dict[str, Any] = {}
    top = max(args.loads)
    top_jobs: list[tuple[str, str]] = []
    top_arrivals: list[float] = []
    for turn, load in enumerate(args.loads):
        count = max(args.trajectories, args.full_load_trajectories) if load == top else args.trajectories
        rate = load * saturation
        jobs = [job(f"load{load}") for _ in range(count)]
        arrivals = poisson_arrivals(count, rate, rng)
        names = [NONSHARED, KVCMAS] if turn % 2 == 0 else [KVCMAS, NONSHARED]
        runs = {}
        for name in names:  # each strategy its own sessions, over the same documents and arrival times
            runs[name] = await offered(targets[name], [(f"{s}-{name}", d) for s, d in jobs], arrivals,
                                       args.output_tokens)
        loads[str(load)] = {"offered_trajectories_per_s": _round(rate), "offered_requests_per_s": _round(4 * rate),
                            "order": names, "strategies": {name: summarize(runs[name]) for name in (NONSHARED, KVCMAS)}}
        if load == top:
            top_jobs, top_arrivals = jobs, arrivals
    full = loads[str(top)]["strategies"]

    # 4. vllm serve on the same model, the highest load point's documents and arrivals
    vllm_summary, vllm_note = None, ("off: pass --vllm-serve to launch `vllm serve` on the same model"
                                     if not args.quick else "off in --quick (launching vllm serve takes minutes)")
    if args.vllm_serve:
        vllm_summary, vllm_note = await vllm_serve(args, base, [(f"{s}-vllm", d) for s, d in top_jobs], top_arrivals,
                                                   [(f"{s}-vllm", d) for s, d in warm])

    # 5. soak against the KVCMAS server: new sessions over new documents, RSS against requests
    soaked = None
    if args.soak_s > 0:
        soaked = await soak(targets[KVCMAS], lambda: job("soak", args.soak_context), args.soak_s, args.soak_concurrency,
                            args.soak_sample_s, args.soak_warmup, args.output_tokens)

    for client in clients.values():
        await client.close()
    return {
        "http_overhead_ratio": _ratio(http_p50, inproc_p50),
        "p50_ttft_ratio_kvcmas_vs_nonshared": _ratio(full[KVCMAS]["ttft_p50_s"], full[NONSHARED]["ttft_p50_s"]),
        "p90_ttft_ratio_kvcmas_vs_nonshared": _ratio(full[KVCMAS]["ttft_p90_s"], full[NONSHARED]["ttft_p90_s"]),
        "server_p50_ttft_ratio_kvcmas_vs_nonshared": _ratio(full[KVCMAS]["server_ttft_p50_s"],
                                                            full[NONSHARED]["server_ttft_p50_s"]),
        "p50_ttft_ratio_vs_vllm_serve": _ratio(full[KVCMAS]["ttft_p50_s"],
                                               vllm_summary["ttft_p50_s"] if vllm_summary else None),
        "vllm_serve_note": vllm_note,
        "errors": errors.count,
        "error_samples": errors.samples,
        "rss_growth_mb_per_1000_requests": soaked["rss_growth_mb_per_1000_requests"] if soaked else None,
        "soak_requests": soaked["requests"] if soaked else 0,
        "http_overhead": overhead,
        "saturation_trajectories_per_s": _round(saturation),
        "full_load": top,
        "loads": loads,
        "vllm_serve": vllm_summary,
        "soak": soaked,
    }


def run(args: argparse.Namespace) -> dict:
    base = open_engine(args.engine, args.model)
    check = None if args.quick else check_model(base)
    runtimes: dict[str, Runtime] = {}
    for name in (NONSHARED, KVCMAS):
        try:
            runtimes[name] = Runtime(base.fresh(), strategy=name, check=check, config=RuntimeConfig(self_check=False))
        except InputError as exc:
            raise SystemExit(f"serve_load: the {name} runtime cannot run on {args.model}: {exc}") from None
    config = ServeConfig(max_in_flight=args.max_in_flight)
    with ExitStack() as stack:
        servers = {name: stack.enter_context(ServerThread(create_app(rt, config))) for name, rt in runtimes.items()}
        try:
            result = asyncio.run(measure(args, base, runtimes, {name: s.url for name, s in servers.items()}))
        finally:
            stack.close()  # the servers drain and stop before the runtimes close
            for rt in runtimes.values():
                rt.close()
    result["max_rss_mb"] = round(max_rss_mb(), 1)
    judge_aims(result, AIMS)
    batch = getattr(getattr(base, "config", None), "max_batch", None)
    result.update(
        model=base.model_name, engine=args.engine, quick=args.quick, strategies=[NONSHARED, KVCMAS],
        sizes={"context": args.context, "output_tokens": args.output_tokens, "warmup": args.warmup,
               "overhead_pairs": args.overhead_pairs, "saturation": args.saturation, "loads": args.loads,
               "trajectories": args.trajectories, "full_load_trajectories": args.full_load_trajectories,
               "soak_s": args.soak_s, "soak_concurrency": args.soak_concurrency, "soak_context": args.soak_context,
               "max_in_flight": args.max_in_flight or (4 * batch if batch else None)},
        machine=machine(**torch_build(), python=platform.python_version()),
    )
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny-llama, short contexts, no soak (< 60 s on 2 cores)")
    parser.add_argument("--engine", choices=ENGINE_KINDS, default="embedded")
    parser.add_argument("--model", default=None, help=f"a preset or a model directory (full run: {DEFAULT_MODEL})")
    parser.add_argument("--context", type=int, default=None, help="shared document tokens per trajectory")
    parser.add_argument("--output-tokens", type=int, default=None, help="max_tokens of every request")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up trajectories per server")
    parser.add_argument("--overhead-pairs", type=int, default=None,
                        help="documents run both in-process and over HTTP for the overhead ratio")
    parser.add_argument("--saturation", type=int, default=None,
                        help="trajectories dispatched at once to find NonShared's saturation over HTTP")
    parser.add_argument("--loads", type=lambda v: [float(x) for x in v.split(",")], default=None,
                        help="fractions of NonShared's saturation, e.g. 0.5,1.0 (the highest is the full load)")
    parser.add_argument("--trajectories", type=int, default=None, help="trajectories per strategy and load point")
    parser.add_argument("--full-load-trajectories", type=int, default=None,
                        help="at the highest load, each strategy runs the larger of this and --trajectories")
    parser.add_argument("--max-in-flight", type=int, default=None,
                        help="the servers' admission limit (ServeConfig.max_in_flight; default 4x the batch)")
    parser.add_argument("--vllm-serve", action="store_true",
                        help="also launch `vllm serve` on the model's local directory (off in --quick)")
    parser.add_argument("--vllm-serve-timeout", type=float, default=900.0, help="seconds to wait for vllm serve")
    parser.add_argument("--soak-s", type=float, default=None, help="seconds of soak against KVCMAS (0: none)")
    parser.add_argument("--soak-concurrency", type=int, default=None, help="trajectories in flight during the soak")
    parser.add_argument("--soak-context", type=int, default=None,
                        help="shared document tokens in the soak's trajectories (short: many requests, and the "
                             "runtime's bounded stores reach their steady state within the warm-up share)")
    parser.add_argument("--soak-sample-s", type=float, default=None, help="seconds between RSS samples")
    parser.add_argument("--soak-warmup", type=float, default=0.2, help="share of the soak before RSS is sampled")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="the client's timeout per request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    # gemma3-270m does not fit 60 s on 2 cores even at 128 shared tokens (about 85 s): quick runs tiny-llama
    quick = dict(model="tiny-llama", context=256, output_tokens=8, warmup=2, overhead_pairs=8, saturation=3,
                 loads=[1.0], trajectories=6, full_load_trajectories=6, soak_s=0.0, soak_concurrency=2,
                 soak_sample_s=1.0, soak_context=128)
    full = dict(model=DEFAULT_MODEL, context=2048, output_tokens=16, warmup=6, overhead_pairs=20, saturation=4,
                loads=[0.5, 1.0], trajectories=10, full_load_trajectories=30, soak_s=600.0, soak_concurrency=4,
                soak_sample_s=10.0, soak_context=256)
    fill_defaults(args, quick, full)
    if args.quick:
        args.vllm_serve = False
    for name in ("context", "output_tokens", "overhead_pairs", "saturation", "trajectories", "soak_concurrency",
                 "soak_context"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not args.loads or min(args.loads) <= 0:
        parser.error("--loads must be positive fractions of the saturation throughput")
    if not 0 <= args.soak_warmup < 1:
        parser.error("--soak-warmup must be a share in [0, 1)")
    return run_and_emit(run, args)


if __name__ == "__main__":
    main()
    sys.exit(0)

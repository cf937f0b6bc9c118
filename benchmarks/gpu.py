"""The embedded engine on a GPU (or, without one, on the CPU): does reuse engage in bf16, does the
pipeline keep every tensor on its device, and does the engine's own overhead leave room for reuse?

Correctness, in bf16 on the device, with a small random preset (`--check-model`, tiny-llama: what
is checked here is the device and the dtype, not the weights):
- `bf16_self_check_passed`: the model self-check (re-alignment exact to bf16's rounding, correction
  better than raw reuse);
- `bf16_kvcmas_reuse_ratio`: the default KVCMAS runtime on the four-agent workflow (`tasks`), the
  share of shared tokens it served from reuse; `bf16_greedy_agreement`: its calls whose tokens equal
  a bf16 NonShared runtime's on the same workflow;
- `device_mixing_free`: both under `DeviceAudit` (no tensor made without naming its device).

Host overhead, with the check model (its kernels take microseconds, so what a step costs is the
host's): `host_ms_per_decode_step` (one request decoding), `host_ms_per_call_plan` (a NonShared
consumer call reading a shared document of `--plan-tokens` tokens: tokenizing, hashing and
planning it until the engine has it; `plan_ms` gives FullShared's and forced KVCMAS's too, whose
planning re-aligns and corrects the source on the device).

The engine's figures, with the timing model (`--model`: `llama-1b`, random weights shaped like
Llama 3.2 1B, on CUDA; `mid-llama` on a CPU), interleaved round by round:
- `decode_tokens_per_s` at 1 and `--batch` requests;
- `prefill_vs_sdpa`: a plain HF SDPA forward's time of the same tokens (logits for the last
  position only, as the engine keeps) over the engine's dense prefill, at each `--prefill-tokens`;
- a consumer agent reading a shared document of `--doc-tokens` tokens that a producer agent read
  first: its TTFT under NonShared over a plain forward of its whole prompt
  (`nonshared_consumer_ttft_over_prefill`); under FullShared (raw reuse) and KVCMAS with its
  acceptance forced (the entropy gate open, τ = 1: random weights cannot be verified, so this is a
  timing only) over NonShared's; each beside the workflow's wall time and prefill work.
`aims` holds issue 39's aims for an H200; `aims_met` is judged on CUDA only (on a CPU these
figures check that the code runs, with sizes scaled down).

    python benchmarks/gpu.py [--quick] [--device cuda|cpu] [--out PATH]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections import defaultdict
from typing import Callable

import torch

from agentcache import Runtime, RuntimeConfig
from agentcache.correction.strategies import STRATEGIES
from agentcache.device_audit import DeviceAudit
from agentcache.engine import EmbeddedEngine, EngineConfig, ExecRequest, SamplingParams, SegmentPlan, Step
from agentcache.segments import AgentCall, Segment
from agentcache.selfcheck import check_model
from agentcache.tasks import FourAgentWorkflow, directory_people, document_problem, fact_problem, filler_tokens

from _report import fill_defaults, machine, run_and_emit, torch_build  # benchmarks/, the script's own folder

DTYPE = "bfloat16"
AIMS = {  # issue 39, on an H200 with the 1.1B-parameter timing model in bf16
    "decode_tokens_per_s_1": (">=", 300.0),
    "prefill_vs_sdpa_min": (">=", 0.9),
    "nonshared_consumer_ttft_over_prefill": ("<=", 1.3),
    "raw_reuse_consumer_ttft_ratio": ("<=", 0.4),
    "kvcmas_forced_consumer_ttft_ratio": ("<=", 0.5),
}
PRODUCER, CONSUMER = "reader", "answerer"
_SYSTEMS = {
    PRODUCER: "You are the reader. You read the staff directory and note the facts the question needs.\n\n",
    CONSUMER: "You are the answerer. You read the staff directory and answer the question with the code.\n\n",
}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


# --- correctness -------------------------------------------------------------------------------


def correctness(check_model_name: str, device: str, problems: int) -> dict:
    """The self-check and a KVCMAS workflow beside NonShared, in bf16 on `device`, under DeviceAudit."""
    workflow = FourAgentWorkflow(role_tokens=6, final_tokens=4)
    with DeviceAudit() as audit:
        engine = EmbeddedEngine(check_model_name, EngineConfig(device=device, dtype=DTYPE))
        report = check_model(engine)
        kvcmas = Runtime(engine.fresh(), strategy="kvcmas", check=report, config=RuntimeConfig(learn="after_call"))
        dense = Runtime(engine.fresh(), strategy="nonshared", check=report)
        same = []
        for seed in range(problems):
            problem = fact_problem(seed, records=4)
            got, want = workflow.run(kvcmas.run, problem), workflow.run(dense.run, problem)
            same += [a.token_ids == b.token_ids for a, b in zip(got, want)]
        summary = kvcmas.summary()
        for runtime in (kvcmas, dense):
            runtime.close()  # no learning left running beside the timings that follow
    return {
        "check_model": check_model_name,
        "bf16_self_check_passed": report.passed,
        "bf16_self_check": report.to_dict(),
        "bf16_kvcmas_strategy": summary["strategy"],  # "nonshared" if the self-check refused reuse
        "bf16_kvcmas_reuse_ratio": summary["reuse_ratio"],
        "bf16_greedy_agreement": sum(same) / len(same),
        "bf16_workflow_faults": summary["faults"],
        "device_mixing_free": audit.clean,
        "device_audit": {"factory_calls_checked": audit.checked, "violations": dict(audit.violations)},
    }


# --- host overhead -----------------------------------------------------------------------------


def _decode_ms_per_step(engine: EmbeddedEngine, tokens: int, reps: int) -> float:
    prompt = engine.tokenize("Decode steps of one request, timed.", bos=True)
    steps = []
    for _ in range(reps):
        result = engine.execute(ExecRequest([SegmentPlan("p", prompt)], SamplingParams(max_tokens=tokens, ignore_eos=True)))
        steps.append((result.total_s - result.ttft_s) / (tokens - 1))
    return 1000 * statistics.median(steps)


def host_overhead(check_model_name: str, device: str, plan_tokens: int, decode_tokens: int, reps: int) -> dict:
    engine = EmbeddedEngine(check_model_name, EngineConfig(device=device, dtype=DTYPE, pool_blocks=4 * plan_tokens // 16))
    _decode_ms_per_step(engine, 8, 1)  # first-call allocations
    decode_ms = _decode_ms_per_step(engine, decode_tokens, reps)
    plans = consumer_rounds(engine, plan_tokens, rounds=reps, warmup=2, out_tokens=2, plain_prefill=None)
    return {
        "host_ms_per_decode_step": decode_ms,
        "host_ms_per_call_plan": plans["plan_ms"]["nonshared"],
        "plan_ms": plans["plan_ms"],
        "plan_tokens": plans["doc_tokens"],
    }


# --- the engine's figures ------------------------------------------------------------------------


def plain_prefill_s(model: torch.nn.Module, ids: list[int], device: torch.device) -> float:
    """A plain HF forward (SDPA, its own DynamicCache) of `ids`, logits for the last position only."""
    tensor = torch.tensor([ids], dtype=torch.long, device=device)  # (1, T)
    _synchronize(device)
    started = time.perf_counter()
    with torch.inference_mode():
        model(input_ids=tensor, use_cache=True, logits_to_keep=1)
    _synchronize(device)
    return time.perf_counter() - started


def prefill_vs_sdpa(engine: EmbeddedEngine, tokens: int, reps: int) -> dict:
    engine_s, plain_s = [], []
    for rep in range(reps):
        ids = filler_tokens(engine.tokenize, tokens, rep)
        request = ExecRequest([SegmentPlan("p", ids, Step.DENSE)], SamplingParams(max_tokens=1))
        runs: list[Callable[[], None]] = [
            lambda: engine_s.append(_timed(lambda: engine.execute(request))),
            lambda: plain_s.append(plain_prefill_s(engine.model, ids, engine.layout.device)),
        ]
        for run in runs if rep % 2 == 0 else runs[::-1]:  # alternate who goes first
            run()
    return {"tokens": tokens, "engine_tokens_per_s": tokens / statistics.median(engine_s),
            "sdpa_tokens_per_s": tokens / statistics.median(plain_s),
            "ratio": statistics.median(p / e for e, p in zip(engine_s, plain_s))}


def _timed(run: Callable[[], object]) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def decode_rate(engine: EmbeddedEngine, requests: int, tokens: int) -> float:
    """Decode tokens per second with `requests` requests decoding together."""
    prompts = [engine.tokenize(f"Request {i} decodes together with the others.", bos=True) for i in range(requests)]
    futures = [engine.submit(ExecRequest([SegmentPlan("p", p)], SamplingParams(max_tokens=tokens, ignore_eos=True)))
               for p in prompts]
    results = [f.result() for f in futures]  # every time is from its own submission, all made together
    window = max(r.total_s for r in results) - min(r.ttft_s for r in results)
    return requests * (tokens - 1) / window


def _call(agent: str, document: str, glue: str) -> AgentCall:
    return AgentCall(agent=agent, segments=(Segment.pf(_SYSTEMS[agent]), Segment.ph("document", document),
                                            Segment.pf(glue)))


def consumer_rounds(engine: EmbeddedEngine, doc_tokens: int, rounds: int, warmup: int, out_tokens: int,
                    plain_prefill: Callable[[list[int]], float] | None) -> dict:
    """A producer then a consumer reading the same new document, round by round under NonShared,
    FullShared and KVCMAS with acceptance forced (the order rotated per round); the first `warmup`
    rounds fill the anchor pools and are not scored. Timing runtimes skip the self-check: random
    weights cannot pass a fidelity check, and these figures are timings."""
    strategies = {"nonshared": STRATEGIES["nonshared"], "fullshared": STRATEGIES["fullshared"],
                  "kvcmas_forced": STRATEGIES["kvcmas_entropy"].replace(name="kvcmas_forced", tau=1.0)}
    runtimes = {name: Runtime(engine.fresh(), strategy=s, config=RuntimeConfig(self_check=False, keep_kv=True))
                for name, s in strategies.items()}
    people = directory_people(engine.tokenize, doc_tokens)
    sampling = SamplingParams(max_tokens=out_tokens, ignore_eos=True)
    ttft, plan_ms, wall, prefill, decisions = (defaultdict(list) for _ in range(5))
    ratio_to_plain = []
    names = list(runtimes)
    for index in range(warmup + rounds):
        problem = document_problem(1000 + index, people)
        question = "\nQuestion answered: " + problem.subject
        for name in names[index % len(names):] + names[:index % len(names)]:
            runtime = runtimes[name]
            began = time.perf_counter()
            first = runtime.run(_call(PRODUCER, problem.text, "\nNotes:"), sampling)
            consumer = runtime.run(_call(CONSUMER, problem.text, question), sampling)
            took = time.perf_counter() - began
            runtime.learned(timeout=120)  # anchors built between rounds, off the timed calls
            if index < warmup:
                continue
            ttft[name].append(consumer.ttft_s)
            plan_ms[name].append(1000 * (consumer.ttft_s - consumer.engine_result.ttft_s))
            wall[name].append(took)
            prefill[name].append(first.prefill_tokens + consumer.prefill_tokens)
            decisions[name].append(next(s.decision for s in consumer.segments if s.kind == "ph"))
            if name == "nonshared" and plain_prefill is not None:
                ratio_to_plain.append(consumer.ttft_s / plain_prefill(consumer.prompt_ids))
    nonshared = _median(ttft["nonshared"])
    summaries = {n: {k: rt.summary()[k] for k in ("strategy", "reuse_ratio", "faults", "anchors")}
                 for n, rt in runtimes.items()}
    for runtime in runtimes.values():
        runtime.close()  # no learning left running beside the timings that follow
    return {
        "doc_tokens": _doc_length(runtimes["nonshared"]),
        "consumer_ttft_s": {n: _median(v) for n, v in ttft.items()},
        "consumer_ttft_ratio": {n: _median(v) / nonshared for n, v in ttft.items()},
        "plan_ms": {n: _median(v) for n, v in plan_ms.items()},
        "workflow_wall_s": {n: _median(v) for n, v in wall.items()},
        "workflow_wall_ratio": {n: _median(v) / _median(wall["nonshared"]) for n, v in wall.items()},
        "prefill_tokens_per_workflow": {n: statistics.fmean(v) for n, v in prefill.items()},
        "consumer_decisions": {n: dict(_count(v)) for n, v in decisions.items()},
        "nonshared_consumer_ttft_over_prefill": _median(ratio_to_plain),
        "summaries": summaries,
    }


def _doc_length(runtime: Runtime) -> int:
    last = runtime.results[-1]
    return next(s.length for s in last.segments if s.kind == "ph")


def _count(values: list[str]) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for v in values:
        out[v] += 1
    return out


def engine_figures(model: str, device: str, args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    blocks = 8 * max(args.prefill_tokens + [args.doc_tokens]) // 16 + 64
    engine = EmbeddedEngine(model, EngineConfig(device=device, dtype=DTYPE, pool_blocks=blocks, max_batch=args.batch,
                                                prefill_chunk=max(args.prefill_tokens)))
    load_s = time.perf_counter() - started
    _decode_ms_per_step(engine, 4, 1)  # first-call allocations
    plain_prefill_s(engine.model, filler_tokens(engine.tokenize, 64, 99), engine.layout.device)
    prefill = [prefill_vs_sdpa(engine, tokens, args.reps) for tokens in args.prefill_tokens]
    decode = {str(n): decode_rate(engine, n, args.decode_tokens) for n in (1, args.batch)}
    consumers = consumer_rounds(engine, args.doc_tokens, rounds=args.reps, warmup=2, out_tokens=args.out_tokens,
                                plain_prefill=lambda ids: plain_prefill_s(engine.model, ids, engine.layout.device))
    graphs = engine.scheduler.graphs
    return {
        "model": model,
        "parameters": sum(p.numel() for p in engine.model.parameters()),
        "decode_graphs": None if graphs is None else graphs.figures(),  # on CUDA: graphs captured, replays, failure
        "load_s": load_s,
        "decode_tokens_per_s": decode,
        "prefill_vs_sdpa": prefill,
        "consumer": consumers,
    }


def judge(figures: dict, on_cuda: bool) -> tuple[dict, bool | None]:
    consumer = figures["consumer"]
    values = {
        "decode_tokens_per_s_1": figures["decode_tokens_per_s"]["1"],
        "prefill_vs_sdpa_min": min(p["ratio"] for p in figures["prefill_vs_sdpa"]),
        "nonshared_consumer_ttft_over_prefill": consumer["nonshared_consumer_ttft_over_prefill"],
        "raw_reuse_consumer_ttft_ratio": consumer["consumer_ttft_ratio"]["fullshared"],
        "kvcmas_forced_consumer_ttft_ratio": consumer["consumer_ttft_ratio"]["kvcmas_forced"],
    }
    aims = {}
    for key, (sense, bound) in AIMS.items():
        value = values[key]
        met = value >= bound if sense == ">=" else value <= bound
        aims[key] = {"value": value, "aim": f"{sense} {bound}", "met": met}
    return aims, (all(a["met"] for a in aims.values()) if on_cuda else None)


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    result = {"device": str(device), "dtype": DTYPE}
    result.update(correctness(args.check_model, args.device, args.problems))
    result.update(host_overhead(args.check_model, args.device, args.plan_tokens, args.decode_tokens, args.reps))
    figures = engine_figures(args.model, args.device, args)
    aims, met = judge(figures, on_cuda)
    consumer = figures["consumer"]
    result.update({
        "timing_model": figures["model"],
        "decode_tokens_per_s_1": figures["decode_tokens_per_s"]["1"],
        f"decode_tokens_per_s_{args.batch}": figures["decode_tokens_per_s"][str(args.batch)],
        **{f"prefill_vs_sdpa_{p['tokens']}": p["ratio"] for p in figures["prefill_vs_sdpa"]},
        "nonshared_consumer_ttft_over_prefill": consumer["nonshared_consumer_ttft_over_prefill"],
        "raw_reuse_consumer_ttft_ratio": consumer["consumer_ttft_ratio"]["fullshared"],
        "kvcmas_forced_consumer_ttft_ratio": consumer["consumer_ttft_ratio"]["kvcmas_forced"],  # timing only
        "workflow_wall_ratio": consumer["workflow_wall_ratio"],
        "prefill_tokens_per_workflow": consumer["prefill_tokens_per_workflow"],
        "aims": aims,
        "aims_met": met,
        "engine": figures,
        "sizes": {k: getattr(args, k) for k in ("prefill_tokens", "doc_tokens", "plan_tokens", "decode_tokens",
                                                "batch", "reps", "out_tokens", "problems")},
        "quick": args.quick,
        "machine": _machine(device),
    })
    return result


def _machine(device: torch.device) -> dict:
    record = machine(platform=platform.platform(), **torch_build())
    if device.type == "cuda":
        record.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (under a minute on 2 CPU cores)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default=None, help="the timing model (default: llama-1b on CUDA, mid-llama on a CPU)")
    parser.add_argument("--check-model", default="tiny-llama", help="the model of the correctness and host checks")
    parser.add_argument("--prefill-tokens", type=lambda v: [int(x) for x in v.split(",")], default=None)
    parser.add_argument("--doc-tokens", type=int, default=None, help="the shared document a consumer reads")
    parser.add_argument("--plan-tokens", type=int, default=None, help="the shared document of the planning figure")
    parser.add_argument("--decode-tokens", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None, help="requests decoding together, beside one alone")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (rounds) of each figure")
    parser.add_argument("--out-tokens", type=int, default=None, help="tokens each agent of a timed round writes")
    parser.add_argument("--problems", type=int, default=None, help="four-agent workflows of the correctness check")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    on_cuda = torch.device(args.device).type == "cuda"
    if args.model is None:
        args.model = "llama-1b" if on_cuda else "mid-llama"
    if on_cuda:
        fill_defaults(args, quick=dict(prefill_tokens=[2048, 8192], doc_tokens=4096, plan_tokens=4096, decode_tokens=64,
                                       batch=16, reps=3, out_tokens=8, problems=4),
                      full=dict(prefill_tokens=[2048, 8192], doc_tokens=4096, plan_tokens=4096, decode_tokens=128,
                                batch=16, reps=7, out_tokens=8, problems=6))
    else:
        fill_defaults(args, quick=dict(prefill_tokens=[256, 1024], doc_tokens=512, plan_tokens=4096, decode_tokens=32,
                                       batch=4, reps=2, out_tokens=4, problems=3),
                      full=dict(prefill_tokens=[2048, 8192], doc_tokens=4096, plan_tokens=4096, decode_tokens=64,
                                batch=8, reps=5, out_tokens=8, problems=6))
    run_and_emit(run, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

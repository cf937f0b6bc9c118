"""Fidelity of every shared-context strategy on a real model, in one interleaved run.

Workload: the four-agent workflow of `agentcache.tasks` (retriever, reader and verifier read a
shared fact-retrieval query in turn; a final agent reads the query and their three outputs and
answers). Problems are generated from seeds with known answers. Each problem runs through every
strategy in turn; the first `--warmup` problems only fill the anchor pools and are not scored.

Per strategy, over the scored calls:
- `kv_rel_error`: relative Frobenius error of the call's shared-segment KV against dense prefill
  of the same prompt (NonShared), layers 1.. (layer 0 is exact after alignment), mean of K and V;
  also per layer, per agent, and over reused segments only (`reused_kv_rel_error`);
- `token_agreement`: fraction of the dense greedy continuation of the same prompt reproduced
  before the first divergence; `teacher_forced_top1` and `teacher_forced_kl` along it;
- `accuracy`: the final answer is the right number; `final_agreement`: it equals NonShared's;
- `reuse_ratio`: shared tokens served from reused cache / shared tokens that had a source
  (selective recomputation counts what it rebuilt as not reused);
- `prefill_tokens_per_call`: the prefill work each call actually did, in full-forward tokens.

Beside the named strategies, the paper's matched pairs (§4.2): CacheBlend and DroidSpeak at
ρ = 0.9 and 0.8, KVCMAS with its gate held at ρ = 0.8 and 0.6 (`*_rho0.8`, ...) from the 4th
eligible segment of the warm-up on (`correction.calibration`).

Prints one JSON object; `--quick` is a small run that finishes in under a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from agentcache.correction.strategies import STRATEGIES
from agentcache.engine import EmbeddedEngine, EngineConfig
from agentcache.engine.precision import dtype_name
from agentcache.fidelity import ph_layer_errors, prefix_agreement, teacher_forced
from agentcache.metrics import summarize
from agentcache.models import DEFAULT_MODEL
from agentcache.runtime import Runtime, RuntimeConfig
from agentcache.selfcheck import check_model
from agentcache.tasks import FourAgentWorkflow, arithmetic_problem, fact_problem

ORDER = ["nonshared", "fullshared", "kvcomm", "kvcomm_canonical", "kvcmas", "kvcmas_nonchained", "kvcmas_fullrank"]
# the paper's pairing at matched reuse (§4.2): selective recomputation at ρ = 0.9 and 0.8 beside
# delta correction with its gate held at ρ = 0.8 and 0.6 (from the warm-up's 4th eligible segment on)
CALIBRATE_EVERY = 4
MATCHED = {
    "kvcmas_rho0.8": ("kvcmas_entropy", dict(target_reuse=0.8, calibrate_after=CALIBRATE_EVERY)),
    "kvcmas_rho0.6": ("kvcmas_entropy", dict(target_reuse=0.6, calibrate_after=CALIBRATE_EVERY)),
    "cacheblend_rho0.9": ("cacheblend", dict(rho=0.9)),
    "cacheblend_rho0.8": ("cacheblend", dict(rho=0.8)),
    "droidspeak_rho0.9": ("droidspeak", dict(rho=0.9)),
    "droidspeak_rho0.8": ("droidspeak", dict(rho=0.8)),
}
QUICK = ["nonshared", "kvcmas_rho0.8", "cacheblend_rho0.8", "droidspeak_rho0.8"]


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _spread(values: list[float]) -> dict | None:
    if not values:
        return None
    ordered = sorted(values)
    return {"n": len(ordered), "median": ordered[len(ordered) // 2], "p90": ordered[int(0.9 * (len(ordered) - 1))],
            "max": ordered[-1]}


def _learns(strategy) -> bool:
    """Whether a strategy keeps state its warm-up traffic builds (anchors, a gate, a layer profile)."""
    return strategy.reuse and (strategy.correct or strategy.recompute == "layers")


def run(args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    engine = EmbeddedEngine(args.model, EngineConfig(dtype=args.dtype))
    check = None if args.quick else check_model(engine.with_config(EngineConfig()))
    strategies = {name: STRATEGIES[name] for name in ORDER}
    for name, (base, changes) in MATCHED.items():
        strategies[name] = STRATEGIES[base].replace(name=name, **changes)
    if args.quick and not args.strategies:
        strategies = {name: strategies[name] for name in QUICK}
    for rank in args.ranks:  # rank ablation: KVCMAS with other ranks for base caches and corrections
        strategies[f"kvcmas_r{rank}"] = STRATEGIES["kvcmas"].replace(name=f"kvcmas_r{rank}", base_rank=rank, delta_rank=rank)
    if args.strategies:
        strategies.update({name: STRATEGIES[name] for name in args.strategies if name in STRATEGIES})
        unknown = set(args.strategies) - set(strategies) - {"nonshared"}
        if unknown:
            raise SystemExit(f"unknown strategies {sorted(unknown)}; choose from {sorted(strategies)}")
        strategies = {n: s for n, s in strategies.items() if n in args.strategies or n == "nonshared"}
    order = list(strategies)
    if args.tau is not None:
        strategies = {name: s.replace(tau=args.tau) for name, s in strategies.items()}
    if args.temperature is not None:
        strategies = {name: s.replace(temperature=args.temperature) for name, s in strategies.items()}
    runtimes = {
        name: Runtime(engine.with_config(EngineConfig()), strategy=s, check=check,
                      config=RuntimeConfig(self_check=False, keep_kv=True))
        for name, s in strategies.items()
    }
    oracle = Runtime(engine.with_config(EngineConfig()), strategy="nonshared",
                     config=RuntimeConfig(self_check=False, keep_kv=True))
    dense_runs: dict[tuple, object] = {}  # (agent, prompt ids) -> the NonShared run of that prompt

    def dense_of(result, call, sampling):
        key = (result.agent, tuple(result.prompt_ids))
        if key not in dense_runs:
            dense_runs[key] = oracle.run(call, sampling)
        return dense_runs[key]

    workflow = FourAgentWorkflow(role_tokens=args.role_tokens, final_tokens=args.final_tokens)
    def make(seed: int):
        return fact_problem(seed, records=args.records) if args.task == "fact" else arithmetic_problem(seed)

    scored = defaultdict(list)  # strategy -> [(call, dense)]
    answers = defaultdict(list)  # strategy -> [final text]
    correct = defaultdict(int)
    spent = defaultdict(float)  # strategy -> seconds in its workflow runs (the dense reference runs included)
    for index in range(args.warmup + args.problems):
        warm = index < args.warmup
        problem = make(10_000 + index if warm else index)
        for name in order:
            if warm and not _learns(strategies[name]):
                continue  # nothing to warm up: no anchor pools, no layer profile
            runtime = runtimes[name]
            pairs = []

            def execute(call, sampling, runtime=runtime, pairs=pairs, warm=warm, name=name):
                result = runtime.run(call, sampling)
                if not warm:
                    if name == "nonshared":
                        dense_runs.setdefault((result.agent, tuple(result.prompt_ids)), result)
                    pairs.append((result, dense_of(result, call, sampling)))
                return result

            begun = time.perf_counter()
            results = workflow.run(execute, problem)
            spent[name] += time.perf_counter() - begun
            if not warm:
                scored[name].extend(pairs)
                answers[name].append(results[-1].text)
                correct[name] += workflow.correct(results, problem)

    report = {}
    for name in order:
        pairs = scored[name]
        errors = [ph_layer_errors(call, dense) for call, dense in pairs]
        reused_errors = [e for e in (ph_layer_errors(c, d, reused_only=True) for c, d in pairs) if e is not None]
        per_agent = defaultdict(list)
        for (call, _), err in zip(pairs, errors):
            per_agent[call.agent].append(err.mean)
        num_layers = len(errors[0].keys)
        tf = [teacher_forced(engine, call, dense) for call, dense in pairs]
        figures = summarize([call for call, _ in pairs])
        report[name] = {
            "kv_rel_error": _mean([e.mean for e in errors]),
            "k_rel_error": _mean([e.key_total for e in errors]),
            "v_rel_error": _mean([e.value_total for e in errors]),
            "reused_kv_rel_error": _mean([e.mean for e in reused_errors]),  # only segments served from reuse
            "per_agent_kv_rel_error": {agent: _mean(v) for agent, v in per_agent.items()},
            "per_layer_k_rel_error": [_mean([e.keys[i] for e in errors]) for i in range(num_layers)],
            "per_layer_v_rel_error": [_mean([e.values[i] for e in errors]) for i in range(num_layers)],
            "token_agreement": _mean([prefix_agreement(c.token_ids, d.token_ids) for c, d in pairs]),
            "teacher_forced_top1": _mean([t[0] for t in tf]),
            "teacher_forced_kl": _mean([t[1] for t in tf]),
            "accuracy": correct[name] / args.problems,
            "final_agreement": _mean([float(a == b) for a, b in zip(answers[name], answers["nonshared"])]),
            "reuse_ratio": figures["reuse_ratio"],
            "ph_decisions": figures["ph_decisions"],
            "fallback_reasons": figures["fallback_reasons"],
            "anchor_bytes": runtimes[name].summary()["anchor_bytes"],
            "ttft_mean_s": figures["ttft_mean_s"],
            # prefill work per scored call in full-forward tokens (computed, rebuilt, probed)
            "prefill_tokens_per_call": figures["prefill_tokens"] / max(1, figures["calls"]),
            "gate_tau": runtimes[name].summary()["gate_tau"] if strategies[name].correct else None,
            "workflow_s": spent[name],
            "gate_entropy": _spread([s.entropy for c, _ in pairs for s in c.segments if s.entropy is not None]),
        }
    return {
        "model": engine.model_name,
        "dtype": dtype_name(engine.layout.dtype),
        "task": args.task,
        "workflow": list(FourAgentWorkflow.agents),
        "problems": args.problems,
        "warmup_problems": args.warmup,
        "records_per_query": args.records if args.task == "fact" else None,
        "tau": {name: s.tau for name, s in strategies.items()},
        "gate_calibration": {name: calibration for name, rt in runtimes.items()
                             if (calibration := rt.summary()["gate_calibration"])},
        "temperature": {name: s.temperature for name, s in strategies.items()},
        "self_check": None if check is None else check.to_dict(),
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cpus, torch CPU",
        "wall_s": round(time.perf_counter() - started, 1),
        "strategies": report,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small run (under a minute on 2 cores)")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--task", choices=["fact", "arithmetic"], default="fact")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                        help="the engine's weights and KV (auto: float32 on a CPU)")
    parser.add_argument("--problems", type=int, default=None, help="scored problems")
    parser.add_argument("--warmup", type=int, default=None, help="problems that only fill the anchor pools")
    parser.add_argument("--tau", type=float, default=None, help="gate threshold for every correcting strategy")
    parser.add_argument("--records", type=int, default=None, help="records per fact-retrieval query")
    parser.add_argument("--role-tokens", type=int, default=None)
    parser.add_argument("--final-tokens", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=None,
                        help="gate softmax temperature T, relative to the nearest anchor's distance (default 0.1)")
    parser.add_argument("--strategies", type=lambda v: [x for x in v.split(",") if x], default=[],
                        help="only these strategies (NonShared always runs: it is the reference)")
    parser.add_argument("--ranks", type=lambda v: [int(x) for x in v.split(",") if x], default=[],
                        help="comma-separated extra KVCMAS ranks to ablate, e.g. 8,16,64")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    defaults = dict(problems=1, warmup=3, records=3, role_tokens=2, final_tokens=3) if args.quick else \
        dict(problems=24, warmup=4, records=8, role_tokens=16, final_tokens=8)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    report = run(args)
    text = json.dumps(report, indent=None if args.quick else 2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

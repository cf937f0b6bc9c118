"""Concurrent serving on the embedded engine: continuous batching against one request at a time
(`max_batch=1`), interleaved in one run, on Gemma 3 270M.

1. N concurrent calls (N = 1, 2, 4, 8), each a distinct prompt of `--prompt-tokens` (256) tokens
   generating `--gen-tokens` (64), submitted at once. Per N and mode: the aggregate decode rate
   (tokens produced while all N requests are decoding, from the last one's first token to the
   first one's last, per second; every token's time comes from the engine's token callback; the
   serialized mode never has N requests decoding at once) and the mean TTFT including queueing.
2. The swarm's shape through the Runtime: a shared query, three experts dispatched at once (each
   its own system prompt and the query; threads calling `Runtime.run`), then a decision agent
   reading the three outputs, under NonShared and KVCMAS (KVCMAS after `--warmup` problems that
   fill its anchor pools). Per strategy: the fan-out's mean TTFT including queueing and the
   wall time of fan-out plus fan-in, batched over serialized.

Keys: `decode_speedup_n4` (batched aggregate decode rate at N=4 over N=1; `hf_batch_speedup_n4`
is the same ratio for the bare HF model's batched forward on this machine, the ceiling), `fanout_ttft_ratio`
and `fanout_wall_ratio` (KVCMAS, batched over serialized; NonShared's too in `fanout`), and
`greedy_identical` (every batched greedy output equals its serialized one, token for token).

Threads: torch runs `--threads` intra-op threads (default: the cores this process may use).
`--quick` runs N = 1 and 4 with 48-token prompts and 16 tokens, and one KVCMAS fan-out (< 60 s).

    python benchmarks/concurrency.py [--quick] [--model gemma3-270m]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from _report import emit, fill_defaults, judge_aims  # benchmarks/, the script's own folder
from agentcache.engine import EmbeddedEngine, EngineConfig, ExecRequest, SamplingParams, SegmentPlan
from agentcache.runtime import Runtime, RuntimeConfig
from agentcache.segments import AgentCall, Segment
from agentcache.selfcheck import check_model

MODES = {"batched": 8, "serialized": 1}  # max_batch
EXPERTS = {
    "algebra": "You are the algebra expert. Set up the equation that the question describes and solve it.",
    "arithmetic": "You are the arithmetic expert. Work the question out step by step with the numbers given.",
    "checker": "You are the checker. Read the question again and list what a correct answer must satisfy.",
}
DECIDER = "You are the decision agent. Read the experts' answers and state the final answer as one number."


def filler_ids(engine: EmbeddedEngine, tokens: int, seed: int) -> list[int]:
    """BOS and `tokens` - 1 tokens of deterministic prose; distinct seeds never share a block."""
    words = ("the team reads a long report about trains hotels budgets weather museums and local food "
             "then plans each day with care and writes a short summary for the user").split()
    text = f"Request {seed}: " + " ".join(words[(seed * 7 + 3 * i) % len(words)] for i in range(tokens))
    return engine.tokenize(text, bos=True)[:tokens]


def concurrent_calls(engines: dict[str, EmbeddedEngine], n: int, prompt_tokens: int, gen_tokens: int,
                     trial: int) -> dict[str, dict]:
    """N requests submitted at once on each engine (modes interleaved); their timings and outputs."""
    base = engines["batched"]
    prompts = [filler_ids(base, prompt_tokens, seed=1000 * trial + 10 * n + i) for i in range(n)]
    out = {}
    order = list(MODES) if trial % 2 == 0 else list(reversed(MODES))
    for mode in order:
        engine = engines[mode]
        stamps: list[list[float]] = [[] for _ in range(n)]
        started = time.perf_counter()
        futures = [engine.submit(ExecRequest([SegmentPlan("prompt", ids)],
                                             SamplingParams(max_tokens=gen_tokens, ignore_eos=True),
                                             on_token=lambda _t, i=i: stamps[i].append(time.perf_counter())))
                   for i, ids in enumerate(prompts)]
        results = [f.result() for f in futures]
        # the steady state: from when every request is past its first token to when the first one ends
        all_decoding, first_done = max(s[0] for s in stamps), min(s[-1] for s in stamps)
        window = [t for s in stamps for t in s[1:] if all_decoding < t <= first_done]
        out[mode] = {
            "decode_tokens_per_s": len(window) / (first_done - all_decoding) if first_done > all_decoding else None,
            "ttft_mean_s": statistics.fmean(s[0] - started for s in stamps),
            "wall_s": max(s[-1] for s in stamps) - started,
            "outputs": [r.token_ids for r in results],
        }
    return out


def hf_batch_speedup(engine: EmbeddedEngine, batch: int, prompt_tokens: int, steps: int = 8) -> float:
    """Decode tokens/s of the bare HF model at `batch` rows over 1 row (its own DynamicCache, no
    engine): what this machine's kernels give for batching, the ceiling for any engine here."""
    from transformers import DynamicCache

    ids = torch.tensor([filler_ids(engine, prompt_tokens, seed=7)])  # (1, T)
    rates = {}
    with torch.inference_mode():
        for rows in (1, batch):
            cache = DynamicCache()
            out = engine.model(input_ids=ids.repeat(rows, 1), past_key_values=cache, use_cache=True, logits_to_keep=1)
            token = out.logits[:, -1].argmax(-1, keepdim=True)  # (rows, 1)
            began = time.perf_counter()
            for _ in range(steps):
                out = engine.model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1)
                token = out.logits[:, -1].argmax(-1, keepdim=True)
            rates[rows] = rows * steps / (time.perf_counter() - began)
    return rates[batch] / rates[1]


def fanout_problem(rt: Runtime, index: int, query_tokens: int, expert_tokens: int, session: str,
                   decision_tokens: int = 8) -> dict:
    """One query, three experts at once, then the decision agent; TTFTs and the wall time."""
    query = " ".join(f"item {index}-{k} costs {3 + (index * 5 + k) % 17} dollars" for k in range(query_tokens // 8))
    query = f"Question {index}: {query}. What do all the items cost together?"
    started = time.perf_counter()

    def expert(name: str):
        call = AgentCall(agent=name, segments=(Segment.pf(EXPERTS[name] + "\n"), Segment.ph("query", query),
                                               Segment.pf("\nAnswer:")), session=session)
        return rt.run(call, SamplingParams(max_tokens=expert_tokens, ignore_eos=True))

    with ThreadPoolExecutor(len(EXPERTS)) as pool:  # the experts are dispatched at once
        results = dict(zip(EXPERTS, pool.map(expert, EXPERTS)))
    segments = [Segment.pf(DECIDER + "\n"), Segment.ph("query", query)]
    for name in EXPERTS:
        segments += [Segment.pf(f"\n{name}:"), rt.output_segment(name, session=session)]
    decision = rt.run(AgentCall(agent="decision", segments=(*segments, Segment.pf("\nFinal answer:")), session=session),
                      SamplingParams(max_tokens=decision_tokens, ignore_eos=True))
    return {
        "fanout_ttft_s": statistics.fmean(results[name].ttft_s for name in EXPERTS),
        "wall_s": time.perf_counter() - started,
        "outputs": [results[name].token_ids for name in EXPERTS] + [decision.token_ids],
    }


def run(args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    base = EmbeddedEngine(args.model, EngineConfig(threads=args.threads))

    def config(max_batch: int) -> EngineConfig:
        return EngineConfig(pool_blocks=4096, max_batch=max_batch, threads=args.threads)

    engines = {mode: base.with_config(config(size)) for mode, size in MODES.items()}
    counts = [1, 4] if args.quick else [1, 2, 4, 8]
    identical = True
    per_n: dict[int, dict] = {}
    for trial in range(args.trials):
        for n in counts:
            measured = concurrent_calls(engines, n, args.prompt_tokens, args.gen_tokens, trial)
            identical &= measured["batched"]["outputs"] == measured["serialized"]["outputs"]
            for mode, figures in measured.items():
                slot = per_n.setdefault(n, {}).setdefault(mode, {"decode_tokens_per_s": [], "ttft_mean_s": []})
                if figures["decode_tokens_per_s"] is not None:
                    slot["decode_tokens_per_s"].append(figures["decode_tokens_per_s"])
                slot["ttft_mean_s"].append(figures["ttft_mean_s"])
    calls = {str(n): {mode: {k: round(statistics.median(v), 3) if v else None for k, v in figures.items()}
                      for mode, figures in modes.items()} for n, modes in per_n.items()}
    rate = {n: calls[str(n)]["batched"]["decode_tokens_per_s"] for n in counts}
    torch.set_num_threads(base.threads or torch.get_num_threads())  # as the engine's steps ran
    ceiling = hf_batch_speedup(base, 4, args.prompt_tokens, steps=4 if args.quick else 8)

    check = None if args.quick else check_model(base.with_config(config(8)))
    fanout = {}
    for strategy in ("kvcmas",) if args.quick else ("nonshared", "kvcmas"):
        runtimes = {mode: Runtime(base.with_config(config(size)), strategy=strategy,
                                  check=check, config=RuntimeConfig(self_check=False))
                    for mode, size in MODES.items()}
        figures = {mode: {"fanout_ttft_s": [], "wall_s": []} for mode in MODES}
        for index in range(args.warmup + args.problems):
            order = list(MODES) if index % 2 == 0 else list(reversed(MODES))
            measured = {mode: fanout_problem(runtimes[mode], index, args.query_tokens, args.expert_tokens,
                                             session=f"problem-{index}", decision_tokens=args.expert_tokens)
                        for mode in order}
            if strategy == "nonshared":  # KVCMAS's choices may depend on which sibling commits first
                identical &= measured["batched"]["outputs"] == measured["serialized"]["outputs"]
            if index >= args.warmup:
                for mode in MODES:
                    for key in figures[mode]:
                        figures[mode][key].append(measured[mode][key])
        fanout[strategy] = {
            "ttft_ratio": round(statistics.fmean(figures["batched"]["fanout_ttft_s"])
                                / statistics.fmean(figures["serialized"]["fanout_ttft_s"]), 3),
            "wall_ratio": round(statistics.fmean(figures["batched"]["wall_s"])
                                / statistics.fmean(figures["serialized"]["wall_s"]), 3),
            **{f"{mode}_{key}": round(statistics.fmean(values), 3) for mode in MODES
               for key, values in figures[mode].items()},
            "reuse_ratio": {mode: round(rt.summary()["reuse_ratio"], 3) for mode, rt in runtimes.items()},
        }
    return {
        "model": args.model,
        "decode_speedup_n4": round(rate[4] / rate[1], 3) if rate.get(4) and rate.get(1) else None,
        "hf_batch_speedup_n4": round(ceiling, 3),
        "fanout_ttft_ratio": fanout["kvcmas"]["ttft_ratio"],
        "fanout_wall_ratio": fanout["kvcmas"]["wall_ratio"],
        "greedy_identical": identical,
        "calls": calls,
        "fanout": fanout,
        "prompt_tokens": args.prompt_tokens,
        "gen_tokens": args.gen_tokens,
        "trials": args.trials,
        "fanout_problems": args.problems,
        "threads": args.threads,
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__}",
        "wall_s": round(time.perf_counter() - started, 1),
    }


AIMS = {"decode_speedup_n4": (">", 1.0), "fanout_ttft_ratio": ("<", 1.0), "batched_over_serialized_ttft_n4": ("<", 1.0)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="N = 1 and 4, short prompts (< 60 s on 2 cores)")
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--prompt-tokens", type=int, default=None)
    parser.add_argument("--gen-tokens", type=int, default=None)
    parser.add_argument("--trials", type=int, default=None, help="repeats of each N (medians are reported)")
    parser.add_argument("--problems", type=int, default=None, help="scored fan-out problems")
    parser.add_argument("--warmup", type=int, default=None, help="fan-out problems that only fill anchor pools")
    parser.add_argument("--query-tokens", type=int, default=None)
    parser.add_argument("--expert-tokens", type=int, default=None)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    quick = {"prompt_tokens": 48, "gen_tokens": 16, "trials": 1, "problems": 1, "warmup": 0, "query_tokens": 32,
             "expert_tokens": 4}
    full = {"prompt_tokens": 256, "gen_tokens": 64, "trials": 2, "problems": 4, "warmup": 3, "query_tokens": 128,
            "expert_tokens": 48}
    fill_defaults(args, quick, full)
    result = run(args)
    four = result["calls"].get("4")
    if four is not None:  # batching never loses to one request at a time
        batched, serialized = four["batched"]["ttft_mean_s"], four["serialized"]["ttft_mean_s"]
        result["batched_over_serialized_ttft_n4"] = round(batched / serialized, 3)
    judge_aims(result, AIMS)
    emit(result, args.out)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)

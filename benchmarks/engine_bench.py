"""Embedded engine against plain HF transformers, in one interleaved run.

1. Dense prefill throughput: `EmbeddedEngine.execute` (one generated token, KV capture and
   block caching included) over a plain HF forward of the same tokens with its own KV cache.
   The fair baseline computes logits for the last position only, as the engine does; the
   ratio against a default HF forward (logits for every position) is reported beside it.
2. Prefix-hit TTFT over cold TTFT: a long shared prefix plus a short new suffix, first with an
   empty prefix cache, then with the prefix cached by the previous call.

Prints one JSON object on stdout. `--quick` finishes in well under a minute on 2 CPU cores
(once the default model has been converted).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

from agentcache.engine import EmbeddedEngine, EngineConfig, ExecRequest, SamplingParams, SegmentPlan, Step
from agentcache.models import DEFAULT_MODEL
from agentcache.tasks import filler_tokens


def prompt_of(engine: EmbeddedEngine, num_tokens: int, salt: int) -> list[int]:
    return filler_tokens(engine.tokenize, num_tokens, salt)


def time_engine_prefill(engine: EmbeddedEngine, ids: list[int]) -> float:
    request = ExecRequest([SegmentPlan("prompt", ids, Step.DENSE)], SamplingParams(max_tokens=1))
    started = time.perf_counter()
    engine.execute(request)
    return time.perf_counter() - started


def time_hf_forward(model: torch.nn.Module, ids: list[int], last_only: bool) -> float:
    tensor = torch.tensor([ids])
    started = time.perf_counter()
    with torch.inference_mode():
        model(input_ids=tensor, use_cache=True, logits_to_keep=1 if last_only else 0)
    return time.perf_counter() - started


def prefill_comparison(engine: EmbeddedEngine, num_tokens: int, reps: int, full_logits: bool) -> dict:
    engine_s, hf_s, hf_full_s = [], [], []
    for rep in range(reps):
        ids = prompt_of(engine, num_tokens, rep)
        # Alternate the order so drift on a shared machine does not favour either side.
        if rep % 2 == 0:
            engine_s.append(time_engine_prefill(engine, ids))
            hf_s.append(time_hf_forward(engine.model, ids, last_only=True))
        else:
            hf_s.append(time_hf_forward(engine.model, ids, last_only=True))
            engine_s.append(time_engine_prefill(engine, ids))
        if full_logits:
            hf_full_s.append(time_hf_forward(engine.model, ids, last_only=False))
    ratios = [h / e for e, h in zip(engine_s, hf_s)]
    out = {
        "tokens": num_tokens,
        "reps": reps,
        "engine_tokens_per_s": num_tokens / statistics.median(engine_s),
        "hf_tokens_per_s": num_tokens / statistics.median(hf_s),
        "ratio": statistics.median(ratios),
    }
    if full_logits:
        out["hf_full_logits_tokens_per_s"] = num_tokens / statistics.median(hf_full_s)
        out["ratio_vs_full_logits"] = statistics.median(h / e for e, h in zip(engine_s, hf_full_s))
    return out


def prefix_hit_comparison(engine: EmbeddedEngine, prefix_tokens: int, suffix_tokens: int, reps: int) -> dict:
    cold_s, warm_s, cached = [], [], []
    for rep in range(reps):
        prefix = prompt_of(engine, prefix_tokens, 100 + rep)
        suffixes = [engine.tokenize(f" Question {rep}-{k}: " + "which hotel is closest " * 8)[:suffix_tokens] for k in range(2)]
        engine.pool.clear()
        cold = engine.execute(ExecRequest([SegmentPlan("shared", prefix), SegmentPlan("q", suffixes[0])], SamplingParams(max_tokens=1)))
        warm = engine.execute(ExecRequest([SegmentPlan("shared", prefix), SegmentPlan("q", suffixes[1])], SamplingParams(max_tokens=1)))
        assert cold.cached_tokens == 0
        cold_s.append(cold.ttft_s)
        warm_s.append(warm.ttft_s)
        cached.append(warm.cached_tokens)
    return {
        "prefix_tokens": prefix_tokens,
        "suffix_tokens": suffix_tokens,
        "reps": reps,
        "cold_ttft_s": statistics.median(cold_s),
        "hit_ttft_s": statistics.median(warm_s),
        "cached_tokens": min(cached),
        "ratio": statistics.median(w / c for w, c in zip(warm_s, cold_s)),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--quick", action="store_true", help="short run (< 60 s on 2 cores)")
    parser.add_argument("--prefill-tokens", type=int, default=None)
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=None)
    args = parser.parse_args(argv)

    prefill_tokens = args.prefill_tokens or (512 if args.quick else 2048)
    reps = args.reps or (3 if args.quick else 7)
    started = time.perf_counter()
    engine = EmbeddedEngine(args.model, EngineConfig(pool_blocks=4 * args.prefix_tokens // 16 + 64))
    load_s = time.perf_counter() - started
    time_engine_prefill(engine, prompt_of(engine, 64, 99))  # warm-up: first-call allocations

    prefill = prefill_comparison(engine, prefill_tokens, reps, full_logits=not args.quick)
    prefix = prefix_hit_comparison(engine, args.prefix_tokens, 24, 2 if args.quick else reps)
    result = {
        "model": engine.model_name,
        "dtype": str(engine.layout.dtype).removeprefix("torch."),
        "prefill_throughput_ratio": round(prefill["ratio"], 4),
        "prefix_hit_ttft_ratio": round(prefix["ratio"], 4),
        "prefill": prefill,
        "prefix_hit": prefix,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "device": engine.config.device,
        },
        "mode": "quick" if args.quick else "full",
        "load_s": round(load_s, 2),
        "wall_s": round(time.perf_counter() - started, 2),
    }
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return result


if __name__ == "__main__":
    main()

"""CacheScout inside vLLM: a generated selector trace replayed through the in-process vLLM engine
at a tight pool, under vLLM's own LRU order, Survival, and Survival with warm-ups.

The workload and procedure are scout_ttft.py's (six agents with 256-640-token prefixes, 4
concurrent sessions, 12 turns, 64-token queries; `--quick` halves the lengths and runs 4
sessions; NonShared calls of one generated token; the pool holds 1.25x the largest request; the
three runtimes interleaved call by call, a warm-up between calls), on three vLLM engines of their
own (block size 32). mid-llama (random weights, 8 layers, hidden 512) by default, as there.

Keys: `hit_rate_lru`, `hit_rate_survival`, `hit_rate_survival_warmup` (cached / prompt tokens),
`ttft_ratio` (mean TTFT of Survival with warm-up over LRU's; below 1 is faster) and
`ttft_ratio_survival` (without warm-up).

    python benchmarks/vllm_eviction.py [--quick] [--model mid-llama]
"""

from __future__ import annotations

import argparse
import sys
import time

from _report import emit  # benchmarks/, the script's own folder
from scout_ttft import run_selector, selector_arguments

from agentcache.engine import EvictionPolicy
from agentcache.engine.vllm import VLLMConfig, VLLMEngine

BLOCK_SIZE = 32
QUICK_SESSIONS = 4  # vLLM's CPU step costs more than the embedded engine's on these small models


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    selector_arguments(parser, "mid-llama", QUICK_SESSIONS)
    args = parser.parse_args(argv)
    started = time.perf_counter()

    def make_engine(name: str, pool_blocks: int, eviction: str | EvictionPolicy) -> VLLMEngine:
        return VLLMEngine(args.model, VLLMConfig(pool_blocks=pool_blocks, eviction=eviction, instance=name,
                                                 block_size=BLOCK_SIZE))

    replay = run_selector(make_engine, args, BLOCK_SIZE, quick_sessions=QUICK_SESSIONS)
    hit = replay["hit_rate"]
    result = {
        "benchmark": "vllm_eviction",
        "hit_rate_lru": hit["lru"], "hit_rate_survival": hit["survival"],
        "hit_rate_survival_warmup": hit["survival_prefetch"],
        "ttft_ratio": replay["ttft_ratio_survival_prefetch_vs_lru"],
        "ttft_ratio_survival": replay["ttft_ratio_survival_vs_lru"],
        **replay,
    }
    result["wall_s"] = round(time.perf_counter() - started, 1)
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])

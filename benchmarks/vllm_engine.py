"""The in-process vLLM engine: what agentcache costs on top of plain vLLM, and what reuse saves.

1. `overhead_ratio`: mean TTFT of agentcache's NonShared path (a Runtime on `VLLMEngine`: the
   adapter-level call, planning, the engine loop, the connector and scheduler hooks) over plain
   vLLM (`LLMEngine` built from the same settings without any agentcache hook, stepped by hand)
   on the same prompts: agent calls of a 200-token system prompt and a new 300-token query
   (`--quick`: 100 + 150), 8 generated tokens, the two interleaved call by call after two untimed
   calls each. Both have vLLM's prefix cache, so both hit the system prompts alike.
2. `reuse_hop_speedup_2k` / `_8k`: ttft.py's reuse-hop workflow (four agents read one shared
   context of L tokens in turn, new content every round, two untimed rounds that fill the anchor
   pools) through vLLM on Gemma 3 270M: mean TTFT of the three reuse hops under NonShared over
   KVCMAS, whose corrected KV enters vLLM through the KV connector. `--quick` runs tiny-llama
   (random weights, the gate opened) at 2K only, one timed round.

Each configuration runs on a vLLM engine of its own. One JSON object on stdout.

    python benchmarks/vllm_engine.py [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics
import sys
import time

from _report import emit  # benchmarks/, the script's own folder
from ttft import measure

from agentcache.engine import SamplingParams
from agentcache.engine.vllm import VLLMConfig, VLLMEngine
from agentcache.runtime import Runtime, RuntimeConfig
from agentcache.segments import AgentCall, Segment


class PlainVLLM:
    """Plain vLLM (`LLMEngine` from the same settings, no agentcache hook), in a child process:
    vLLM keeps one KV connector per process, and an engine without one cannot run beside it. The
    two take turns, one call at a time, so they never compete for the cores."""

    def __init__(self, engine: VLLMEngine) -> None:
        import multiprocessing

        config = engine.config
        settings = dict(model=str(engine.model_directory), block_size=config.block_size,
                        max_model_len=engine.max_context, max_num_seqs=config.max_batch,
                        max_num_batched_tokens=config.prefill_chunk, kv_cache_memory_bytes=config.kv_cache_bytes)
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve_plain, args=(child, settings), daemon=True)
        self._process.start()
        if self._conn.recv() != "ready":
            raise RuntimeError("plain vLLM did not start")

    def ttft(self, prompt: list[int], tokens: int) -> float:
        self._conn.send((prompt, tokens))
        return self._conn.recv()

    def close(self) -> None:
        self._conn.send(None)
        self._process.join(timeout=30)


def _serve_plain(conn, settings: dict) -> None:
    """The child: build plain vLLM, then time one request per message (submission to first token)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams as VLLMSampling
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    llm = LLMEngine.from_engine_args(EngineArgs(
        dtype="float32", enable_prefix_caching=True, enforce_eager=True, enable_chunked_prefill=True,
        skip_tokenizer_init=True, generation_config="vllm", seed=0, **settings))
    conn.send("ready")
    for index in itertools.count():
        message = conn.recv()
        if message is None:
            return
        prompt, tokens = message
        started = time.perf_counter()
        llm.add_request(f"plain{index}", {"prompt_token_ids": prompt},
                        VLLMSampling(max_tokens=tokens, temperature=0.0, ignore_eos=True, detokenize=False))
        first = None
        while llm.has_unfinished_requests():
            for output in llm.step():
                if first is None and output.outputs and output.outputs[0].token_ids:
                    first = time.perf_counter() - started
        conn.send(first)


def overhead(model: str, calls: int, system_words: int, query_words: int) -> dict:
    engine = VLLMEngine(model, VLLMConfig(instance="overhead"))
    runtime = Runtime(engine, strategy="nonshared", config=RuntimeConfig(self_check=False))
    plain = PlainVLLM(engine)
    bos = [engine.bos_token_id] if engine.bos_token_id is not None else []
    systems = {f"agent{i}": tuple(bos + engine.tokenize(f"You are agent {i}. " + " ".join(context_words(system_words, i))))
               for i in range(3)}
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    times: dict[str, list[float]] = {"ours": [], "plain": []}
    for index in range(calls + 2):  # the first two of each are untimed
        agent = f"agent{index % 3}"
        query = tuple(engine.tokenize(" " + " ".join(context_words(query_words, seed=100 + index))))
        call = AgentCall(agent=agent, segments=(Segment(kind="pf", token_ids=systems[agent]),
                                               Segment(kind="ph", slot="query", token_ids=query)))
        prompt = list(systems[agent]) + list(query)
        for side in (("ours", "plain") if index % 2 == 0 else ("plain", "ours")):
            if side == "ours":
                result = runtime.run(call, sampling)
                if list(result.prompt_ids) != prompt:
                    raise RuntimeError("the runtime sent other tokens than the plain engine gets")
                ttft = result.ttft_s
            else:
                ttft = plain.ttft(prompt, 8)
            if index >= 2:
                times[side].append(ttft)
    plain.close()
    ours, theirs = statistics.fmean(times["ours"]), statistics.fmean(times["plain"])
    return {"overhead_ratio": round(ours / theirs, 3), "agentcache_ttft_s": round(ours, 4),
            "plain_vllm_ttft_s": round(theirs, 4), "calls": calls, "prompt_tokens": len(prompt)}


def context_words(count: int, seed: int) -> list[str]:
    import random

    words = ("report hotel train museum budget weather river market ticket guide station dinner bridge "
             "castle garden harbor gallery festival route schedule price review").split()
    rng = random.Random(seed)
    return [rng.choice(words) for _ in range(count)]


def reuse_hop(model: str, length: int, rounds: int, warmup: int) -> dict:
    def make_engine(name: str) -> VLLMEngine:
        return VLLMEngine(model, VLLMConfig(instance=f"hop-{name}-{length}"))

    rows = measure(make_engine, length, rounds, warmup, open_gate=model != "gemma3-270m",
                   order=["nonshared", "kvcmas"])
    return {"speedup": round(rows["kvcmas"]["hop_speedup_vs_nonshared"], 3),
            "hop_ttft_s": {name: round(rows[name]["hop_ttft_s"], 4) for name in ("nonshared", "kvcmas")},
            "reuse_ratio": rows["kvcmas"]["reuse_ratio"], "fallback_reasons": rows["kvcmas"]["fallback_reasons"],
            "rounds": rounds, "warmup": warmup}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny-llama, one timed round (< 60 s once vLLM is up)")
    parser.add_argument("--model", default=None, help="the model of the reuse hops (default Gemma 3 270M)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per shared length")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    result: dict = {"benchmark": "vllm_engine", "machine": f"{platform.machine()}, {os.cpu_count()} cores"}
    model = args.model or ("tiny-llama" if args.quick else "gemma3-270m")
    result["model"] = model
    if args.quick:
        result.update(overhead(model, calls=8, system_words=60, query_words=90))
    else:
        result.update(overhead(model, calls=12, system_words=120, query_words=180))
    result["reuse_hops"] = {}
    lengths = ((2048, args.rounds or 1),) if args.quick else ((2048, args.rounds or 2), (8192, args.rounds or 1))
    for length, rounds in lengths:
        hop = reuse_hop(model, length, rounds=rounds, warmup=2)
        result[f"reuse_hop_speedup_{length // 1024}k"] = hop["speedup"]
        result["reuse_hops"][f"{model}@{length}"] = hop
    result["wall_s"] = round(time.perf_counter() - started, 1)
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])

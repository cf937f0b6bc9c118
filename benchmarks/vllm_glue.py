"""Shared segments interleaved with agent glue on vLLM: successive phases against injecting the
glue's exact KV too.

A vLLM KV connector can only extend the contiguous computed prefix. When a call reads several
shared (PH) segments with the agent's own text between them (a system prompt whose tail is not
block-aligned, "Report 2:" lines), the vLLM engine runs it in phases: a prefill-only request
computes up to each injected segment that the cache does not reach, and the next phase claims it.
The alternative the design names is to inject the glue as well, so that one request claims one
contiguous run from the agent's cached block boundary on; the runtime must then compute the
glue's KV itself, on its own copy of the model, since the glue's KV depends on the shared
segments before it.

Per round (new shared content each round; the two orders alternate), on Gemma 3 270M:

- `phases_ttft_s`: TTFT of the call as the vLLM engine runs it (PH injected, the rest computed;
  a prefill-only phase per gap, `phases` of them before the last request: the glue between the
  PH segments, as the system prompt's partial block is kept from the agent's earlier call).
- `contiguous_ttft_s`: TTFT of the same call with the system prompt's tail and the glue injected
  too, their exact KV handed over for free (one request, no phase).
- `glue_compute_s`: what that KV costs the runtime: the embedded engine computing the tail and
  the glue over the cached system prompt and the injected PH segments (its fastest way).
- `glue_injection_ratio`: (`contiguous_ttft_s` + `glue_compute_s`) / `phases_ttft_s`; above 1,
  phases are faster.

Every variant must give the dense call's greedy tokens (they all read exact KV), or the run fails.
`--quick`: tiny-llama, two shared segments of about 128 tokens, two rounds.

    python benchmarks/vllm_glue.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

from _report import emit  # benchmarks/, the script's own folder
from vllm_engine import context_words

from agentcache.engine import EmbeddedEngine, SamplingParams
from agentcache.engine.protocol import ExecRequest, SegmentPlan, Step
from agentcache.engine.vllm import VLLMConfig, VLLMEngine

BLOCK_SIZE = 32
SAMPLING = SamplingParams(max_tokens=4, ignore_eos=True)


def call_segments(engine: VLLMEngine, system: list[int], shared: int, words: int, seed: int) -> list[SegmentPlan]:
    """[system head (block-aligned), system tail, report 0, glue 0, ..., question]: the system
    prompt looked up in the cache (PREFIX), the rest dense."""
    head = len(system) // BLOCK_SIZE * BLOCK_SIZE
    segments = [SegmentPlan("head", system[:head], Step.PREFIX), SegmentPlan("tail", system[head:], Step.PREFIX)]
    for i in range(shared):
        report = engine.tokenize(" " + " ".join(context_words(words, seed=1000 * seed + i)))
        segments += [SegmentPlan(f"ph{i}", report), SegmentPlan(f"glue{i}", engine.tokenize(f"\nThe critic on report {i + 1}:"))]
    segments.append(SegmentPlan("ask", engine.tokenize(" Which report is the most useful, and why?")))
    return segments


def planned(segments: list[SegmentPlan], reference, injected) -> list[SegmentPlan]:
    """The segments, those named by `injected` carrying the reference's KV."""
    return [SegmentPlan(seg.name, seg.token_ids, Step.INJECT, out.kv) if injected(seg.name) else seg
            for seg, out in zip(segments, reference.segments)]


def run(model: str, shared: int, words: int, rounds: int) -> dict:
    base = VLLMEngine(model, VLLMConfig(instance="glue", block_size=BLOCK_SIZE))
    reference_view, phases_view, contiguous_view = base.fresh(), base.fresh(), base.fresh()
    embedded = EmbeddedEngine(model)
    bos = [base.bos_token_id] if base.bos_token_id is not None else []
    system = bos + base.tokenize("You are the critic of the team. " + " ".join(context_words(180 if model.startswith("gemma") else 90, 7)))
    # each view and the embedded engine hold the system prompt's blocks, as they would after the agent's first call
    for engine in (phases_view, contiguous_view, embedded):
        engine.execute(ExecRequest([SegmentPlan("system", system)], SamplingParams(max_tokens=1)))
    times: dict[str, list[float]] = {"phases": [], "contiguous": [], "glue": []}
    phase_counts = set()

    def is_shared(name: str) -> bool:
        return name.startswith("ph")

    def phased(segments, reference):
        core = phases_view._core
        before = core.phases_run
        result = phases_view.execute(ExecRequest(planned(segments, reference, is_shared), SAMPLING))
        return result, core.phases_run - before, None

    def contiguous(segments, reference):
        last_glue = max(i for i, seg in enumerate(segments) if seg.name.startswith("glue"))
        glue = embedded.execute(ExecRequest(planned(segments[:last_glue + 1], reference, is_shared),
                                            SamplingParams(max_tokens=1)))
        given = planned(segments, reference, lambda name: name not in ("head", "ask"))
        return contiguous_view.execute(ExecRequest(given, SAMPLING)), 0, glue.total_s

    for index in range(rounds + 1):  # the first round is untimed (and keeps the system prompt's partial block)
        segments = call_segments(base, system, shared, words, seed=index)
        reference = reference_view.execute(ExecRequest(segments, SAMPLING))
        for name, variant in (("phases", phased), ("contiguous", contiguous))[:: 1 if index % 2 else -1]:
            result, phases, glue_s = variant(segments, reference)
            if result.token_ids != reference.token_ids:
                raise RuntimeError(f"{name}: exact KV gave other tokens than the dense call")
            if index:
                times[name].append(result.ttft_s)
                if name == "phases":
                    phase_counts.add(phases)
                else:
                    times["glue"].append(glue_s)
    mean = {name: statistics.fmean(values) for name, values in times.items()}
    prompt = sum(len(seg.token_ids) for seg in segments)
    return {
        "model": model, "prompt_tokens": prompt, "shared_segments": shared,
        "shared_tokens": sum(len(seg.token_ids) for seg in segments if seg.name.startswith("ph")),
        "glue_tokens": sum(len(seg.token_ids) for seg in segments if seg.name.startswith("glue") or seg.name == "tail"),
        "rounds": rounds, "phases": sorted(phase_counts),
        "phases_ttft_s": round(mean["phases"], 4), "contiguous_ttft_s": round(mean["contiguous"], 4),
        "glue_compute_s": round(mean["glue"], 4),
        "glue_injection_ratio": round((mean["contiguous"] + mean["glue"]) / mean["phases"], 3),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny-llama, 2 rounds (< 60 s once vLLM is up)")
    parser.add_argument("--model", default=None)
    parser.add_argument("--shared", type=int, default=None, help="shared segments per call (default 3)")
    parser.add_argument("--words", type=int, default=None, help="words per shared segment (default 400)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    model = args.model or ("tiny-llama" if args.quick else "gemma3-270m")
    result = {"benchmark": "vllm_glue", "machine": f"{platform.machine()}, {os.cpu_count()} cores"}
    result.update(run(model, shared=args.shared or (2 if args.quick else 3), words=args.words or (100 if args.quick else 400),
                      rounds=args.rounds or (2 if args.quick else 4)))
    result["wall_s"] = round(time.perf_counter() - started, 1)
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])

"""The vLLM engine with tensor_parallel_size=2: vLLM's worker processes (one core per rank here),
the connector's payloads carried to every worker in the step's metadata, each writing and reading
its own KV heads. Greedy output, logits and captured KV equal one worker's; injected KV gives what
vLLM computes, and wrong KV changes it."""

from __future__ import annotations

import pytest
import torch

from agentcache.engine import ExecRequest, SamplingParams, SegmentPlan, Step
from agentcache.errors import InputError
from tests.conftest import ENGINE_KINDS, text_of_length

pytestmark = pytest.mark.vllm

vllm_engine = ENGINE_KINDS["vllm"]
# tiny-llama: 2 KV heads, one per rank; tiny-gemma3: 1 KV head, held by both ranks (Gemma 3 270M's case)
PRESETS = ["tiny-llama", "tiny-gemma3"]


def _prompt(engine, seed: int) -> list[SegmentPlan]:
    return [SegmentPlan("sys", engine.tokenize("System: you are the planner. " + text_of_length(engine, 12, seed), bos=True)),
            SegmentPlan("query", engine.tokenize(" Query: " + text_of_length(engine, 30, seed + 1))),
            SegmentPlan("glue", engine.tokenize(" Answer:"))]


def _logprobs(result) -> torch.Tensor:
    return torch.log_softmax(result.last_logits.double(), dim=-1)


@pytest.fixture(scope="module", params=PRESETS)
def engines(request):
    one = vllm_engine(request.param, pool_blocks=128, instance="tp1")
    two = vllm_engine(request.param, pool_blocks=128, instance="tp2", tensor_parallel_size=2)
    return one, two


def test_two_ranks_give_one_workers_tokens_logits_and_kv(engines):
    one, two = engines
    for seed in range(2):
        request = ExecRequest(_prompt(one, seed), SamplingParams(max_tokens=16, ignore_eos=True))
        want, got = one.execute(request), two.execute(request)
        assert got.token_ids == want.token_ids
        assert torch.allclose(got.last_logits, want.last_logits, atol=1e-4)
        for a, b in zip(want.segments, got.segments):  # both ranks' heads read back and joined
            assert b.kv.keys.shape == a.kv.keys.shape
            assert torch.allclose(a.kv.keys, b.kv.keys, atol=1e-4) and torch.allclose(a.kv.values, b.kv.values, atol=1e-4)


def test_two_ranks_inject_exactly_and_wrong_kv_changes_the_result(engines):
    _, two = engines
    parts = [two.tokenize("System: you are the judge. ", bos=True)]
    for i in range(2):
        parts += [two.tokenize(f" Note {i}: " + text_of_length(two, 14, seed=i)), two.tokenize(f" then{i}")]
    names = ["sys", "note0", "glue0", "note1", "glue1"]
    computed = two.fresh().execute(ExecRequest([SegmentPlan(n, t) for n, t in zip(names, parts)],
                                               SamplingParams(max_tokens=8, ignore_eos=True)))

    def plan(kv_of):
        return [SegmentPlan(n, t, Step.INJECT, kv_of(i)) if n.startswith("note") else SegmentPlan(n, t)
                for i, (n, t) in enumerate(zip(names, parts))]

    injected = two.fresh().execute(ExecRequest(plan(lambda i: computed.segments[i].kv),
                                               SamplingParams(max_tokens=8, ignore_eos=True), lineage="tp-l1"))
    assert [o.injected_tokens for o in injected.segments] == [0, len(parts[1]), 0, len(parts[3]), 0]
    assert injected.token_ids == computed.token_ids
    assert (_logprobs(injected) - _logprobs(computed)).abs().max() < 1e-4

    def scrambled(i):  # every head wrong (swapped where there are two): what each rank writes matters
        kv = computed.segments[i].kv
        return type(kv)(kv.keys.flip(1) * 3 + 0.5, kv.values.flip(1) * 3 + 0.5, kv.start)

    wrong = two.fresh().execute(ExecRequest(plan(scrambled), SamplingParams(max_tokens=8, ignore_eos=True),
                                            lineage="tp-l2"))
    assert (_logprobs(wrong) - _logprobs(computed)).abs().max() > 1e-3


def test_a_bad_tensor_parallel_size_is_refused():
    from agentcache.engine.vllm import VLLMConfig

    for bad in (0, -2, 1.5, "2"):
        with pytest.raises(InputError, match="tensor_parallel_size"):
            VLLMConfig(tensor_parallel_size=bad)


def test_kvcmas_through_the_runtime_serves_the_same_on_two_ranks_as_on_one(engines):
    from agentcache.runtime import Runtime
    from tests.test_economics import DETERMINISTIC, chain, long_query

    one, two = engines
    runs = {}
    for name, engine in (("one", one), ("two", two)):
        rt = Runtime(engine.fresh(), strategy="kvcmas", config=DETERMINISTIC)
        results = [r for seed in range(3) for r in chain(rt, long_query(rt, seed))]
        runs[name] = ([r.text for r in results], [[s.decision for s in r.segments] for r in results],
                      rt.summary())
    assert runs["two"][0] == runs["one"][0] and runs["two"][1] == runs["one"][1]
    assert runs["two"][2]["reused_tokens"] == runs["one"][2]["reused_tokens"] > 0
    assert runs["two"][2]["faults"] == {}

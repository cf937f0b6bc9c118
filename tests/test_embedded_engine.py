"""Embedded-engine specifics: equality with HF `generate`, the real model, memory accounting."""

import pytest
import torch

from agentcache.engine import ExecRequest, SamplingParams, SegmentPlan, Step

from agentcache.errors import PlanError

from conftest import text_of_length
from test_engine_conformance import GREEDY, three_segments, with_steps


def _hf_greedy(engine, prompt, max_new_tokens):
    out = engine.model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
        eos_token_id=engine.eos_token_id, pad_token_id=engine.tokenizer.pad_token_id,
    )
    return out[0, len(prompt):].tolist()


def test_dense_greedy_equals_hf_generate(tiny_engine):
    engine = tiny_engine
    sys_ids = engine.tokenize("You are the local-guide agent. ", bos=True)
    query = engine.tokenize(text_of_length(engine, 30))  # longer than tiny-gemma3's sliding window of 8
    result = engine.execute(ExecRequest(
        [SegmentPlan("sys", sys_ids, Step.DENSE), SegmentPlan("q", query, Step.DENSE)], SamplingParams(max_tokens=16)
    ))
    assert result.token_ids == _hf_greedy(engine, sys_ids + query, 16)


@pytest.mark.slow
def test_gemma_dense_greedy_equals_hf_generate_and_knows_facts(gemma_engine):
    engine = gemma_engine
    prompt = engine.tokenize("The capital of France is", bos=True)
    assert prompt[0] == engine.bos_token_id == 2
    result = engine.execute(ExecRequest([SegmentPlan("q", prompt, Step.DENSE)], SamplingParams(max_tokens=12)))
    assert result.token_ids == _hf_greedy(engine, prompt, 12)
    # BOS present: a real continuation, not the degenerate "The The The" of a BOS-less Gemma.
    words = result.text.split()
    assert len(set(words)) >= len(words) // 2, result.text


@pytest.mark.slow
def test_gemma_segments_prefix_hit_and_injection(gemma_engine):
    engine = gemma_engine
    segments = [
        SegmentPlan("sys", engine.tokenize("You are a careful math tutor. Solve the problem step by step.\n", bos=True)),
        SegmentPlan("query", engine.tokenize("Problem: Tom has 3 boxes with 12 apples each. He eats 5 apples. How many are left?\n")),
        SegmentPlan("glue", engine.tokenize("Answer:")),
    ]
    dense_one = engine.execute(ExecRequest(
        [SegmentPlan("all", [t for s in segments for t in s.token_ids], Step.DENSE)], SamplingParams(max_tokens=8)
    ))
    split = engine.execute(ExecRequest([SegmentPlan(s.name, s.token_ids, Step.DENSE) for s in segments], SamplingParams(max_tokens=8)))
    assert torch.allclose(dense_one.last_logits, split.last_logits, atol=1e-3, rtol=1e-4)
    cold = engine.execute(ExecRequest(segments, SamplingParams(max_tokens=8)))
    warm = engine.execute(ExecRequest(segments, SamplingParams(max_tokens=8)))
    total = sum(len(s.token_ids) for s in segments)
    assert warm.cached_tokens == (total - 1) // engine.block_size * engine.block_size  # all but the last token's
    assert torch.allclose(cold.last_logits, warm.last_logits, atol=1e-3, rtol=1e-4)
    assert cold.token_ids == warm.token_ids == split.token_ids
    injected = engine.execute(ExecRequest(
        [segments[0], SegmentPlan("query", segments[1].token_ids, Step.INJECT, split.segments[1].kv),
         SegmentPlan("glue", segments[2].token_ids, Step.DENSE)],
        SamplingParams(max_tokens=8),
    ))
    assert torch.allclose(split.last_logits, injected.last_logits, atol=1e-3, rtol=1e-4)
    assert injected.token_ids == split.token_ids


def test_pool_capacity_from_bytes(tiny_engine):
    from agentcache.engine import EngineConfig

    per_block = tiny_engine.layout.bytes_per_token * 16
    engine = tiny_engine.with_config(EngineConfig(pool_bytes=10 * per_block))
    assert engine.pool.capacity == 10
    assert engine.pool.storage.keys.numel() * 4 * 2 == 10 * per_block


@pytest.mark.slow
def test_gemma_past_its_sliding_window(gemma_engine):
    """Gemma 3 270M attends through a 512-token window on 15 of 18 layers; our full-length call
    cache with a sliding mask must match HF's own sliding cache beyond the window."""
    engine = gemma_engine.with_config(type(gemma_engine.config)(pool_blocks=128, prefill_chunk=256))
    shared = engine.tokenize(text_of_length(engine, 700, seed=9) + "\n")
    assert len(shared) > 600
    segments = [
        SegmentPlan("sys", engine.tokenize("Summarize the notes below.\n", bos=True)),
        SegmentPlan("notes", shared),
        SegmentPlan("ask", engine.tokenize("Summary:")),
    ]
    prompt = [t for s in segments for t in s.token_ids]
    cold = engine.execute(ExecRequest(segments, SamplingParams(max_tokens=8, ignore_eos=True)))
    assert cold.token_ids == _hf_greedy(engine, prompt, 8)
    warm = engine.execute(ExecRequest(segments, SamplingParams(max_tokens=8, ignore_eos=True)))
    assert warm.cached_tokens > 512
    assert torch.allclose(cold.last_logits, warm.last_logits, atol=1e-3, rtol=1e-4)
    assert warm.token_ids == cold.token_ids


# --- moved from the conformance suite: they reach into the embedded engine's internals ---------------

def test_kv_is_exact_only_for_the_weights_that_computed_it(tiny_engine):
    from agentcache.models import LoadedModel

    engine = tiny_engine
    segments = three_segments(engine)
    kv = engine.execute(ExecRequest(with_steps(segments, Step.DENSE), GREEDY)).segments[1].kv
    loaded = engine.loaded
    twin = type(engine)(LoadedModel(loaded.name, loaded.model, loaded.tokenizer, loaded.requires_bos))
    plan = [segments[0], SegmentPlan("query", segments[1].token_ids, Step.INJECT, kv), segments[2]]
    assert engine.execute(ExecRequest(plan, GREEDY)).segments[1].kv.exact
    assert not twin.execute(ExecRequest(plan, GREEDY)).segments[1].kv.exact


def test_failure_while_caching_blocks_leaks_no_references(tiny_engine, monkeypatch):
    engine = tiny_engine
    segments = three_segments(engine, seed=12)
    real_store = engine.pool._stored
    calls = {"n": 0}

    def flaky_store(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("disk on fire")
        return real_store(*args, **kwargs)

    monkeypatch.setattr(engine.pool, "_stored", flaky_store)
    with pytest.raises(RuntimeError, match="disk on fire"):
        engine.execute(ExecRequest(segments, GREEDY))
    assert engine.pool.num_used == 2 and all(b.ref_count == 0 for b in engine.pool.blocks())
    monkeypatch.undo()
    assert engine.execute(ExecRequest(segments, GREEDY)).cached_tokens == 2 * engine.block_size


def test_stop_string_split_across_tokens_is_found(tiny_engine, monkeypatch):
    import agentcache.engine.scheduler as scheduler

    engine = tiny_engine
    if engine.model_name not in ("tiny-llama", "tiny-qwen2", "tiny-gemma3"):
        pytest.skip("scripted byte tokens need the byte-level tokenizer")
    script = iter(engine.tokenize("xé!zzzzzz"))  # 'é' is two byte tokens
    monkeypatch.setattr(scheduler, "choose_token", lambda *args: next(script))
    result = engine.execute(ExecRequest(three_segments(engine), SamplingParams(max_tokens=8, stop=("é",))))
    assert result.finish_reason == "stop" and result.text == "x"


def test_stop_strings_are_found_in_a_tail_at_the_same_token_and_cut_as_in_the_whole_text(tiny_engine):
    from agentcache.engine.sampling import find_stop, finish_after, stop_window

    engine = tiny_engine
    text = ("Plan: é then ü; next \u2603 snow, repeated. " * 40) + "END-OF-PLAN é tail"
    tokens = engine.tokenize(text)
    decoded: list[int] = []

    def detokenize(ids):
        decoded.append(len(ids))
        return engine.detokenize(ids)

    for stops in (("END-OF-PLAN",), ("\u2603 snow, repeated. Plan",), ("é tail", "zzz"), ("never there",)):
        whole = next((k for k in range(1, len(tokens) + 1)
                      if find_stop(engine.detokenize(tokens[:k]), stops) is not None), None)  # the old rule
        decoded.clear()
        ended = None
        for k in range(1, len(tokens) + 1):  # as an engine checks each new token
            if (found := finish_after(tokens[:k], 10**6, stops, True, (), detokenize)) is not None:
                ended = k, found
                break
        if whole is None:
            assert ended is None and len(tokens) > 2 * stop_window(stops)
            assert max(decoded) <= stop_window(stops)  # each token's check reads a bounded tail, not the reply
            continue
        k, (reason, cut) = ended
        assert k == whole and reason == "stop"
        assert cut == engine.detokenize(tokens[:k])[:find_stop(engine.detokenize(tokens[:k]), stops)]


def test_request_and_config_validation():
    from agentcache.engine import EngineConfig

    assert SamplingParams(stop="###").stop == ("###",)
    with pytest.raises(PlanError, match="max_tokens"):
        SamplingParams(max_tokens=2.5)
    with pytest.raises(PlanError, match="lineage must be a non-empty string"):
        ExecRequest([SegmentPlan("a", [1])], lineage=123)
    with pytest.raises(ValueError, match="prefill_chunk"):
        EngineConfig(prefill_chunk=0)


def test_foreign_devices_are_refused(tiny_engine):
    from agentcache.engine import EngineConfig

    with pytest.raises(ValueError, match="device 'meta'"):  # refused by the config, before any engine is built
        tiny_engine.with_config(EngineConfig(device="meta"))

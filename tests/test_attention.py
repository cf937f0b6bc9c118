"""The engine's attention: the causal mask implied (lower-right), computing what HF's SDPA path computes."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import agentcache.engine.attention as attention
from agentcache.engine import EmbeddedEngine, EngineConfig, ExecRequest, SamplingParams, SegmentPlan
from agentcache.models import load_model

from conftest import TINY_PRESETS

# (cached, new): from position 0; fewer cached than new (padded queries); more (a mask); one new token
SHAPES = [(0, 40), (12, 40), (40, 12), (39, 1), (30, 30)]


def _last_pass(model, ids: torch.Tensor, cached: int, implementation: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.config._attn_implementation = implementation
    cache = DynamicCache()
    with torch.inference_mode():
        if cached:
            model(input_ids=ids[:, :cached], past_key_values=cache, use_cache=True)
        out = model(input_ids=ids[:, cached:], past_key_values=cache, use_cache=True)
    return out.logits, [layer.keys for layer in cache.layers]


@pytest.mark.parametrize("preset", TINY_PRESETS)  # tiny-gemma3: sliding-window layers of 8, passed by far here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_implied_mask_computes_what_hf_sdpa_computes(preset, dtype):
    model = load_model(preset, dtype=dtype).model
    torch.manual_seed(0)
    for cached, new in SHAPES:
        ids = torch.randint(3, 250, (1, cached + new))
        want_logits, want_keys = _last_pass(model, ids, cached, "sdpa")
        got_logits, got_keys = _last_pass(model, ids, cached, attention.ATTENTION)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(got_logits.float(), want_logits.float(), atol=tolerance, rtol=tolerance), (cached, new)
        for got, want in zip(got_keys, want_keys):
            assert torch.allclose(got.float(), want.float(), atol=tolerance, rtol=tolerance), (cached, new)


def test_a_prefill_after_a_prefix_hit_builds_no_mask(monkeypatch):
    """After a hit, the engine's prefill runs SDPA's causal kernel (queries padded) with no mask tensor."""
    engine = EmbeddedEngine("tiny-llama", EngineConfig(pool_blocks=64))
    seen = []
    real = attention.sdpa_attention_forward

    def spy(module, query, key, value, mask, **kwargs):
        seen.append((query.shape[2], key.shape[2], mask is None, kwargs.get("is_causal")))
        return real(module, query, key, value, mask, **kwargs)

    system = engine.tokenize("You are the planner of a small team." * 2, bos=True)[:32]
    for text in ("First question about the trip." * 3, "Second question about the budget." * 3):
        engine.execute(ExecRequest([SegmentPlan("sys", system), SegmentPlan("q", engine.tokenize(text))],
                                   SamplingParams(max_tokens=1)))
        if not seen:
            monkeypatch.setattr(attention, "sdpa_attention_forward", spy)
    assert seen, "the second call's passes went through the engine's attention"
    cached, new = 32, seen[0][1] - 32
    assert seen[0][0] == cached + new  # the queries padded to the keys' length
    assert all(mask_free and causal for _, _, mask_free, causal in seen)


def test_a_pass_with_fewer_keys_than_queries_is_refused():
    query = torch.zeros(1, 2, 5, 4)
    key = torch.zeros(1, 2, 3, 4)
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="5 queries over 3 keys"):
        attention.causal_attention(module, query, key, key, None)


def test_a_padding_mask_from_the_caller_is_honoured():
    """A model an engine took still serves its owner's padded batches: left padding and causality
    together, in full and sliding-window layers, as HF's SDPA path computes them."""
    for preset in ("tiny-llama", "tiny-gemma3"):
        model = load_model(preset).model
        torch.manual_seed(1)
        ids = torch.randint(3, 250, (2, 24))
        padding = torch.ones(2, 24, dtype=torch.long)
        padding[1, :9] = 0  # the second row is left-padded
        got_want = []
        for implementation in ("sdpa", attention.ATTENTION):
            model.config._attn_implementation = implementation
            with torch.inference_mode():
                got_want.append(model(input_ids=ids, attention_mask=padding).logits)
        got, want = got_want[1], got_want[0]
        assert torch.allclose(got[:, -1], want[:, -1], atol=1e-5), preset  # the rows' last tokens, padding aside
        assert torch.allclose(got[1, 9:], want[1, 9:], atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_grouped_attention_computes_what_hf_sdpa_computes_without_repeating_heads(dtype, monkeypatch):
    """A masked pass over grouped key heads (a decode step's rows, the scattered pass) stacks each
    group's query heads instead of repeating the key and value heads: the same output as HF's SDPA
    path, for additive and bool masks, one mask row per batch row or one for all, one query or many."""
    import transformers.integrations.sdpa_attention as hf_sdpa

    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 7, True
    torch.manual_seed(2)
    # (batch, queries, keys, mask rows, stacked): 70 queries' stacked mask outweighs the repeated heads
    for batch, new, seen, mask_rows, stacked in [(3, 1, 37, 3, True), (1, 5, 40, 1, True), (2, 4, 9, 1, True),
                                                 (1, 70, 80, 1, False)]:
        query = torch.randn(batch, 14, new, 16, dtype=dtype)
        key, value = torch.randn(2, batch, 2, seen, 16, dtype=dtype)
        where = torch.randint(seen - new, seen, (mask_rows, new))  # (rows, T): each query's own position
        allowed = torch.arange(seen)[None, None, :] <= where[:, :, None]  # (rows, T, S)
        additive = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
        for mask in (allowed[:, None], additive[:, None]):
            want, _ = hf_sdpa.sdpa_attention_forward(module, query, key, value, mask, is_causal=False, scaling=0.25)
            with monkeypatch.context() as patched:
                if stacked:
                    patched.setattr(hf_sdpa, "repeat_kv", _refuse_repeated_heads)
                got, _ = attention.masked_attention(module, query, key, value, mask, scaling=0.25)
            assert got.shape == want.shape == (batch, new, 14, 16)
            tolerance = 1e-5 if dtype == torch.float32 else 2e-2
            assert torch.allclose(got.float(), want.float(), atol=tolerance, rtol=tolerance), (batch, new, seen, mask.dtype)


def _refuse_repeated_heads(*_):
    pytest.fail("the key and value heads were repeated")

import pytest
import torch

from agentcache.engine import ExecRequest, SamplingParams, SegmentPlan
from agentcache.engine.rope import RopeAligner, rotate_keys
from agentcache.errors import RopeAlignmentError
from agentcache.models import load_model

from conftest import text_of_length


def _segment_kv_at(engine, filler_words: int, segment_ids: list[int]):
    """Prefill BOS + filler + segment; return the segment's captured KV and its start."""
    lead = engine.tokenize(text_of_length(engine, filler_words, seed=filler_words) + " ", bos=True)
    result = engine.execute(
        ExecRequest([SegmentPlan("lead", lead), SegmentPlan("seg", segment_ids)], SamplingParams(max_tokens=1))
    )
    return result.segments[1].kv


def _check_layer0_alignment(engine, tolerance):
    segment = engine.tokenize("Shared query: plan three days in Lisbon on a small budget.")
    at_p = _segment_kv_at(engine, 3, segment)
    at_q = _segment_kv_at(engine, 40, segment)
    assert at_p.start != at_q.start
    moved = engine.realign(at_p, at_q.start)
    assert moved.start == at_q.start and not moved.exact
    # Layer 0 KV depends on the token and its position only: after re-alignment it is exact.
    err = (moved.keys[0] - at_q.keys[0]).norm() / at_q.keys[0].norm()
    assert err < tolerance, f"layer-0 key re-alignment error {err:.2e}"
    assert torch.equal(moved.values, at_p.values)  # values carry no position
    assert torch.allclose(at_p.values[0], at_q.values[0], atol=1e-5)
    # Without re-alignment the keys really differ: the test can fail.
    raw_err = (at_p.keys[0] - at_q.keys[0]).norm() / at_q.keys[0].norm()
    assert raw_err > 100 * tolerance


def test_layer0_keys_realign_exactly(tiny_engine):
    _check_layer0_alignment(tiny_engine, 1e-5)


@pytest.mark.slow
def test_layer0_keys_realign_exactly_gemma(gemma_engine):
    _check_layer0_alignment(gemma_engine, 1e-5)


def test_tiny_gemma3_has_distinct_local_and_global_frequencies():
    model = load_model("tiny-gemma3").model
    aligner = RopeAligner.from_model(model)
    # layer types: sliding, sliding, full, sliding; the global layer uses base 1e6 with linear scaling 8
    assert torch.equal(aligner.inv_freq[0], aligner.inv_freq[1])
    assert not torch.allclose(aligner.inv_freq[0], aligner.inv_freq[2])
    dim = model.config.head_dim
    expected_global = 1.0 / (1e6 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)) / 8.0
    assert torch.allclose(aligner.inv_freq[2], expected_global, rtol=1e-6)


def test_rotations_compose_and_invert():
    torch.manual_seed(0)
    keys = torch.randn(2, 3, 5, 8)
    inv_freq = torch.rand(2, 4, dtype=torch.float64)
    there = rotate_keys(keys, 1000, inv_freq)
    assert torch.allclose(rotate_keys(rotate_keys(keys, 400, inv_freq), 600, inv_freq), there, atol=1e-5)
    assert torch.allclose(rotate_keys(there, -1000, inv_freq), keys, atol=1e-5)
    assert torch.allclose(there.norm(dim=-1), keys.norm(dim=-1), atol=1e-5)  # a rotation keeps norms


def test_dynamic_rope_is_refused_with_a_clear_error():
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    )
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(RopeAlignmentError, match="dynamic"):
        RopeAligner.from_model(model)


def test_engine_without_exact_rope_refuses_realign_but_still_runs():
    from transformers import AutoModelForCausalLM, LlamaConfig

    from agentcache.engine import EmbeddedEngine
    from agentcache.models import LoadedModel, byte_tokenizer

    config = LlamaConfig(
        vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    )
    engine = EmbeddedEngine(LoadedModel("dyn", AutoModelForCausalLM.from_config(config).eval(), byte_tokenizer(), True))
    assert not engine.supports_realignment
    kv = _segment_kv_at(engine, 2, engine.tokenize("abc"))
    with pytest.raises(RopeAlignmentError, match="dynamic"):
        engine.realign(kv, kv.start + 3)
    assert engine.realign(kv, kv.start) is kv  # not moving needs no rotation


def test_unknown_rotary_layouts_are_refused():
    from transformers import AutoModelForCausalLM, CohereConfig

    config = CohereConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )
    with pytest.raises(RopeAlignmentError, match="cohere"):
        RopeAligner.from_model(AutoModelForCausalLM.from_config(config))


def test_engine_probe_catches_a_layout_that_does_not_realign(monkeypatch):
    """Cohere rotates interleaved pairs: if it slipped past the model-type list, the probe refuses it,
    and an engine over it still runs, without re-alignment."""
    from transformers import AutoModelForCausalLM, CohereConfig

    import agentcache.engine.rope as rope
    from agentcache.engine import EmbeddedEngine
    from agentcache.models import LoadedModel, byte_tokenizer

    monkeypatch.setattr(rope, "REALIGNABLE_MODEL_TYPES", rope.REALIGNABLE_MODEL_TYPES | {"cohere"})
    config = CohereConfig(
        vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    engine = EmbeddedEngine(LoadedModel("cohere", model, byte_tokenizer(), True))
    assert not engine.supports_realignment
    with pytest.raises(RopeAlignmentError, match="cannot be re-aligned exactly"):
        RopeAligner.from_model(model)
    kv = _segment_kv_at(engine, 2, engine.tokenize("abc"))
    with pytest.raises(RopeAlignmentError, match="cannot be re-aligned exactly"):
        engine.realign(kv, kv.start + 1)


@pytest.mark.slow
def test_layer0_keys_realign_exactly_qwen(qwen_engine):
    _check_layer0_alignment(qwen_engine, 1e-5)  # Qwen2: RoPE base 1e6 on every layer, 2 KV heads

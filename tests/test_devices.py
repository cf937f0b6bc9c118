"""Device and dtype: every tensor agentcache makes names its device, and bf16/fp16 engines reuse.

A CPU-only machine cannot run the pipeline on a second device, so `DeviceAudit` flags what would
mix devices on a GPU: a tensor factory called from agentcache's code without `device=`
(`agentcache.device_audit` says why this and not a TorchFunctionMode). conftest.py holds every test
to it; here it is shown to catch the bug an H200 found, and run over every strategy in bf16.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from agentcache import Runtime, RuntimeConfig
from agentcache.correction.strategies import STRATEGIES
from agentcache.device_audit import DeviceAudit
from agentcache.engine import EmbeddedEngine, EngineConfig, ExecRequest, SamplingParams, SegmentPlan
from agentcache.engine.kv import SegmentKV
from agentcache.engine.precision import exactness_tolerance, resolve_dtype
from agentcache.engine.rope import rotate_keys
from agentcache.errors import InputError, KVShapeError, ModelLoadError, RopeAlignmentError
from agentcache.selfcheck import check_model
from agentcache.tasks import FourAgentWorkflow, fact_problem

_engines: dict[tuple[str, str], EmbeddedEngine] = {}


def _engine(preset: str, dtype: str) -> EmbeddedEngine:
    """A fresh engine (empty cache) over weights shared per preset and dtype."""
    if (preset, dtype) not in _engines:
        _engines[preset, dtype] = EmbeddedEngine(preset, EngineConfig(dtype=dtype))
    return _engines[preset, dtype].fresh()


def _workflows(engine, strategy, problems: int, anchors_dir: str | None = None) -> Runtime:
    """A runtime (self-check included) that has run the four-agent workflow on `problems` problems."""
    runtime = Runtime(engine, strategy=strategy, config=RuntimeConfig(learn="after_call"), anchors_dir=anchors_dir)
    workflow = FourAgentWorkflow(role_tokens=6, final_tokens=4)
    for seed in range(problems):
        workflow.run(runtime.run, fact_problem(seed, records=4))
    return runtime


# --- the audit --------------------------------------------------------------------------------


def test_the_audit_catches_the_correction_that_crashed_on_cuda(monkeypatch):
    """The H200 bug, put back: the token-wise weights' distance tensor made on the CPU. The audit
    names the line, and the same workflow with the fixed function is clean."""
    import agentcache.correction.matching as matching

    source = Path(matching.__file__).read_text()
    mutated = source.replace("dtype=source.dtype, device=source.device)", "dtype=source.dtype)")
    assert mutated != source, "the mutation no longer applies: update this test with the code"
    namespace = {"__name__": matching.__name__}
    exec(compile(mutated, matching.__file__, "exec"), namespace)  # its lines keep matching.py's name
    gate_open = STRATEGIES["kvcmas_entropy"].replace(tau=1.0)  # every edge with two anchors is corrected

    with DeviceAudit() as fixed:
        runtime = _workflows(_engine("tiny-llama", "float32"), gate_open, problems=3)
    assert runtime.summary()["ph_decisions"].get("corrected", 0) > 0  # the correction ran
    assert fixed.clean, fixed.report()

    monkeypatch.setattr("agentcache.correction.corrections.interpolation_weights", namespace["interpolation_weights"])
    with DeviceAudit() as broken:
        _workflows(_engine("tiny-llama", "float32"), gate_open, problems=3)
    assert any("correction/matching.py" in where and "interpolation_weights(torch.full)" in where
               for where in broken.violations), broken.report()


def test_the_audit_names_explicit_devices_and_ignores_other_code():
    with DeviceAudit() as audit:
        torch.zeros(3)  # a test's own tensor: not agentcache's code
        namespace: dict = {"torch": torch}
        place = str(Path(__import__("agentcache").__file__).parent / "somewhere.py")
        exec(compile("torch.arange(4, device='cpu'); torch.ones(2)", place, "exec"), namespace)
    assert audit.checked == 2
    assert list(audit.violations) == [f"{place}:1 <module>(torch.ones)"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_every_strategy_runs_device_clean_with_anchors_persisted(dtype):
    """Every registered strategy, its self-check, shadow runs, anchors, selective recomputation, and
    anchors saved and loaded by a second runtime: no tensor made without its device."""
    strategies = list(STRATEGIES.values()) + [STRATEGIES["kvcmas"].replace(name="kvcmas_siblings", siblings=True)]
    with DeviceAudit() as audit:
        for strategy in strategies:
            with tempfile.TemporaryDirectory() as folder:
                first = _workflows(_engine("tiny-gemma3", dtype), strategy, problems=3, anchors_dir=folder)
                first.close()
                second = _workflows(_engine("tiny-gemma3", dtype), strategy, problems=1, anchors_dir=folder)
                assert first.strategy.name == strategy.name, first.refusal  # the self-check passed in this dtype
                assert not first.summary()["faults"] and not second.summary()["faults"]
    assert audit.checked > 100
    assert audit.clean, audit.report()


def test_injected_kv_on_another_device_is_refused_by_name():
    engine = _engine("tiny-llama", "float32")
    ids = engine.tokenize("Shared text", bos=True)
    kv = engine.execute(ExecRequest([SegmentPlan("a", ids, capture=True)], SamplingParams(max_tokens=1))).segments[0].kv
    elsewhere = SegmentKV(kv.keys.to("meta"), kv.values.to("meta"), kv.start)
    with pytest.raises(KVShapeError, match="on meta, the engine's KV is on cpu"):
        elsewhere.check(engine.layout, kv.length, "segment 'a'")


def test_persisted_anchors_load_onto_the_engines_device(tmp_path):
    runtime = _workflows(_engine("tiny-llama", "float32"), "kvcmas_entropy", problems=3, anchors_dir=str(tmp_path))
    runtime.close()
    assert runtime.anchors.device == runtime.engine.layout.device
    again = Runtime(_engine("tiny-llama", "float32"), strategy="kvcmas_entropy", anchors_dir=str(tmp_path))
    anchors = [a for pool in again.corrector.bank.pools.values() for a in pool.anchors.values()]
    assert anchors and all(a.keys.a.device == again.engine.layout.device for a in anchors)


# --- dtypes -------------------------------------------------------------------------------------


def test_dtype_settings_resolve_and_bad_ones_are_named():
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype(None, "cuda") == torch.bfloat16
    assert resolve_dtype("fp16", "cuda") == torch.float16
    assert resolve_dtype(torch.bfloat16, "cpu") == torch.bfloat16
    with pytest.raises(InputError, match="EngineConfig.dtype 'float8' is not a dtype"):
        EngineConfig(dtype="float8")
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="EngineConfig.device 'cuda': this machine has no cuda device"):
            EngineConfig(device="cuda")


def test_exactness_tolerance_follows_the_dtypes_rounding():
    assert exactness_tolerance(torch.float32) == 1e-3
    assert exactness_tolerance(torch.bfloat16) == pytest.approx(2 * 2**-7)
    assert exactness_tolerance(torch.float16) == pytest.approx(2e-3, rel=0.03)


def test_bf16_rotation_is_computed_in_float32_and_rounded_once():
    torch.manual_seed(0)
    exact = torch.randn(2, 2, 64, 16, dtype=torch.float64)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    inv_freq = inv_freq.expand(2, -1).contiguous()
    moved = rotate_keys(exact.to(torch.bfloat16), 1234, inv_freq)
    assert moved.dtype == torch.bfloat16
    truth = rotate_keys(exact, 1234, inv_freq)  # float64 throughout
    error = float((moved.double() - truth).norm() / truth.norm())
    floor = float((exact.to(torch.bfloat16).double() - exact).norm() / exact.norm())  # one rounding of the input
    assert error < 2.5 * floor  # the input's rounding and the output's, nothing more


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-gemma3"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_engines_pass_the_self_check(preset, dtype):
    engine = _engine(preset, dtype)
    assert engine.layout.dtype == getattr(torch, dtype)
    assert engine.supports_realignment
    report = check_model(engine)
    assert report.passed, report.reason
    # its own rounding, far below the bar, and far above what float32 gets
    assert 1e-5 < report.rope_error < exactness_tolerance(engine.layout.dtype) / 2


def test_a_wrong_rotary_layout_is_still_refused_in_bf16(monkeypatch):
    """Cohere rotates interleaved pairs: even with bf16's looser bar its keys do not re-align."""
    from transformers import AutoModelForCausalLM, CohereConfig

    import agentcache.engine.rope as rope
    from agentcache.models import LoadedModel, byte_tokenizer

    monkeypatch.setattr(rope, "REALIGNABLE_MODEL_TYPES", rope.REALIGNABLE_MODEL_TYPES | {"cohere"})
    config = CohereConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config).eval()
    engine = EmbeddedEngine(LoadedModel("cohere", model, byte_tokenizer(), True), EngineConfig(dtype="bfloat16"))
    assert engine.layout.dtype == torch.bfloat16 and not engine.supports_realignment
    with pytest.raises(RopeAlignmentError, match=r"bfloat16 allows 1\.6e-02"):
        rope.RopeAligner.from_model(engine.model)
    assert next(model.parameters()).dtype == torch.bfloat16  # converted in place, as Module.to does


def test_engines_share_weights_only_in_their_dtype():
    engine = _engine("tiny-llama", "bfloat16")
    assert engine.with_config(EngineConfig(pool_blocks=8)).layout.dtype == torch.bfloat16  # auto keeps it
    with pytest.raises(ValueError, match="in bfloat16; build a new EmbeddedEngine for dtype 'float32'"):
        engine.with_config(EngineConfig(dtype="float32"))
    # a model that serves an engine is not converted under it
    with pytest.raises(InputError, match="already serves an engine in bfloat16; converting it to float32"):
        EmbeddedEngine(engine.loaded, EngineConfig(dtype="float32"))
    assert EmbeddedEngine(engine.loaded).layout.dtype == torch.bfloat16  # auto: the model's own dtype


def test_bf16_kvcmas_reuses_and_answers_like_bf16_nonshared():
    """A bf16 engine reuses (the self-check passes, KVCMAS serves shared segments from reuse) and
    its greedy outputs stay those of NonShared in bf16."""
    problems = [fact_problem(seed, records=4) for seed in range(4)]
    workflow = FourAgentWorkflow(role_tokens=6, final_tokens=4)
    kvcmas = Runtime(_engine("tiny-gemma3", "bfloat16"), strategy="kvcmas", config=RuntimeConfig(learn="after_call"))
    dense = Runtime(_engine("tiny-gemma3", "bfloat16"), strategy="nonshared")
    assert kvcmas.strategy.name == "kvcmas", kvcmas.refusal
    same = []
    for problem in problems:
        got, want = workflow.run(kvcmas.run, problem), workflow.run(dense.run, problem)
        same += [a.token_ids == b.token_ids for a, b in zip(got, want)]
    assert kvcmas.summary()["reuse_ratio"] > 0
    assert sum(same) / len(same) >= 0.9


@pytest.mark.slow
def test_gemma_in_bf16_passes_the_self_check_and_fp16_is_refused_by_name():
    bf16 = EmbeddedEngine("gemma3-270m", EngineConfig(dtype="bfloat16", pool_blocks=256))
    report = check_model(bf16)
    assert report.passed, report.reason
    assert report.rope_error < exactness_tolerance(torch.bfloat16)
    with pytest.raises(ModelLoadError, match="NaN or Inf in torch.float16.*bfloat16 or float32"):
        EmbeddedEngine("gemma3-270m", EngineConfig(dtype="float16", pool_blocks=16))


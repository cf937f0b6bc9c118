"""Converting a real model once: a GGUF dequantized into a safetensors directory under the cache.

The converted directory appears whole or not at all: it is built in a scratch directory beside
the target and renamed into place under a file lock, so concurrent processes convert it once.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

__all__ = ["cache_root", "is_converted", "convert_once", "steps", "dequantize_gguf", "save_converted"]


def cache_root() -> Path:
    """Where converted models live: $AGENTCACHE_HOME, else $XDG_CACHE_HOME/agentcache, else ~/.cache/agentcache."""
    if home := os.environ.get("AGENTCACHE_HOME"):
        return Path(home)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "agentcache"


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def is_converted(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("model*.safetensors"))


def convert_once(dir_name: str, convert: Callable[[Path], Path]) -> Path:
    """The converted model `dir_name` under cache_root()/models, made by `convert` when missing.

    `convert(work)` builds the model in `work`, a scratch directory beside the target, and returns
    the directory to rename into place: an interrupted run never leaves a broken model, and the
    scratch (downloads, the GGUF) is deleted whatever happens.
    """
    target = cache_root() / "models" / dir_name
    if is_converted(target):
        return target
    with _file_lock(target.parent / f".{dir_name}.lock"):
        if is_converted(target):  # another process converted it while we waited
            return target
        work = Path(tempfile.mkdtemp(prefix=f".{dir_name}-", dir=target.parent))
        try:
            out = convert(work)
            if target.exists():
                shutil.rmtree(target)
            os.replace(out, target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target


@contextmanager
def steps(desc: str, total: int, progress: bool) -> Iterator[Callable[[str], None]]:
    """A progress bar over `total` named steps; each call of the yielded function starts the next."""
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=desc, disable=not progress, unit="step")
    started = False

    def step(name: str) -> None:
        nonlocal started
        if started:
            bar.update(1)
        started = True
        bar.set_postfix_str(name)

    try:
        yield step
        bar.update(1)
    finally:
        bar.close()


def dequantize_gguf(gguf_path: Path, step: Callable[[str], None]) -> tuple[Any, Any]:
    """The model (float32) and tokenizer that transformers reads from a GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    step("tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    step("dequantize weights")
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    # The weights are dequantized to float32 already; drop the GGUF quantizer marker, which
    # otherwise makes save_pretrained refuse a "quantized" model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


def save_converted(model: Any, tokenizer: Any, out: Path, source: str) -> Path:
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "AGENTCACHE_SOURCE.txt").write_text(source)
    return out

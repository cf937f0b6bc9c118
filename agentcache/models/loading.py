"""Loading a model: a preset by name (random weights built, a real model from its converted
directory) or a local Hugging Face model directory by path."""

from __future__ import annotations

import hashlib
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from agentcache.errors import ModelLoadError
from agentcache.models.convert import convert_once, save_converted
from agentcache.models.presets import DEFAULT_MODEL, PRESETS, Preset

__all__ = ["LoadedModel", "load_model", "model_directory"]


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


def _build_random(name: str, preset: Preset, seed: int, dtype: torch.dtype,
                  device: torch.device | str = "cpu") -> LoadedModel:
    from transformers import AutoModelForCausalLM

    config = preset.make_config()
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), device:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    return LoadedModel(name=name, model=model, tokenizer=preset.make_tokenizer(), requires_bos=preset.requires_bos)


def _real_model_directory(name: str, preset: Preset, progress: bool) -> Path:
    if preset.fetch_on_load:
        return preset.fetch(None, progress)
    if not preset.ready:
        raise ModelLoadError(
            f"model '{name}' is not fetched yet (no converted model in {preset.directory}); "
            f"run `agentcache models fetch {name}` once, which downloads and converts it"
        )
    return preset.directory


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


def model_directory(spec: str | os.PathLike[str] = DEFAULT_MODEL, *, seed: int = 0, progress: bool = True) -> Path:
    """The HF model directory that holds `spec`'s weights, for an engine that loads from disk (vLLM).

    A random-weight preset is written there once (the same weights `load_model(spec, seed=seed)`
    builds); a real preset is its converted directory; a path is itself.
    """
    name = str(spec)
    preset = PRESETS.get(name)
    if preset is not None and preset.make_config is not None:
        def save(work: Path) -> Path:
            loaded = _build_random(name, preset, seed, torch.float32)
            return save_converted(loaded.model, loaded.tokenizer, work / "model",
                                  f"random weights of the agentcache preset {name}, seed {seed}\n")

        # the config's digest in the name: a preset whose config changes gets a new directory
        template = preset.make_tokenizer().chat_template or ""  # and its chat template: a new one, a new directory
        digest = hashlib.sha256((preset.make_config().to_json_string() + template).encode()).hexdigest()[:10]
        return convert_once(f"random-{name}-seed{seed}-{digest}", save)
    if preset is not None:
        return _real_model_directory(name, preset, progress)
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"unknown model '{name}': not a preset ({', '.join(PRESETS)}) and not a directory with a config.json"
        )
    return path.resolve()


def load_model(
    spec: str | os.PathLike[str] = DEFAULT_MODEL,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    progress: bool = True,
    device: torch.device | str = "cpu",
) -> LoadedModel:
    """Load a preset by name or a local HF model directory by path. A random-weight preset is built
    on `device` (its weights then differ from the CPU's: each device has its own generator); a real
    model is loaded on the CPU, and the engine moves it."""
    name = str(spec)
    preset = PRESETS.get(name)
    if preset is not None and preset.make_config is not None:
        return _build_random(name, preset, seed, dtype, device)
    if preset is not None:
        return _load_directory(name, _real_model_directory(name, preset, progress), dtype, preset.requires_bos)
    path = Path(name).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"unknown model '{name}': not a preset ({', '.join(PRESETS)}) and no such directory"
        )
    return _load_directory(path.name, path, dtype, None)

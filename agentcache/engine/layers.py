"""Running part of a model's decoder stack, and reading the hidden states entering one layer.

Selective recomputation needs two things HF's forward does not offer: a pass through only some
decoder layers (CacheBlend's probe runs layers 0..1 for every shared token; DroidSpeak runs its
recomputed layer group), starting from hidden states given for the first of them (DroidSpeak's
"E cache"), and the hidden states that entered a layer during an ordinary pass (the E cache a
source call leaves for later consumers).

`LayerControl` wraps each decoder layer's `forward` once per model. The wrapper reads a
thread-local setting, so a pass on one thread never changes a pass on another (engines over the
same weights run on their own loop threads): with nothing set it calls the layer as it is.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["LayerControl", "decoder_layers"]


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layer stack of an HF causal LM (`model.model.layers` for the families we run)."""
    inner = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise TypeError(f"{type(model).__name__} has no decoder layer stack this engine can run in parts")
    return layers


@dataclass
class _Setting:
    first: int = 0  # layers first..last run; the others pass their input through untouched
    last: int | None = None
    hidden: torch.Tensor | None = None  # (B, T, hidden): replaces the input of layer `first`
    capture: int | None = None  # record the input of this layer
    captured: list[torch.Tensor] = field(default_factory=list)


class LayerControl:
    """Thread-local control over which decoder layers a forward pass runs."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.layers = decoder_layers(model)
        self._local = threading.local()
        for index, layer in enumerate(self.layers):
            layer.forward = self._wrapped(index, layer.forward)

    @classmethod
    def of(cls, model: torch.nn.Module) -> LayerControl:
        """The model's control, installed on first use (engines sharing weights share it)."""
        control = getattr(model, "_agentcache_layer_control", None)
        if control is None:
            control = cls(model)
            model._agentcache_layer_control = control
        return control

    @staticmethod
    def installed(model: torch.nn.Module) -> bool:
        """Whether an engine has taken this model (installed its control)."""
        return getattr(model, "_agentcache_layer_control", None) is not None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def _wrapped(self, index: int, forward: Any) -> Any:
        def run(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            setting: _Setting | None = getattr(self._local, "setting", None)
            if setting is None:
                return forward(hidden_states, *args, **kwargs)
            if index == setting.first and setting.hidden is not None:
                hidden_states = setting.hidden.to(hidden_states.dtype)
            if index == setting.capture:
                setting.captured.append(hidden_states.detach().clone())
            if index < setting.first or (setting.last is not None and index > setting.last):
                return hidden_states  # not run: its KV stays what the cache holds
            return forward(hidden_states, *args, **kwargs)

        return run

    @contextmanager
    def running(self, first: int = 0, last: int | None = None, hidden: torch.Tensor | None = None,
                capture: int | None = None) -> Iterator[_Setting]:
        """During the block, passes on this thread run layers first..last only (all by default),
        layer `first` taking `hidden` (B, T, hidden size) as its input when given; the input of layer
        `capture`, if any, is appended to the yielded setting's `captured`."""
        n = self.num_layers
        last_layer = n - 1 if last is None else last
        if not 0 <= first <= last_layer < n:
            raise ValueError(f"layer range {first}..{last_layer} is not within the model's {n} layers")
        if capture is not None and not 0 <= capture < n:
            raise ValueError(f"cannot capture the input of layer {capture}: the model has {n} layers")
        if getattr(self._local, "setting", None) is not None:
            raise RuntimeError("layer ranges do not nest")
        setting = _Setting(first, last, hidden, capture)
        self._local.setting = setting
        try:
            yield setting
        finally:
            self._local.setting = None

"""Selective recomputation (CacheBlend, DroidSpeak): what a reused segment rebuilds.

Both reuse the aligned source cache of a shared segment and rebuild a fixed share 1 − ρ of it
under the consumer's own context, through the engine's `recompute` step:

- CacheBlend (token-wise, Yao et al. 2025) rebuilds the tokens whose KV deviates most at an early
  layer: `token_plan`.
- DroidSpeak (layer-wise, Liu et al.) rebuilds a contiguous group of layers for every token,
  starting from the hidden states that entered the group's first layer when the source computed
  the segment (its "E cache"). The group is the one whose KV deviates most, found by profiling:
  `LayerProfile` averages the per-layer deviation of the first dense transitions, then fixes it.
"""

from __future__ import annotations

import torch

from agentcache.engine.kv import SegmentKV
from agentcache.engine.protocol import LayerRecompute, TokenRecompute

__all__ = ["LayerProfile", "layer_count", "token_plan"]


def token_plan(rho: float, probe_layer: int) -> TokenRecompute:
    """CacheBlend's step: rebuild 1 − ρ of the tokens, picked at `probe_layer`."""
    return TokenRecompute(1.0 - rho, probe_layer)


def layer_count(rho: float, num_layers: int) -> int:
    """Layers DroidSpeak rebuilds to reuse the share ρ of a segment's KV (whole layers, nearest)."""
    return min(num_layers, max(0, round((1.0 - rho) * num_layers)))


class LayerProfile:
    """Per-layer KV deviation of reused sources against dense targets, over the first transitions."""

    def __init__(self, num_layers: int, needed: int) -> None:
        self.num_layers = num_layers
        self.needed = needed
        self.observed = 0
        self.deviation = torch.zeros(num_layers, dtype=torch.float64)  # summed relative error per layer

    @property
    def ready(self) -> bool:
        return self.observed >= self.needed

    def observe(self, aligned: SegmentKV, dense: SegmentKV) -> None:
        """One transition: the source re-aligned to canonical positions and the dense target there."""
        for part in ("keys", "values"):
            got, want = getattr(aligned, part).double(), getattr(dense, part).double()  # (L, H, T, D)
            error = (got - want).flatten(1).norm(dim=1) / want.flatten(1).norm(dim=1).clamp_min(1e-30)  # (L,)
            self.deviation += error / 2
        self.observed += 1

    def group(self, count: int) -> tuple[int, int]:
        """The `count` consecutive layers with the largest summed deviation: (first, last)."""
        if not 1 <= count <= self.num_layers:
            raise ValueError(f"a layer group needs 1..{self.num_layers} layers, got {count}")
        sums = self.deviation.unfold(0, count, 1).sum(-1)  # (L - count + 1,)
        first = int(sums.argmax())
        return first, first + count - 1

    def recompute(self, rho: float, hidden: torch.Tensor) -> LayerRecompute | None:
        """DroidSpeak's step for a segment whose source left `hidden` (T, hidden size) at the group's
        first layer; None when ρ leaves no layer to rebuild."""
        count = layer_count(rho, self.num_layers)
        if count == 0:
            return None
        first, last = self.group(count)
        return LayerRecompute(first, last, hidden)

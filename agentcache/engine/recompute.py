"""Selective recomputation inside the embedded engine's prefill: what to recompute, and in what order.

An injected segment may carry a `TokenRecompute` (CacheBlend) or a `LayerRecompute` (DroidSpeak).
The scheduler places every injected segment's KV first, as for plain reuse, and then:

- CacheBlend: one probe over every position after the placed KV runs layers 0..probe (exact there),
  `pick_deviating` ranks each blended segment's tokens by how far the probed KV at the probe layer
  is from the injected KV, and the picked tokens join the dense tokens of the main scattered pass.
- DroidSpeak: each layered segment runs its layer group from the source's hidden states. Its
  tokens attend to whatever precedes them, so the dense tokens before it are computed first:
  `stages` cuts the dense positions at every layered segment. Leading tokens the source has no
  hidden states for (its prefix-cache hit) are prefilled instead.

`HiddenRecord` keeps the hidden states entering one layer, per position, for a request that asks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentcache.engine.kv import CallCache, SegmentKV
from agentcache.engine.protocol import LayerRecompute, TokenRecompute

__all__ = ["Blend", "HiddenRecord", "Layered", "chunks", "known_from", "pick_deviating", "stages"]


@dataclass(frozen=True)
class Blend:
    """A CacheBlend segment: the injected positions and the KV injected there."""

    segment: int  # index in the request
    positions: list[int]
    kv: SegmentKV  # (L, H, T, D) as placed
    spec: TokenRecompute


@dataclass(frozen=True)
class Layered:
    """A DroidSpeak segment: its injected positions and the hidden states entering its first layer."""

    segment: int
    positions: list[int]
    hidden: torch.Tensor  # (T, hidden size)
    spec: LayerRecompute

    @property
    def layers(self) -> int:
        return self.spec.last - self.spec.first + 1


def pick_deviating(cache: CallCache, blend: Blend, layer: int) -> list[int]:
    """The `fraction` of the segment's positions whose KV at `layer`, as the probe recomputed it in
    `cache`, is furthest (squared L2 over heads and channels, K plus V) from the injected KV.
    Ascending positions."""
    count = round(blend.spec.fraction * len(blend.positions))
    if count == 0:
        return []
    where = torch.tensor(blend.positions, dtype=torch.long, device=cache.key_buffer.device)  # (T,)
    keys, values = cache.key_buffer[layer, 0][:, where], cache.value_buffer[layer, 0][:, where]  # (H, T, D)
    deviation = ((keys.float() - blend.kv.keys[layer].float()).pow(2).sum((0, 2))
                 + (values.float() - blend.kv.values[layer].float()).pow(2).sum((0, 2)))  # (T,)
    top = deviation.topk(count).indices
    return sorted(where[top].tolist())


def stages(dense: list[int], layered: list[Layered]) -> list[list[int] | Layered]:
    """The order of the passes after the placed KV: dense positions (ascending) up to each layered
    segment, that segment, and so on; the dense positions after the last one close it."""
    out: list[list[int] | Layered] = []
    rest = dense
    for segment in sorted(layered, key=lambda s: s.positions[0]):
        begin = segment.positions[0]
        before = [p for p in rest if p < begin]
        rest = [p for p in rest if p >= begin]
        if before:
            out.append(before)
        out.append(segment)
    if rest:
        out.append(rest)
    return out


def chunks(positions: list[int], size: int) -> list[list[int]]:
    return [positions[i : i + size] for i in range(0, len(positions), size)]


class HiddenRecord:
    """The hidden states entering one decoder layer, per position of a request (prompt and output)."""

    def __init__(self, layer: int, capacity: int, width: int, device: torch.device | str) -> None:
        self.layer = layer
        # float32 on purpose: exact for every hidden state of a bf16 or fp16 model, fed back as its dtype
        self.rows = torch.zeros((capacity, width), dtype=torch.float32, device=device)  # (C, hidden size)
        self.known = torch.zeros(capacity, dtype=torch.bool, device=device)

    def put(self, positions: list[int], hidden: torch.Tensor) -> None:
        """`hidden` (T, hidden size) entered the layer at `positions`."""
        where = torch.tensor(positions, dtype=torch.long, device=self.rows.device)  # (T,)
        self.rows[where] = hidden.float().to(self.rows.device)
        self.known[where] = True

    def get(self, begin: int, end: int) -> torch.Tensor | None:
        """A copy of positions [begin, end), NaN where unknown (served from the prefix cache, which
        keeps no hidden states); None when none is known."""
        if end <= begin or not bool(self.known[begin:end].any()):
            return None
        rows = self.rows[begin:end].clone()
        rows[~self.known[begin:end]] = float("nan")
        return rows


def known_from(hidden: torch.Tensor) -> int:
    """How many leading rows of `hidden` (T, hidden size) are unknown (NaN)."""
    known = torch.isfinite(hidden).all(-1)  # (T,)
    return int(known.float().argmax()) if bool(known.any()) else hidden.shape[0]

"""Additive attention masks for queries at arbitrary positions over a cache of `end` keys."""

from __future__ import annotations

import torch

__all__ = ["position_masks"]


def position_masks(
    queries: torch.Tensor, end: int, dtype: torch.dtype, layer_types: list[str] | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """Masks (B, 1, T, end) for queries at positions `queries` (B, T): each sees the keys at or below
    its own position, and in a sliding-window layer only the last `sliding_window` of them. A model
    that mixes layer types gets one mask per type (the dict HF models take)."""
    keys = torch.arange(end, device=queries.device)[None, None, :]  # (1, 1, end)
    position = queries[:, :, None]  # (B, T, 1)
    zero = torch.zeros((), dtype=dtype, device=queries.device)
    blocked = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=queries.device)  # a fill, no host copy
    causal = keys <= position  # (B, T, end)
    if not layer_types:
        return torch.where(causal, zero, blocked)[:, None]
    masks = {}
    for kind in set(layer_types):
        allowed = causal
        if kind == "sliding_attention" and sliding_window:
            allowed = causal & (keys > position - sliding_window)  # HF's window: q - k < window
        masks[kind] = torch.where(allowed, zero, blocked)[:, None]
    return masks

"""Next-token choice (greedy, temperature, top-p) and stop-string detection."""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["choose_token", "find_stop"]


def choose_token(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> int:
    """Pick the next token from logits (V,)."""
    if temperature == 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # (V,)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        keep = cumulative - sorted_probs < top_p  # always keeps the most likely token
        sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
        choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))


def find_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index in `text` where the earliest stop string begins, or None."""
    found = [i for i in (text.find(stop) for stop in stops) if i != -1]
    return min(found, default=None)

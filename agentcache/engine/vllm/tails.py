"""Exact KV of the partial block before a call's first injected segment, kept between calls.

vLLM's prefix cache holds only full blocks, so an agent's system prompt that does not end on a
block boundary leaves a partial block that no later call hits; with an injected segment right
after it, every call would need a prefill-only phase just to compute those few tokens again.
The first phase reads that block's KV back anyway (`core.py`); kept here under the request's
cache salt and the exact tokens before it, the next call of the same agent claims it through the
connector together with its injected segment, and runs in one request fewer.

Only KV computed over exact context is kept (never after an approximate token), and only a call
under the same salt (view and tenant) with the same tokens up to the tail's end is served it:
the same rule as vLLM's own exact blocks. The store is bounded in bytes, least recently used out.
"""

from __future__ import annotations

import torch

from agentcache.engine.budget import BudgetedLRU

__all__ = ["ExactTails"]


def _nbytes(keys: torch.Tensor, values: torch.Tensor) -> int:
    return keys.numel() * keys.element_size() + values.numel() * values.element_size()


class ExactTails:
    """Keyed by (cache salt, `prefix_digests` digest of the prompt up to the tail's end)."""

    def __init__(self, capacity_bytes: int) -> None:
        self.hits = 0
        self._tails: BudgetedLRU[tuple[str, bytes], tuple[torch.Tensor, torch.Tensor]] = BudgetedLRU(capacity_bytes)

    @property
    def capacity_bytes(self) -> int:
        return self._tails.byte_budget

    @property
    def bytes(self) -> int:
        return self._tails.nbytes

    def put(self, key: tuple[str, bytes], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keep a tail's KV, (L, H, T, D) each."""
        size = _nbytes(keys, values)
        if not self._tails.fits(size):
            return
        if key in self._tails:  # the same tokens under the same salt: the same KV
            self._tails.touch(key)
            return
        self._tails.put(key, (keys, values), size)

    def get(self, key: tuple[str, bytes], length: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The kept KV under `key`, if it covers `length` tokens."""
        found = self._tails.get(key)
        if found is None or found[0].shape[2] != length:
            return None
        self._tails.touch(key)
        self.hits += 1
        return found

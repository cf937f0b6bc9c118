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

from collections import OrderedDict

import torch

__all__ = ["ExactTails"]


def _nbytes(keys: torch.Tensor, values: torch.Tensor) -> int:
    return keys.numel() * keys.element_size() + values.numel() * values.element_size()


class ExactTails:
    """Keyed by (cache salt, `prefix_digests` digest of the prompt up to the tail's end)."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.bytes = 0
        self.hits = 0
        self._tails: OrderedDict[tuple[str, bytes], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()

    def put(self, key: tuple[str, bytes], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keep a tail's KV, (L, H, T, D) each."""
        size = _nbytes(keys, values)
        if size > self.capacity_bytes:
            return
        if key in self._tails:
            self._tails.move_to_end(key)
            return
        self._tails[key] = (keys, values)
        self.bytes += size
        while self.bytes > self.capacity_bytes:
            _, old = self._tails.popitem(last=False)
            self.bytes -= _nbytes(*old)

    def get(self, key: tuple[str, bytes], length: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The kept KV under `key`, if it covers `length` tokens."""
        found = self._tails.get(key)
        if found is None or found[0].shape[2] != length:
            return None
        self._tails.move_to_end(key)
        self.hits += 1
        return found

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

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import torch

__all__ = ["ExactTails"]


class ExactTails:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.bytes = 0
        self.hits = 0
        self._tails: OrderedDict[bytes, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()

    @staticmethod
    def _key(salt: str, tokens: Sequence[int]) -> bytes:
        digest = hashlib.blake2b(salt.encode() + b"\0", digest_size=16)
        digest.update(torch.tensor(list(tokens), dtype=torch.int64).numpy().tobytes())
        return digest.digest()

    def put(self, salt: str, prompt: Sequence[int], begin: int, end: int,
            keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keep the KV of positions [begin, end) of `prompt`, (L, H, end - begin, D) each."""
        size = keys.numel() * keys.element_size() + values.numel() * values.element_size()
        if size > self.capacity_bytes or keys.shape[2] != end - begin:
            return
        key = self._key(salt, prompt[:end])
        if key in self._tails:
            self._tails.move_to_end(key)
            return
        self._tails[key] = (keys, values)
        self.bytes += size
        while self.bytes > self.capacity_bytes:
            _, (old_k, old_v) = self._tails.popitem(last=False)
            self.bytes -= old_k.numel() * old_k.element_size() + old_v.numel() * old_v.element_size()

    def get(self, salt: str, prompt: Sequence[int], begin: int, end: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The kept KV of [begin, end) of `prompt`, if its exact tokens before `end` were seen."""
        key = self._key(salt, prompt[:end])
        found = self._tails.get(key)
        if found is None or found[0].shape[2] != end - begin:
            return None
        self._tails.move_to_end(key)
        self.hits += 1
        return found

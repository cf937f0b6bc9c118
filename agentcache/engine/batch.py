"""Decode rows: the KV of every request a batching engine is decoding, packed for one forward pass.

A request prefills in a call cache of its own; when its first token is out it joins the decode
rows, a shared buffer (L, R, H, T, D) whose rows 0..n-1 are the n decoding requests, and its
call cache is rebound to its row. Each decode step is one forward over rows 0..n-1: row b's
query sits at its own position, and the additive mask hides every key past it (and, in a
sliding-window layer, before its window). When a request leaves, the last row moves into its
place, so the rows stay packed. The buffer doubles its token capacity when a request needs more.

Masked keys must still be finite (0 * NaN poisons attention): each row tracks how far it has
been written or zeroed, and a step zeroes what it would read beyond that.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from agentcache.engine.kv import CallCache, KVLayout
from agentcache.errors import CapacityError

__all__ = ["DecodeRows", "StepCache"]


class DecodeRows:
    """Rows of the shared decode buffer, one per decoding request, packed from row 0."""

    def __init__(self, layout: KVLayout, rows: int, device: torch.device) -> None:
        if rows < 1:
            raise CapacityError(f"a batch needs at least one decode row, got {rows}")
        self.layout, self.rows, self.device = layout, rows, device
        self.tokens = 0  # positions each row holds
        self.keys: torch.Tensor | None = None  # (L, R, H, T, D)
        self.values: torch.Tensor | None = None
        self.members: list[CallCache] = []  # row i holds members[i]
        self.clean = [0] * rows  # row i: positions [0, clean[i]) hold finite numbers

    def __len__(self) -> int:
        return len(self.members)

    @property
    def full(self) -> bool:
        return len(self.members) >= self.rows

    def join(self, cache: CallCache) -> None:
        """Move a prefilled call cache into the next free row (its KV is copied there)."""
        if self.full:
            raise CapacityError(f"all {self.rows} decode rows are taken")
        self._ensure(cache.capacity)
        row = len(self.members)
        n = cache.length
        self.keys[:, row, :, :n] = cache.key_buffer[:, 0, :, :n]  # (L, H, n, D)
        self.values[:, row, :, :n] = cache.value_buffer[:, 0, :, :n]
        self.clean[row] = max(self.clean[row], n)
        self.members.append(cache)
        cache.rebind(*self._row(row))

    def leave(self, cache: CallCache) -> None:
        """Free a request's row once its KV is taken (the cache is not used again); the last row moves in."""
        row = next(i for i, member in enumerate(self.members) if member is cache)
        last = len(self.members) - 1
        if row != last:
            moved = self.members[last]
            m = moved.length
            self.keys[:, row, :, :m] = self.keys[:, last, :, :m]
            self.values[:, row, :, :m] = self.values[:, last, :, :m]
            self.clean[row] = max(self.clean[row], m)
            self.members[row] = moved
            moved.rebind(*self._row(row))
        self.members.pop()

    @property
    def positions(self) -> list[int]:
        """Where each member's next token goes, in row order."""
        return [member.length for member in self.members]

    def prepare(self, rows: int, end: int) -> None:
        """Make rows 0..rows-1 finite up to `end`: a step reads them all, masked or not."""
        for row in range(rows):
            if self.clean[row] < end:
                self.keys[:, row, :, self.clean[row] : end] = 0
                self.values[:, row, :, self.clean[row] : end] = 0
                self.clean[row] = end

    def advance(self) -> None:
        """After a step: every member holds one more token."""
        for row, member in enumerate(self.members):
            member.advance(1, views=False)
            self.clean[row] = max(self.clean[row], member.length)

    def _row(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[:, row : row + 1], self.values[:, row : row + 1]  # (L, 1, H, T, D) views

    def _ensure(self, tokens: int) -> None:
        """Room for `tokens` positions per row: grow (doubling) and carry the members' KV over."""
        if tokens <= self.tokens:
            return
        size = max(tokens, 2 * self.tokens, 256)
        lay = self.layout
        shape = (lay.num_layers, self.rows, lay.num_kv_heads, size, lay.head_dim)
        keys = torch.empty(shape, dtype=lay.dtype, device=self.device)
        values = torch.empty(shape, dtype=lay.dtype, device=self.device)
        if self.keys is not None:
            for row in range(self.rows):
                written = min(self.clean[row], self.tokens)
                keys[:, row, :, :written] = self.keys[:, row, :, :written]
                values[:, row, :, :written] = self.values[:, row, :, :written]
        self.keys, self.values, self.tokens = keys, values, size
        for row, member in enumerate(self.members):
            member.rebind(*self._row(row))


class _StepLayer(DynamicLayer):
    """One layer of a decode step: writes each row's new token at that row's position."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                 end: int) -> None:
        super().__init__()
        self._keys, self._values = keys, values  # (R, H, T, D)
        self._rows = rows  # (n,): 0..n-1
        self._positions = positions  # (n,)
        self._end = end
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        # key_states: (n, H, 1, D), one new token per row
        n = self._rows.shape[0]
        self._keys[self._rows, :, self._positions] = key_states[:, :, 0]  # (n, H, D)
        self._values[self._rows, :, self._positions] = value_states[:, :, 0]
        return self._keys[:n, :, : self._end], self._values[:n, :, : self._end]  # (n, H, end, D)

    def get_seq_length(self) -> int:
        return self._end


class StepCache(Cache):
    """The HF cache of one batched decode step over rows 0..n-1 of the decode rows: row b's new token
    goes to `positions[b]`, and the step reads keys 0..end-1 of every row. Made of tensor operations
    only (no host reads), so a step can be captured in a CUDA graph."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, end: int) -> None:
        self.positions = positions  # (n,)
        rows = torch.arange(positions.shape[0], device=positions.device)  # (n,)
        layers = [_StepLayer(keys[i], values[i], rows, positions, end) for i in range(keys.shape[0])]
        super().__init__(layers=layers)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[0]._end

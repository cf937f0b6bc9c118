"""The block pool's tensors: one storage row of keys and one of values per block id.

The pool (`blocks.BlockPool`) decides which id holds which tokens; this holds their KV, in the
layout's dtype on the pool's device. torch.empty maps pages lazily: untouched capacity costs no
resident memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from agentcache.engine.kv import KVLayout

__all__ = ["BlockStorage"]


class BlockStorage:
    def __init__(self, capacity: int, block_size: int, layout: KVLayout, device: torch.device | str) -> None:
        self.block_size = block_size
        shape = (capacity, layout.num_layers, layout.num_kv_heads, block_size, layout.head_dim)
        self.keys = torch.empty(shape, dtype=layout.dtype, device=device)  # (N, L, H, B, D)
        self.values = torch.empty(shape, dtype=layout.dtype, device=device)

    def gather(self, block_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The KV of a chain of blocks, keys and values (L, H, n·B, D) each."""
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.keys.device)  # (n,)
        out = []
        for storage in (self.keys, self.values):
            rows = storage.index_select(0, ids)  # (n, L, H, B, D)
            n, layers, heads, bs, dim = rows.shape
            out.append(rows.permute(1, 2, 0, 3, 4).reshape(layers, heads, n * bs, dim))  # (L, H, n·B, D)
        return out[0], out[1]

    def write(self, block_id: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """One block's KV, (L, H, B, D) each, into its row."""
        self.keys[block_id] = keys
        self.values[block_id] = values

    def write_run(self, first: int, block_ids: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Blocks first.. of a run's KV (L, H, n·B, D) into rows `block_ids`: one copy for K, one for V."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.keys.device)  # (m,)
        begin, end = first * self.block_size, (first + len(block_ids)) * self.block_size
        for source, storage in ((keys, self.keys), (values, self.values)):
            layers, heads, _, dim = source.shape
            blocks = source[:, :, begin:end].reshape(layers, heads, len(block_ids), self.block_size, dim)  # (L, H, m, B, D)
            storage.index_copy_(0, ids, blocks.permute(2, 0, 1, 3, 4))  # rows (m, L, H, B, D)

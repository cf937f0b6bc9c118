"""The forward passes of the embedded engine over an HF causal LM: contiguous prefill, the
scattered pass that computes the glue between injected segments, and one batched decode step.
Logits are kept for the last position only."""

from __future__ import annotations

from typing import Sequence

import torch

from agentcache.engine.batch import DecodeRows, StepCache
from agentcache.engine.kv import CallCache, KVLayout
from agentcache.engine.masks import position_masks

__all__ = ["ModelRunner"]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, layout: KVLayout) -> None:
        self.model = model
        self.layout = layout
        config = getattr(model.config, "get_text_config", lambda: model.config)()
        self._layer_types = getattr(config, "layer_types", None) or None
        self._window = getattr(config, "sliding_window", None)

    def masks(self, queries: torch.Tensor, end: int) -> torch.Tensor | dict[str, torch.Tensor]:
        """Attention masks for queries at positions `queries` (B, T) over `end` keys."""
        return position_masks(queries, end, self.layout.dtype, self._layer_types, self._window)

    def forward(self, cache: CallCache, token_ids: Sequence[int], start: int) -> torch.Tensor:
        """Tokens placed at start.. (the cache's length) in one pass; returns the last logits (V,)."""
        device = cache.key_buffer.device
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=device)  # (1, T)
        positions = torch.arange(start, start + len(token_ids), device=device)[None]  # (1, T)
        out = self.model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache.advance(len(token_ids))
        return out.logits[0, -1].float()

    def forward_scattered(self, cache: CallCache, token_ids: list[int], positions: list[int], end: int) -> torch.Tensor:
        """Tokens at `positions` (ascending, below `end`) over a cache that holds everything else
        below `end`: each attends to every lower position, injected or computed."""
        device = cache.key_buffer.device
        ids = torch.tensor([token_ids], dtype=torch.long, device=device)  # (1, T)
        where = torch.tensor(positions, dtype=torch.long, device=device)  # (T,)
        with cache.scattered(where, end):
            out = self.model(input_ids=ids, position_ids=where[None], cache_position=where,
                             attention_mask=self.masks(where[None], end), past_key_values=cache, use_cache=True,
                             logits_to_keep=1)
        return out.logits[0, -1].float()

    def decode(self, rows: DecodeRows, token_ids: list[int]) -> torch.Tensor:
        """One decode step: row b's next token is `token_ids[b]`, at the row's own position. Returns
        logits (n, V); every row holds one more token afterwards."""
        positions = rows.positions
        end = max(positions) + 1
        rows.prepare(len(positions), end)
        inputs = torch.tensor([token_ids, positions], dtype=torch.long, device=rows.device)  # (2, n)
        logits = self.step(rows.keys, rows.values, inputs[0], inputs[1], end)
        rows.advance()
        return logits

    def step(self, keys: torch.Tensor, values: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
             end: int) -> torch.Tensor:
        """One decode step of rows 0..n-1 of the decode buffers keys/values (L, R, H, T, D): row b's
        token ids[b] (n,) goes to positions[b] (n,), attending to keys 0..end-1 up to its own position.
        Returns logits (n, V) float32. Tensor work only: a CUDA graph can capture it."""
        where = positions[:, None]  # (n, 1)
        out = self.model(input_ids=ids[:, None], position_ids=where, attention_mask=self.masks(where, end),
                         past_key_values=StepCache(keys, values, positions, end), use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float()  # (n, V)

"""Per-layer matrix factors for anchor states: truncated SVD (KVCMAS Eq. 7) or dense storage.

A segment's keys or values `(L, H, T, D)` are seen per layer as a matrix of T rows (tokens) and
F = H·D features. `factorize` keeps the top-r singular directions, `A = U_r Σ_r` (L, T, r) and
`B = R_rᵀ` (L, r, F); `rank=None` stores the matrix itself (the full-dimensional baselines).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentcache.engine.kv import all_finite

__all__ = ["Factors", "factorize", "low_rank_is_smaller", "as_rows", "from_rows"]


def as_rows(kv: torch.Tensor) -> torch.Tensor:
    """(L, H, T, D) -> (L, T, H·D): one row per token, per layer. A view when H = 1: copy before writing."""
    layers, heads, tokens, dim = kv.shape
    return kv.permute(0, 2, 1, 3).reshape(layers, tokens, heads * dim)


def from_rows(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """(L, T, H·D) -> (L, H, T, D), the inverse of `as_rows`."""
    layers, tokens, features = rows.shape
    return rows.reshape(layers, tokens, heads, features // heads).permute(0, 2, 1, 3)


@dataclass(frozen=True)
class Factors:
    """A stack of per-layer (T, F) matrices, `a @ b` per layer, or `a` alone when dense."""

    a: torch.Tensor  # (L, T, r) low-rank, or (L, T, F) dense
    b: torch.Tensor | None  # (L, r, F), or None when dense

    @property
    def length(self) -> int:
        return int(self.a.shape[1])

    @property
    def num_layers(self) -> int:
        return int(self.a.shape[0])

    @property
    def rank(self) -> int | None:
        return None if self.b is None else int(self.a.shape[2])

    @property
    def features(self) -> int:
        return int(self.a.shape[2] if self.b is None else self.b.shape[2])

    @property
    def nbytes(self) -> int:
        held = self.a.numel() * self.a.element_size()
        if self.b is not None:
            held += self.b.numel() * self.b.element_size()
        return held

    @property
    def dense_numel(self) -> int:
        """Numbers in the matrices these factors describe (L·T·F)."""
        return self.num_layers * self.length * self.features

    def rows(self, count: int | None = None, layers: slice = slice(None)) -> torch.Tensor:
        """The first `count` rows of every layer (of `layers`), reconstructed: (L, count, F)."""
        a = self.a[layers] if count is None else self.a[layers, :count]
        return a.clone() if self.b is None else torch.bmm(a, self.b[layers])

    def has_shape(self, layers: int, length: int, features: int) -> bool:
        """Whether this holds `layers` float32 matrices of `length` x `features`, consistently factored."""
        a, b = self.a, self.b
        if a.dtype != torch.float32 or a.dim() != 3 or tuple(a.shape[:2]) != (layers, length):
            return False
        if b is None:
            return a.shape[2] == features
        return b.dtype == torch.float32 and tuple(b.shape) == (layers, a.shape[2], features)

    def layer_rows(self, layer: int, count: int | None = None) -> torch.Tensor:
        """The first `count` rows of one layer, reconstructed: (count, F)."""
        a = self.a[layer] if count is None else self.a[layer, :count]
        return a.clone() if self.b is None else a @ self.b[layer]

    def is_finite(self) -> bool:
        return all_finite(self.a, *([] if self.b is None else [self.b]))


def low_rank_is_smaller(tokens: int, features: int, rank: int) -> bool:
    """Whether rank-`rank` factors of a `tokens` x `features` matrix hold fewer numbers than it."""
    r = min(rank, tokens, features)
    return r * (tokens + features) < tokens * features


def factorize(rows: torch.Tensor, rank: int | None) -> Factors:
    """Rank-`rank` truncated SVD of each layer of `rows` (L, T, F); `None` keeps it dense.

    Computed from the eigenvectors of the smaller Gram matrix (F×F, or T×T for short segments):
    the same top singular directions as an SVD, at a fraction of its cost on a CPU. The rank is
    clipped to min(T, F). Where the factors would hold at least as many numbers as the matrix
    (r·(T + F) ≥ T·F: short segments), the matrix is kept dense instead: smaller and exact.
    """
    rows = rows.float()
    if rank is not None and rank < 1:
        raise ValueError(f"rank must be at least 1 or None (dense), got {rank}")
    layers, tokens, features = rows.shape
    if rank is None or not low_rank_is_smaller(tokens, features, rank):
        return Factors(rows.clone(), None)
    r = min(rank, tokens, features)
    if tokens >= features:
        gram = torch.bmm(rows.transpose(1, 2), rows).double()  # (L, F, F)
        basis = torch.linalg.eigh(gram)[1][:, :, -r:].flip(-1).float()  # (L, F, r): top right singular vectors
        return Factors(torch.bmm(rows, basis).contiguous(), basis.transpose(1, 2).contiguous())  # U_r Σ_r, R_rᵀ
    gram = torch.bmm(rows, rows.transpose(1, 2)).double()  # (L, T, T)
    left = torch.linalg.eigh(gram)[1][:, :, -r:].flip(-1).float()  # (L, T, r): top left singular vectors
    return Factors(left.contiguous(), torch.bmm(left.transpose(1, 2), rows).contiguous())  # U_r, U_rᵀ·rows

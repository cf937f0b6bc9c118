"""Anchor matching math (KVCMAS App. A.3): the entropy gate and token-wise correction weights.

Stateless functions over tensors. Rows are per-layer token matrices `(L, T, F)` in canonical
positions (keys rotated to start 0), as `lowrank.as_rows` makes them.
"""

from __future__ import annotations

import math

import torch

from agentcache.correction.lowrank import Factors

__all__ = ["gate_distances", "normalized_entropy", "gate_weights", "interpolated_correction", "interpolation_weights",
           "add_interpolated_correction", "GATE_SCALES"]


def gate_distances(source_values: torch.Tensor, anchors: list[Factors], k: int) -> torch.Tensor:
    """Eq. 9: d_v = (Σ_ℓ ||V_src[ℓ, :k] − Ṽ_v[ℓ, :k]||²_F)^½ for each anchor's base values.

    source_values: (L, ≥k, F); anchors: base value factors covering at least k rows. Returns (n,).
    """
    src = source_values[:, :k]  # (L, k, F)
    return torch.stack([torch.linalg.vector_norm(base.rows(k).sub_(src)) for base in anchors])  # rows: a new tensor


GATE_SCALES = ("nearest", "absolute")


def gate_weights(distances: torch.Tensor, temperature: float, scale: str = "nearest") -> torch.Tensor:
    """Eq. 10: g = softmax(−d / T). With `scale="nearest"` T is relative to the nearest anchor's
    distance (T · min d), so the gate reads how much closer one anchor is than the others, on any
    model: raw value-cache distances run from single digits on a random-weight model to the
    hundreds on Gemma 3, where T = 1 makes every match look certain. `"absolute"` is the paper's T."""
    d = distances.double()
    if scale == "nearest":
        temperature = temperature * float(d.min().clamp_min(1e-12))
    elif scale != "absolute":
        raise ValueError(f"unknown gate scale {scale!r}; use one of {GATE_SCALES}")
    return torch.softmax(-d / temperature, dim=0)


def normalized_entropy(weights: torch.Tensor) -> float:
    """Eq. 11: H̄(g) = −Σ g log₂ g / log₂ n, in [0, 1]; 0 = one anchor clearly preferred."""
    n = weights.numel()
    if n < 2:
        raise ValueError("normalized entropy needs at least two weights")
    g = weights.double().clamp_min(1e-300)
    return float(-(g * g.log2()).sum() / math.log2(n))


def interpolated_correction(
    source: torch.Tensor,
    bases: list[Factors],
    deltas: list[Factors],
    temperature: float,
    base_layer_offset: int = 0,
) -> tuple[torch.Tensor, int]:
    """Eq. 8 with token-wise weights: Δ̂[ℓ, t] = Σ_v w_v[ℓ, t] Δ_v[ℓ, t].

    source: (L, S, F) source rows of the layers being corrected; deltas: per anchor, correction
    factors of those layers; bases: base factors, whose layer ℓ + `base_layer_offset` pairs with
    source layer ℓ. w_v[ℓ, t] = softmax over the anchors covering token t of
    −mean|source[ℓ, t] − base_v[ℓ, t]| / T (`interpolation_weights`). Tokens no anchor covers get no
    correction (no extrapolation). Returns (Δ̂ (L, S, F), tokens corrected).
    """
    weights, reach = interpolation_weights(source, bases, temperature, base_layer_offset)
    correction = torch.zeros_like(source)
    add_interpolated_correction(correction, weights, deltas, reach)
    return correction, weights.shape[2]


def interpolation_weights(source: torch.Tensor, bases: list[Factors], temperature: float,
                          base_layer_offset: int = 0) -> tuple[torch.Tensor, list[int]]:
    """The token-wise weights of Eq. 8 and how many rows each anchor covers: weights (n, L, covered),
    softmax over the anchors of −mean|source − base_v| / T, each anchor's rows rebuilt once for every
    layer; source (L, S, F)."""
    layers, length, features = source.shape
    covered = min(length, max(base.length for base in bases))
    paired = slice(base_layer_offset, base_layer_offset + layers)  # the base layers that pair with the source's
    reach = [min(covered, base.length) for base in bases]
    distance = torch.full((len(bases), layers, covered), math.inf, dtype=source.dtype, device=source.device)
    for v, (base, rows) in enumerate(zip(bases, reach)):
        rebuilt = base.rows(rows, paired)  # (L, rows, F), a new tensor: worked in place
        distance[v, :, :rows] = rebuilt.sub_(source[:, :rows]).abs_().mean(-1)  # (L, rows)
    return torch.softmax(-distance / temperature, dim=0), reach  # every token has at least one anchor


def add_interpolated_correction(target: torch.Tensor, weights: torch.Tensor, deltas: list[Factors],
                                reach: list[int]) -> None:
    """target (L, ≥covered, F) += Σ_v w_v Δ_v, in place (the weights were read from it before)."""
    for v, (delta, rows) in enumerate(zip(deltas, reach)):
        weight = weights[v, :, :rows, None]  # (L, rows, 1)
        part = target[:, :rows]
        if delta.b is None:
            part.addcmul_(weight, delta.a[:, :rows])  # dense: Δ rows (L, rows, F)
        else:  # Σ_t w·(A B)[t] = (w·A) B: the weights scale A's rows, and Δ is never rebuilt
            part.baddbmm_(weight * delta.a[:, :rows], delta.b)

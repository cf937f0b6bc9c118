"""KVCMAS's correction as pure functions over anchors: apply one (Eq. 8), observe one (Δ).

Both work on KV re-aligned to canonical positions (start 0), in float32 whatever the KV's dtype,
and leave layer 0 alone: it depends on position only, and re-alignment makes it exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from agentcache.correction.anchors import Anchor, Correction
from agentcache.correction.lowrank import Factors, as_rows, factorize, from_rows
from agentcache.correction.matching import add_interpolated_correction, interpolation_weights
from agentcache.engine.kv import KVLayout, SegmentKV, all_finite

__all__ = ["corrected", "observed_correction", "fits", "TOKEN_WEIGHT_TEMPERATURE"]

TOKEN_WEIGHT_TEMPERATURE = 1.0  # softmax temperature of the token-wise interpolation weights (App. A.3)


def corrected(aligned: SegmentKV, anchors: Sequence[Anchor], k: int, consumer: str,
              layout: KVLayout) -> SegmentKV | None:
    """`aligned` with its first `k` tokens corrected for `consumer` by the anchors' interpolated
    corrections; None when the result is not finite. Rows past `k` stay the aligned source: no
    extrapolation past the anchors."""
    parts = []
    for part in ("keys", "values"):
        rows = as_rows(getattr(aligned, part)).to(torch.float32, copy=True)  # (L, S, F); the source stays intact
        target = rows[1:, :k]  # (L-1, k, F)
        weights, reach = interpolation_weights(target, [getattr(a, part) for a in anchors],
                                               TOKEN_WEIGHT_TEMPERATURE, base_layer_offset=1)
        add_interpolated_correction(target, weights, [getattr(a.corrections[consumer], part) for a in anchors], reach)
        parts.append(from_rows(rows.to(layout.dtype), layout.num_kv_heads))
    if not all_finite(*parts):
        return None
    return SegmentKV(parts[0], parts[1], 0)


def observed_correction(source: SegmentKV, dense: SegmentKV, base: tuple[Factors, Factors] | None,
                        base_rank: int | None, delta_rank: int | None
                        ) -> tuple[Factors, Factors, Correction] | None:
    """The correction a dense prefill observed, Δ = dense − source (both re-aligned, same tokens),
    factorized at `delta_rank`, with the source's own factors at `base_rank` (or `base`, the
    anchor's it is added to): (base keys, base values, correction); None when Δ is not finite."""
    src_k, src_v = as_rows(source.keys).float(), as_rows(source.values).float()  # (L, S, F)
    tgt_k, tgt_v = as_rows(dense.keys).float(), as_rows(dense.values).float()
    delta_k, delta_v = tgt_k[1:] - src_k[1:], tgt_v[1:] - src_v[1:]  # (L-1, S, F)
    if not all_finite(delta_k, delta_v):
        return None
    base_k, base_v = base if base is not None else (factorize(src_k, base_rank), factorize(src_v, base_rank))
    return base_k, base_v, Correction(factorize(delta_k, delta_rank), factorize(delta_v, delta_rank))


def fits(anchor: Anchor, layout: KVLayout) -> bool:
    """The anchor's shapes fit the model; an anchor too corrupt to say does not."""
    try:
        return anchor.fits(layout.num_layers, layout.num_kv_heads * layout.head_dim)
    except Exception:  # noqa: BLE001 - factors that are not even tensors
        return False

"""How far reused KV is from dense prefill: KV error, greedy agreement, teacher-forced scores.

Each function compares one call made with some strategy against the dense (NonShared) run of
the same prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from agentcache.engine.kv import SegmentKV
from agentcache.engine.tokens import common_prefix
from agentcache.metrics import CallResult

__all__ = ["relative_error", "kv_error", "LayerErrors", "ph_layer_errors", "prefix_agreement", "teacher_forced"]


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """||approx − exact||_F / ||exact||_F."""
    return float((approx.double() - exact.double()).norm() / exact.double().norm().clamp_min(1e-30))


def kv_error(approx: SegmentKV, exact: SegmentKV) -> float:
    """Mean of the K and V relative errors over layers 1.. (layer 0 is exact after alignment)."""
    return (relative_error(approx.keys[1:], exact.keys[1:]) + relative_error(approx.values[1:], exact.values[1:])) / 2


@dataclass(frozen=True)
class LayerErrors:
    keys: list[float]  # per layer
    values: list[float]
    key_total: float  # over layers 1..
    value_total: float

    @property
    def mean(self) -> float:
        return (self.key_total + self.value_total) / 2


def _stack(kvs: Sequence[SegmentKV], part: str) -> torch.Tensor:
    return torch.cat([getattr(kv, part) for kv in kvs], dim=2)  # (L, H, T, D)


def ph_layer_errors(call: CallResult, dense: CallResult, reused_only: bool = False) -> LayerErrors | None:
    """Relative error of the call's shared (PH) segments' KV against the dense run of the same
    prompt, per layer (layer 0 included) and over layers 1.. (layer 0 is exact after alignment);
    `reused_only` keeps the segments served from reused KV. None when no segment qualifies."""
    if call.prompt_ids != dense.prompt_ids:
        raise ValueError("compare a call only with the dense run of the same prompt")
    picks = [i for i, s in enumerate(call.segments) if s.kind == "ph" and (s.injected_tokens or not reused_only)]
    if not picks:
        return None
    got = {part: _stack([call.segment_kv[i] for i in picks], part) for part in ("keys", "values")}
    want = {part: _stack([dense.segment_kv[i] for i in picks], part) for part in ("keys", "values")}
    per_layer = {
        part: [relative_error(got[part][layer], want[part][layer]) for layer in range(got[part].shape[0])]
        for part in got
    }
    return LayerErrors(per_layer["keys"], per_layer["values"],
                       relative_error(got["keys"][1:], want["keys"][1:]),
                       relative_error(got["values"][1:], want["values"][1:]))


def prefix_agreement(tokens: Sequence[int], reference: Sequence[int]) -> float:
    """Fraction of `reference` greedy tokens reproduced before the first divergence."""
    return common_prefix(tokens, reference) / len(reference) if reference else 1.0


def teacher_forced(engine, call: CallResult, dense: CallResult) -> tuple[float, float]:
    """Top-1 agreement and mean KL(dense || call) of next-token distributions along the dense
    greedy continuation, each side scored from its own prompt KV."""
    continuation = dense.token_ids[:-1]  # every token but the last was fed back
    logits = []
    for result in (call, dense):
        rows = [result.engine_result.last_logits[None]]  # (1, V)
        if continuation:
            rows.append(engine.continuation_logits(result.segment_kv, continuation))  # (n, V)
        logits.append(torch.cat(rows).double())
    approx, exact = logits
    top1 = float((approx.argmax(-1) == exact.argmax(-1)).double().mean())
    log_p, log_q = exact.log_softmax(-1), approx.log_softmax(-1)
    kl = float((log_p.exp() * (log_p - log_q)).sum(-1).mean())
    return top1, kl

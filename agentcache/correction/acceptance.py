"""When a corrected reuse is served: the acceptance policies (a registry) and the entropy gate.

A policy answers twice for a shared segment with a sound source: `accepts`, from what is known
without touching a tensor (the edge's record, the anchors it has), then `select`, which anchors
correct the re-aligned source over how many tokens, or why none may.

- `verified` (agentcache's default, `correction.verification`): a method is served on an edge
  only while shadow runs of its dense calls agree with it; every anchor of the edge corrects.
- `entropy` (the papers' gate, App. A.3 Eq. 9-11): the anchors covering the longest prefix two
  of them share are weighted by their value distance to the source; a normalized entropy above τ
  (or a reuse budget, once a target ratio holds τ) refuses the correction.

`EntropyGate` holds τ and the log of gate entropies it is calibrated from (`calibration`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from agentcache.correction.anchors import Anchor
from agentcache.correction.calibration import CALIBRATION_WINDOW, ReuseController
from agentcache.correction.lowrank import as_rows
from agentcache.correction.matching import gate_distances, gate_weights, normalized_entropy
from agentcache.correction.plan import PHDecision
from agentcache.correction.records import Edge
from agentcache.correction.strategies import Strategy
from agentcache.correction.verification import CONTEXT_FREE_VERDICTS, MIN_VERDICTS, Verification
from agentcache.engine.kv import SegmentKV
from agentcache.errors import InputError

__all__ = ["Selection", "Refusal", "EntropyGate", "VerifiedAcceptance", "EntropyAcceptance", "ACCEPTANCE_POLICIES",
           "GATE_LOG"]

log = logging.getLogger(__name__)

GATE_LOG = 512  # the latest planned segments kept for calibrating the gate


@dataclass(frozen=True)
class Selection:
    """The anchors that correct a source's first `k` tokens, and the gate's entropy when one ran."""

    anchors: tuple[Anchor, ...]
    k: int
    entropy: float | None = None


@dataclass(frozen=True)
class Refusal:
    """Why no correction is served; `nonfinite`: these anchors gave non-finite distances."""

    reason: str
    entropy: float | None = None
    nonfinite: tuple[Anchor, ...] = ()


class EntropyGate:
    """τ, and the gate entropies of recently planned segments that a target reuse ratio reads it from."""

    def __init__(self, settings: Strategy) -> None:
        self.settings = settings
        self.tau = settings.tau  # `control` moves it for a target reuse ratio
        # planned segments that had a source: (gate entropy, or None when the gate was not reached; tokens)
        self.log: deque[tuple[float | None, int]] = deque(maxlen=GATE_LOG)
        self.control: ReuseController | None = None  # from the first calibration on
        self.planned = 0  # segments ever logged

    def entropy(self, values: torch.Tensor, anchors: Sequence[Anchor], k: int) -> float | None:
        """The normalized entropy of the anchors' gate weights for the source's values (L, ≥k, F);
        None when a distance is not finite."""
        distances = gate_distances(values, [a.values for a in anchors], k)
        if not bool(torch.isfinite(distances).all()):
            return None
        return normalized_entropy(gate_weights(distances, self.settings.temperature, self.settings.gate_scale))

    def observe(self, decision: PHDecision, tokens: int) -> None:
        """Log an eligible segment's entropy; a controlled gate follows it, and a target reuse ratio
        starts being controlled after `calibrate_after` segments with gate evaluations."""
        self.log.append((decision.entropy, tokens))
        self.planned += 1
        if self.control is not None:
            self.tau = self.control.record(decision.entropy, tokens, decision.covered if decision.reused else 0)
            return
        target = self.settings.target_reuse
        if (target is not None and self.planned >= self.settings.calibrate_after
                and any(entropy is not None for entropy, _ in self.log)):
            self.calibrate(target, CALIBRATION_WINDOW)

    def calibrate(self, target: float, recent: int | None = None) -> float:
        """Hold the gate at reuse ratio `target` from now on: τ is read from the entropies of the
        latest `recent` logged segments (all by default) and then follows every segment planned."""
        history = list(self.log)[-recent:] if recent else list(self.log)
        try:
            self.control = ReuseController(target, history)
        except ValueError as exc:
            raise InputError(str(exc)) from None
        self.tau = self.control.tau
        log.info("gate held at reuse %.2f: tau = %.4f from %d segments", target, self.tau, len(history))
        return self.tau

    @property
    def calibrated(self) -> dict | None:
        """How τ is set, once a target reuse ratio holds it."""
        return self.control.report() if self.control is not None else None

    def figures(self) -> dict:
        return dict(gate_tau=self.tau, gate_calibration=self.calibrated)


class VerifiedAcceptance:
    name = "verified"

    def __init__(self, settings: Strategy, gate: EntropyGate, verification: Verification) -> None:
        self.verification = verification

    def accepts(self, edge: Edge, anchors: int, context_free: bool) -> tuple[str | None, str | None]:
        """(method, None) when a method is verified on the edge (`anchors`: how many it has), else
        (None, "unverified"); `context_free`: the source is a reference prefill."""
        return self.verification.decide(edge, can_correct=anchors > 0,
                                        needed=CONTEXT_FREE_VERDICTS if context_free else MIN_VERDICTS)

    def select(self, aligned: SegmentKV, candidates: Sequence[Anchor]) -> Selection | Refusal:
        """Verified on this edge: every anchor, no gate."""
        return Selection(tuple(candidates), min(aligned.length, max(a.length for a in candidates)))

    def figures(self) -> dict:
        return self.verification.figures()


class EntropyAcceptance:
    name = "entropy"

    def __init__(self, settings: Strategy, gate: EntropyGate, verification: Verification) -> None:
        self.settings = settings
        self.gate = gate

    def accepts(self, edge: Edge, anchors: int, context_free: bool) -> tuple[str | None, str | None]:
        """(None, "few_anchors") when the edge has too few anchors to gate; (None, None): decide later."""
        return (None, "few_anchors") if anchors < (1 if self.settings.max_anchors == 1 else 2) else (None, None)

    def select(self, aligned: SegmentKV, candidates: Sequence[Anchor]) -> Selection | Refusal:
        """The gate over the longest prefix at least two anchors cover (V = 1: the sole anchor, no gate)."""
        length = aligned.length
        if self.settings.max_anchors == 1 and len(candidates) == 1:
            return Selection(tuple(candidates), min(length, candidates[0].length))
        k = min(length, sorted((a.length for a in candidates), reverse=True)[1])
        compatible = tuple(a for a in candidates if a.length >= k)
        entropy = self.gate.entropy(as_rows(aligned.values[:, :, :k]).float(), compatible, k)  # values (L, k, F)
        if entropy is None:
            return Refusal("nonfinite", nonfinite=compatible)
        if not entropy <= self.gate.tau:
            return Refusal("gate", entropy)
        if self.gate.control is not None and not self.gate.control.allows(entropy, length):
            return Refusal("budget", entropy)
        return Selection(compatible, k, entropy)

    def figures(self) -> dict:
        return {}


ACCEPTANCE_POLICIES = {"verified": VerifiedAcceptance, "entropy": EntropyAcceptance}

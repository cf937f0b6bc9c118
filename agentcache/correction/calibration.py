"""Keeping the correction gate at a target reuse ratio (the papers tune τ per workload).

A fixed τ taken from warm-up traffic misses its target in two ways, and each part here answers one:

- The traffic moves. The pools fill (segments that met too few anchors stop coming), and later
  segments gate lower than the ones τ was read from. `ReuseController` reads τ from the recent
  entropies (`calibrated_tau`, lowest first: the segments it refuses are the least certain ones),
  but at a share `aim` that integral feedback moves by the gap between the target and the reuse
  actually reached, token by token.
- Segments are coarse and come in ties. One query read by three agents has nearly one entropy, so
  a threshold takes or leaves all three, and on a short run one tie is a tenth of the tokens.
  A reuse budget (a token credit that leaks over about one window) refuses a correction the gate
  accepted when taking it would put recent reuse more than half the segment above target. It
  decides only in a band just under τ (the least certain corrections the gate accepted), and it
  only refuses: it never accepts what the entropy gate refused.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Iterable

__all__ = ["calibrated_tau", "ReuseController", "CALIBRATION_WINDOW"]

CALIBRATION_WINDOW = 48  # segments whose entropies set τ, and about the budget's memory
FEEDBACK_GAIN = 0.1  # aim moved per segment by gain · (target · tokens − reused) / mean segment tokens
BUDGET_SLACK = 0.5  # a correction may take recent reuse this share of its own tokens above target
# the budget decides only for entropies in the top share of what τ accepts: below the entropy that
# reaches aim − BUDGET_BAND of the window's tokens, a correction the gate accepted is always taken
BUDGET_BAND = 0.3


def _reaching(gated: list[tuple[float, int]], eligible_tokens: int, share: float) -> tuple[float, float | None] | None:
    """Accepting the gated segments lowest entropy first: the entropy at which they reach the share
    `share` of `eligible_tokens`, and the next higher entropy (None when none is higher); None when
    the gated segments never reach it."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"a target reuse ratio is in [0, 1], got {share!r}")
    if eligible_tokens <= 0 or not gated:
        raise ValueError("calibrating the gate needs gate evaluations on eligible traffic (run a warm-up first)")
    ordered = sorted(gated)
    accepted = 0
    for index, (entropy, tokens) in enumerate(ordered):
        accepted += tokens
        if accepted >= share * eligible_tokens:
            return entropy, next((e for e, _ in ordered[index + 1:] if e > entropy), None)
    return None


def calibrated_tau(gated: list[tuple[float, int]], eligible_tokens: int, target: float) -> float:
    """The gate threshold τ under which the share `target` of `eligible_tokens` would have been
    reused, given the gate evaluations `gated` as (normalized entropy, tokens), lowest entropies
    accepted first: halfway between the entropy that reaches the share and the next one above it (1
    when that one is the highest). Segments that never reach the gate (too few anchors) count in
    `eligible_tokens` only, so a target above what the gate can reach gives τ = 1."""
    reached = _reaching(gated, eligible_tokens, target)
    if target == 0.0:
        return 0.0
    if reached is None or reached[1] is None:
        return 1.0
    return float(sum(reached) / 2)


class ReuseController:
    """Holds the gate at `target` reuse (tokens reused / eligible tokens) from its first calibration
    on. Per eligible segment planned: `allows` (only for a correction the gate accepted), then
    `record` what the segment became; `tau` follows every record."""

    def __init__(self, target: float, history: Iterable[tuple[float | None, int]] = (),
                 window: int = CALIBRATION_WINDOW) -> None:
        self.target = target  # checked by the first τ below
        # the latest eligible segments: (gate entropy, or None when the gate was not reached; tokens)
        history = list(history)
        self.window: deque[tuple[float | None, int]] = deque(history, maxlen=window)
        self.aim = target  # the share asked of the recent entropies
        self.credit = 0.0  # tokens: target · eligible − reused, leaking 1/window per segment
        self.leak = 1.0 - 1.0 / window
        self.eligible = 0  # tokens planned since the first calibration
        self.reused = 0
        self.budget_refusals = 0
        self.tau, self.sure = self._thresholds(history)  # the first from all the history given

    def allows(self, entropy: float, tokens: int) -> bool:
        """Whether a correction (gate `entropy`, `tokens` tokens) the gate accepted is taken: always
        when its entropy is below the budget's band, else when it stays within the reuse budget."""
        if entropy < self.sure or self.credit - (1.0 - self.target) * tokens >= -BUDGET_SLACK * tokens:
            return True
        self.budget_refusals += 1
        return False

    def record(self, entropy: float | None, tokens: int, reused: int) -> float:
        """One eligible segment planned (`reused` of its `tokens` served from reuse); returns τ."""
        self.window.append((entropy, tokens))
        self.eligible += tokens
        self.reused += reused
        gap = self.target * tokens - reused  # > 0: fewer tokens reused than the target asks
        self.credit = self.leak * self.credit + gap
        mean_tokens = max(1.0, sum(n for _, n in self.window) / len(self.window))
        self.aim = min(1.0, max(0.0, self.aim + FEEDBACK_GAIN * gap / mean_tokens))
        if any(entropy is not None for entropy, _ in self.window):
            self.tau, self.sure = self._thresholds(self.window)
        return self.tau

    def _thresholds(self, segments: Iterable[tuple[float | None, int]]) -> tuple[float, float]:
        """τ for the share `aim` of `segments`' tokens, and the budget's band edge: entropies below
        the one that reaches aim − BUDGET_BAND are taken whatever the budget (strictly below, so ties
        at the edge stay the budget's)."""
        segments = list(segments)
        gated = sorted((e, n) for e, n in segments if e is not None)
        eligible = sum(n for _, n in segments)
        tau = calibrated_tau(gated, eligible, self.aim)
        share = self.aim - BUDGET_BAND
        if share <= 0.0:
            return tau, 0.0
        reached = _reaching(gated, eligible, share)
        return tau, math.inf if reached is None else reached[0]

    def report(self) -> dict:
        window_tokens = sum(tokens for _, tokens in self.window)
        return {
            "target_reuse": self.target,
            "tau": self.tau,
            "aim": self.aim,
            "segments": len(self.window),
            "gated_share": sum(t for e, t in self.window if e is not None) / window_tokens if window_tokens else 0.0,
            # reuse planned since the first calibration (tokens), and corrections the budget refused
            "reuse_since_calibrated": self.reused / self.eligible if self.eligible else None,
            "budget_refusals": self.budget_refusals,
        }

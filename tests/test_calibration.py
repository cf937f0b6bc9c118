"""Holding the correction gate at a target reuse ratio (`agentcache.correction.calibration`)."""

from __future__ import annotations

import json
import math
import random
import statistics
from pathlib import Path

import pytest

from agentcache.correction import calibration
from agentcache.correction.calibration import ReuseController, calibrated_tau

# gate entropies Gemma 3 270M produced in benchmarks/fidelity.py's workflow (see the file's "about")
GEMMA_GATE_LOG = json.loads((Path(__file__).parent / "data" / "gemma_gate_log.json").read_text())
SEGMENTS_PER_PROBLEM = 6


def test_calibrated_tau_accepts_the_lowest_entropies_up_to_the_target_share():
    gated = [(0.1, 10), (0.5, 10), (0.2, 10), (0.9, 10)]
    # 20 of 50 eligible tokens: the two lowest entropies, τ halfway to the next
    assert calibrated_tau(gated, 50, 0.4) == pytest.approx(0.35)
    assert calibrated_tau(gated, 50, 0.6) == pytest.approx(0.7)
    assert calibrated_tau(gated, 50, 0.8) == 1.0  # the highest entropy accepted: nothing gated is refused
    assert calibrated_tau(gated, 50, 0.9) == 1.0  # 10 tokens never reach the gate: accept all gated
    assert calibrated_tau(gated, 50, 0.0) == 0.0
    with pytest.raises(ValueError, match="warm-up"):
        calibrated_tau([], 50, 0.5)
    with pytest.raises(ValueError, match="warm-up"):
        ReuseController(0.5, [(None, 40)])  # nothing ever reached the gate
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        ReuseController(1.5, gated)


def replay(segments, target: float, *, controlled: bool = True, start: int = 4, scored_from: int = 0) -> float:
    """Run a gate over recorded (entropy, tokens) segments as `acceptance.EntropyGate` does: τ read after `start`
    segments, then (when `controlled`) following every segment. Returns the reuse ratio in tokens
    over the segments from `scored_from` on."""
    seen, control, reused, eligible = [], None, 0, 0
    for index, (entropy, tokens) in enumerate(segments):
        accepted = (control is not None and entropy is not None and entropy <= control.tau
                    and (not controlled or control.allows(entropy, tokens)))
        served = tokens if accepted else 0
        if index >= scored_from:
            reused, eligible = reused + served, eligible + tokens
        seen.append((entropy, tokens))
        if control is not None:
            if controlled:
                control.record(entropy, tokens, served)
        elif len(seen) >= start and any(e is not None for e, _ in seen):
            control = ReuseController(target, seen)
    return reused / eligible


def gemma_runs(count: int):
    """The recorded warm-up, then 8 problems drawn from the two recorded runs, in `count` orders."""
    warmup = [tuple(s) for s in GEMMA_GATE_LOG["warmup"]]
    problems = [[tuple(s) for s in run[i:i + SEGMENTS_PER_PROBLEM]]
                for run in GEMMA_GATE_LOG["runs"] for i in range(0, len(run), SEGMENTS_PER_PROBLEM)]
    rng = random.Random(0)
    for _ in range(count):
        yield warmup + [s for problem in rng.sample(problems, 8) for s in problem], len(warmup)


@pytest.mark.parametrize("target", [0.8, 0.6])
def test_the_gate_holds_its_target_on_gemmas_gate_entropies(target):
    """On the entropies Gemma's workflow produced, the scored problems reach the target on average,
    and every run comes within one problem's query (its three readers are 0.12 of the scored tokens)
    of it. A τ read once from the warm-up (its first segments met too few anchors, so every gated
    segment looked needed) reuses everything."""
    held = [replay(run, target, scored_from=warm) for run, warm in gemma_runs(40)]
    fixed = [replay(run, target, controlled=False, scored_from=warm) for run, warm in gemma_runs(40)]
    assert abs(statistics.fmean(held) - target) < 0.03
    assert math.sqrt(statistics.fmean((r - target) ** 2 for r in held)) < 0.04
    assert max(abs(r - target) for r in held) < 0.12
    assert min(fixed) > target + 0.15


def test_feedback_follows_entropies_that_drift_up():
    """τ read from a warm-up whose segments gated low takes too little once the pools see harder
    segments; the feedback raises it back to the target (the budget only ever refuses)."""
    rng = random.Random(1)
    warmup = [(rng.uniform(0.0, 0.5), 100) for _ in range(48)]
    later = [(rng.uniform(0.3, 1.0), 100) for _ in range(400)]
    held = replay(warmup + later, 0.6, start=48, scored_from=148)
    fixed = replay(warmup + later, 0.6, start=48, scored_from=148, controlled=False)
    assert fixed < 0.35  # only entropies up to the warm-up's 60% quantile, ~0.3, pass
    assert abs(held - 0.6) < 0.05


def test_the_budget_splits_tied_segments():
    """A threshold takes or leaves segments of one entropy together; the budget refuses enough of
    what the gate accepted to hold the target."""
    control = ReuseController(0.5, [(0.1, 100)] * 8)  # every segment gates at 0.1: τ takes them all
    served = []
    for _ in range(40):
        accepted = 0.1 <= control.tau and control.allows(0.1, 100)
        served.append(100 if accepted else 0)
        control.record(0.1, 100, served[-1])
    assert sum(served) / (100 * len(served)) == pytest.approx(0.5, abs=0.05)
    assert control.budget_refusals >= 15
    assert control.report()["reuse_since_calibrated"] == pytest.approx(0.5, abs=0.05)


def test_the_budget_decides_only_in_the_band_below_tau():
    """Over budget, a correction well below τ is still taken; the budget refuses only those in the
    band under τ (the least certain the gate accepted), ties at the band's edge included."""
    control = ReuseController(0.5, [(e / 10, 10) for e in range(10)])  # entropies 0.0-0.9, 10 tokens each
    assert control.tau == pytest.approx(0.45)  # 50 of 100 tokens: halfway from 0.4 to 0.5
    control.credit = -1000.0  # recent reuse far above target
    assert control.allows(0.05, 10)  # below the entropy reaching 0.5 - BUDGET_BAND = 0.2 of the tokens
    assert not control.allows(0.1, 10) and not control.allows(0.4, 10)
    control.credit = 0.0
    assert control.allows(0.4, 10)


@pytest.mark.parametrize("part", ["FEEDBACK_GAIN", "BUDGET_SLACK"])
def test_without_feedback_or_budget_the_gemma_targets_are_missed_by_more(monkeypatch, part):
    """Each part carries its weight on Gemma's entropies: without the feedback, or without the
    budget, the scored problems' root-mean-square distance from 0.8 and 0.6 grows by half or more."""
    def rms_error():
        return sum(math.sqrt(statistics.fmean((replay(run, target, scored_from=warm) - target) ** 2
                                              for run, warm in gemma_runs(40))) for target in (0.8, 0.6))
    held = rms_error()
    monkeypatch.setattr(calibration, part, 0.0 if part == "FEEDBACK_GAIN" else 1e9)
    assert rms_error() > 1.5 * held

"""A model self-check to run before trusting cross-context KV reuse on it.

1. RoPE re-alignment: a probe text's keys computed at one position and re-aligned to another
   must match the keys computed there (layer 0, which depends on position only).
2. Correction fidelity: a short three-agent probe workflow runs KVCMAS (entropy gate open, so every
   edge with two anchors is corrected) beside dense prefill; corrected shared-segment KV must
   be closer to the dense KV than the raw aligned reuse is.

The probe drives calls through `agentcache.calls` and a strategy on fresh engines over the
same weights, below the Runtime: a Runtime runs this check (`check_model`, the one entry point)
before it trusts reuse, or takes a report of it.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

from agentcache.calls import plan_call
from agentcache.correction import SharedContextStrategy, make_strategy
from agentcache.correction.plan import Served
from agentcache.correction.strategies import STRATEGIES, Strategy
from agentcache.engine.precision import exactness_tolerance
from agentcache.engine.protocol import Engine, ExecRequest, SamplingParams, SegmentPlan, Step
from agentcache.errors import InputError
from agentcache.fidelity import relative_error
from agentcache.isolation import Scope
from agentcache.segments import AgentCall, Segment

__all__ = ["CheckReport", "Verdict", "check_model", "vet_strategy"]

log = logging.getLogger(__name__)

_PROBE_AGENTS = {
    "analyst": "You are a careful analyst. Read the problem and list the facts it gives.\n",
    "solver": "You are a math solver. Work step by step and give the final number.\n",
    "critic": "You are a strict critic. Point out any mistake in the reasoning below.\n",
}
_PROBE_QUERIES = [
    "Mia has 12 apples and buys 7 more at the market, then gives 5 to her brother.",
    "A train travels 60 miles per hour for 3 hours and then 40 miles per hour for 2 hours.",
    "The library had 340 books, lent out 85 on Monday and received 42 new ones on Tuesday.",
    "Four friends share 3 pizzas cut into 8 slices each and eat all but 5 slices.",
    "A farmer plants 9 rows of corn with 14 plants in each row and 6 plants die.",
]


@dataclass(frozen=True)
class CheckReport:
    model: str
    passed: bool
    reason: str
    rope_error: float | None
    corrected_error: float | None  # mean relative Frobenius error of corrected PH KV vs dense
    uncorrected_error: float | None  # the same for the raw aligned source cache
    corrections: int

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def checked(value: object) -> CheckReport | None:
        """`value` when it is None or a CheckReport; otherwise an InputError."""
        if value is not None and not isinstance(value, CheckReport):
            raise InputError(f"Runtime(check=...) must be a CheckReport (from agentcache.check_model) or None, "
                             f"got {type(value).__name__}")
        return value


def _rope_error(engine: Engine) -> float:
    """Relative error of the probe text's layer-0 keys moved from one position to another."""
    bos = engine.tokenize("", bos=True)  # [BOS], or [] for a model without one
    text = engine.tokenize(" The quick brown fox jumps over the lazy dog near the river bank.")
    lead = engine.tokenize(" Some words that come first and push the text to later positions.")
    sampling = SamplingParams(max_tokens=1)

    def text_kv(before: list[int]):
        segments = ([SegmentPlan("before", before, Step.DENSE)] if before else []) + [SegmentPlan("text", text, Step.DENSE)]
        return engine.execute(ExecRequest(segments, sampling)).segments[-1].kv

    early, late = text_kv(bos), text_kv(bos + lead)
    return relative_error(engine.realign(early, late.start).keys[0], late.keys[0])


_PROBE_BYTES = 2**28  # anchor pools and source store of a probe strategy


def _probe_call(engine: Engine, strategy: SharedContextStrategy, call: AgentCall) -> tuple[Served, str]:
    """One probe call end to end (plan, execute, settle, learn at once), one token generated; what
    it served, and the decision on its shared segment."""
    plan = plan_call(engine, strategy, call, SamplingParams(max_tokens=1), runtime_id="selfcheck")
    served = Served.of(plan.tokenized, plan.planned, engine.execute(plan.request))
    strategy.settle(served, strategy.prepare(served))
    for lesson in strategy.lessons(served):
        lesson.apply(lesson.study())
    return served, served.reports()[1].decision


def check_model(engine: Engine, tolerance: float | None = None) -> CheckReport:
    """Run both checks; `passed` is False with a reason when reuse should not be trusted. The
    re-aligned keys' relative error must be below `tolerance` (default: what the engine's KV dtype
    can tell apart, `precision.exactness_tolerance`)."""
    name = engine.model_name
    if not engine.supports_realignment:
        return CheckReport(name, False, "RoPE re-alignment is not supported on this model", None, None, None, 0)
    if tolerance is None:
        tolerance = exactness_tolerance(engine.layout.dtype)
    rope = _rope_error(engine.fresh())  # probes stay out of the user's cache
    if not rope <= tolerance:
        return CheckReport(name, False, f"re-aligned keys differ from keys computed in place by {rope:.2e} "
                           f"(tolerance {tolerance:.1e} in {engine.layout.dtype})", rope, None, None, 0)

    reuse_engine, dense_engine = engine.fresh(), engine.fresh()
    reuse = make_strategy(reuse_engine, STRATEGIES["kvcmas_entropy"].replace(tau=1.0), _PROBE_BYTES,
                          _PROBE_BYTES)  # the gate open: every edge with two anchors is corrected
    dense = make_strategy(dense_engine, STRATEGIES["nonshared"], _PROBE_BYTES, _PROBE_BYTES)
    corrected, raw = [], []
    for query in _PROBE_QUERIES:
        for agent, system in _PROBE_AGENTS.items():
            call = AgentCall(agent=agent, segments=(Segment.pf(system), Segment.ph("query", "Problem: " + query),
                                                    Segment.pf("\nAnswer:")))
            source = reuse.store.find(Scope(), "query", engine.tokenize("Problem: " + query))
            got, decision = _probe_call(reuse_engine, reuse, call)
            want, _ = _probe_call(dense_engine, dense, call)
            if decision != "corrected":
                continue
            got_kv, want_kv = got.kvs[1], want.kvs[1]
            source_kv = engine.realign(source[0].kv, want_kv.start)
            for errors, approx in ((corrected, got_kv), (raw, source_kv)):
                errors.append([relative_error(getattr(approx, part)[1:], getattr(want_kv, part)[1:])
                               for part in ("keys", "values")])
    if not corrected:
        return CheckReport(name, False, "the probe workflow produced no corrections to measure", rope, None, None, 0)
    k_fixed, v_fixed = (sum(e[i] for e in corrected) / len(corrected) for i in (0, 1))
    k_raw, v_raw = (sum(e[i] for e in raw) / len(raw) for i in (0, 1))
    mean_corrected, mean_raw = (k_fixed + v_fixed) / 2, (k_raw + v_raw) / 2
    passed = k_fixed <= k_raw and v_fixed <= v_raw  # keys and values each: a key bug must not hide behind V
    reason = (f"correction brings shared KV to {k_fixed:.3f} (K) / {v_fixed:.3f} (V) relative error, "
              f"raw reuse {k_raw:.3f} / {v_raw:.3f}")
    if not passed:
        reason = "correction makes shared KV worse than raw reuse: " + reason
    return CheckReport(name, passed, reason, rope, mean_corrected, mean_raw, len(corrected))


@dataclass(frozen=True)
class Verdict:
    """The strategy a runtime runs: the one asked for, or NonShared with the reason it was refused."""

    strategy: Strategy
    check: CheckReport | None
    refusal: str | None = None


def vet_strategy(engine: Engine, strategy: Strategy, check: CheckReport | None, self_check: bool) -> Verdict:
    """Refuse cross-context reuse on a model that fails the self-check (run now when `self_check`
    and no `check` report is given): NonShared runs instead, with the reason."""
    check = CheckReport.checked(check)
    if not strategy.reuse:
        return Verdict(strategy, check)
    if strategy.recompute is not None and not engine.supports_recompute:
        raise InputError(f"strategy {strategy.name!r} recomputes part of the reused cache, which "
                         f"{type(engine).__name__} cannot do (its KV connector fills whole contiguous "
                         "ranges); run it on the EmbeddedEngine")
    nonshared = STRATEGIES["nonshared"]
    if not engine.supports_realignment:
        log.warning("%s cannot re-align RoPE exactly; running NonShared instead of %s", engine.model_name, strategy.name)
        return Verdict(nonshared, check, f"{engine.model_name}: RoPE re-alignment is not exact on this model")
    if check is None and self_check:
        try:
            check = check_model(engine)
        except Exception as exc:  # noqa: BLE001 - a check that cannot run proves nothing: refuse reuse
            log.warning("the self-check raised on %s (%s: %s); running NonShared instead of %s",
                        engine.model_name, type(exc).__name__, exc, strategy.name)
            return Verdict(nonshared, None, f"the self-check raised {type(exc).__name__}: {exc}")
    if check is not None and not check.passed:
        log.warning("self-check failed on %s (%s); running NonShared instead of %s",
                    engine.model_name, check.reason, strategy.name)
        return Verdict(nonshared, check, f"{engine.model_name} failed the self-check: {check.reason}")
    return Verdict(strategy, check)

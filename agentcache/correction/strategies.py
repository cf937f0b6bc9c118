"""Shared-context strategies' settings: which kind of strategy runs, and its parameters.

A strategy's `kind` picks the class that runs it from `agentcache.correction.STRATEGY_KINDS`
(a registry); the other fields are that class's parameters.

| name               | kind       | chained | ranks (base, Δ) | anchors | accept   |
| ------------------ | ---------- | ------- | --------------- | ------- | -------- |
| nonshared          | nonshared  | -       | -               | -       | -        |
| fullshared         | fullshared | yes     | -               | -       | always   |
| kvcomm             | kvcomm     | no      | full            | 20 (+1) | entropy  |
| kvcomm_canonical   | kvcmas     | no      | full            | 20      | entropy  |
| kvcmas             | kvcmas     | yes     | 32, 32          | 10      | verified |
| kvcmas_entropy     | kvcmas     | yes     | 32, 32          | 10      | entropy  |
| kvcmas_nonchained  | kvcmas     | no      | 32, 32          | 10      | verified |
| kvcmas_fullrank    | kvcmas     | yes     | full            | 10      | verified |
| cacheblend         | cacheblend | yes     | -               | -       | always   |
| droidspeak         | droidspeak | yes     | -               | -       | always   |

Acceptance: `verified` (agentcache's default, `correction.verification`) serves a reuse method on
an edge (the raw re-aligned source, or its correction) only while shadow runs on the edge's dense
calls show it gives the same output, and weighs each segment's reuse against its measured cost
(`correction.costs`); `entropy` is the papers' gate on the anchors' normalized entropy (τ).

CacheBlend and DroidSpeak are selective recomputation: they reuse the aligned source and rebuild
a fixed share 1 − ρ of it under the consumer's own context, CacheBlend the tokens whose KV at an
early layer deviates most, DroidSpeak a group of layers found by profiling the first transitions
(see `correction.selective`). They need an engine with `supports_recompute` (the embedded one).

`kvcomm` follows KVCOMM's reference procedure (`correction.kvcomm`): one gate per shared segment
when it is first needed (T = 1 on raw distances, τ = 0.3), whose rejection makes the segment an
anchor that every consumer prefills densely once; anchors stored at the positions they were
observed at; the template text after each shared segment reused from the agent's template
prefill and corrected too, so a reused call prefills only its last token. `kvcomm_canonical` is
agentcache's earlier construction of the same idea, with the same gate setting: a gate per
consumer and segment, anchors at canonical positions, the text between shared segments prefilled
densely.

Chained: an edge's source is the latest materialization of the segment along the workflow,
and the first agent prefills densely (exact). Non-chained: the source is a context-free
reference (the segment prefilled after a short neutral lead-in, made once when first needed)
or, for an agent's output, the generating agent's cache; every consumer is corrected from it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from agentcache.correction.matching import GATE_SCALES

__all__ = ["Strategy", "STRATEGIES", "get_strategy", "ACCEPTANCE", "KINDS"]

ACCEPTANCE = ("verified", "entropy")
KINDS = ("nonshared", "fullshared", "kvcmas", "kvcomm", "cacheblend", "droidspeak")
RECOMPUTE = {"cacheblend": "tokens", "droidspeak": "layers"}  # selective recomputation: what is rebuilt


@dataclass(frozen=True)
class Strategy:
    name: str
    kind: str = "kvcmas"  # one of KINDS: the strategy class that runs these settings
    chained: bool = True
    base_rank: int | None = 32  # None: full-dimensional
    delta_rank: int | None = 32
    max_anchors: int = 10  # V, per slot
    tau: float = 0.3  # accept a correction when the gate's normalized entropy is at most tau
    # T of the gate's softmax (the token-wise weights always use T = 1), relative to the nearest
    # anchor's distance ("nearest": the same on every model) or on raw distances ("absolute", the paper's T = 1)
    temperature: float = 0.1
    gate_scale: str = "nearest"
    # the reuse ratio (tokens) to hold: after `calibrate_after` eligible segments, tau is read from their
    # gate entropies and then follows every segment, with feedback and a reuse budget
    # (`correction.calibration`); None keeps tau as given
    target_reuse: float | None = None
    calibrate_after: int = 16
    rho: float | None = None  # selective recomputation: the share of the shared KV reused (1 − ρ is rebuilt)
    probe_layer: int = 1  # CacheBlend: the layer whose KV deviation picks the tokens (0..it run for all)
    profile_transitions: int = 2  # DroidSpeak: dense transitions profiled before its layer group is fixed
    accept: str = "entropy"  # "verified": shadow-verified methods, cost-aware; "entropy": the papers' gate
    # verified, chained: siblings dispatched together on a new segment share their leader's prefill
    # (`correction.siblings`). Off by default: on Gemma 3 270M it changed 3 of 20 calls' tokens
    siblings: bool = False

    @property
    def reuse(self) -> bool:
        """Shared segments may be served from another agent's cache (False: NonShared)."""
        return self.kind != "nonshared"

    @property
    def correct(self) -> bool:
        """A reused cache is corrected with anchors (False: served raw or partly recomputed)."""
        return self.kind in ("kvcmas", "kvcomm")

    @property
    def recompute(self) -> str | None:
        """"tokens" (CacheBlend) or "layers" (DroidSpeak): what selective recomputation rebuilds."""
        return RECOMPUTE.get(self.kind)

    @property
    def kvcomm_procedure(self) -> bool:
        """KVCOMM's reference procedure (see `correction.kvcomm`)."""
        return self.kind == "kvcomm"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Strategy.kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("base_rank", "delta_rank"):
            rank = getattr(self, name)
            if rank is not None and (type(rank) is not int or rank < 1):
                raise ValueError(f"Strategy.{name} must be a positive int or None (full rank), got {rank!r}")
        if type(self.max_anchors) is not int or self.max_anchors < 1:
            raise ValueError(f"Strategy.max_anchors must be a positive int, got {self.max_anchors!r}")
        if not 0.0 <= self.tau <= 1.0:
            raise ValueError(f"Strategy.tau is a normalized entropy threshold in [0, 1], got {self.tau!r}")
        if not self.temperature > 0:
            raise ValueError(f"Strategy.temperature must be positive, got {self.temperature!r}")
        if self.gate_scale not in GATE_SCALES:
            raise ValueError(f"Strategy.gate_scale must be one of {GATE_SCALES}, got {self.gate_scale!r}")
        if self.target_reuse is not None and not (isinstance(self.target_reuse, (int, float))
                                                  and 0.0 <= self.target_reuse <= 1.0):
            raise ValueError(f"Strategy.target_reuse must be None or in [0, 1], got {self.target_reuse!r}")
        if type(self.calibrate_after) is not int or self.calibrate_after < 1:
            raise ValueError(f"Strategy.calibrate_after must be a positive int, got {self.calibrate_after!r}")
        if self.recompute is not None:
            if not (isinstance(self.rho, (int, float)) and 0.0 <= self.rho <= 1.0):
                raise ValueError(f"Strategy.rho, the share of the shared KV reused, must be in [0, 1], got {self.rho!r}")
        if type(self.probe_layer) is not int or self.probe_layer < 1:
            raise ValueError(f"Strategy.probe_layer must be an int >= 1 (layer 0 is exact), got {self.probe_layer!r}")
        if type(self.profile_transitions) is not int or self.profile_transitions < 1:
            raise ValueError(f"Strategy.profile_transitions must be a positive int, got {self.profile_transitions!r}")
        if self.accept not in ACCEPTANCE:
            raise ValueError(f"Strategy.accept must be one of {ACCEPTANCE}, got {self.accept!r}")
        if self.accept == "verified" and (self.target_reuse is not None or self.kvcomm_procedure):
            raise ValueError("a target reuse ratio and KVCOMM's procedure steer the entropy gate (accept='entropy')")
        if self.kvcomm_procedure and self.chained:
            raise ValueError("KVCOMM's procedure corrects from non-chained sources (chained=False)")

    def replace(self, **changes) -> "Strategy":
        return dataclasses.replace(self, **changes)


STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("nonshared", kind="nonshared"),
        Strategy("fullshared", kind="fullshared"),
        # KVCOMM evicts only once a pool holds more than 20 anchors, so its pools reach 21
        Strategy("kvcomm", kind="kvcomm", chained=False, base_rank=None, delta_rank=None, max_anchors=21,
                 temperature=1.0, gate_scale="absolute"),
        Strategy("kvcomm_canonical", chained=False, base_rank=None, delta_rank=None, max_anchors=20, temperature=1.0,
                 gate_scale="absolute"),
        Strategy("kvcmas", accept="verified"),
        Strategy("kvcmas_entropy"),
        Strategy("kvcmas_nonchained", chained=False, accept="verified"),
        Strategy("kvcmas_fullrank", base_rank=None, delta_rank=None, accept="verified"),
        Strategy("cacheblend", kind="cacheblend", rho=0.8),
        Strategy("droidspeak", kind="droidspeak", rho=0.8),
    )
}


def get_strategy(strategy: str | Strategy) -> Strategy:
    if isinstance(strategy, Strategy):
        return strategy
    try:
        return STRATEGIES[strategy]
    except KeyError:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {sorted(STRATEGIES)}") from None

"""The contract between a call and its shared-context strategy.

`agentcache.calls` tokenizes a call and hands it to a strategy as a `TokenizedCall`; the strategy
answers with `Planned`: the engine segments to run (`Piece`s) and, per shared (PH) segment, a
`PHDecision`. After the engine ran them, `Served.of` reads the engine's result back per call
segment, and the strategy prepares its learning from it with no lock held and then settles it;
`Served.reports` says how each segment was materialized. Every strategy implements
`SharedContextStrategy`, and the runtime and `agentcache.calls` use no other part of it.
"""

from __future__ import annotations

import itertools

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from agentcache.correction.anchors import AnchorBank
from agentcache.correction.records import Prepared
from agentcache.correction.store import Materialization
from agentcache.engine.kv import SegmentKV, joined, joined_hidden
from agentcache.engine.protocol import ExecResult, SegmentOutcome, SegmentPlan
from agentcache.errors import InputError
from agentcache.idle import Lesson
from agentcache.isolation import Scope
from agentcache.metrics import SegmentReport
from agentcache.segments import Segment

__all__ = ["TokenizedCall", "PHDecision", "Piece", "Planned", "Served", "SharedContextStrategy", "Learned",
           "common_figures"]


@dataclass(frozen=True)
class TokenizedCall:
    """A call's segments (a BOS segment included when the model needs one) and their tokens."""

    agent: str
    scope: Scope
    segments: tuple[Segment, ...]
    token_lists: tuple[tuple[int, ...], ...]
    # per PH segment index: the source a strategy found the segment's tokens in (`refine`)
    origins: Mapping[int, Materialization] = field(default_factory=lambda: MappingProxyType({}), compare=False,
                                                   repr=False)
    prompt: tuple[int, ...] = field(init=False, repr=False)
    starts: tuple[int, ...] = field(init=False, repr=False)  # each segment's first position, the length last

    def __post_init__(self) -> None:
        starts = [0]
        for tokens in self.token_lists:
            starts.append(starts[-1] + len(tokens))
        object.__setattr__(self, "starts", tuple(starts))
        object.__setattr__(self, "prompt", tuple(itertools.chain.from_iterable(self.token_lists)))

    @property
    def fixed_prefix(self) -> int:
        """Tokens in the leading PF segments: the agent's own fixed context (CacheScout's agent prefix)."""
        return next((self.starts[i] for i, seg in enumerate(self.segments) if seg.kind != "pf"), len(self.prompt))


@dataclass(frozen=True)
class PHDecision:
    """How one PH segment is materialized in a call: what every strategy fills, plus its own `detail`."""

    # "first" (no source: dense), "corrected", "reused" (raw), "recomputed" (selective), "fallback" (dense), "off"
    decision: str
    reason: str | None = None  # why it fell back
    source: Materialization | None = None
    covered: int = 0  # leading tokens served by `inject`
    inject: SegmentKV | None = None  # canonical positions (start 0) unless the strategy places it itself
    entropy: float | None = None  # the correction gate's, when one ran
    plan_s: float = 0.0  # time spent planning (inside TTFT)
    setup_s: float = 0.0  # of which reference and template prefills and the gate (KVCOMM leaves them out)
    detail: object | None = field(default=None, repr=False)  # the deciding strategy's own record

    @property
    def reused(self) -> bool:
        return self.inject is not None


@dataclass(frozen=True)
class Piece:
    """One engine segment: a whole call segment, or part of one split where its reuse ends."""

    index: int  # the call segment it belongs to
    plan: SegmentPlan


@dataclass(frozen=True)
class Planned:
    """A strategy's answer for a call: the engine segments in prompt order, and its PH decisions."""

    pieces: tuple[Piece, ...]
    decisions: Mapping[int, PHDecision]  # per PH segment index


@dataclass(frozen=True)
class Served:
    """A finished call's segments as the engine served them (per call segment, in order)."""

    call: TokenizedCall
    outcomes: tuple[tuple[SegmentOutcome, ...], ...]  # the engine segments each call segment became
    decisions: Mapping[int, PHDecision]  # the plan's, as the engine served them
    result: ExecResult
    kvs: tuple[SegmentKV | None, ...]  # each segment's KV, when it came back
    hiddens: tuple[torch.Tensor | None, ...]  # (T, hidden size) each, when the strategy asked for them
    greedy: bool = True  # the call decoded greedily: its tokens are the model's argmax continuation

    @classmethod
    def of(cls, call: TokenizedCall, planned: Planned, result: ExecResult, *, greedy: bool = True) -> Served:
        grouped: list[list[SegmentOutcome]] = [[] for _ in call.segments]
        for piece, outcome in zip(planned.pieces, result.segments):
            grouped[piece.index].append(outcome)
        outcomes = tuple(map(tuple, grouped))
        return cls(call, outcomes, MappingProxyType(_as_served(planned.decisions, grouped)), result,
                   tuple(joined([o.kv for o in parts]) for parts in outcomes),
                   tuple(joined_hidden([o.hidden for o in parts]) for parts in outcomes), greedy)

    def shared(self) -> Iterator[tuple[int, Segment, Sequence[int], PHDecision, str, SegmentKV | None]]:
        """(index, segment, tokens, decision, how, kv) of every PH segment: `how` is the decision
        when the segment was reused, else how the engine made it (dense, or a prefix hit)."""
        for index, (seg, tokens) in enumerate(zip(self.call.segments, self.call.token_lists)):
            if seg.kind != "ph":
                continue
            made = _made(self.outcomes[index], len(tokens))
            decision = self.decisions.get(index) or PHDecision(made)
            yield index, seg, tokens, decision, decision.decision if decision.reused else made, self.kvs[index]

    def reports(self) -> list[SegmentReport]:
        """How each call segment was materialized. A segment served whole from the prefix cache is a
        `prefix_hit` when every block was exact, an `own_lineage_hit` when some came from the caller's
        own approximate lineage: never counted as exact."""
        out = []
        for index, (seg, tokens, parts) in enumerate(zip(self.call.segments, self.call.token_lists, self.outcomes)):
            decision = self.decisions.get(index)
            out.append(SegmentReport(
                name=seg.name, kind=seg.kind, start=parts[0].start, length=len(tokens),
                decision=decision.decision if decision is not None else _made(parts, len(tokens)),
                reason=decision.reason if decision else None, cached_tokens=sum(o.cached_tokens for o in parts),
                computed_tokens=sum(o.computed_tokens for o in parts),
                injected_tokens=sum(o.injected_tokens for o in parts),
                entropy=decision.entropy if decision else None,
                source=decision.source.agent if decision and decision.source else None,
                plan_s=decision.plan_s if decision else 0.0, setup_s=decision.setup_s if decision else 0.0,
                lineage_tokens=sum(o.lineage_tokens for o in parts),
                recomputed_tokens=sum(o.recomputed_tokens for o in parts),
                prefill_tokens=sum(o.prefill_tokens for o in parts),
            ))
        return out


def _made(parts: Sequence[SegmentOutcome], length: int) -> str:
    """How the engine materialized a segment it was not asked to inject."""
    cached = sum(o.cached_tokens for o in parts)
    return "dense" if cached < length else "own_lineage_hit" if any(o.lineage_tokens for o in parts) else "prefix_hit"


def _as_served(decisions: Mapping[int, PHDecision], outcomes: list[list[SegmentOutcome]]) -> dict[int, PHDecision]:
    """The plan's decisions as the engine served them: a reused segment the prefix cache covered
    whole at admission (nothing injected) was a prefix hit, not a reuse; one the engine computed
    itself instead (vLLM lost a phase's blocks, or the injected KV failed to load) is exact, and a
    fallback of its own."""
    served = dict(decisions)
    for index, decision in decisions.items():
        if decision.reused and not any(o.injected_tokens for o in outcomes[index]):
            computed = any(o.computed_tokens for o in outcomes[index])
            served[index] = PHDecision("fallback", reason="engine_recomputed" if computed else "prefix_covers_source",
                                       source=decision.source)
    return served


@dataclass(frozen=True)
class Learned:
    """What a strategy learns that outlives the process (`correction.persist`): its anchor pools,
    its edges' verification records, and the settings they were learned under."""

    bank: AnchorBank
    verification: object  # a `verification.Verification`
    settings: object  # the `strategies.Strategy`


def common_figures(settings) -> dict:
    """The figures every strategy reports in `Runtime.summary()`, zero where it keeps no such state."""
    return dict(anchors=0, anchor_bytes=0, anchors_evicted=0, store_bytes=0, store_entries=0, anchor_build_s=0.0,
                anchor_dense_bytes=0, gate_tau=settings.tau, gate_calibration=None, acceptance=settings.accept,
                faults={})


class SharedContextStrategy(ABC):
    """What every shared-context strategy does for a call (see the module's description)."""

    caches_approximate = True  # a reused segment's KV is cached in the caller's lineage for its later turns

    @abstractmethod
    def plan_call(self, call: TokenizedCall, *, lineage: str, namespace: str | None,
                  capture_all: bool = False) -> Planned:
        """The engine segments and PH decisions for `call`. `lineage` and `namespace` salt what the
        call may be served from the prefix cache; `capture_all`: every segment's KV comes back."""

    def refine(self, call: TokenizedCall) -> TokenizedCall:
        """The call as the strategy plans it: by default as tokenized; a strategy may split shared
        segments where it finds their tokens in earlier materializations (`TokenizedCall.origins`).
        Called under the runtime's lock, right before `plan_call`."""
        return call

    def awaited(self, call: TokenizedCall) -> tuple[Future, ...]:
        """Work in flight (shared segments being prefilled) the call should wait for, with no lock
        held, before it is planned; none by default."""
        return ()

    def prepare(self, served: Served) -> Prepared:
        """Learning that needs no strategy state to change (it runs with no runtime lock held)."""
        return Prepared()

    @abstractmethod
    def settle(self, served: Served, prepared: Prepared | None = None) -> None:
        """Record what the call's segments became (with the anchors `prepare` built, when given)."""

    def refused(self, decisions: Mapping[int, PHDecision], exc: BaseException, agent: str) -> None:
        """The engine refused the reused KV of these decisions (`agent`'s call): never offer it again."""

    @abstractmethod
    def fault(self, kind: str, what: str, exc: BaseException | None = None) -> None:
        """Count and log one fault the call's owner met (`kind` is what the figures report)."""

    def forget(self, scope: Scope) -> None:
        """A session ended: drop what the strategy keeps for it."""

    def calibrate(self, target: float, recent: int | None = None) -> float:
        """Hold the strategy's correction gate at reuse ratio `target`; returns its threshold."""
        raise InputError(f"{type(self).__name__} has no correction gate to calibrate")

    def hidden_layer(self, scope: Scope) -> int | None:
        """The decoder layer whose input hidden states a call should hand back; None: none."""
        return None

    def lessons(self, served: Served) -> list[Lesson]:
        """What the settled call teaches, to be learned when the engine is idle (`agentcache.idle`)."""
        return []

    def held_bytes(self) -> dict[str, int]:
        """The bytes the strategy holds now: anchor pools and source caches (cheap, for a per-call watch)."""
        return dict(anchor_bytes=0, store_bytes=0)

    def learned(self) -> Learned | None:
        """The anchor pools and verification records to persist; None: the strategy learns none."""
        return None

    def figures(self) -> dict:
        """The strategy's own figures for `Runtime.summary()` (`common_figures` and more)."""
        return {}

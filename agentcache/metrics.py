"""Per-call results, aggregate figures kept incrementally, the call log, and sinks that stream records out.

A long-lived runtime never re-reads its history: `Figures` folds each call into counters and a
bounded reservoir of TTFTs (exact percentiles up to `RESERVOIR` calls, a uniform sample after),
and `CallLog` keeps per-call records and dispatch events in a bounded ring, counts dispatches, and
hands each record to a callback such as `JsonlSink` if asked.
"""

from __future__ import annotations

import json
import logging
import random
import threading
from array import array
from collections import Counter, deque
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from agentcache.engine.kv import SegmentKV
from agentcache.engine.protocol import ExecResult
from agentcache.errors import InputError
from agentcache.segments import DispatchEvent

__all__ = ["SegmentReport", "CallResult", "Figures", "CallLog", "JsonlSink", "summarize", "percentile", "RESERVOIR"]

log = logging.getLogger(__name__)

RESERVOIR = 10_000  # TTFTs kept for percentiles: exact up to this many calls, a uniform sample after
DISPATCH_KEYS = 1024  # distinct framework:agent keys counted apart; the rest count as "(other)"


@dataclass(frozen=True)
class SegmentReport:
    name: str  # "pf" or the PH slot
    kind: str  # "pf" or "ph"
    start: int
    length: int
    # "prefix_hit", "own_lineage_hit", "dense", "first", "corrected", "reused", "recomputed", "fallback", "off"
    decision: str
    reason: str | None  # why a PH segment fell back to dense
    cached_tokens: int
    computed_tokens: int
    injected_tokens: int
    entropy: float | None = None
    source: str | None = None  # the agent whose cache was the source (corrected/reused/fallback)
    plan_s: float = 0.0  # looking up, gating and correcting it (inside TTFT)
    # inside the call's TTFT: reference and template prefills and the gate, which KVCOMM's own TTFT
    # leaves out (it makes them before the consumer's call)
    setup_s: float = 0.0
    lineage_tokens: int = 0  # of cached_tokens, served by the caller's own approximate lineage blocks
    recomputed_tokens: float = 0.0  # of injected_tokens, tokens' worth rebuilt by selective recomputation
    prefill_tokens: float = 0.0  # prefill work in full-forward tokens: computed, recomputed, probed


@dataclass(frozen=True)
class CallResult:
    agent: str
    text: str
    token_ids: list[int]
    finish_reason: str
    ttft_s: float  # from entering the runtime to the first token, correction work included
    queued_s: float  # of which waiting for the runtime: other calls (a fan-out's siblings) or a warm-up
    total_s: float  # to the last token, plus anchor construction after it
    prompt_tokens: int
    cached_tokens: int  # prefix hits: exact blocks and the caller's own lineage (see lineage_tokens)
    ph_tokens: int  # tokens of shared segments
    eligible_tokens: int  # PH tokens with a source cache and no prefix hit: could be reused
    reused_tokens: float  # PH tokens injected (corrected or raw), less what selective recomputation rebuilt
    segments: list[SegmentReport]
    # Kept only with RuntimeConfig(keep_kv=True): the engine's result and each segment's KV.
    engine_result: ExecResult | None = field(default=None, repr=False, compare=False)
    segment_kv: list[SegmentKV | None] = field(default_factory=list, repr=False, compare=False)
    prompt_ids: list[int] = field(default_factory=list, repr=False, compare=False)
    event: DispatchEvent | None = None  # the adapter's dispatch event for this call
    session: str | None = None
    tenant: str | None = None
    lineage_tokens: int = 0  # of cached_tokens, approximate: the caller's own lineage blocks

    @classmethod
    def of(cls, call: Any, event: DispatchEvent | None, segments: list[SegmentReport], result: ExecResult,
           prompt: Sequence[int], *, ttft_s: float, queued_s: float, total_s: float,
           kvs: Sequence[SegmentKV | None] | None = None) -> CallResult:
        """The record of an `AgentCall` the engine served (`result`) with these segment reports;
        `kvs` (each segment's KV) keeps the KV and the engine's result on the record."""
        shared = [r for r in segments if r.kind == "ph"]
        return cls(
            agent=call.agent, text=result.text, token_ids=result.token_ids, finish_reason=result.finish_reason,
            ttft_s=ttft_s, queued_s=queued_s, total_s=total_s, event=event, prompt_tokens=result.prompt_tokens,
            cached_tokens=result.cached_tokens, lineage_tokens=sum(r.lineage_tokens for r in segments),
            session=call.session, tenant=call.tenant, ph_tokens=sum(r.length for r in shared),
            eligible_tokens=sum(r.length - r.cached_tokens for r in shared if r.source is not None),
            reused_tokens=sum(r.injected_tokens - r.recomputed_tokens for r in shared),
            segments=segments, prompt_ids=list(prompt),
            engine_result=result if kvs is not None else None, segment_kv=list(kvs) if kvs is not None else [],
        )

    @property
    def exact_cached_tokens(self) -> int:
        return self.cached_tokens - self.lineage_tokens

    @property
    def prefill_tokens(self) -> float:
        """The prompt's prefill work in full-forward tokens (what each strategy actually computed)."""
        return sum(s.prefill_tokens for s in self.segments)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _NOT_EXPORTED} | {
            "segments": [asdict(s) for s in self.segments],
            "event": self.event.model_dump() if self.event is not None else None,
        }


_NOT_EXPORTED = ("engine_result", "segment_kv", "prompt_ids")


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


class Figures:
    """Aggregate figures over calls, updated per call in O(1): hit rate, reuse ratio, TTFT
    percentiles, decisions. Thread-safe."""

    def __init__(self, reservoir: int = RESERVOIR) -> None:
        self._lock = threading.Lock()
        self._reservoir = reservoir
        self._ttfts = array("d")
        self._rng = random.Random(0)  # reservoir sampling (Algorithm R), reproducible
        self.calls = 0
        self._sums: Counter[str] = Counter()
        self.ph_decisions: Counter[str] = Counter()
        self.fallback_reasons: Counter[str] = Counter()

    def add(self, result: CallResult) -> None:
        with self._lock:
            self.calls += 1
            sums = self._sums
            sums["prompt"] += result.prompt_tokens
            sums["cached"] += result.exact_cached_tokens
            sums["lineage"] += result.lineage_tokens
            sums["ph"] += result.ph_tokens
            sums["eligible"] += result.eligible_tokens
            sums["reused"] += result.reused_tokens
            sums["prefill"] += result.prefill_tokens
            sums["ttft"] += result.ttft_s
            sums["queued"] += result.queued_s
            for seg in result.segments:
                if seg.kind == "ph":
                    self.ph_decisions[seg.decision] += 1
                if seg.reason:
                    self.fallback_reasons[seg.reason] += 1
            if len(self._ttfts) < self._reservoir:
                self._ttfts.append(result.ttft_s)
            else:
                slot = self._rng.randrange(self.calls)
                if slot < self._reservoir:
                    self._ttfts[slot] = result.ttft_s

    def to_dict(self) -> dict[str, Any]:
        with self._lock:
            n, sums, ttfts = self.calls, self._sums, list(self._ttfts)
            prompt, eligible = sums["prompt"], sums["eligible"]
            return {
                "calls": n,
                "prompt_tokens": prompt,
                "cached_tokens": sums["cached"],  # exact prefix hits only
                "hit_rate": sums["cached"] / prompt if prompt else 0.0,
                # the caller's own approximate lineage blocks: reuse, never counted as exact hits
                "own_lineage_tokens": sums["lineage"],
                "own_lineage_hit_rate": sums["lineage"] / prompt if prompt else 0.0,
                "ph_tokens": sums["ph"],
                "eligible_tokens": eligible,
                "reused_tokens": sums["reused"],
                "reuse_ratio": sums["reused"] / eligible if eligible else 0.0,
                "prefill_tokens": sums["prefill"],  # prefill work in full-forward tokens
                "ttft_mean_s": sums["ttft"] / n if n else None,
                "ttft_p50_s": percentile(ttfts, 50),
                "ttft_p90_s": percentile(ttfts, 90),
                "ttft_p99_s": percentile(ttfts, 99),
                "ttft_percentiles_exact": n <= self._reservoir,
                # TTFT less the wait for other calls: what the call itself cost (prefill, correction)
                "service_ttft_mean_s": (sums["ttft"] - sums["queued"]) / n if n else None,
                "queued_mean_s": sums["queued"] / n if n else None,
                "ph_decisions": dict(self.ph_decisions),
                "fallback_reasons": dict(self.fallback_reasons),
            }


def summarize(results: Iterable[CallResult]) -> dict[str, Any]:
    """Aggregate figures over some calls (e.g. one strategy's), as `Runtime.summary()` keeps them."""
    figures = Figures()
    for result in results:
        figures.add(result)
    return figures.to_dict()


class CallLog:
    """The newest `keep` calls' records and dispatch events, dispatch counts per framework and
    agent, aggregate `figures`, and the `on_call` sink. Thread-safe: records are read while calls run."""

    def __init__(self, keep: int, on_call: Callable[[CallResult], None] | None = None) -> None:
        if on_call is not None and not callable(on_call):
            raise InputError(f"Runtime(on_call=...) must be callable or None, got {type(on_call).__name__}")
        self._results: deque[CallResult] = deque(maxlen=keep)
        self._events: deque[DispatchEvent] = deque(maxlen=keep)
        self._dispatches: Counter[str] = Counter()
        self._lock = threading.Lock()
        self.figures = Figures()
        self.on_call = on_call
        self.sink_faults = 0

    def record(self, result: CallResult) -> None:
        """A finished call: kept, counted, and its dispatch event (if any) with it."""
        with self._lock:
            self._results.append(result)
            event = result.event
            if event is not None:
                self._events.append(event)
                key = f"{event.framework}:{event.agent}"
                self._dispatches[key if key in self._dispatches or len(self._dispatches) < DISPATCH_KEYS
                                 else "(other)"] += 1
        self.figures.add(result)

    def emit(self, result: CallResult) -> None:
        """Hand a finished call's record to `on_call`; a failing sink is counted, never the call's fault."""
        if self.on_call is None:
            return
        try:
            self.on_call(result)
        except Exception as exc:  # noqa: BLE001
            with self._lock:
                self.sink_faults += 1
            log.warning("sink_error: the on_call sink raised; the call's record was not kept there (%s: %s)",
                        type(exc).__name__, exc)

    @property
    def results(self) -> list[CallResult]:
        with self._lock:
            return list(self._results)

    @property
    def events(self) -> list[DispatchEvent]:
        with self._lock:
            return list(self._events)

    def dispatch_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._dispatches)

    @staticmethod
    def export_json(path: str | Path, summary: dict[str, Any], calls: Iterable[CallResult]) -> Path:
        """`summary` and the calls' records as one JSON file."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"summary": summary, "calls": [r.to_dict() for r in calls]}, indent=2))
        return path


class JsonlSink:
    """A per-call callback that appends each call's record to a JSON-lines file (one object a line):
    `Runtime(..., on_call=JsonlSink("calls.jsonl"))` streams records out instead of holding them."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def __call__(self, result: CallResult) -> None:
        line = json.dumps(result.to_dict(), default=str)
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()

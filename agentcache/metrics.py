"""Per-call results and aggregate figures of a runtime, and their JSON form."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from agentcache.engine.kv import SegmentKV
from agentcache.engine.protocol import ExecResult
from agentcache.segments import DispatchEvent

__all__ = ["SegmentReport", "CallResult", "summarize", "percentile"]


@dataclass(frozen=True)
class SegmentReport:
    name: str  # "pf" or the PH slot
    kind: str  # "pf" or "ph"
    start: int
    length: int
    decision: str  # "prefix_hit", "dense", "first", "corrected", "reused", "fallback", "off"
    reason: str | None  # why a PH segment fell back to dense
    cached_tokens: int
    computed_tokens: int
    injected_tokens: int
    entropy: float | None = None
    source: str | None = None  # the agent whose cache was the source (corrected/reused/fallback)
    plan_s: float = 0.0  # looking up, gating and correcting it (inside TTFT)


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
    cached_tokens: int  # exact (or own-lineage) prefix hits
    ph_tokens: int  # tokens of shared segments
    eligible_tokens: int  # PH tokens with a source cache and no prefix hit: could be reused
    reused_tokens: int  # PH tokens injected (corrected or raw)
    segments: list[SegmentReport]
    # Kept only with RuntimeConfig(keep_kv=True): the engine's result and each segment's KV.
    engine_result: ExecResult | None = field(default=None, repr=False, compare=False)
    segment_kv: list[SegmentKV | None] = field(default_factory=list, repr=False, compare=False)
    prompt_ids: list[int] = field(default_factory=list, repr=False, compare=False)
    event: DispatchEvent | None = None  # the adapter's dispatch event for this call

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


def summarize(results: list[CallResult]) -> dict[str, Any]:
    """Aggregate figures over calls: hit rate, reuse ratio, TTFT percentiles, decisions."""
    prompt = sum(r.prompt_tokens for r in results)
    cached = sum(r.cached_tokens for r in results)
    eligible = sum(r.eligible_tokens for r in results)
    reused = sum(r.reused_tokens for r in results)
    ttfts = [r.ttft_s for r in results]
    decisions = Counter(s.decision for r in results for s in r.segments if s.kind == "ph")
    reasons = Counter(s.reason for r in results for s in r.segments if s.reason)
    return {
        "calls": len(results),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "ph_tokens": sum(r.ph_tokens for r in results),
        "eligible_tokens": eligible,
        "reused_tokens": reused,
        "reuse_ratio": reused / eligible if eligible else 0.0,
        "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else None,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "ttft_p99_s": percentile(ttfts, 99),
        # TTFT less the wait for other calls: what the call itself cost (prefill, correction)
        "service_ttft_mean_s": sum(r.ttft_s - r.queued_s for r in results) / len(results) if results else None,
        "queued_mean_s": sum(r.queued_s for r in results) / len(results) if results else None,
        "ph_decisions": dict(decisions),
        "fallback_reasons": dict(reasons),
    }

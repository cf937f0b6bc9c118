"""`/metrics`: the server's figures in the Prometheus text format (prometheus_client).

Per call, labelled by agent: TTFT and queueing histograms, requests by outcome, prompt, cached
and reused tokens. Per segment: the strategy's decisions. From the runtime when scraped: hit rate,
reuse ratio, faults by kind, cancelled calls, and the requests in flight. The agent label set is
bounded (`AgentLabels`): each tenant's first `max_agents` agents keep their names, later ones count as
"other", so a client that names an agent per request cannot grow the series without bound.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from agentcache.metrics import CallResult
    from agentcache.runtime import Runtime

__all__ = ["ServeMetrics", "AgentLabels", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# every decision a segment report can carry (metrics.SegmentReport.decision): a fixed label set
_DECISIONS = ("prefix_hit", "own_lineage_hit", "dense", "first", "corrected", "reused", "recomputed", "fallback", "off")
OTHER = "other"


class AgentLabels:
    """The agent label of each agent name: its own for each tenant's first `limit` agents, "other" after.

    Bounded per tenant (a salted tenant "<tenant>#<salt>" counts as its tenant), so one tenant naming
    an agent per request fills only its own share; with names bounded in length (`identity`), the
    scrape stays bounded too. Tenants with the same agent name share its series."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._known: dict[str | None, set[str]] = {}  # tenant -> agents labelled by name
        self._lock = threading.Lock()

    def __call__(self, agent: str, tenant: str | None = None) -> str:
        owner = None if tenant is None else tenant.partition("#")[0]
        with self._lock:
            known = self._known.setdefault(owner, set())
            if agent in known:
                return agent
            if len(known) < self.limit:
                known.add(agent)
                return agent
        return OTHER


class ServeMetrics:
    def __init__(self, runtime: "Runtime", max_agents: int = 32) -> None:
        self.registry = CollectorRegistry()
        self.label = AgentLabels(max_agents)
        r = self.registry
        self.ttft = Histogram("agentcache_ttft_seconds", "Time to first token, from the call reaching the runtime",
                              ["agent"], buckets=_SECONDS, registry=r)
        self.queued = Histogram("agentcache_queue_seconds", "Of the TTFT, time waiting behind other calls",
                                ["agent"], buckets=_SECONDS, registry=r)
        self.requests = Counter("agentcache_requests", "Chat completion requests by outcome", ["agent", "outcome"],
                                registry=r)
        self.prompt_tokens = Counter("agentcache_prompt_tokens", "Prompt tokens served", ["agent"], registry=r)
        self.cached_tokens = Counter("agentcache_cached_tokens", "Prompt tokens served from the prefix cache",
                                     ["agent"], registry=r)
        self.reused_tokens = Counter("agentcache_reused_tokens",
                                     "Shared-context tokens whose KV was reused (corrected) instead of prefilled",
                                     ["agent"], registry=r)
        self.decisions = Counter("agentcache_segment_decisions", "Shared-segment decisions", ["decision"], registry=r)
        self.rejected = Counter("agentcache_rejected_requests",
                                "Requests refused before running (429 queue full, 413 too large)", ["reason"],
                                registry=r)
        self.in_flight = Gauge("agentcache_requests_in_flight", "Chat completion requests being served", registry=r)
        r.register(_RuntimeFigures(runtime))

    def observe(self, result: "CallResult") -> None:
        """A finished call (the runtime's `on_call` sink)."""
        agent = self.label(result.agent, result.tenant)
        self.ttft.labels(agent).observe(result.ttft_s)
        self.queued.labels(agent).observe(result.queued_s)
        self.prompt_tokens.labels(agent).inc(result.prompt_tokens)
        self.cached_tokens.labels(agent).inc(result.cached_tokens)
        self.reused_tokens.labels(agent).inc(result.reused_tokens)
        for segment in result.segments:
            if segment.kind == "ph":
                self.decisions.labels(segment.decision if segment.decision in _DECISIONS else OTHER).inc()

    def outcome(self, agent: str, tenant: str | None, outcome: str) -> None:
        self.requests.labels(self.label(agent, tenant), outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _RuntimeFigures(Collector):
    """The runtime's aggregate figures, read when scraped."""

    def __init__(self, runtime: "Runtime") -> None:
        self.runtime = runtime

    def collect(self) -> Iterator:
        summary = self.runtime.summary()
        yield GaugeMetricFamily("agentcache_hit_rate", "Exact prefix-cache hits over prompt tokens",
                                value=summary["hit_rate"])
        yield GaugeMetricFamily("agentcache_reuse_ratio", "Reused over reusable shared-context tokens",
                                value=summary["reuse_ratio"])
        if "anchors" in summary:
            yield GaugeMetricFamily("agentcache_anchors", "Anchors in the strategy's pools", value=summary["anchors"])
        if "verified_edges" in summary:
            yield GaugeMetricFamily("agentcache_verified_edges",
                                    "Producer-to-consumer edges whose reuse was judged by a shadow run",
                                    value=summary["verified_edges"])
        if "shadow_runs" in summary:  # verified acceptance: what its checks saw since start
            yield CounterMetricFamily("agentcache_shadow_runs", "Verdicts on a reuse method: shadow runs and audits",
                                      value=summary["shadow_runs"])
            yield CounterMetricFamily("agentcache_audits", "Served reuses replayed densely, per edge the call reused",
                                      value=summary["audits"])
            yield CounterMetricFamily("agentcache_audit_disagreements",
                                      "Audits (per edge) whose dense replay gave another output than the served call",
                                      value=summary["audit_disagreements"])
        if "anchors_loaded" in summary:
            yield GaugeMetricFamily("agentcache_anchors_loaded", "Anchors loaded from the persisted pools at start",
                                    value=summary["anchors_loaded"])
            yield CounterMetricFamily("agentcache_anchors_pulled", "Anchors other instances stored, taken in since start",
                                      value=summary["anchors_pulled"])
            yield CounterMetricFamily("agentcache_anchor_saves", "Anchor blobs this instance wrote to the shared store",
                                      value=summary["anchor_saves"])
        calls = CounterMetricFamily("agentcache_calls", "Calls the runtime finished")
        calls.add_metric([], summary["calls"])
        yield calls
        cancelled = CounterMetricFamily("agentcache_cancelled_calls", "Calls cancelled by their clients (disconnects)")
        cancelled.add_metric([], summary["cancelled_calls"])
        yield cancelled
        faults = CounterMetricFamily("agentcache_faults", "Faults that fell back to exact computation", labels=["kind"])
        for kind, count in sorted(summary["faults"].items()):
            faults.add_metric([kind], count)
        yield faults
        fallbacks = CounterMetricFamily("agentcache_fallbacks", "Shared segments prefilled instead of reused, by reason",
                                        labels=["reason"])
        for reason, count in sorted(summary["fallback_reasons"].items()):
            fallbacks.add_metric([reason], count)
        yield fallbacks

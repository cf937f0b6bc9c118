"""Where a shared segment's source cache comes from: chained or non-chained.

Chained (KVCMAS): the source of an edge is the latest materialization of the segment along the
workflow (or the named agent's), so the first agent prefills densely and every later one is
corrected from its predecessor; with `prefer_exact` (verified KVCMAS), of materializations sharing
as much, the first exact one (prefilled, or a prefix hit) goes before any that was itself reused:
an approximate hop's error would compound down the chain, and the first exact one is the same
producer on every run of a workflow (whichever consumers also prefilled), so its edges stay the
ones verification has records for. Non-chained (KVCOMM, the ablation): the source is a context-free
reference, the segment prefilled once after a short lead-in outside the workflow, or for an
agent's output the generating agent's own cache.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from agentcache.correction.store import Materialization, SegmentStore
from agentcache.engine.kv import SegmentKV
from agentcache.engine.protocol import Engine, ExecRequest, ExecResult, SamplingParams, SegmentPlan, Step
from agentcache.isolation import Scope, tenant_salt

__all__ = ["SourceFinder", "REFERENCE", "NEUTRAL_LEAD_IN", "reference_request", "reference_kv"]

REFERENCE = "<reference>"  # the pseudo-agent of context-free reference prefills
NEUTRAL_LEAD_IN = "\n"  # what precedes a segment in its reference prefill (then dropped)


class SourceFinder:
    def __init__(self, engine: Engine, store: SegmentStore, chained: bool, prefer_exact: bool = False) -> None:
        self.engine = engine
        self.store = store
        self.chained = chained
        self.prefer_exact = prefer_exact
        self.reference_s = 0.0  # context-free reference prefills (non-chained), on consumers' critical paths

    def find(self, scope: Scope, slot: str, token_ids: Sequence[int], agent: str | None,
             lead_in: Sequence[int] | None = None) -> tuple[Materialization, int] | None:
        """The source of this segment and how many of its leading tokens it shares; `agent` pins a
        chained edge's source agent, `lead_in` is what a reference prefill puts before the segment."""
        if self.chained:
            return self.store.find(scope, slot, token_ids, agent=agent, prefer_exact=self.prefer_exact)
        if slot.startswith("out:"):  # non-chained: an output's reference is its generator's cache
            return self.store.find(scope, slot, token_ids, agent=slot[4:])
        found = self.store.find(scope, slot, token_ids, agent=REFERENCE)
        if found is None or found[1] < len(token_ids):
            entry = self._reference_prefill(scope, slot, token_ids, lead_in)
            found = (entry, len(token_ids)) if entry is not None else found
        return found

    def _reference_prefill(self, scope: Scope, slot: str, token_ids: Sequence[int],
                           lead_in: Sequence[int] | None = None) -> Materialization | None:
        """Prefill the segment after `lead_in` (BOS and a neutral newline by default), outside the workflow."""
        started = time.perf_counter()
        # on the first consumer's critical path: a real request's priority and chunks
        result = self.engine.execute(reference_request(self.engine, scope, slot, token_ids, lead_in))
        self.reference_s += time.perf_counter() - started
        return self.store.put(scope, slot, REFERENCE, token_ids, reference_kv(result), "reference")


def reference_request(engine: Engine, scope: Scope, slot: str, token_ids: Sequence[int],
                      lead_in: Sequence[int] | None = None, priority: int = 0) -> ExecRequest:
    """A prefill of a segment after `lead_in` (by default BOS and a neutral newline: a context-free
    reference), whose KV `reference_kv` reads from the result. The runtime's own request
    (no agent dispatch, no hit in the statistics), cached in the scope's tenant namespace only."""
    lead = list(lead_in) if lead_in else engine.tokenize(NEUTRAL_LEAD_IN, bos=True)
    return ExecRequest(
        [SegmentPlan("lead-in", lead, Step.PREFIX, capture=False), SegmentPlan(slot, list(token_ids), Step.PREFIX)],
        SamplingParams(max_tokens=1), owner=REFERENCE, internal=True, priority=priority,
        cache_salt=tenant_salt(scope.tenant))


def reference_kv(result: ExecResult) -> SegmentKV:
    """The segment's KV in a `reference_request`'s result (the lead-in's is not captured)."""
    lead_in, segment = result.segments
    return segment.kv

"""Replays of a finished call on the engine, judged against what the call served: the evidence
verified acceptance (`correction.verification`) decides on.

- `shadow_run`: a call whose shared segment was prefilled densely, replayed with that segment
  served by a reuse method (its re-aligned or corrected source): would reuse have given the same
  output?
- `dense_replay`: a call that was served reused KV, replayed with every segment prefilled: did the
  reuse give the same output? (an audit)

Both are the runtime's own requests (`internal`: no agent dispatch, no hit in the statistics),
wait behind real calls for admission (but an edge's first shadow run, which every later call on
the edge waits for), cache no approximate KV (no lineage) and read exact blocks
only in the caller's tenant namespace. Greedy calls are compared on up to SHADOW_TOKENS tokens;
a sampled call on its most likely next token only.
"""

from __future__ import annotations

import torch

from agentcache.correction.plan import Served
from agentcache.correction.verification import SHADOW_TOKENS, Verdict, compare_outputs
from agentcache.engine.kv import SegmentKV
from agentcache.engine.protocol import Engine, ExecRequest, ExecResult, SamplingParams, SegmentPlan, Step
from agentcache.isolation import tenant_salt

__all__ = ["shadow_run", "dense_replay", "exact_reference", "REPLAY_PRIORITY", "FIRST_VERDICT_PRIORITY"]

REPLAY_PRIORITY = 1  # admitted after real calls (lower runs first)
FIRST_VERDICT_PRIORITY = 0  # an edge's first shadow run: as a call, since every later call of the edge waits on it


def shadow_run(engine: Engine, served: Served, index: int, shared: int, reused: SegmentKV, method: str,
               priority: int = REPLAY_PRIORITY) -> Verdict:
    """Replay `served` with segment `index`'s first `shared` tokens served by `reused` (canonical
    positions) and judge its output against the call's own (which prefilled that segment)."""
    call = served.call
    plans = []
    for i, (seg, tokens) in enumerate(zip(call.segments, call.token_lists)):
        if i == index:
            plans.append(SegmentPlan(seg.slot, tokens[:shared], Step.INJECT, reused))
            tokens = tokens[shared:]
        if tokens:
            plans.append(SegmentPlan(seg.name, tokens, Step.PREFIX, capture=False))
    # The dense call just cached this very prompt's exact blocks: served from them, the shadow would
    # judge exact KV instead of the reused one. The cache serves it up to the reused segment only.
    start = sum(len(tokens) for tokens in call.token_lists[:index])
    shadow = _replay(engine, served, plans, lookup_limit=start, priority=priority)
    return compare_outputs(method, served.result.last_logits, _greedy_tokens(served, served.result),
                           shadow.last_logits, shadow.token_ids)


def dense_replay(engine: Engine, served: Served, methods: list[str]) -> list[Verdict]:
    """Replay `served` (which reused KV) with every segment prefilled; a verdict on each method it
    used, its served output judged against the replay's."""
    call = served.call
    plans = [SegmentPlan(seg.name, tokens, Step.PREFIX, capture=False)
             for seg, tokens in zip(call.segments, call.token_lists)]
    exact = _replay(engine, served, plans)
    return [compare_outputs(method, exact.last_logits, _greedy_tokens(served, exact),
                            served.result.last_logits, served.result.token_ids) for method in methods]


def exact_reference(served: Served, index: int) -> bool:
    """Whether the call is exact everywhere but possibly segment `index`: then its output is the
    reference a shadow run of that segment is judged against."""
    if not isinstance(served.result.last_logits, torch.Tensor):
        return False
    if any(d.reused for i, d in served.decisions.items() if i != index):
        return False
    return not any(o.lineage_tokens for parts in served.outcomes for o in parts)


def _replay(engine: Engine, served: Served, plans: list[SegmentPlan], lookup_limit: int | None = None,
            priority: int = REPLAY_PRIORITY) -> ExecResult:
    tokens = max(1, min(SHADOW_TOKENS, len(served.result.token_ids))) if served.greedy else 1
    return engine.execute(ExecRequest(
        plans, SamplingParams(max_tokens=tokens), cache_salt=tenant_salt(served.call.scope.tenant),
        internal=True, capture_kv=False, priority=priority, lookup_limit=lookup_limit))  # lineage None: nothing approximate is cached


def _greedy_tokens(served: Served, reference: ExecResult) -> list[int] | None:
    """The reference's tokens to compare, when the call decoded greedily (else None)."""
    return list(reference.token_ids) if served.greedy else None

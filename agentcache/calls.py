"""One agent call between the runtime and the engine: its plan, and what it became.

`awaited_context` tokenizes a call and asks the strategy what shared context in flight it should
wait for first (siblings' reference prefill). `plan_call` asks the strategy how to materialize
the call, and builds the engine
request, salted for the caller's tenant and lineage, into an immutable `CallPlan` (its `planned`
part is what `correction.plan.Served.of` reads the engine's result back with). Nothing here knows
which strategy runs, takes a lock, or keeps state: the runtime calls it under its lock, and the
self-check drives it directly.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, replace
from types import MappingProxyType

from agentcache.correction.plan import Piece, Planned, PHDecision, SharedContextStrategy, TokenizedCall
from agentcache.engine.protocol import Engine, ExecRequest, SamplingParams, SegmentPlan, Step
from agentcache.errors import InputError, PlanError, SegmentError
from agentcache.isolation import Scope, engine_session, lineage_salt, tenant_salt
from agentcache.segments import AgentCall, Segment

__all__ = ["CallPlan", "awaited_context", "plan_call", "tokenize_call"]


@dataclass(frozen=True)
class CallPlan:
    """What a call will ask of the engine, decided once and never changed afterwards."""

    call: AgentCall
    tokenized: TokenizedCall
    planned: Planned
    request: ExecRequest

    @property
    def decisions(self) -> Mapping[int, PHDecision]:
        return self.planned.decisions

    @property
    def injects(self) -> bool:
        return any(p.plan.step is Step.INJECT for p in self.planned.pieces)

    def densely(self) -> CallPlan:
        """The same call with nothing reused: every segment prefilled (the engine refused the reused KV)."""
        decisions = {i: PHDecision("fallback", reason="engine_rejected") if d.reused else d
                     for i, d in self.decisions.items()}
        call = self.tokenized
        pieces = tuple(Piece(i, SegmentPlan(s.name, list(t), Step.PREFIX))
                       for i, (s, t) in enumerate(zip(call.segments, call.token_lists)))
        return replace(self, planned=Planned(pieces, MappingProxyType(decisions)),
                       request=replace(self.request, segments=[p.plan for p in pieces]))


def tokenize_call(engine: Engine, call: AgentCall) -> TokenizedCall:
    """The call's segments and their tokens. The prompt starts with BOS: in the first segment when
    it is PF, as a PF segment of its own before a leading PH (whose tokens must match other agents'
    copies of the same content)."""
    segments, ids = list(call.segments), []
    bos, vocab = engine.bos_token_id, engine.vocab_size
    for i, seg in enumerate(segments):
        tokens = list(seg.token_ids) if seg.token_ids is not None else engine.tokenize(seg.text)
        if not tokens:
            raise PlanError(f"segment {i} ({seg.name}) of agent {call.agent!r} tokenizes to nothing")
        if seg.token_ids is not None and max(tokens) >= vocab:
            raise SegmentError(f"segment {i} ({seg.name}) of agent {call.agent!r}: token id {max(tokens)} is "
                               f"not in {engine.model_name}'s vocabulary of {vocab}")
        ids.append(tokens)
    if bos is not None and ids[0][0] != bos:
        if segments[0].kind == "pf":
            ids[0].insert(0, bos)
        else:
            segments.insert(0, Segment(kind="pf", token_ids=(bos,)))
            ids.insert(0, [bos])
    return TokenizedCall(call.agent, Scope(call.tenant, call.session), tuple(segments), tuple(map(tuple, ids)))


def awaited_context(engine: Engine, strategy: SharedContextStrategy, call: AgentCall,
                    tokenized: TokenizedCall | None = None) -> tuple[TokenizedCall, tuple[Future, ...]]:
    """Tokenize `call` (unless the caller did: `tokenized`) and ask `strategy` what shared context
    in flight (a reference prefill its siblings share) the call should wait for before it is planned."""
    tokenized = tokenize_call(engine, call) if tokenized is None else tokenized
    return tokenized, strategy.awaited(tokenized)


def checked_tokens(tokenized: object, call: AgentCall, where: str) -> TokenizedCall | None:
    """`tokenized` when it is None or `tokenize_call`'s form of `call`; otherwise an InputError."""
    if tokenized is None:
        return None
    added = len(tokenized.segments) - len(call.segments) if isinstance(tokenized, TokenizedCall) else -1
    if not (added in (0, 1) and tokenized.agent == call.agent and tokenized.scope == Scope(call.tenant, call.session)
            and tokenized.segments[added:] == tuple(call.segments)):  # `added`: a BOS segment put first
        raise InputError(f"{where} must be None or `tokenize_call`'s form of this call, got {type(tokenized).__name__}")
    return tokenized


def plan_call(
    engine: Engine,
    strategy: SharedContextStrategy,
    call: AgentCall,
    sampling: SamplingParams,
    *,
    runtime_id: str,
    on_token: Callable[[int], None] | None = None,
    capture_all: bool = False,
    tokenized: TokenizedCall | None = None,
    cancelled: threading.Event | None = None,
) -> CallPlan:
    """Tokenize `call` (unless given its `tokenized` form) and let `strategy` plan it. The
    approximate KV the call caches is salted for its lineage in runtime `runtime_id` (none is
    cached when the strategy says so), its exact blocks for its tenant; `capture_all` asks for
    every segment's KV (for measuring); setting `cancelled` cancels the engine request."""
    tokenized = strategy.refine(tokenize_call(engine, call) if tokenized is None else tokenized)
    lineage = lineage_salt(runtime_id, tokenized.scope, call.agent) if strategy.caches_approximate else None
    namespace = tenant_salt(call.tenant)
    planned = strategy.plan_call(tokenized, lineage=lineage, namespace=namespace, capture_all=capture_all)
    request = ExecRequest([p.plan for p in planned.pieces], sampling, lineage=lineage, cache_salt=namespace,
                          owner=call.agent, session=engine_session(tokenized.scope), on_token=on_token,
                          hidden_layer=strategy.hidden_layer(tokenized.scope), cancelled=cancelled)
    return CallPlan(call, tokenized, planned, request)

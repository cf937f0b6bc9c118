"""Strategies that serve a shared (PH) segment from another materialization of it: the common part.

Before a call, `plan_call` asks the prefix cache what it already serves and `plan` decides each
remaining PH segment: skip one not worth reuse work (the cost gate, `costs`), look up its source
(`sources`), ask the strategy's `accepts` (bookkeeping only), check the source is sound, and let
the strategy's `reuse` turn it into KV to inject (raw, corrected, or partly recomputed), or
refuse. After the call, `settle` records what each segment became: the source of the next edge.
Any fault while planning falls back to dense prefill and is counted in `faults`; a source that
is not sound is removed so that it stops poisoning later calls.

`FullShared` is the whole of the simplest such strategy: the source injected as it is.
Sources are looked up in the caller's scope (its tenant's session) only.
"""

from __future__ import annotations

import logging
import time
from abc import abstractmethod
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType

import torch

from agentcache.correction.costs import CostModel, FreeReuse
from agentcache.correction.plan import (Piece, Planned, PHDecision, Served, SharedContextStrategy, TokenizedCall,
                                        common_figures)
from agentcache.correction.records import Prepared, PreparedAnchor
from agentcache.correction.sources import SourceFinder
from agentcache.correction.store import Materialization, SegmentStore
from agentcache.correction.strategies import Strategy
from agentcache.engine.kv import SegmentKV, all_finite
from agentcache.engine.protocol import Engine, SegmentPlan, Step
from agentcache.isolation import Scope
from agentcache.segments import Segment

__all__ = ["SourcedStrategy", "FullShared", "SPAN_SLOT", "span_source"]

log = logging.getLogger(__name__)


class SourcedStrategy(SharedContextStrategy):
    """A shared segment served from its source; a subclass says how (`reuse`) and what it learns."""

    def __init__(self, engine: Engine, settings: Strategy, anchor_bytes: int, store_bytes: int) -> None:
        self.engine = engine
        self.strategy = settings
        self.verified = settings.accept == "verified"
        self.store = SegmentStore(store_bytes)
        self.sources = SourceFinder(engine, self.store, settings.chained, prefer_exact=self.verified)
        self.faults: Counter[str] = Counter()  # real faults only: each one fell back to dense prefill
        # verified reuse weighs each segment's reuse against its cost; the baselines reuse whatever they can
        self.costs: CostModel | FreeReuse = CostModel() if self.verified else FreeReuse()

    @property
    def caches_approximate(self) -> bool:
        """Verified reuse keeps no approximate KV in the prefix cache: a later call would be
        served it as a prefix hit, in a context no shadow run verified."""
        return not self.verified

    def fault(self, kind: str, what: str, exc: BaseException | None = None) -> None:
        self.faults[kind] += 1
        log.warning("%s: %s%s", kind, what, f" ({type(exc).__name__}: {exc})" if exc is not None else "")

    # --- a call ----------------------------------------------------------------------------

    def plan_call(self, call: TokenizedCall, *, lineage: str, namespace: str | None,
                  capture_all: bool = False) -> Planned:
        """Decide every PH segment the prefix cache does not already serve. A reused segment is
        injected whole: the engine serves from its prefix cache whatever it holds of it at
        admission; the prefix cache is asked here only as a hint, to skip reuse work on what it
        covers. Only PH segments' KV comes back from the engine, unless `capture_all`."""
        covered = self.engine.cached_prefix_length(call.prompt, lineage=lineage, cache_salt=namespace)  # a hint
        kept = self.costs.kept_for_next_call(call)  # tokens of this prompt the agent's next call would find cached
        decisions: dict[int, PHDecision] = {}
        pieces: list[Piece] = []
        for index, (seg, tokens) in enumerate(zip(call.segments, call.token_lists)):
            pos = call.starts[index]
            uncovered = seg.kind == "ph" and pos + len(tokens) > covered
            if uncovered and not self.costs.worth_reusing(len(tokens), max(0, kept - pos)):
                decisions[index] = PHDecision("off", reason="not_worth")  # as NonShared: nothing captured or kept
                pieces.append(Piece(index, SegmentPlan(seg.name, tokens, Step.PREFIX, capture=capture_all)))
                continue
            if uncovered:
                decision = self.plan(call.scope, call.agent, seg.slot, tokens, seg.source,
                                     after=len(call.prompt) - call.starts[index + 1], origin=call.origins.get(index))
                beyond_cache = decision.covered - max(0, covered - pos)  # what reuse serves past the prefix cache
                if decision.reused and beyond_cache > 0 and self.costs.worth(beyond_cache):
                    kept = 0  # nothing after reused KV is cached: later reuses cost the next call nothing more
                    decisions[index] = decision
                    pieces.extend(Piece(index, plan) for plan in self.engine_segments(seg.slot, tokens, decision))
                    continue
                if decision.reused:  # the prefix cache already serves (nearly) what the source covers
                    decision = PHDecision("fallback", reason="prefix_covers_source", source=decision.source)
                decisions[index] = self.dense_read(call, index, decision)
            pieces.append(Piece(index, SegmentPlan(seg.name, tokens, Step.PREFIX,
                                                   capture=capture_all or seg.kind == "ph")))
        return Planned(tuple(pieces), MappingProxyType(decisions))

    def refine(self, call: TokenizedCall) -> TokenizedCall:
        """Verified chained reuse reads shared text wherever it sits: a PH segment that no stored
        materialization of its slot holds whole is split where its tokens are found in one of any
        slot (`SegmentStore.spans`). Each found span becomes a PH segment read from that source
        (`span_source`); the text around keeps the segment's slot. A segment with a pinned source
        is left as it is."""
        if not (self.verified and self.strategy.chained and self.engine.supports_realignment):
            return call
        try:
            return self._split(call)
        except Exception as exc:  # noqa: BLE001 - a fault while looking costs only the split: planned as it came
            self.fault("span_error", f"finding shared spans in agent {call.agent!r}'s call; planned unsplit", exc)
            return call

    def _split(self, call: TokenizedCall) -> TokenizedCall:
        segments: list[Segment] = []
        token_lists: list[tuple[int, ...]] = []
        origins: dict[int, Materialization] = {}
        for seg, tokens in zip(call.segments, call.token_lists):
            for piece, piece_tokens, origin in self._found_in(call.scope, call.agent, seg, tokens):
                if origin is not None:
                    origins[len(segments)] = origin
                segments.append(piece)
                token_lists.append(piece_tokens)
        if not origins:
            return call
        return TokenizedCall(call.agent, call.scope, tuple(segments), tuple(token_lists), MappingProxyType(origins))

    def _found_in(self, scope: Scope, agent: str, seg: Segment, tokens: tuple[int, ...]
                  ) -> list[tuple[Segment, tuple[int, ...], Materialization | None]]:
        """`seg` as (segment, tokens, origin) pieces: itself when nothing is found in it. Spans too
        short to be worth reuse, and spans of the agent's own earlier prompts (what its prefix
        cache serves), are not split out."""
        whole = [(seg, tokens, None)]
        if seg.kind != "ph" or seg.source is not None:
            return whole
        found = self.store.find(scope, seg.slot, tokens, prefer_exact=self.verified)
        if found is not None and found[1] == len(tokens):
            return whole
        # a span not worth reusing alone is not split out (common phrases of a template)
        spans = [(span, entry) for span, entry in self.store.spans(scope, tokens, prefer_exact=self.verified)
                 if self.costs.worth(span.length) and entry.agent != agent]
        if not spans:
            return whole
        pieces, cursor = [], 0
        for span, entry in spans:
            if span.start > cursor:
                pieces.append((_ph_ids(seg.slot, tokens[cursor:span.start]), tokens[cursor:span.start], None))
            origin = span_source(entry, span.offset, span.length)
            pieces.append((_ph_ids(origin.slot, tokens[span.start:span.end]), tokens[span.start:span.end], origin))
            cursor = span.end
        if cursor < len(tokens):
            pieces.append((_ph_ids(seg.slot, tokens[cursor:]), tokens[cursor:], None))
        return pieces

    def dense_read(self, call: TokenizedCall, index: int, decision: PHDecision) -> PHDecision:
        """The decision of a segment the call prefills (a strategy may note more about it)."""
        return decision

    def engine_segments(self, slot: str, tokens: Sequence[int], decision: PHDecision) -> list[SegmentPlan]:
        """A reused segment's engine segments: its covered part injected (the engine re-aligns it
        from canonical start 0), the rest prefilled."""
        cover = decision.covered
        plans = [SegmentPlan(slot, tokens[:cover], Step.INJECT, decision.inject.slice(0, cover))]
        if cover < len(tokens):
            plans.append(SegmentPlan(slot, tokens[cover:], Step.PREFIX))
        return plans

    def settle(self, served: Served, prepared: Prepared | None = None) -> None:
        """Record how each PH segment was materialized and the agent's output: the sources of the
        next edges, with the anchors `prepared` built. A fault while recording is counted and costs
        only what it touched; the call's result stands."""
        call, result = served.call, served.result
        anchors = prepared.anchors if prepared is not None else {}
        self.costs.observe_call(served)
        for index, seg, tokens, decision, how, kv in served.shared():
            if decision.decision == "off":
                continue
            try:
                self.commit(call.scope, call.agent, seg.slot, tokens, decision, kv, how,
                            own_tokens_exact=kv is not None and kv.exact, hidden=served.hiddens[index],
                            prepared=anchors.get(index))
            except Exception as exc:  # noqa: BLE001
                self.fault("commit_error", f"recording agent {call.agent!r}'s segment {seg.slot!r}", exc)
        try:
            if self.costs.worth_reusing(max(0, len(result.token_ids) - 1)):
                self.record_output(call.scope, call.agent, result.token_ids[:-1], result.generated_kv,
                                   result.generated_hidden)
        except Exception as exc:  # noqa: BLE001
            self.fault("commit_error", f"recording agent {call.agent!r}'s output", exc)

    def refused(self, decisions: Mapping[int, PHDecision], exc: BaseException, agent: str) -> None:
        self.fault("engine_rejected", f"the engine refused reused KV for agent {agent!r}; prefilling densely", exc)
        for decision in decisions.values():
            if decision.reused and decision.source is not None:
                self.store.remove(decision.source.entry_id)

    def forget(self, scope: Scope) -> None:
        """A session ended: its source caches go."""
        self.store.drop_scope(scope)

    def held_bytes(self) -> dict[str, int]:
        return dict(anchor_bytes=0, store_bytes=self.store.nbytes)

    def figures(self) -> dict:
        faults = dict(self.faults)
        if self.store.dropped_corrupt:
            faults["corrupt_source"] = self.store.dropped_corrupt
        return common_figures(self.strategy) | dict(
            store_bytes=self.store.nbytes, store_entries=len(self.store), faults=faults, **self.costs.figures())

    # --- one shared segment, before the call -----------------------------------------------

    def plan(self, scope: Scope, agent: str, slot: str, token_ids: Sequence[int],
             source: str | None = None, *, start: int = 0, lead_in: Sequence[int] | None = None,
             after: int = 0, origin: Materialization | None = None) -> PHDecision:
        """How `agent` should materialize this PH segment; `source` pins the edge's source agent,
        `origin` gives the source itself (a span `refine` found, holding exactly these tokens).
        `start`: where the segment sits in the call; `lead_in`: tokens (BOS first) a context-free
        reference prefill puts before the segment (default: BOS and a neutral newline); `after`:
        how many of the call's tokens follow the segment (verification tells calls apart by it)."""
        started, references_before = time.perf_counter(), self.sources.reference_s
        try:
            decision = self.decide(scope, agent, slot, token_ids, source, start, lead_in, after, origin)
        except Exception as exc:  # noqa: BLE001 - never serve a cache a fault touched: prefill
            self.fault("plan_error", f"planning slot {slot!r} for agent {agent!r}; prefilling densely", exc)
            decision = PHDecision("fallback", reason="error")
        decision = replace(decision, plan_s=time.perf_counter() - started,
                           setup_s=decision.setup_s + self.sources.reference_s - references_before)
        if decision.source is not None:
            self.planned_with_source(decision, len(token_ids))
        return decision

    def planned_with_source(self, decision: PHDecision, tokens: int) -> None:
        """A segment that had a source was decided (a gate logs it)."""

    def decide(self, scope: Scope, agent: str, slot: str, token_ids: Sequence[int], source_agent: str | None,
               start: int = 0, lead_in: Sequence[int] | None = None, after: int = 0,
               origin: Materialization | None = None) -> PHDecision:
        found = (origin, len(token_ids)) if origin is not None else self.sources.find(scope, slot, token_ids,
                                                                                       source_agent, lead_in)
        if found is None:
            return PHDecision("first") if self.strategy.chained else PHDecision("fallback", reason="no_source")
        source, shared = found
        if origin is None and source.agent == agent and source.how == "dense":  # its own prefill: a prefix hit
            return PHDecision("fallback", reason="own_prefill")
        if not self.engine.supports_realignment:
            return PHDecision("fallback", reason="not_realignable", source=source)
        method, refusal = self.accepts(scope, agent, slot, source, after)  # bookkeeping only: before any tensor work
        if refusal is not None:
            return PHDecision("fallback", reason=refusal, source=source)
        if not self._source_is_sound(source):
            return PHDecision("fallback", reason="bad_source")
        if method == "raw":  # at the source's positions: the engine moves it where the call reads it
            return raw_reuse(source, shared)
        return self.reuse(scope, agent, slot, source, shared, start)

    def accepts(self, scope: Scope, agent: str, slot: str, source: Materialization,
                after: int = 0) -> tuple[str | None, str | None]:
        """(reuse method, refusal) from what is known without touching a tensor; (None, None): `reuse` decides."""
        return None, None

    @abstractmethod
    def reuse(self, scope: Scope, agent: str, slot: str, source: Materialization, shared: int,
              start: int) -> PHDecision:
        """The decision for a sound, accepted source whose first `shared` tokens the call reads."""

    def _source_is_sound(self, source: Materialization) -> bool:
        """The stored KV fits the model and is finite; otherwise it is removed from the store."""
        kv = source.kv
        try:
            kv.check(self.engine.layout, len(source.token_ids), f"source cache {source.id}")
            sound = all_finite(kv.keys, kv.values)
        except Exception:  # noqa: BLE001 - a mis-shaped, mistyped or missing KV: not a source
            sound = False
        if not sound:
            self.faults["bad_source"] += 1
            log.warning("removing source cache %s of slot %r: wrong shape or NaN/Inf", source.id, source.slot)
            self.store.remove(source.entry_id)
        return sound

    # --- one shared segment, after the call ------------------------------------------------

    def commit(self, scope: Scope, agent: str, slot: str, token_ids: Sequence[int], decision: PHDecision,
               kv: SegmentKV | None, how: str, *, own_tokens_exact: bool = True,
               hidden: torch.Tensor | None = None, prepared: PreparedAnchor | None = None) -> None:
        """Record what the segment became in the call (`how`), with its KV `kv`: the next edge's
        source (chained). `own_tokens_exact`: none of its tokens came from the lineage's
        approximate blocks; `prepared`: an anchor built for it (strategies that learn anchors)."""
        if kv is not None and self.strategy.chained:
            self.store.put(scope, slot, agent, token_ids, kv, how, hidden=hidden)

    def record_output(self, scope: Scope, agent: str, token_ids: Sequence[int], kv: SegmentKV | None,
                      hidden: torch.Tensor | None = None) -> None:
        """An agent's decoded output becomes the source of its `out:<agent>` slot."""
        if kv is not None and token_ids:
            self.store.put(scope, f"out:{agent}", agent, token_ids, kv, "decoded", hidden=hidden)


_SPAN_SUFFIX = "@span"
SPAN_SLOT = "{slot}" + _SPAN_SUFFIX  # the slot through which a span found in a source of `slot` is read


def span_source(entry: Materialization, offset: int, length: int) -> Materialization:
    """Tokens [offset, offset + length) of `entry` as a source of their own: its KV sliced (at the
    positions it was made at), read through `SPAN_SLOT` of the entry's own slot (a span of a span
    keeps the first slot). However the producer's prompt was cut, the same text read by the same
    consumer is the same edge: the span's slot, source agent and exactness (a span is never the
    producer's exact prefix) do not depend on where in the entry it sits."""
    end = offset + length
    hidden = entry.hidden[offset:end] if entry.hidden is not None else None  # (length, hidden size)
    kv = entry.kv.slice(offset, end)
    slot = SPAN_SLOT.format(slot=entry.slot.removesuffix(_SPAN_SUFFIX))
    return replace(entry, id=f"{entry.id}[{offset}:{end}]", slot=slot,
                   token_ids=entry.token_ids[offset:end], kv=replace(kv, exact_for=None), hidden=hidden,
                   cut_from=entry.entry_id)


def _ph_ids(slot: str, token_ids: tuple[int, ...]) -> Segment:
    return Segment(kind="ph", slot=slot, token_ids=token_ids)


def raw_reuse(source: Materialization, shared: int) -> PHDecision:
    """The source's first `shared` tokens injected as they are (the engine moves them, one rotation)."""
    return PHDecision("reused", source=source, covered=shared, inject=source.kv.slice(0, shared))


class FullShared(SourcedStrategy):
    """Raw reuse: every shared segment with a source is served the source's KV, re-aligned."""

    def reuse(self, scope: Scope, agent: str, slot: str, source: Materialization, shared: int,
              start: int) -> PHDecision:
        return raw_reuse(source, shared)

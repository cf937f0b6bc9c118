"""The store of materialized shared-segment caches: the sources of the next workflow edges.

It keeps each agent's latest materialization (dense, corrected, or decoded) of each slot's
content, per scope (a tenant's session): the newest overall is the next hop of a chain, an
agent's own is the source of a fan-out edge from that agent. A materialization attended to its
session's private context, so it is found only from the same scope. Bounded by a byte budget over
all entries: least recently used entries go first.

Lookups do not scan the store. A match must share at least half of the looked-up segment's tokens
as a prefix, so every entry is indexed under its first k tokens for k = 1, 2, 4, 8, ...; a lookup
reads the one bucket of the largest such k within that half, which holds only entries that open
with the same k tokens. Entries are also indexed by token windows (`spans.SpanIndex`), so that
`spans` finds the runs of a new segment that any entry of its scope holds, wherever they sit.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from agentcache.correction.spans import MIN_SPAN_TOKENS, Span, SpanIndex
from agentcache.engine.budget import BudgetedLRU
from agentcache.engine.kv import SegmentKV
from agentcache.engine.tokens import common_prefix
from agentcache.isolation import Scope

__all__ = ["Materialization", "SegmentStore"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Materialization:
    id: str
    scope: Scope  # the tenant's session it was made in; only that scope may read it
    slot: str
    agent: str  # who materialized it ("<reference>" for a context-free reference prefill)
    token_ids: tuple[int, ...]
    kv: SegmentKV  # full-dimensional KV of token_ids, at the positions it was made at
    how: str  # "dense", "prefix_hit", "corrected", "reused", "decoded", "reference"
    serial: int = 0  # order of materialization: higher is newer
    hidden: torch.Tensor | None = None  # (T, hidden size) entering DroidSpeak's layer group, when kept
    cut_from: str | None = None  # a span of a kept entry (`sourced.span_source`): that entry's id

    @property
    def entry_id(self) -> str:
        """The id of the store entry that holds it: what to remove when it proves unsound."""
        return self.cut_from or self.id

    @property
    def exact(self) -> bool:
        """Made with no reused KV before or in it (its KV's digest says so; KV too corrupt to say is not)."""
        return getattr(self.kv, "exact", False) is True

    @property
    def nbytes(self) -> int:
        held = 0 if self.hidden is None else self.hidden.numel() * self.hidden.element_size()
        return self.kv.nbytes + held


@dataclass(frozen=True)
class _Kept:
    """An entry and where it is indexed, as computed when it was put (its own fields may be corrupt later)."""

    entry: Materialization
    content_key: tuple  # (scope, slot, agent, tokens)
    bucket_keys: list[tuple]  # (scope, slot, first k tokens) for k = 1, 2, 4, ...


def _needed(length: int) -> int:
    """Tokens a materialization must share with a segment of `length` tokens to be its content."""
    return max(1, (length + 1) // 2)


def _key_lengths(length: int) -> Iterator[int]:
    """1, 2, 4, ... up to `length`: the prefixes an entry is indexed under."""
    k = 1
    while k <= length:
        yield k
        k *= 2


class SegmentStore:
    def __init__(self, byte_budget: int) -> None:
        if byte_budget < 1:
            raise ValueError(f"segment store byte budget must be positive, got {byte_budget}")
        self._kept: BudgetedLRU[str, _Kept] = BudgetedLRU(byte_budget)  # id -> entry, LRU first
        self._buckets: dict[tuple, dict[str, Materialization]] = {}  # (scope, slot, prefix) -> id -> entry
        self._by_content: dict[tuple, str] = {}  # (scope, slot, agent, tokens) -> id
        self._by_scope: dict[Scope, set[str]] = {}
        self._spans = SpanIndex()  # token windows of every entry but context-free references
        self._ids = itertools.count()
        self.evicted = 0
        self.rejected_too_large = 0
        self.dropped_corrupt = 0

    def __len__(self) -> int:
        return len(self._kept)

    def __iter__(self):
        return iter([kept.entry for kept in self._kept.values()])

    @property
    def byte_budget(self) -> int:
        return self._kept.byte_budget

    @property
    def nbytes(self) -> int:
        return self._kept.nbytes

    @property
    def scopes(self) -> int:
        return len(self._by_scope)

    def put(self, scope: Scope, slot: str, agent: str, token_ids: Sequence[int], kv: SegmentKV,
            how: str, hidden: torch.Tensor | None = None) -> Materialization | None:
        """Keep a materialization (with the hidden states its tokens left, if any); None when it alone
        is larger than the whole budget."""
        serial = next(self._ids)
        if hidden is not None and hidden.shape[0] != len(token_ids):
            hidden = None  # not one row per token: of no use to a consumer
        entry = Materialization(f"{slot}#{serial}", scope, slot, agent, tuple(token_ids), kv, how, serial, hidden)
        nbytes = entry.nbytes
        if not self._kept.fits(nbytes):
            self.rejected_too_large += 1
            return None
        old = self._by_content.get((scope, slot, agent, entry.token_ids))
        if old is not None:  # an agent's newest materialization of the same content replaces the older
            self.remove(old)
        kept = _Kept(entry, (scope, slot, agent, entry.token_ids),
                     [(scope, slot, entry.token_ids[:k]) for k in _key_lengths(len(entry.token_ids))])
        evicted = self._kept.put(entry.id, kept, nbytes)
        self._by_content[kept.content_key] = entry.id
        self._by_scope.setdefault(scope, set()).add(entry.id)
        for key in kept.bucket_keys:
            self._buckets.setdefault(key, {})[entry.id] = entry
        if how != "reference":
            self._spans.add(scope, entry.id, entry.token_ids)
        for gone_id, gone in evicted:
            self._unindex(gone_id, gone)
            self.evicted += 1
        return entry

    def find(self, scope: Scope, slot: str, token_ids: Sequence[int], agent: str | None = None, *,
             prefer_exact: bool = False) -> tuple[Materialization, int] | None:
        """The newest materialization (by when it was made) of `slot` in `scope` sharing the longest
        token prefix with `token_ids` (optionally only `agent`'s), and that prefix length; with
        `prefer_exact`, of those sharing the longest prefix the oldest exact one (made without
        reused KV: the producer, whichever consumers happened to prefill it too; one made in an
        agent's context before a context-free reference) before any approximate one.

        Only the same content counts: the shared prefix must cover at least half of the segment
        (an agent output re-tokenized from its text may differ from the generated ids near the
        end; two different queries that open with the same template words are not the same).
        An entry that cannot be compared (corrupt) is dropped and counted.
        """
        needed = _needed(len(token_ids))
        k = 1 << (needed.bit_length() - 1)  # the largest power of two <= needed

        def rank(entry: Materialization, shared: int) -> tuple:
            if prefer_exact and entry.exact:  # the first exact one: the same producer every run,
                return (shared, True, entry.how != "reference", -entry.serial)  # in context before context-free
            return (shared, False, entry.serial)

        bucket = self._buckets.get((scope, slot, tuple(token_ids[:k])), {})
        best: tuple[Materialization, int] | None = None
        for entry in list(bucket.values()):
            if agent is not None and entry.agent != agent:
                continue
            try:
                shared = common_prefix(entry.token_ids, token_ids)
            except Exception as exc:  # noqa: BLE001 - any corruption: drop the entry, never fail the call
                log.warning("dropping corrupt source cache %s: %s", entry.id, exc)
                self.remove(entry.id)
                self.dropped_corrupt += 1
                continue
            if shared >= needed and (best is None or rank(entry, shared) > rank(*best)):
                best = (entry, shared)
        if best is not None:
            self._kept.touch(best[0].id)
        return best

    def spans(self, scope: Scope, token_ids: Sequence[int], *, prefer_exact: bool = False,
              min_tokens: int = MIN_SPAN_TOKENS) -> list[tuple[Span, Materialization]]:
        """The runs of `token_ids`, at least `min_tokens` long, that materializations of `scope`
        hold anywhere in them, in order and not overlapping; of entries holding a run as long,
        `find`'s choice (with `prefer_exact`, the oldest exact one). The entries are touched."""

        def tokens_of(entry_id: str) -> tuple[int, ...] | None:
            kept = self._kept.get(entry_id)
            return kept.entry.token_ids if kept is not None else None

        def rank(entry_id: str) -> tuple:
            entry = self._kept.get(entry_id).entry
            return (True, -entry.serial) if prefer_exact and entry.exact else (False, entry.serial)

        found = []
        for span in self._spans.find(scope, token_ids, tokens_of, rank, min_tokens):
            self._kept.touch(span.entry_id)
            found.append((span, self._kept.get(span.entry_id).entry))
        return found

    def remove(self, entry_id: str) -> None:
        """Forget an entry, by the keys recorded when it was put (its own fields may be corrupt)."""
        kept = self._kept.pop(entry_id)
        if kept is not None:
            self._unindex(entry_id, kept)

    def _unindex(self, entry_id: str, kept: _Kept) -> None:
        self._spans.remove(entry_id)
        if self._by_content.get(kept.content_key) == entry_id:
            del self._by_content[kept.content_key]
        scope = kept.content_key[0]
        ids = self._by_scope[scope]
        ids.discard(entry_id)
        if not ids:
            del self._by_scope[scope]
        for key in kept.bucket_keys:
            bucket = self._buckets[key]
            bucket.pop(entry_id, None)
            if not bucket:
                del self._buckets[key]

    def drop_scope(self, scope: Scope) -> int:
        """Forget every materialization of `scope` (a session the runtime no longer keeps)."""
        ids = list(self._by_scope.get(scope, ()))
        for entry_id in ids:
            self.remove(entry_id)
        return len(ids)

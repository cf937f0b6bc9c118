"""Siblings: agents dispatched together on a shared segment new to their session.

None of them has a source to reuse (no one has materialized the segment yet), so each would
prefill it whole, all at once, on the same cores. Instead, the first of them to read it (the
leader) has its own prompt prefilled through the segment once, before it is planned: the leader
is then served that prefill as an exact prefix hit, and every other sibling reuses the segment's
KV from it, in the leader's context: the same edge (leader -> sibling) a chained workflow would
verify, and verified the same way before it is served (`verification`). One prefill of the
segment instead of one per sibling.

`SiblingReads` keeps what that takes: which new contents calls are reading and who read each
first with what lead-in (so the second reader knows it has a sibling and its leader), which
slots were read by siblings before (so the next workflow's leader starts the prefill), and the
leader prefills in flight, which calls wait for with no lock held and which become the
session's sources when done.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass

from agentcache.correction.sources import reference_kv, reference_request
from agentcache.correction.store import Materialization, SegmentStore
from agentcache.engine.protocol import Engine
from agentcache.isolation import Scope

__all__ = ["SiblingReads", "Content", "Leader", "study_source"]

KEPT = 1024  # contents and slots remembered (least recently used go first)


@dataclass(frozen=True)
class Content:
    """One shared segment's text in one session."""

    scope: Scope
    slot: str
    tokens: tuple[int, ...]

    @property
    def read_key(self) -> tuple:
        """Its key among the reads: its tokens hashed (a collision only misjudges a cost)."""
        return self.scope, self.slot, len(self.tokens), hash(self.tokens)


@dataclass(frozen=True)
class Leader:
    """The first call to read a content: its agent and its prompt's tokens before the segment."""

    agent: str
    lead_in: tuple[int, ...]


class SiblingReads:
    def __init__(self, kept: int = KEPT) -> None:
        self.kept = kept
        self.reads: OrderedDict[tuple, tuple[int, Leader]] = OrderedDict()  # content -> (readers, leader)
        self.fanned_out: OrderedDict[tuple, bool] = OrderedDict()  # (tenant, slot) -> siblings read it last time
        self.pending: dict[Content, tuple[Future, Leader]] = {}  # leader prefills in flight
        self.prefills = 0  # leader prefills started
        self.failed = 0  # of which failed (their readers prefilled densely)

    def read(self, content: Content, reader: Leader) -> Leader | None:
        """A call reads new `content` (no source in its session yet); its leader when the content
        is read by siblings: now (another call read it first) or, for the first reader, the last
        time the slot was read."""
        key = content.read_key
        count, leader = self.reads.pop(key, (0, reader))
        self.reads[key] = (count + 1, leader)
        _bound(self.reads, self.kept)
        slot_key = (content.scope.tenant, content.slot)
        if count + 1 > 1:
            self.fanned_out.pop(slot_key, None)
            self.fanned_out[slot_key] = True
            _bound(self.fanned_out, self.kept)
        return leader if count + 1 > 1 or self.fanned_out.get(slot_key, False) else None

    def leader(self, content: Content) -> Leader | None:
        """The content's leader when it was read by more than one call or its slot by siblings before."""
        count, leader = self.reads.get(content.read_key, (0, None))
        return leader if count > 1 or (count and self.fanned_out.get((content.scope.tenant, content.slot), False)) else None

    def prefill(self, engine: Engine, content: Content, leader: Leader) -> Future:
        """The leader's prompt prefilled through `content`, started now unless it is in flight."""
        pending = self.pending.get(content)
        if pending is None:
            pending = self.pending[content] = (
                engine.submit(reference_request(engine, content.scope, content.slot, content.tokens, leader.lead_in)),
                leader)
            self.prefills += 1
        return pending[0]

    def harvest(self, store: SegmentStore) -> list[BaseException]:
        """Put every finished leader prefill in its session's store (the leader's materialization
        of the segment, a source like any other); the errors of those that failed."""
        errors = []
        for content in [c for c, (f, _) in self.pending.items() if f.done()]:
            future, leader = self.pending.pop(content)
            try:
                store.put(content.scope, content.slot, leader.agent, content.tokens, reference_kv(future.result()),
                          "dense")
            except Exception as exc:  # noqa: BLE001 - its readers prefill; counted by the caller
                self.failed += 1
                errors.append(exc)
        return errors

    def figures(self) -> dict:
        return dict(sibling_prefills=self.prefills, sibling_prefill_failures=self.failed)


def study_source(engine: Engine, content: Content, leader: Leader, priority: int) -> Materialization:
    """The leader's prefill of `content` run now (when the engine is idle; mostly a prefix hit of
    the leader's own call), as the source to shadow-run a sibling's call with; not stored."""
    result = engine.execute(reference_request(engine, content.scope, content.slot, content.tokens, leader.lead_in,
                                              priority=priority))
    return Materialization("sibling-study", content.scope, content.slot, leader.agent, content.tokens,
                           reference_kv(result), "dense")


def _bound(table: OrderedDict, kept: int) -> None:
    while len(table) > kept:
        table.popitem(last=False)

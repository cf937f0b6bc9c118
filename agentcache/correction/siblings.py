"""Siblings: agents dispatched together on a shared segment new to their session.

None of them has a source to reuse (no one has materialized the segment yet), so each would
prefill it whole, all at once, on the same cores. When the edge from a context-free reference
prefill of the segment to the agent is verified (`verification`: raw reuse of the reference gave
the agent's own output), the siblings instead wait for one reference prefill and each reuse it:
one prefill of the segment instead of one per sibling.

`SiblingReads` keeps what that takes: which new contents calls are reading (so the second reader
knows it has a sibling), which slots were read by siblings before (so the first reader of the
next workflow starts the reference too), and the reference prefills in flight, which a call's
planning waits for with no lock held and which become sources of the session when done.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future

from agentcache.correction.sources import REFERENCE, reference_request
from agentcache.correction.store import Materialization, SegmentStore
from agentcache.engine.protocol import Engine
from agentcache.isolation import Scope

__all__ = ["SiblingReads", "Content"]

Content = tuple  # (scope, slot, token ids): one shared segment's text in one session
KEPT = 1024  # contents and slots remembered (least recently used go first)


class SiblingReads:
    def __init__(self, kept: int = KEPT) -> None:
        self.kept = kept
        self.reads: OrderedDict[tuple, int] = OrderedDict()  # calls that read a content with no source
        self.fanned_out: OrderedDict[tuple, bool] = OrderedDict()  # (tenant, slot) -> siblings read it last time
        self.pending: dict[Content, Future] = {}  # reference prefills in flight
        self.references = 0  # reference prefills started
        self.failed = 0  # of which failed (their readers prefilled densely)

    def read(self, content: Content) -> bool:
        """A call reads new `content` (no source in its session yet): whether it is read by siblings,
        now (another call read it first) or, for the first reader, the last time the slot was."""
        key = _read_key(content)
        count = self.reads.pop(key, 0) + 1
        self.reads[key] = count
        _bound(self.reads, self.kept)
        scope, slot, _ = content
        key = (scope.tenant, slot)
        if count > 1:
            self.fanned_out.pop(key, None)
            self.fanned_out[key] = True
            _bound(self.fanned_out, self.kept)
        return count > 1 or self.fanned_out.get(key, False)

    def is_sibling_read(self, content: Content) -> bool:
        """Whether `content` was read by more than one call, or its slot was read by siblings before."""
        scope, slot, _ = content
        return self.reads.get(_read_key(content), 0) > 1 or self.fanned_out.get((scope.tenant, slot), False)

    def reference(self, engine: Engine, content: Content) -> Future:
        """The reference prefill of `content`, started now unless it is in flight."""
        future = self.pending.get(content)
        if future is None:
            scope, slot, tokens = content
            future = self.pending[content] = engine.submit(reference_request(engine, scope, slot, tokens))
            self.references += 1
        return future

    def harvest(self, store: SegmentStore) -> list[BaseException]:
        """Put every finished reference prefill in its session's store (a source like any other);
        the errors of those that failed."""
        errors = []
        for content in [c for c, f in self.pending.items() if f.done()]:
            future = self.pending.pop(content)
            scope, slot, tokens = content
            try:
                store.put(scope, slot, REFERENCE, tokens, future.result().segments[1].kv, "reference")
            except Exception as exc:  # noqa: BLE001 - its readers prefill; counted by the caller
                self.failed += 1
                errors.append(exc)
        return errors

    def figures(self) -> dict:
        return dict(sibling_references=self.references, sibling_reference_failures=self.failed)


def study_source(engine: Engine, content: Content, priority: int) -> Materialization:
    """A reference prefill of `content` run now (when the engine is idle), as a source to shadow-run
    a sibling's call with; not stored."""
    scope, slot, tokens = content
    result = engine.execute(reference_request(engine, scope, slot, tokens, priority=priority))
    return Materialization("sibling-study", scope, slot, REFERENCE, tuple(tokens), result.segments[1].kv, "reference")


def content_of(scope: Scope, slot: str, tokens: Sequence[int]) -> Content:
    return (scope, slot, tuple(tokens))


def _read_key(content: Content) -> tuple:
    """A content's key among the reads: its tokens hashed (a collision only misjudges a cost)."""
    scope, slot, tokens = content
    return scope, slot, len(tokens), hash(tokens)


def _bound(table: OrderedDict, kept: int) -> None:
    while len(table) > kept:
        table.popitem(last=False)

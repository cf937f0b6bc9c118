"""Shared text found anywhere in a prompt: token spans an earlier materialization of the session holds.

A document pasted after an agent's own task line, a tool result quoted inside a message, another
agent's notes in the middle of a prompt: the same tokens, in a segment that opens with other text,
so a lookup by the segment's opening tokens (`SegmentStore.find`) misses them. `SpanIndex` finds
them at token level, wherever they sit.

The detector: every stored materialization is indexed by the hashes of its token windows of
`WINDOW` tokens that start at multiples of `WINDOW` (one entry per `WINDOW` tokens held); a lookup
hashes the window at every position of the new segment and, at a hit, checks the tokens and
extends the match both ways. Any common run of at least 2·`WINDOW` − 1 tokens holds an indexed
window, so it is found whatever text surrounds it, and its ends are found token by token (a span's
boundary tokens may differ where its text joins other text: the match stops there). The cost is
linear: indexing touches each stored token once, a lookup hashes one window per position and
compares tokens only along the matches it extends. Content-defined chunking would index less but
loses a chunk at each edge of a span; a suffix structure finds the same spans with more memory
per token and is rebuilt as entries are evicted. Windows are hashed by Python's tuple hash, so a
collision costs one token comparison, never a wrong span.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agentcache.isolation import Scope

__all__ = ["Span", "SpanIndex", "WINDOW", "MIN_SPAN_TOKENS"]

WINDOW = 16  # tokens per hashed window
MIN_SPAN_TOKENS = 2 * WINDOW  # shorter common runs are not reported (they may be a common phrase)


@dataclass(frozen=True)
class Span:
    """Tokens [start, end) of the looked-up segment equal tokens [offset, offset + end - start) of
    the stored entry `entry_id`."""

    start: int
    end: int
    entry_id: str
    offset: int

    @property
    def length(self) -> int:
        return self.end - self.start


class SpanIndex:
    """Window hashes of stored token runs, per scope. Entries are named by id; the caller resolves
    an id to its tokens and rank (`find`'s arguments), and removes an entry when it forgets it."""

    def __init__(self) -> None:
        self._windows: dict[Scope, dict[int, list[tuple[str, int]]]] = {}  # scope -> hash -> (id, offset)
        self._keys: dict[str, tuple[Scope, list[int]]] = {}  # id -> the hashes it was indexed under

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, scope: Scope, entry_id: str, token_ids: Sequence[int]) -> None:
        if entry_id in self._keys or len(token_ids) < WINDOW:
            return
        table = self._windows.setdefault(scope, {})
        hashes = []
        for offset in range(0, len(token_ids) - WINDOW + 1, WINDOW):
            key = hash(tuple(token_ids[offset:offset + WINDOW]))
            table.setdefault(key, []).append((entry_id, offset))
            hashes.append(key)
        self._keys[entry_id] = (scope, hashes)

    def remove(self, entry_id: str) -> None:
        indexed = self._keys.pop(entry_id, None)
        if indexed is None:
            return
        scope, hashes = indexed
        table = self._windows[scope]
        for key in set(hashes):
            kept = [hit for hit in table[key] if hit[0] != entry_id]
            if kept:
                table[key] = kept
            else:
                del table[key]
        if not table:
            del self._windows[scope]

    def find(self, scope: Scope, token_ids: Sequence[int], tokens_of: Callable[[str], Sequence[int] | None],
             rank: Callable[[str], tuple], min_tokens: int = MIN_SPAN_TOKENS) -> list[Span]:
        """The spans of `token_ids` that entries of `scope` hold, in order and not overlapping, each
        at least `min_tokens` long and as long as it can be. Where several entries hold a span of
        the same length, the one `rank` puts highest. `tokens_of(id)`: an entry's tokens (None: it
        is gone)."""
        table = self._windows.get(scope)
        if not table or len(token_ids) < min_tokens:
            return []
        tokens = tuple(token_ids)
        spans: list[Span] = []
        floor, i = 0, 0  # nothing before `floor` may join a new span: it belongs to the previous one
        while i + WINDOW <= len(tokens):
            best: tuple[tuple, Span] | None = None
            for entry_id, offset in table.get(hash(tokens[i:i + WINDOW]), ()):
                held = tokens_of(entry_id)
                if held is None or tuple(held[offset:offset + WINDOW]) != tokens[i:i + WINDOW]:
                    continue
                span = _extended(tokens, held, i, offset, floor, entry_id)
                key = (span.length, rank(entry_id))
                if best is None or key > best[0]:
                    best = (key, span)
            if best is not None and best[1].length >= min_tokens:
                spans.append(best[1])
                floor = i = best[1].end
            else:
                i += 1
        return spans


def _extended(tokens: tuple[int, ...], held: Sequence[int], at: int, offset: int, floor: int,
              entry_id: str) -> Span:
    """The longest common run through tokens[at] = held[offset], not reaching before `floor`."""
    back = 0
    while at - back > floor and offset - back > 0 and tokens[at - back - 1] == held[offset - back - 1]:
        back += 1
    ahead = WINDOW
    while at + ahead < len(tokens) and offset + ahead < len(held) and tokens[at + ahead] == held[offset + ahead]:
        ahead += 1
    return Span(at - back, at + ahead, entry_id, offset - back)

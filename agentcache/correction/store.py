"""The store of materialized shared-segment caches: the sources of the next workflow edges.

It keeps each agent's latest materialization (dense, corrected, or decoded) of each slot's
content: the newest overall is the next hop of a chain, an agent's own is the source of a
fan-out edge from that agent. Bounded by a byte budget over all entries: least recently
used entries go first.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from agentcache.engine.kv import SegmentKV

__all__ = ["Materialization", "SegmentStore"]


@dataclass(frozen=True)
class Materialization:
    id: str
    slot: str
    agent: str  # who materialized it ("<reference>" for a context-free reference prefill)
    token_ids: tuple[int, ...]
    kv: SegmentKV  # full-dimensional KV of token_ids, at the positions it was made at
    how: str  # "dense", "prefix_hit", "corrected", "reused", "decoded", "reference"
    serial: int = 0  # order of materialization: higher is newer

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class SegmentStore:
    def __init__(self, byte_budget: int) -> None:
        if byte_budget < 1:
            raise ValueError(f"segment store byte budget must be positive, got {byte_budget}")
        self.byte_budget = byte_budget
        self._entries: OrderedDict[str, Materialization] = OrderedDict()  # id -> entry, LRU first
        self._ids = itertools.count()
        self.evicted = 0
        self.rejected_too_large = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self):
        return iter(list(self._entries.values()))

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def put(self, slot: str, agent: str, token_ids: Sequence[int], kv: SegmentKV, how: str) -> Materialization | None:
        """Keep a materialization; None when it alone is larger than the whole budget."""
        serial = next(self._ids)
        entry = Materialization(f"{slot}#{serial}", slot, agent, tuple(token_ids), kv, how, serial)
        if entry.nbytes > self.byte_budget:
            self.rejected_too_large += 1
            return None
        # An agent's newest materialization of the same content replaces its older ones.
        for old in [e.id for e in self._entries.values()
                    if e.slot == slot and e.agent == agent and e.token_ids == entry.token_ids]:
            del self._entries[old]
        self._entries[entry.id] = entry
        while self.nbytes > self.byte_budget:
            self._entries.popitem(last=False)
            self.evicted += 1
        return entry

    def find(self, slot: str, token_ids: Sequence[int], agent: str | None = None) -> tuple[Materialization, int] | None:
        """The newest materialization (by when it was made) of `slot` sharing the longest token prefix with `token_ids`
        (optionally only `agent`'s), and that prefix length.

        Only the same content counts: the shared prefix must cover at least half of the segment
        (an agent output re-tokenized from its text may differ from the generated ids near the
        end; two different queries that open with the same template words are not the same).
        """
        best: tuple[Materialization, int] | None = None
        needed = max(1, (len(token_ids) + 1) // 2)
        for entry in self._entries.values():
            if entry.slot != slot or (agent is not None and entry.agent != agent):
                continue
            shared = common_prefix(entry.token_ids, token_ids)
            if shared >= needed and (best is None or (shared, entry.serial) > (best[1], best[0].serial)):
                best = (entry, shared)
        if best is not None:
            self._entries.move_to_end(best[0].id)
        return best

    def remove(self, entry_id: str) -> None:
        self._entries.pop(entry_id, None)

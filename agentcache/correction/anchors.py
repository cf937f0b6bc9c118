"""Anchor pools: per slot, up to V anchors of low-rank base caches and observed corrections.

An anchor is one materialized source cache of a shared segment (its base, canonical positions)
plus the corrections Δ = C_target − Align(C_source) observed for its consumers. A bank holds one
pool per slot and a byte budget over all of them; a full pool evicts the least frequently used
of its five oldest anchors (KVComm, KVCMAS App. A.3).
"""

from __future__ import annotations

import itertools
import logging
import uuid
from dataclasses import dataclass, field
from typing import Hashable

from agentcache.correction.lowrank import Factors

__all__ = ["Anchor", "Correction", "AnchorPool", "AnchorBank", "OLDEST_WINDOW"]

log = logging.getLogger(__name__)

OLDEST_WINDOW = 5  # eviction looks at this many oldest anchors and drops the least used


@dataclass(frozen=True)
class Correction:
    """Observed correction for one consumer, layers 1.. (layer 0 is exact after alignment)."""

    keys: Factors  # (L-1, T, F) canonical positions (KVCOMM's procedure: where it was observed)
    values: Factors
    # KVCOMM's procedure: the correction of the template text after the segment, for these tokens
    glue_tokens: tuple[int, ...] = ()
    glue_keys: Factors | None = None  # (L-1, G, F)
    glue_values: Factors | None = None

    @property
    def glue(self) -> list[Factors]:
        return [f for f in (self.glue_keys, self.glue_values) if f is not None]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + sum(f.nbytes for f in self.glue)


@dataclass
class Anchor:
    source_id: str  # which materialization the base is (one per source cache instance)
    source: str  # the agent (or reference) whose cache the base is
    keys: Factors  # base keys (L, T, F), canonical positions
    values: Factors  # base values (L, T, F)
    corrections: dict[str, Correction] = field(default_factory=dict)  # consumer agent -> Δ
    serial: int = 0  # insertion order
    uses: int = 0
    counted_bytes: int = 0  # what its bank counted for it (kept apart: a corrupt anchor cannot say)
    uid: str = field(default_factory=lambda: uuid.uuid4().hex)  # the same in every instance that loads it

    @property
    def length(self) -> int:
        return self.keys.length

    def _parts(self) -> list[tuple[Factors, int]]:
        """Every stored factor stack with its layer offset (corrections skip layer 0)."""
        return [(self.keys, 0), (self.values, 0)] + [
            (f, 1) for c in self.corrections.values() for f in (c.keys, c.values)]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + sum(c.nbytes for c in self.corrections.values())

    @property
    def dense_numel(self) -> int:
        """Numbers in the KV (and corrections) this anchor describes, stored dense."""
        return sum(part.dense_numel for part, _ in self._parts())

    def fits(self, num_layers: int, features: int) -> bool:
        """Shapes agree with the model and with each other (cheap: checked on every use)."""
        glue = [(f, len(c.glue_tokens)) for c in self.corrections.values() for f in c.glue]
        return (all(part.has_shape(num_layers - skip, self.length, features) for part, skip in self._parts())
                and all(f.has_shape(num_layers - 1, tokens, features) for f, tokens in glue))

    def is_finite(self) -> bool:
        """Every stored number is finite (checked when a correction comes out non-finite)."""
        glue = [f for c in self.corrections.values() for f in c.glue]
        return all(part.is_finite() for part, _ in self._parts()) and all(f.is_finite() for f in glue)


class AnchorPool:
    """The anchors of one slot (`query`, `out:<agent>`, ...), at most `capacity` of them."""

    def __init__(self, slot: str, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"anchor pool capacity must be at least 1, got {capacity}")
        self.slot = slot
        self.capacity = capacity
        self.anchors: dict[str, Anchor] = {}  # source_id -> anchor, insertion ordered

    def __len__(self) -> int:
        return len(self.anchors)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.anchors.values())

    def candidates(self, source: str, consumer: str) -> list[Anchor]:
        """Anchors whose base came from `source` and that hold a correction for `consumer`."""
        return [a for a in self.anchors.values() if a.source == source and consumer in a.corrections]

    def victim(self, keep: Anchor | None = None) -> Anchor | None:
        """The least frequently used of the oldest anchors (never `keep`); None if there is none."""
        others = [a for a in self.anchors.values() if a is not keep]
        oldest = sorted(others, key=lambda a: a.serial)[:OLDEST_WINDOW]
        return min(oldest, key=lambda a: (a.uses, a.serial), default=None)

    def remove(self, source_id: str) -> Anchor | None:
        return self.anchors.pop(source_id, None)


class AnchorBank:
    """One pool per key (a tenant's slot), all within `byte_budget` bytes; counts what it inserted and
    evicted. Empty pools are dropped, so the bank holds only what its anchors need."""

    def __init__(self, capacity: int, byte_budget: int) -> None:
        if byte_budget < 1:
            raise ValueError(f"anchor byte budget must be positive, got {byte_budget}")
        self.capacity = capacity
        self.byte_budget = byte_budget
        self.pools: dict[Hashable, AnchorPool] = {}
        self._nbytes = 0  # kept as anchors come and go: budget checks never walk the pools
        self._serial = itertools.count()
        self.inserted = 0
        self.evicted = 0
        self.rejected_too_large = 0
        self.dropped_invalid = 0

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def dense_numel(self) -> int:
        return sum(a.dense_numel for p in self.pools.values() for a in p.anchors.values())

    @property
    def num_anchors(self) -> int:
        return sum(len(p) for p in self.pools.values())

    def pool(self, key: Hashable) -> AnchorPool:
        """The pool of `key` (created empty on first use; dropped again once empty)."""
        if key not in self.pools:
            self.pools[key] = AnchorPool(key, self.capacity)
        return self.pools[key]

    def candidates(self, key: Hashable, source: str, consumer: str) -> list[Anchor]:
        pool = self.pools.get(key)
        return pool.candidates(source, consumer) if pool is not None else []

    def anchor(self, key: Hashable, source_id: str) -> Anchor | None:
        pool = self.pools.get(key)
        return pool.anchors.get(source_id) if pool is not None else None

    def add(self, slot: Hashable, source_id: str, source: str, keys: Factors, values: Factors,
            consumer: str, correction: Correction) -> bool:
        """Record `correction` for `consumer` on the anchor of this source cache, creating the anchor
        when the pool has none for it. Evicts to stay within capacity and budget; False if it cannot fit."""
        pool = self.pool(slot)
        anchor = pool.anchors.get(source_id)
        added = correction.nbytes if anchor is not None else keys.nbytes + values.nbytes + correction.nbytes
        if added > self.byte_budget:
            self.rejected_too_large += 1
            self._drop_if_empty(pool)
            log.info("anchor for slot %r (%d bytes) exceeds the whole anchor budget (%d); not kept",
                     slot, added, self.byte_budget)
            return False
        if anchor is None:
            while len(pool) >= pool.capacity:
                self._evict(pool, pool.victim())
            anchor = Anchor(source_id, source, keys, values, serial=next(self._serial))
            pool.anchors[source_id] = anchor
            self.inserted += 1
        replaced = anchor.corrections.get(consumer)
        anchor.corrections[consumer] = correction
        change = added - (replaced.nbytes if replaced is not None else 0)
        anchor.counted_bytes += change
        self._nbytes += change
        self._fit_budget(keep=anchor)
        kept = source_id in pool.anchors
        self._drop_if_empty(pool)
        return kept

    def drop(self, key: Hashable, anchor: Anchor) -> None:
        """Remove an anchor found corrupted."""
        pool = self.pools.get(key)
        if pool is not None and self._take(pool, anchor) is not None:
            self.dropped_invalid += 1
            self._drop_if_empty(pool)

    def _evict(self, pool: AnchorPool, anchor: Anchor | None) -> None:
        if anchor is not None and self._take(pool, anchor) is not None:
            self.evicted += 1

    def _take(self, pool: AnchorPool, anchor: Anchor) -> Anchor | None:
        removed = pool.remove(anchor.source_id)
        if removed is not None:
            self._nbytes -= removed.counted_bytes
        return removed

    def _drop_if_empty(self, pool: AnchorPool) -> None:
        if not pool.anchors and self.pools.get(pool.slot) is pool:
            del self.pools[pool.slot]

    def _fit_budget(self, keep: Anchor) -> None:
        """Evict (LFU among the oldest, from the pool holding the most bytes) until within budget."""
        while self.nbytes > self.byte_budget:
            pools = sorted(self.pools.values(), key=lambda p: p.nbytes, reverse=True)
            for pool in pools:
                victim = pool.victim(keep)
                if victim is not None:
                    self._evict(pool, victim)
                    break
            else:  # only `keep` is left and it is over budget on its own
                for pool in pools:
                    self._evict(pool, pool.anchors.get(keep.source_id))
                    self._drop_if_empty(pool)
                return
        for pool in [p for p in self.pools.values() if not p.anchors]:
            self._drop_if_empty(pool)


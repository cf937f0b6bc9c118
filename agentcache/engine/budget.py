"""A byte-budgeted LRU map: how the segment store and vLLM's kept tails bound their memory.

Each value's size is given when it is put and remembered, so taking a value out never asks it
again (a corrupt value may not be able to say). A value larger than the whole budget never fits
(check with `fits` before `put`); any other is kept, and the least recently used values go until
the total fits the budget again.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, Hashable, TypeVar

__all__ = ["BudgetedLRU"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class BudgetedLRU(Generic[K, V]):
    def __init__(self, byte_budget: int) -> None:
        self.byte_budget = byte_budget
        self._items: OrderedDict[K, tuple[V, int]] = OrderedDict()  # key -> (value, its bytes), LRU first
        self._nbytes = 0  # kept as values come and go: a put never walks the map

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def values(self) -> list[V]:
        """The values, least recently used first (a copy: safe to remove while walking it)."""
        return [value for value, _ in self._items.values()]

    def get(self, key: K) -> V | None:
        """The value under `key`, or None; looking does not count as a use (see `touch`)."""
        item = self._items.get(key)
        return None if item is None else item[0]

    def touch(self, key: K) -> None:
        """Mark `key` as the most recently used."""
        self._items.move_to_end(key)

    def fits(self, nbytes: int) -> bool:
        """Whether a value of `nbytes` can be kept at all (evicting everything else if need be)."""
        return nbytes <= self.byte_budget

    def put(self, key: K, value: V, nbytes: int) -> list[tuple[K, V]]:
        """Keep `value` under `key` (replacing what was there) as the most recently used; the pairs
        evicted to make room, oldest first."""
        if not self.fits(nbytes):
            raise ValueError(f"a value of {nbytes} bytes never fits a budget of {self.byte_budget}; check fits() first")
        self.pop(key)
        self._items[key] = (value, nbytes)
        self._nbytes += nbytes
        evicted = []
        while self._nbytes > self.byte_budget:  # never reaches `key`: it fits the budget alone
            old_key, (old_value, old_nbytes) = self._items.popitem(last=False)
            self._nbytes -= old_nbytes
            evicted.append((old_key, old_value))
        return evicted

    def pop(self, key: K) -> V | None:
        """Take the value under `key` out; None when there is none."""
        item = self._items.pop(key, None)
        if item is None:
            return None
        self._nbytes -= item[1]
        return item[0]

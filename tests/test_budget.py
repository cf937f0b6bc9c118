"""The byte-budgeted LRU map behind the segment store and vLLM's kept tails."""

import pytest

from agentcache.engine.budget import BudgetedLRU


def test_least_recently_used_goes_first_and_touch_counts_as_a_use():
    lru = BudgetedLRU(byte_budget=30)
    assert lru.put("a", "A", 10) == [] and lru.put("b", "B", 10) == [] and lru.put("c", "C", 10) == []
    lru.touch("a")  # now b is the least recently used
    assert lru.put("d", "D", 10) == [("b", "B")]
    assert lru.values() == ["C", "A", "D"]
    assert lru.put("e", "E", 20) == [("c", "C"), ("a", "A")]  # oldest first, as many as it takes
    assert lru.values() == ["D", "E"] and "a" not in lru and len(lru) == 2


def test_get_is_no_use():
    lru = BudgetedLRU(byte_budget=20)
    lru.put("a", "A", 10)
    lru.put("b", "B", 10)
    assert lru.get("a") == "A" and lru.get("missing") is None
    assert lru.put("c", "C", 10) == [("a", "A")]


def test_bytes_are_the_sizes_given_at_put():
    lru = BudgetedLRU(byte_budget=100)
    lru.put("a", "A", 40)
    lru.put("b", "B", 25)
    assert lru.nbytes == 65
    assert lru.put("a", "A2", 5) == []  # replacing a key swaps its size and makes it the newest
    assert lru.nbytes == 30 and lru.values() == ["B", "A2"]
    assert lru.pop("b") == "B" and lru.pop("b") is None
    assert lru.nbytes == 5 and len(lru) == 1
    lru.put("c", "C", 95)  # exactly the budget: nothing evicted
    assert lru.nbytes == 100 and len(lru) == 2
    assert lru.put("d", "D", 1) == [("a", "A2")] and lru.nbytes == 96


def test_a_value_larger_than_the_budget_never_fits_and_changes_nothing():
    lru = BudgetedLRU(byte_budget=10)
    lru.put("a", "A", 6)
    assert lru.fits(10) and not lru.fits(11)
    with pytest.raises(ValueError, match="11 bytes never fits a budget of 10"):
        lru.put("a", "huge", 11)
    assert lru.get("a") == "A" and lru.nbytes == 6
    assert lru.put("b", "B", 10) == [("a", "A")]  # a value the size of the budget evicts all the rest
    assert lru.values() == ["B"] and lru.nbytes == 10

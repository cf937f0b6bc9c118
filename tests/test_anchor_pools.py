"""Anchor pools (capacity, LFU among the oldest, byte budget) and the segment store."""

from __future__ import annotations

import pytest
import torch

from agentcache.correction.anchors import OLDEST_WINDOW, AnchorBank, Correction
from agentcache.correction.lowrank import factorize
from agentcache.correction.store import SegmentStore
from agentcache.engine.tokens import common_prefix
from agentcache.isolation import Scope
from agentcache.engine.kv import SegmentKV


def _parts(tokens: int = 12, layers: int = 3, features: int = 8, rank: int | None = 4):
    gen = torch.Generator().manual_seed(tokens)
    base = factorize(torch.randn(layers, tokens, features, generator=gen), rank)
    delta = factorize(torch.randn(layers - 1, tokens, features, generator=gen), rank)
    return base, Correction(delta, delta)


def test_pool_keeps_at_most_v_anchors_and_evicts_lfu_among_the_oldest():
    bank = AnchorBank(capacity=6, byte_budget=2**30)
    base, corr = _parts()
    for i in range(6):
        bank.add("query", f"s{i}", "a0", base, base, "a1", corr)
    pool = bank.pool("query")
    uses = {"s0": 5, "s1": 3, "s2": 0, "s3": 4, "s4": 2, "s5": 0}  # s5 is unused but not among the 5 oldest
    for sid, n in uses.items():
        pool.anchors[sid].uses = n
    bank.add("query", "s6", "a0", base, base, "a1", corr)
    assert len(pool) == 6 and "s2" not in pool.anchors and "s5" in pool.anchors
    assert bank.evicted == 1 and OLDEST_WINDOW == 5


def test_one_source_collects_corrections_for_each_consumer():
    bank = AnchorBank(capacity=10, byte_budget=2**30)
    base, corr = _parts()
    for consumer in ("a1", "a2", "a3", "a4"):
        bank.add("query", "s0", "a0", base, base, consumer, corr)
    anchor = bank.pool("query").anchors["s0"]
    assert sorted(anchor.corrections) == ["a1", "a2", "a3", "a4"]
    assert anchor.nbytes == 2 * base.nbytes + 4 * corr.nbytes
    assert bank.pool("query").candidates("a0", "a3") == [anchor]
    assert bank.pool("query").candidates("a9", "a3") == []


def test_byte_budget_is_never_exceeded():
    base, corr = _parts()
    one = 2 * base.nbytes + corr.nbytes
    bank = AnchorBank(capacity=10, byte_budget=3 * one + 10)
    for i in range(12):
        bank.add(f"slot{i % 3}", f"s{i}", "a0", base, base, "a1", corr)
        assert bank.nbytes <= bank.byte_budget
    assert bank.num_anchors == 3 and bank.evicted == 9
    tiny = AnchorBank(capacity=10, byte_budget=one - 1)
    assert not tiny.add("query", "s0", "a0", base, base, "a1", corr)
    assert tiny.num_anchors == 0 and tiny.rejected_too_large == 1


def test_anchor_shape_checks():
    base, corr = _parts(features=8)
    bank = AnchorBank(capacity=4, byte_budget=2**30)
    bank.add("query", "s0", "a0", base, base, "a1", corr)
    anchor = bank.pool("query").anchors["s0"]
    assert anchor.fits(num_layers=3, features=8)
    assert not anchor.fits(num_layers=4, features=8)
    assert not anchor.fits(num_layers=3, features=16)
    assert anchor.is_finite()
    anchor.values.a[0, 0, 0] = float("inf")
    assert not anchor.is_finite()


def _kv(tokens: int, start: int = 0) -> SegmentKV:
    return SegmentKV(torch.randn(2, 1, tokens, 4), torch.randn(2, 1, tokens, 4), start)


S = Scope("tenant", "session")


def test_store_finds_the_same_content_only():
    store = SegmentStore(byte_budget=2**30)
    store.put(S, "query", "a0", [1, 2, 3, 4, 5, 6], _kv(6), "dense")
    store.put(S, "query", "a1", [1, 2, 9, 9, 9, 9], _kv(6), "dense")  # another query with the same opening
    entry, shared = store.find(S, "query", [1, 2, 3, 4, 5, 6, 7])
    assert (entry.agent, shared) == ("a0", 6)
    assert store.find(S, "query", [1, 2, 7, 7, 7, 7, 7, 7]) is None  # 2 of 8 tokens: not the same content
    assert store.find(S, "other", [1, 2, 3, 4, 5, 6]) is None
    assert store.find(S, "query", [1, 2, 3, 4, 5, 6], agent="a1") is None


def test_store_prefers_the_first_exact_source_and_one_in_context_before_a_reference():
    store = SegmentStore(byte_budget=2**30)
    tokens = [1, 2, 3, 4, 5, 6]
    exact = lambda: SegmentKV(_kv(6).keys, _kv(6).values, 0, exact_for=b"digest")  # noqa: E731
    store.put(S, "query", "<reference>", tokens, exact(), "reference")
    store.put(S, "query", "a0", tokens, exact(), "dense")
    store.put(S, "query", "a1", tokens, exact(), "dense")
    store.put(S, "query", "a2", tokens, _kv(6), "corrected")  # the newest, approximate
    assert store.find(S, "query", tokens)[0].agent == "a2"  # chained: the newest
    assert store.find(S, "query", tokens, prefer_exact=True)[0].agent == "a0"
    store.remove(store.find(S, "query", tokens, agent="a0")[0].id)
    store.remove(store.find(S, "query", tokens, agent="a1")[0].id)
    assert store.find(S, "query", tokens, prefer_exact=True)[0].agent == "<reference>"


def test_store_keeps_the_newest_materialization_and_its_budget():
    one = _kv(6).nbytes
    store = SegmentStore(byte_budget=2 * one)
    store.put(S, "query", "a0", [1, 2, 3, 4, 5, 6], _kv(6), "dense")
    store.put(S, "query", "a0", [1, 2, 3, 4, 5, 6], _kv(6), "corrected")  # replaces a0's older one
    assert len(store) == 1 and store.find(S, "query", [1, 2, 3, 4, 5, 6])[0].how == "corrected"
    store.put(S, "out:a0", "a0", [7, 8, 9, 10, 11, 12], _kv(6), "decoded")
    store.put(S, "out:a1", "a1", [7, 8, 9, 10, 11, 13], _kv(6), "decoded")
    assert store.nbytes <= store.byte_budget and store.evicted == 1
    assert store.find(S, "query", [1, 2, 3, 4, 5, 6]) is None  # the least recently used went first
    assert store.put(S, "big", "a0", list(range(20)), _kv(20), "dense") is None
    assert store.rejected_too_large == 1


def test_budgets_must_be_positive():
    with pytest.raises(ValueError, match="budget"):
        AnchorBank(capacity=4, byte_budget=0)
    with pytest.raises(ValueError, match="budget"):
        SegmentStore(byte_budget=0)


def _brute_force_find(entries, scope, slot, tokens, agent=None):
    """What the store's lookup must return, by scanning every entry."""
    needed, best = max(1, (len(tokens) + 1) // 2), None
    for entry in entries:
        if entry.scope != scope or entry.slot != slot or (agent is not None and entry.agent != agent):
            continue
        shared = common_prefix(entry.token_ids, tokens)
        if shared >= needed and (best is None or (shared, entry.serial) > (best[1], best[0].serial)):
            best = (entry, shared)
    return best


def test_store_index_finds_what_a_full_scan_finds():
    import random

    rng = random.Random(7)
    store = SegmentStore(byte_budget=2**30)
    scopes = [Scope(None, None), Scope(None, "s1"), Scope("t", "s1")]
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]  # a tiny alphabet: many shared prefixes
        store.put(rng.choice(scopes), rng.choice(["query", "out:a"]), rng.choice(["a", "b"]), tokens,
                  _kv(len(tokens)), "dense")
    for _ in range(400):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        args = (rng.choice(scopes), rng.choice(["query", "out:a"]), tokens, rng.choice([None, "a"]))
        want = _brute_force_find(list(store), *args)
        got = store.find(*args)
        assert (got[0].id, got[1]) == (want[0].id, want[1]) if want else got is None


def test_store_keeps_scopes_apart_and_drops_corrupt_entries():
    store = SegmentStore(byte_budget=2**30)
    mine, other_session, other_tenant = Scope("t", "s"), Scope("t", "s2"), Scope("u", "s")
    store.put(mine, "query", "a0", [1, 2, 3, 4], _kv(4), "dense")
    assert store.find(other_session, "query", [1, 2, 3, 4]) is None
    assert store.find(other_tenant, "query", [1, 2, 3, 4]) is None
    assert store.find(mine, "query", [1, 2, 3, 4])[1] == 4
    entry = store.put(mine, "query", "a1", [1, 2, 3, 5], _kv(4), "dense")
    object.__setattr__(entry, "token_ids", None)  # corrupt it in place
    assert store.find(mine, "query", [1, 2, 3, 5])[0].agent == "a0"  # the corrupt entry is skipped ...
    assert store.dropped_corrupt == 1 and len(store) == 1  # ... and dropped
    assert store.drop_scope(mine) == 1 and len(store) == 0 and store.nbytes == 0 and store.scopes == 0

"""The cache manager: leases over the block pool, the last-token rule, lineage caching, events,
overlapping requests, and the pool's incremental count of evictable blocks."""

import random

import pytest
import torch

from agentcache.engine.blocks import BlockPool
from agentcache.engine.cache_manager import CacheManager
from agentcache.engine.kv import KVLayout
from agentcache.scout.policies import SurvivalPolicy, TTLPolicy

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32)
BS = 4


def kv_source(tokens):
    """KV that encodes each position's token, so a block stored from the wrong rows is detectable."""
    table = torch.tensor(tokens, dtype=torch.float32)[None, None, :, None].expand(LAYOUT.num_layers, 1, -1,
                                                                                  LAYOUT.head_dim)

    def kv_of(begin, end):
        keys = table[:, :, begin:end].clone()  # (L, H, B, D)
        return keys, -keys

    return kv_of


def evictable_by_walk(pool: BlockPool) -> int:
    """The definition: unreferenced blocks with no referenced descendant."""
    kept = set()
    for block in pool.blocks():
        node = block if block.ref_count > 0 else None
        while node is not None and node.block_id not in kept:
            kept.add(node.block_id)
            node = node.parent
    return pool.num_used - len(kept)


def test_a_lease_holds_its_hit_and_commits_the_rest():
    cache = CacheManager(BlockPool(32, BS, "lru", LAYOUT))
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks
    first = cache.admit(prompt)
    assert first.hit.tokens == 0 and cache.stats.lookups == 1 and cache.stats.lookup_blocks == 3
    assert cache.commit(first, prompt, kv_source(prompt)) == 3
    assert all(b.ref_count == 1 for b in first.held)
    cache.free(first)
    assert all(b.ref_count == 0 for b in cache.pool.blocks())

    again = cache.admit(prompt)
    assert again.hit.tokens == 12 and [b.ref_count for b in again.hit.blocks] == [1, 1, 1]
    keys, _ = cache.pool.gather(again.hit.blocks)
    assert keys[0, 0, :, 0].tolist() == prompt[:12]  # the KV stored is the KV of those tokens
    cache.free(again)
    cache.free(again)  # freeing twice is harmless
    with pytest.raises(ValueError, match="freed"):
        cache.commit(again, prompt)


def test_the_last_prompt_token_is_never_served():
    cache = CacheManager(BlockPool(32, BS, "lru"))
    prompt = list(range(1, 9))  # exactly 2 blocks
    lease = cache.admit(prompt)
    cache.commit(lease, prompt)
    cache.free(lease)
    assert cache.servable_blocks(8) == 1 and cache.servable_blocks(9) == 2 and cache.servable_blocks(0) == 0
    assert cache.admit(prompt).hit.tokens == 4  # the second block holds the last token: computed
    assert cache.cached_prefix_length(prompt) == 4
    assert cache.fully_cached(prompt) and not cache.fully_cached(list(range(1, 14)))


def test_only_the_looked_up_tokens_are_served():
    cache = CacheManager(BlockPool(32, BS, "lru"))
    prompt = list(range(1, 14))
    lease = cache.admit(prompt)
    cache.commit(lease, prompt)
    cache.free(lease)
    assert cache.admit(prompt, 5).hit.tokens == 4  # only a 5-token lead is looked up


def test_approximate_blocks_go_under_the_lineage_or_nowhere():
    pool = BlockPool(32, BS, "lru")
    cache = CacheManager(pool)
    prompt = list(range(1, 18))  # 4 full blocks
    anonymous = cache.admit(prompt)
    assert cache.commit(anonymous, prompt, approximate_from=6) == 1  # block 2 holds token 6: not cached
    cache.free(anonymous)
    assert pool.num_used == 1

    mine = cache.admit(prompt, lineage="agent-a")
    assert mine.hit.tokens == 4
    assert cache.commit(mine, prompt, approximate_from=6) == 3
    cache.free(mine)
    salted = [b for b in pool.blocks() if not b.exact]
    assert len(salted) == 3 and all(b.salt == "agent-a" for b in salted)
    assert cache.lookup(prompt, lineage="agent-a").tokens == 16
    assert cache.lookup(prompt).tokens == 4  # another request sees only the exact block
    hit = cache.lookup(prompt, lineage="agent-a")
    assert hit.lineage_from == 4


def test_disabled_manager_neither_looks_up_nor_stores():
    pool = BlockPool(32, BS, "lru")
    cache = CacheManager(pool, enabled=False)
    prompt = list(range(1, 14))
    for _ in range(2):
        lease = cache.admit(prompt)
        assert lease.hit.tokens == 0 and cache.commit(lease, prompt) == 0
        cache.free(lease)
    assert pool.num_used == 0 and pool.stats.lookups == 0


def test_a_full_pool_stops_caching_and_counts_it():
    pool = BlockPool(3, BS, "lru")
    cache = CacheManager(pool)
    holder = cache.admit(list(range(100, 109)))
    cache.commit(holder, list(range(100, 109)))  # 2 blocks, held
    lease = cache.admit(list(range(1, 14)))
    assert cache.commit(lease, list(range(1, 14))) == 1
    assert pool.stats.store_skipped == 2
    cache.free(lease)
    cache.free(holder)


def test_events_mirror_what_the_pool_holds():
    pool = BlockPool(6, BS, "lru")
    cache = CacheManager(pool)
    rng = random.Random(0)
    mirror = set()
    for _ in range(40):
        prompt = [rng.randrange(5) for _ in range(rng.randrange(1, 14))]
        lease = cache.admit(prompt)
        cache.commit(lease, prompt)
        cache.free(lease)
        for event in cache.drain_events():
            if event.kind == "stored":
                assert event.block_hash not in mirror
                mirror.add(event.block_hash)
            else:
                assert event.kind == "removed"
                mirror.remove(event.block_hash)
    assert mirror == {b.block_hash for b in pool.blocks()}
    assert cache.drain_events() == [] and cache.events_dropped == 0
    cache = CacheManager(BlockPool(6, BS, "lru"), max_events=4)
    for i in range(3):  # more events than the buffer holds between drains: the oldest are dropped, counted
        lease = cache.admit(list(range(200 + 20 * i, 213 + 20 * i)))
        cache.commit(lease, list(range(200 + 20 * i, 213 + 20 * i)))
        cache.free(lease)
    # 3 x 3 full blocks stored in a 6-block pool: 9 "stored" and 3 "removed", of which the last 4 are kept
    assert len(cache.drain_events()) == 4 and cache.events_dropped == 9 + 3 - 4


def test_overlapping_requests_attribute_their_own_blocks():
    """Two leases open at once (a batching engine): each block is credited to the agent whose request
    touched it, not to whichever request was admitted last."""
    policy = SurvivalPolicy()
    pool = BlockPool(32, BS, policy)
    cache = CacheManager(pool)
    a_prompt, b_prompt = list(range(1, 10)), list(range(50, 59))
    a = cache.admit(a_prompt, owner="A", session="s1")
    b = cache.admit(b_prompt, owner="B", session="s2")  # admitted while A still runs
    cache.commit(a, a_prompt)
    cache.commit(b, b_prompt)
    agent_a, agent_b = policy.learner.index["A"], policy.learner.index["B"]
    assert {policy.agent_of[x.block_id] for x in a.held} == {agent_a}
    assert {policy.agent_of[x.block_id] for x in b.held} == {agent_b}
    assert {policy.session_of[x.block_id] for x in a.held} == {"s1"}
    cache.free(b)
    cache.free(a)

    ttl = TTLPolicy(ttl=2)
    cache = CacheManager(BlockPool(32, BS, ttl))
    a = cache.admit(a_prompt, owner="A")
    b = cache.admit(b_prompt, owner="B")
    cache.commit(a, a_prompt)
    cache.commit(b, b_prompt)
    a_blocks = list(a.held)
    cache.free(b)
    assert all(ttl.pinned_until[x.block_id] == 0 for x in a_blocks)  # B's end pins only B's blocks
    cache.free(a)
    assert all(ttl.pinned_until[x.block_id] == ttl.step + 2 for x in a_blocks)


@pytest.mark.parametrize("seed", range(4))
def test_evictable_count_is_kept_exactly(seed):
    """The pool keeps `num_evictable` as references change (no walk per eviction); random traffic
    with leases left open checks it against the definition after every operation."""
    rng = random.Random(seed)
    pool = BlockPool(24, BS, "lru")
    cache = CacheManager(pool)
    open_leases = []
    for _ in range(300):
        action = rng.random()
        if action < 0.5 or not open_leases:
            prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 20))]
            lease = cache.admit(prompt, lineage=rng.choice([None, "x"]))
            cache.commit(lease, prompt, approximate_from=rng.choice([None, 5, 9]))
            open_leases.append(lease)
        elif action < 0.85:
            cache.free(open_leases.pop(rng.randrange(len(open_leases))))
        else:
            pool.evict(min(pool.num_evictable, rng.randrange(1, 4)))
        assert pool.num_evictable == evictable_by_walk(pool)
    for lease in open_leases:
        cache.free(lease)
    assert pool.num_evictable == pool.num_used == evictable_by_walk(pool)

import random

import pytest
import torch

from agentcache.engine.blocks import BlockPool, block_hash
from agentcache.engine.kv import KVLayout
from agentcache.errors import CapacityError, InputError
from agentcache.policies import EVICTION_POLICIES, make_policy

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32)
BS = 4


def kv_for(tokens: tuple[int, ...], position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's fake KV that encodes its tokens and position, so a wrong hit is detectable."""
    base = torch.tensor(tokens, dtype=torch.float32)[None, None, :, None] + 1000.0 * position  # (1, 1, B, 1)
    keys = base.expand(LAYOUT.num_layers, 1, BS, LAYOUT.head_dim).clone()
    return keys, -keys


def store_chain(pool, tokens, salt=None):
    """Store all full blocks of `tokens` after what is cached; return the whole chain (released)."""
    chain = pool.match(tokens, salt)
    parent = chain[-1] if chain else None
    held = []
    for i in range(len(chain), len(tokens) // BS):
        block_tokens = tuple(tokens[i * BS : (i + 1) * BS])
        parent = pool.store(parent, block_tokens, *kv_for(block_tokens, i), salt=salt)
        held.append(parent)
    pool.release(held)
    return pool.match(tokens, salt)


def test_hash_chains_parent_tokens_and_salt():
    h1 = block_hash(None, [1, 2, 3, 4], None)
    assert h1 == block_hash(None, [1, 2, 3, 4], None)
    assert h1 != block_hash(None, [1, 2, 3, 5], None)
    assert h1 != block_hash(None, [1, 2, 3, 4], "agent-a")
    assert block_hash(h1, [5, 6, 7, 8], None) != block_hash(None, [5, 6, 7, 8], None)


def test_match_returns_longest_cached_prefix_and_gathers_its_kv():
    pool = BlockPool(16, BS, "lru", LAYOUT)
    tokens = list(range(10, 23))  # 13 tokens: 3 full blocks
    store_chain(pool, tokens)
    chain = pool.match(tokens + [99])
    assert len(chain) == 3
    keys, values = pool.gather(chain)
    assert keys.shape == (2, 1, 12, 4)
    for i in range(3):
        expected, _ = kv_for(tuple(tokens[i * BS : (i + 1) * BS]), i)
        assert torch.equal(keys[:, :, i * BS : (i + 1) * BS], expected)
    assert len(pool.match(tokens[:4] + [0, 0, 0, 0])) == 1  # diverges in the second block


def test_salted_blocks_serve_only_their_lineage():
    pool = BlockPool(16, BS, "lru", LAYOUT)
    exact = list(range(8))
    approx_tail = list(range(100, 108))
    store_chain(pool, exact)
    # An approximate continuation stored under lineage "planner".
    chain = pool.match(exact)
    parent = chain[-1]
    held = []
    for i in range(2):
        t = tuple(approx_tail[i * BS : (i + 1) * BS])
        parent = pool.store(parent, t, *kv_for(t, 2 + i), salt="planner")
        held.append(parent)
    pool.release(held)
    assert len(pool.match(exact + approx_tail)) == 2  # another request: exact blocks only
    assert len(pool.match(exact + approx_tail, salt="critic")) == 2
    own = pool.match(exact + approx_tail, salt="planner")
    assert len(own) == 4 and [b.exact for b in own] == [True, True, False, False]


def test_hash_hit_is_verified_against_stored_tokens(monkeypatch):
    pool = BlockPool(8, BS, "lru", LAYOUT)
    store_chain(pool, [1, 2, 3, 4])
    # Force a collision: every hash the same. A lookup of other tokens must still miss.
    monkeypatch.setattr("agentcache.engine.blocks.block_hash", lambda parent, tokens, salt, namespace=None: b"same")
    pool2 = BlockPool(8, BS, "lru", LAYOUT)
    store_chain(pool2, [1, 2, 3, 4])
    assert pool2.match([9, 9, 9, 9]) == []
    assert len(pool2.match([1, 2, 3, 4])) == 1


def test_lru_evicts_least_recent_leaf_first():
    pool = BlockPool(4, BS, "lru", LAYOUT)
    a = store_chain(pool, [1] * 4 + [2] * 4)  # a0 <- a1
    b = store_chain(pool, [3] * 4 + [4] * 4)  # b0 <- b1
    pool.acquire(a)  # touch chain a
    pool.release(a)
    store_chain(pool, [5] * 4)  # needs one block: evict b's leaf (b1), never b0 before b1
    assert len(pool.match([3] * 4 + [4] * 4)) == 1
    assert len(pool.match([1] * 4 + [2] * 4)) == 2
    assert b[1].block_id == pool.match([5] * 4)[0].block_id  # the freed row was reused


def test_referenced_blocks_are_never_evicted_and_full_pool_raises():
    pool = BlockPool(2, BS, "lru", LAYOUT)
    chain = store_chain(pool, list(range(8)))
    pool.acquire(chain)
    with pytest.raises(CapacityError, match="unreferenced"):
        pool.store(None, (9, 9, 9, 9), *kv_for((9, 9, 9, 9), 0))
    assert len(pool.match(list(range(8)))) == 2  # nothing was lost by the failed store
    pool.release(chain)
    pool.store(None, (9, 9, 9, 9), *kv_for((9, 9, 9, 9), 0))


def test_bad_capacity_is_refused():
    with pytest.raises(CapacityError):
        BlockPool(0, BS)
    with pytest.raises(ValueError, match="unknown eviction policy 'fifo'"):
        make_policy("fifo")
    with pytest.raises(InputError, match=r"BlockPool.policy: unknown eviction policy 'survival'.*make_policy"):
        BlockPool(4, BS, "survival")  # the pool knows the engine's own names only: hand it the object


@pytest.mark.parametrize("policy", sorted(EVICTION_POLICIES))
def test_random_workload_respects_capacity_and_never_serves_evicted_kv(policy):
    rng = random.Random(7)
    pool = BlockPool(24, BS, make_policy(policy), LAYOUT)
    prefixes = [[rng.randrange(50) for _ in range(BS * rng.randint(1, 5))] for _ in range(12)]
    for step in range(400):
        tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(0, 9))]
        chain = pool.match(tokens)
        pool.acquire(chain)
        if chain:
            keys, _ = pool.gather(chain)
            for i in range(len(chain)):
                expected, _ = kv_for(tuple(tokens[i * BS : (i + 1) * BS]), i)
                assert torch.equal(keys[:, :, i * BS : (i + 1) * BS], expected), f"step {step}: stale KV served"
        parent = chain[-1] if chain else None
        stored = []
        for i in range(len(chain), len(tokens) // BS):
            t = tuple(tokens[i * BS : (i + 1) * BS])
            try:
                parent = pool.store(parent, t, *kv_for(t, i))
            except CapacityError:
                break
            stored.append(parent)
        assert pool.num_used <= pool.capacity
        assert pool.num_used + pool.num_free == pool.capacity
        pool.release(chain + stored)
        # every cached block's parent is cached too: eviction goes leaves first
        for block in pool.blocks():
            assert block.parent is None or pool.get(block.parent.block_hash) is block.parent
    assert pool.stats.evictions > 0


def test_a_referenced_child_pins_its_parent():
    pool = BlockPool(2, 2)
    a = pool.store(None, (1, 2))
    b = pool.store(a, (3, 4))
    pool.release([a, b])
    pool.acquire([b])  # a caller holding the child only
    assert pool.num_evictable == 0
    with pytest.raises(CapacityError, match="unreferenced"):
        pool.store(None, (9, 9))


def test_salt_is_verified_on_a_hash_hit(monkeypatch):
    monkeypatch.setattr("agentcache.engine.blocks.block_hash", lambda parent, tokens, salt, namespace=None: b"same")
    pool = BlockPool(4, BS, "lru", LAYOUT)
    store_chain(pool, [1, 2, 3, 4], salt="planner")
    assert pool.match([1, 2, 3, 4]) == []  # the exact lookup must not take the salted block
    from agentcache.engine.blocks import BlockCollision

    with pytest.raises(BlockCollision):
        pool.store(None, (1, 2, 3, 4), *kv_for((1, 2, 3, 4), 0))


def test_a_run_of_blocks_is_stored_in_one_write_and_taken_back_if_the_write_fails(monkeypatch):
    pool = BlockPool(16, BS, "lru", LAYOUT)
    tokens = list(range(1, 13))  # 3 blocks
    keys = torch.tensor(tokens, dtype=torch.float32)[None, None, :, None].expand(2, 1, -1, 4)  # (L, H, T, D)
    first = pool.store(None, tuple(tokens[:BS]), keys[:, :, :BS].clone(), -keys[:, :, :BS].clone())
    held = []
    # the first block is cached already: found, not written again; the two after it are new
    assert pool.store_run(None, tokens, keys, -keys, [None, None, "planner"], held) is None
    assert held[0] is first and [b.salt for b in held] == [None, None, "planner"]
    stored, _ = pool.gather(held)
    assert stored[0, 0, :, 0].tolist() == tokens  # every block's KV is its tokens'
    pool.release(held + [first])

    def broken(*args):
        raise RuntimeError("device lost")

    monkeypatch.setattr(pool.storage, "write_run", broken)
    again: list = []
    more = list(range(21, 33))
    with pytest.raises(RuntimeError, match="device lost"):
        pool.store_run(None, more, keys, -keys, [None] * 3, again)
    assert again == [] and pool.match(more) == []  # nothing unwritten stays cached or referenced
    assert all(b.ref_count == 0 for b in pool.blocks()) and pool.num_used == 3

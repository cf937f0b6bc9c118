"""Paged block pool: fixed-size token blocks, chained hashes, reference counts, pluggable eviction.

A block holds the KV of `block_size` consecutive tokens. Its hash chains the parent's hash, its
own token ids and a salt; a hash hit is trusted only after the stored tokens and parent match.
Exact KV is stored under its namespace (None: shared by every caller; a tenant's salt: that
tenant's only). KV that is approximate (a corrected or reused segment, or anything computed after
one) is stored under the salt of its lineage, so it can serve that lineage's own later calls but
never another request's exact prefix lookup.

The pool can run without tensors (`layout=None`) to replay traces through the same bookkeeping.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from agentcache.engine.block_storage import BlockStorage
from agentcache.engine.eviction import Dispatch, EvictionPolicy, builtin_policy
from agentcache.engine.kv import KVLayout
from agentcache.errors import CapacityError

__all__ = ["Block", "BlockCollision", "BlockPool", "CacheEvent", "PoolStats", "block_hash"]

_ROOT = b"agentcache-root"


def block_hash(
    parent_hash: bytes | None, token_ids: Sequence[int], salt: str | None, namespace: str | None = None
) -> bytes:
    """Hash of a block from its parent's hash, its tokens, its lineage salt (None for exact KV) and
    the namespace of exact KV (None: shared)."""
    digest = hashlib.blake2b(parent_hash or _ROOT, digest_size=16)
    for tag in (salt, namespace):
        digest.update(b"\x00" if tag is None else b"\x01" + str(len(tag)).encode() + b":" + tag.encode())
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class BlockCollision(Exception):
    """Two different blocks hash alike: the new one is not cached (the old one stays valid)."""


@dataclass(eq=False)
class Block:
    """Metadata of one cached block; the KV lives in the pool's storage at row `block_id`."""

    block_id: int
    block_hash: bytes
    token_ids: tuple[int, ...]
    parent: "Block | None"
    salt: str | None  # the lineage of approximate KV; None: exact
    owner: str | None  # who stored it (an agent name), for agent-aware policies
    created: int
    last_access: int
    hits: int = 0
    ref_count: int = 0
    num_children: int = 0
    namespace: str | None = None  # exact KV only: whose it is (a tenant's salt); None: shared
    keeps: int = 0  # (referenced ? 1 : 0) + children with keeps > 0: > 0 means eviction cannot free it

    @property
    def exact(self) -> bool:
        return self.salt is None

    @property
    def depth(self) -> int:
        """Blocks before this one in its chain."""
        depth, node = 0, self.parent
        while node is not None:
            depth, node = depth + 1, node.parent
        return depth


@dataclass(frozen=True)
class CacheEvent:
    """A change to what the pool holds, for whoever mirrors it (vLLM reports the same as KV events)."""

    kind: str  # "stored" | "removed"
    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    exact: bool  # False: approximate KV of one lineage, never served to another request
    owner: str | None = None


@dataclass
class PoolStats:
    lookups: int = 0  # recorded by the pool's user (the engine, a trace replay)
    lookup_blocks: int = 0  # full blocks asked for across those lookups
    hit_blocks: int = 0
    stored_blocks: int = 0
    store_skipped: int = 0  # blocks not cached because nothing was evictable
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.lookup_blocks if self.lookup_blocks else 0.0


class BlockIndex:
    """Cached blocks by their chained hash. A hash hit is trusted only after the stored tokens,
    parent, salt and namespace match too."""

    def __init__(self) -> None:
        self.by_hash: dict[bytes, Block] = {}

    def get(self, key: bytes) -> Block | None:
        return self.by_hash.get(key)

    def match(self, token_ids: Sequence[int], block_size: int, salt: str | None, namespace: str | None) -> list[Block]:
        """The longest chain of cached full blocks that prefixes `token_ids`: each block looked up
        exact (in `namespace`) first, then under `salt` (the caller's lineage)."""
        chain: list[Block] = []
        parent: Block | None = None
        keys = [(None, namespace)] + ([(salt, None)] if salt is not None else [])
        for i in range(len(token_ids) // block_size):
            tokens = tuple(token_ids[i * block_size : (i + 1) * block_size])
            found = None
            for candidate_salt, candidate_space in keys:
                block = self.by_hash.get(block_hash(parent.block_hash if parent else None, tokens, candidate_salt,
                                                    candidate_space))
                if self.verified(block, tokens, parent, candidate_salt, candidate_space):
                    found = block
                    break
            if found is None:
                break
            chain.append(found)
            parent = found
        return chain

    @staticmethod
    def verified(block: Block | None, tokens: tuple[int, ...], parent: Block | None, salt: str | None,
                 namespace: str | None) -> bool:
        return (block is not None and block.token_ids == tokens and block.parent is parent and block.salt == salt
                and block.namespace == namespace)


@dataclass
class BlockPool:
    capacity: int
    block_size: int = 16
    policy: EvictionPolicy | str = "lru"  # a policy object, or the name of one of the engine's own
    layout: KVLayout | None = None
    device: torch.device | str = "cpu"
    stats: PoolStats = field(default_factory=PoolStats)
    listener: Callable[[CacheEvent], None] | None = None  # told of every block stored and removed

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise CapacityError(f"block pool capacity must be at least 1 block, got {self.capacity}")
        if self.block_size < 1:
            raise CapacityError(f"block size must be at least 1 token, got {self.block_size}")
        self.policy = builtin_policy(self.policy, "BlockPool.policy")
        self.policy.attach(self.capacity, self.block_size)
        self._blocks: dict[int, Block] = {}
        self._index = BlockIndex()
        self._recycled: list[int] = []  # ids freed by eviction; fresh ids come from _next_fresh
        self._next_fresh = 0  # ids are handed out lazily: a huge capacity costs nothing up front
        self._clock = 0
        self._num_kept = 0  # blocks with keeps > 0, kept current on every reference change
        self.storage = (BlockStorage(self.capacity, self.block_size, self.layout, self.device)
                        if self.layout is not None else None)  # None: bookkeeping only

    # --- queries -------------------------------------------------------------------------

    @property
    def num_used(self) -> int:
        return len(self._blocks)

    @property
    def num_free(self) -> int:
        return self.capacity - len(self._blocks)

    @property
    def num_evictable(self) -> int:
        """Blocks that leaf-first eviction can free: unreferenced, with no referenced descendant."""
        return len(self._blocks) - self._num_kept

    def can_allocate(self, num_blocks: int) -> bool:
        return self.num_free + self.num_evictable >= num_blocks

    def blocks(self) -> list[Block]:
        return list(self._blocks.values())

    def get(self, block_hash_: bytes) -> Block | None:
        return self._index.get(block_hash_)

    def match(self, token_ids: Sequence[int], salt: str | None = None, namespace: str | None = None) -> list[Block]:
        """The longest chain of cached full blocks that prefixes `token_ids` (`BlockIndex.match`).
        Nothing is touched or referenced: call `acquire` on what you use."""
        return self._index.match(token_ids, self.block_size, salt, namespace)

    # --- requests and reference counting ----------------------------------------------------

    def begin_request(
        self, token_ids: Sequence[int], agent: str | None = None, *, session: str | None = None, warmup: bool = False
    ) -> Any:
        """Tell the eviction policy a request is admitted: who runs it (None: let it fingerprint the
        prompt). Returns the request's visit, for `acquire`, `store` and `end_request`."""
        return self.policy.begin_request(Dispatch(token_ids, agent, session, warmup))

    def end_request(self, visit: Any = None) -> None:
        self.policy.end_request(visit)

    def acquire(self, blocks: Sequence[Block], *, hit: bool = True, visit: Any = None) -> None:
        """Reference blocks for the duration of a call; counts as an access (and a hit)."""
        for block in blocks:
            self._check_member(block)
        now = self._tick()
        touch = self.policy.touch
        for block in blocks:
            self._reference(block, +1)
            block.last_access = now
            if hit:
                block.hits += 1
            touch(block, visit)
        if hit:
            self.stats.hit_blocks += len(blocks)

    def release(self, blocks: Sequence[Block]) -> None:
        for block in blocks:
            self._check_member(block)
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block.block_id} released more often than acquired")
            self._reference(block, -1)

    def _reference(self, block: Block, change: int) -> None:
        """Change a block's reference count; when it starts or stops being referenced, the blocks
        kept from eviction (it and its ancestors) change too, as far as the change reaches."""
        was_referenced = block.ref_count > 0
        block.ref_count += change
        if (block.ref_count > 0) == was_referenced:
            return
        step = 1 if block.ref_count > 0 else -1
        node: Block | None = block
        while node is not None:
            was_kept = node.keeps > 0
            node.keeps += step
            if (node.keeps > 0) == was_kept:
                break  # its parent already counts it (or never did)
            self._num_kept += step
            node = node.parent

    def _check_member(self, block: Block) -> None:
        if self._blocks.get(block.block_id) is not block:
            raise ValueError(f"block {block.block_id} is not cached in this pool (evicted, or from another pool)")

    # --- data ----------------------------------------------------------------------------------

    def gather(self, blocks: Sequence[Block]) -> tuple[torch.Tensor, torch.Tensor]:
        """KV of a chain of blocks, each (L, H, n·B, D)."""
        if self.storage is None:
            raise RuntimeError("this block pool holds no tensors (layout=None)")
        return self.storage.gather([b.block_id for b in blocks])

    def store(
        self,
        parent: Block | None,
        token_ids: Sequence[int],
        keys: torch.Tensor | None = None,
        values: torch.Tensor | None = None,
        *,
        salt: str | None = None,
        namespace: str | None = None,
        owner: str | None = None,
        visit: Any = None,
    ) -> Block:
        """Cache one full block after `parent` and return it acquired (the caller releases it).

        `salt` marks approximate KV of that lineage; exact KV (no salt) lives in `namespace`.
        keys/values: (L, H, B, D). An identical block already cached is returned instead.
        Raises CapacityError when the pool is full and nothing can be evicted, BlockCollision
        when another block already holds this hash.
        """
        block, created = self._stored(parent, token_ids, salt, namespace, owner, visit)
        if created and self.storage is not None:
            self.storage.write(block.block_id, keys, values)
        return block

    def store_run(
        self,
        parent: Block | None,
        token_ids: Sequence[int],
        keys: torch.Tensor | None,
        values: torch.Tensor | None,
        salts: Sequence[str | None],
        held: list[Block],
        *,
        namespace: str | None = None,
        owner: str | None = None,
        visit: Any = None,
    ) -> CapacityError | BlockCollision | None:
        """Cache len(salts) consecutive full blocks after `parent`, block i under `salts[i]` (as `store`
        does one): token_ids holds their n·B tokens, keys/values (L, H, n·B, D) their KV, written in one
        copy. Each block stored is acquired and appended to `held` as it is. When one cannot be (a full
        pool, a collision) the run stops there and that error is returned. The new blocks' KV is written
        before the run returns (the caller holds the pool meanwhile); if the write fails, they are
        dropped again."""
        bs = self.block_size
        fresh: list[Block] = []  # blocks new to the pool (a suffix of the run: a new block's children are new)
        stored = 0
        try:
            for i, salt in enumerate(salts):
                try:
                    block, created = self._stored(parent, token_ids[i * bs : (i + 1) * bs], salt, namespace, owner,
                                                  visit)
                except (CapacityError, BlockCollision) as exc:
                    return exc
                held.append(block)
                stored += 1
                if created:
                    fresh.append(block)
                parent = block
            return None
        finally:
            if fresh and self.storage is not None:
                try:
                    self.storage.write_run(stored - len(fresh), [b.block_id for b in fresh], keys, values)
                except BaseException:
                    self._drop_new(fresh, held)
                    raise

    def _drop_new(self, fresh: list[Block], held: list[Block]) -> None:
        """Take back blocks just stored whose KV never reached storage (children first)."""
        for block in reversed(fresh):
            self._reference(block, -1)
            held.remove(block)
            self._remove(block)

    def _stored(
        self, parent: Block | None, token_ids: Sequence[int], salt: str | None, namespace: str | None,
        owner: str | None, visit: Any,
    ) -> tuple[Block, bool]:
        """The block of these tokens after `parent`, acquired: one already cached (False), or a new one
        whose storage row the caller writes (True)."""
        tokens = tuple(token_ids)
        if len(tokens) != self.block_size:
            raise ValueError(f"a block holds exactly {self.block_size} tokens, got {len(tokens)}")
        if parent is not None and self._index.get(parent.block_hash) is not parent:
            raise ValueError(f"parent block {parent.block_id} is no longer cached")
        if salt is not None:
            namespace = None  # a lineage salt already names its tenant
        key = block_hash(parent.block_hash if parent else None, tokens, salt, namespace)
        existing = self._index.get(key)
        if self._index.verified(existing, tokens, parent, salt, namespace):
            self.acquire([existing], hit=False, visit=visit)
            return existing, False
        if existing is not None:
            raise BlockCollision(f"hash of block after {parent and parent.block_id} collides with block {existing.block_id}")
        if parent is not None:
            self._reference(parent, +1)  # making room must not evict the block we are about to chain to
        try:
            block_id = self._allocate_id()
        finally:
            if parent is not None:
                self._reference(parent, -1)
        now = self._tick()
        block = Block(block_id, key, tokens, parent, salt, owner, created=now, last_access=now, namespace=namespace)
        self._blocks[block_id] = block
        self._index.by_hash[key] = block
        if parent is not None:
            parent.num_children += 1
        self._reference(block, +1)
        self.stats.stored_blocks += 1
        self.policy.touch(block, visit)
        if self.listener is not None:
            self.listener(CacheEvent("stored", key, parent.block_hash if parent else None, tokens, salt is None, owner))
        return block, True

    # --- eviction -------------------------------------------------------------------------------

    def _allocate_id(self) -> int:
        if self.num_free == 0:
            self.evict(1)
        if self._recycled:
            return self._recycled.pop()
        self._next_fresh += 1
        return self._next_fresh - 1

    def reserve(self, num_blocks: int) -> int:
        """Free room for `num_blocks` new blocks in one eviction pass, as far as unreferenced blocks
        allow; returns the free blocks now. Storing block by block would instead run one pass
        (a scan of every candidate) per block."""
        short = num_blocks - self.num_free
        if short > 0:
            evictable = self.num_evictable
            if evictable:
                self.evict(min(short, evictable))
        return self.num_free

    def evict(self, num_blocks: int) -> list[Block]:
        """Free `num_blocks` blocks, lowest policy priority first, leaves before their parents."""
        if num_blocks > self.num_evictable:
            raise CapacityError(
                f"cannot evict {num_blocks} blocks: only {self.num_evictable} of {self.num_used} cached "
                f"blocks are unreferenced (capacity {self.capacity}); the pool is too small for this call"
            )
        priority = self.policy.priority
        heap = [
            (priority(b), b.block_id, b) for b in self._blocks.values() if b.ref_count == 0 and b.num_children == 0
        ]
        heapq.heapify(heap)
        evicted: list[Block] = []
        while len(evicted) < num_blocks:
            if not heap:  # cannot happen while num_evictable is right; never pop an empty heap
                raise CapacityError(f"eviction ran out of candidates after {len(evicted)} of {num_blocks} blocks")
            _, _, block = heapq.heappop(heap)
            self._remove(block)
            evicted.append(block)
            parent = block.parent
            if parent is not None and parent.ref_count == 0 and parent.num_children == 0:
                heapq.heappush(heap, (priority(parent), parent.block_id, parent))
        return evicted

    def _remove(self, block: Block) -> None:
        del self._blocks[block.block_id]
        del self._index.by_hash[block.block_hash]
        if block.parent is not None:
            block.parent.num_children -= 1
        self._recycled.append(block.block_id)
        self.stats.evictions += 1
        self.policy.forget(block)
        if self.listener is not None:
            parent = block.parent
            self.listener(CacheEvent("removed", block.block_hash, parent.block_hash if parent else None,
                                     block.token_ids, block.exact, block.owner))

    def clear(self) -> None:
        """Drop every unreferenced block."""
        self.evict(self.num_evictable)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

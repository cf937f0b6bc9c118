"""The cache manager: one request-level view of the block pool, used by every engine and replay.

A request's life in the prefix cache:

    lease = manager.admit(prompt, lookup_tokens, ...)   # the policy learns the dispatch; the hit is referenced
    ... compute the rest of the prompt and the output ...
    manager.commit(lease, tokens, kv_of, approximate_from=...)   # cache every full block past the hit
    manager.free(lease)                                  # release everything the request held

Two rules live here and nowhere else: a hit covers whole blocks only, and never the last prompt
token, whose logits the engine must compute (`servable_blocks`). Approximate KV (anything at or
after `approximate_from`) is cached only under the request's lineage, and not at all without one.

Requests may overlap (a batching engine admits one while others decode): each holds its own
lease, and the policy attributes touches through the lease's visit. Every public method holds
the manager's lock for as long as its bookkeeping (and block copies) take, never across a
forward pass: a lookup from another thread (a runtime planning a call) never waits for an
engine step.
"""

from __future__ import annotations

import functools
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from agentcache.engine.blocks import Block, BlockPool, CacheEvent
from agentcache.engine.protocol import CacheStats

__all__ = ["CacheManager", "Lease", "PrefixHit", "servable_tokens"]

KVSource = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]  # (begin, end) -> keys, values (L, H, B, D)


def servable_tokens(prompt_len: int, block_size: int) -> int:
    """Prompt tokens a prefix hit may cover: whole blocks, never the last token (its logits are computed)."""
    return max(0, prompt_len - 1) // block_size * block_size


@dataclass(frozen=True)
class PrefixHit:
    """The cached blocks that serve a prompt's first `tokens` tokens."""

    blocks: tuple[Block, ...]
    block_size: int

    @property
    def tokens(self) -> int:
        return len(self.blocks) * self.block_size

    @property
    def lineage_from(self) -> int:
        """Where the caller's own approximate blocks begin (every block after one is approximate
        too); `tokens` when every block is exact."""
        return next((i * self.block_size for i, b in enumerate(self.blocks) if not b.exact), self.tokens)


@dataclass(eq=False)
class Lease:
    """One request's hold on the pool, from admission to `free`."""

    hit: PrefixHit
    lineage: str | None
    namespace: str | None
    owner: str | None
    visit: Any  # the eviction policy's record of this request
    held: list[Block] = field(default_factory=list)
    freed: bool = False


def _locked(method):
    @functools.wraps(method)
    def under_lock(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return under_lock


class CacheManager:
    """Prefix lookups, admission, commits and frees over one `BlockPool`; see the module doc.

    `enabled=False` is the no-reuse baseline: nothing is looked up or stored, and leases are empty.
    """

    def __init__(self, pool: BlockPool, *, enabled: bool = True, max_events: int = 65536) -> None:
        self.pool = pool
        self.enabled = enabled
        self.events: deque[CacheEvent] = deque(maxlen=max_events)
        self.events_dropped = 0
        self._lock = threading.RLock()
        pool.listener = self._record

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def stats(self):
        return self.pool.stats

    @_locked
    def cache_stats(self) -> CacheStats:
        pool = self.pool
        return CacheStats(
            capacity_blocks=pool.capacity, cached_blocks=pool.num_used,
            blocks_in_use=sum(1 for block in pool.blocks() if block.ref_count > 0),
            lookup_blocks=pool.stats.lookup_blocks, hit_blocks=pool.stats.hit_blocks, evictions=pool.stats.evictions,
        )

    def servable_blocks(self, prompt_len: int) -> int:
        """Full blocks a prefix hit may cover: the last prompt token is always computed."""
        return servable_tokens(prompt_len, self.block_size) // self.block_size

    # --- lookups --------------------------------------------------------------------------

    @_locked
    def lookup(
        self, token_ids: Sequence[int], prompt_len: int | None = None, *, lineage: str | None = None,
        namespace: str | None = None,
    ) -> PrefixHit:
        """The hit a request whose prompt is `prompt_len` tokens long (default: all of
        `token_ids`) would get for its looked-up tokens `token_ids` now. Nothing is referenced."""
        if not self.enabled or not token_ids:
            return PrefixHit((), self.block_size)
        prompt_len = len(token_ids) if prompt_len is None else prompt_len
        chain = self.pool.match(token_ids, lineage, namespace)
        return PrefixHit(tuple(chain[: self.servable_blocks(prompt_len)]), self.block_size)

    def cached_prefix_length(
        self, token_ids: Sequence[int], *, lineage: str | None = None, namespace: str | None = None
    ) -> int:
        return self.lookup(token_ids, lineage=lineage, namespace=namespace).tokens

    def fully_cached(self, prefix: Sequence[int], namespace: str | None = None) -> bool:
        """Whether a prompt that is `prefix` would be served all it can be (a warmed prefix)."""
        return self.cached_prefix_length(prefix, namespace=namespace) >= servable_tokens(len(prefix), self.block_size)

    # --- a request's life ------------------------------------------------------------------

    @_locked
    def admit(
        self,
        prompt: Sequence[int],
        lookup_tokens: int | None = None,
        *,
        lineage: str | None = None,
        namespace: str | None = None,
        owner: str | None = None,
        session: str | None = None,
        warmup: bool = False,
    ) -> Lease:
        """Admit a request: its first `lookup_tokens` prompt tokens (default all) are looked up, and
        the hit is referenced until `free`. A warm-up counts as no lookup or hit in the statistics."""
        lookup_tokens = len(prompt) if lookup_tokens is None else lookup_tokens
        if not self.enabled:
            return Lease(PrefixHit((), self.block_size), lineage, namespace, owner, None)
        stats = self.pool.stats
        if not warmup:
            stats.lookups += 1
            stats.lookup_blocks += lookup_tokens // self.block_size
        visit = self.pool.begin_request(prompt, owner, session=session, warmup=warmup)
        hit = self.lookup(prompt[:lookup_tokens], len(prompt), lineage=lineage, namespace=namespace)
        lease = Lease(hit, lineage, namespace, owner, visit)
        self.pool.acquire(hit.blocks, hit=not warmup, visit=visit)
        lease.held.extend(hit.blocks)
        return lease

    @_locked
    def can_allocate(self, num_blocks: int) -> bool:
        return self.pool.can_allocate(num_blocks)

    @_locked
    def commit(
        self, lease: Lease, token_ids: Sequence[int], kv_of: KVSource | None = None, *,
        approximate_from: int | None = None,
    ) -> int:
        """Cache every full block of `token_ids` (the prompt, then what was generated and fed back)
        past the lease's hit; blocks at or after `approximate_from` go under the lease's lineage, or
        are not cached without one. `kv_of(begin, end)` gives a block's KV (None: a pool without
        tensors). Stored blocks are held until `free`. Returns the blocks stored or found cached;
        a full pool or a hash collision stops caching, counted in `stats.store_skipped`."""
        if not self.enabled:
            return 0
        self._check_live(lease)
        bs = self.block_size
        start = len(lease.hit.blocks)
        full = len(token_ids) // bs
        storable = full
        if approximate_from is not None and lease.lineage is None:
            storable = min(full, approximate_from // bs)  # approximate KV without a lineage is not cached
        if storable > start:  # make room in one eviction pass for what is not cached yet
            cached = len(self.pool.match(token_ids[: storable * bs], lease.lineage, lease.namespace))
            self.pool.reserve(storable - max(cached, start))
        if storable <= start:
            return 0
        parent = lease.hit.blocks[-1] if lease.hit.blocks else None
        salts = [lease.lineage if approximate_from is not None and (index + 1) * bs > approximate_from else None
                 for index in range(start, storable)]
        keys, values = kv_of(start * bs, storable * bs) if kv_of is not None else (None, None)  # (L, H, T, D)
        held = len(lease.held)
        error = self.pool.store_run(parent, token_ids[start * bs : storable * bs], keys, values, salts, lease.held,
                                    namespace=lease.namespace, owner=lease.owner, visit=lease.visit)
        stored = len(lease.held) - held
        if error is not None:
            self.pool.stats.store_skipped += storable - start - stored
        return stored

    @_locked
    def free(self, lease: Lease) -> None:
        """End the request: the policy sees it finish, then everything it held is released."""
        if lease.freed:
            return
        lease.freed = True
        if self.enabled:
            self.pool.end_request(lease.visit)
        self.pool.release(lease.held)
        lease.held.clear()

    @_locked
    def gather(self, lease: Lease) -> tuple[torch.Tensor, torch.Tensor]:
        """The KV of the lease's hit, each (L, H, hit tokens, D): copies, safe to use after the lock."""
        return self.pool.gather(lease.hit.blocks)

    def _check_live(self, lease: Lease) -> None:
        if lease.freed:
            raise ValueError("this lease was freed: admit the request again")

    # --- events ----------------------------------------------------------------------------

    def _record(self, event: CacheEvent) -> None:
        if len(self.events) == self.events.maxlen:
            self.events_dropped += 1
        self.events.append(event)

    @_locked
    def drain_events(self) -> list[CacheEvent]:
        """Blocks stored and removed since the last drain, oldest first (the oldest are dropped
        past `max_events`, counted in `events_dropped`)."""
        drained = list(self.events)
        self.events.clear()
        return drained

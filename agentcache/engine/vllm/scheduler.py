"""agentcache's vLLM scheduler: approximate KV is cached only under its lineage.

vLLM names a cached block by a hash chained over the tokens before it, with the request's
`cache_salt` mixed into the first block. A salt is one value for a whole request, so salting a
call by its lineage would also lose the exact prefix it shares with other sessions of its agent.
Here a call's blocks are hashed as vLLM hashes them up to the block holding its first
approximate token, and with the lineage mixed in from that block on: an exact prefix still hits
across sessions (under the tenant's salt), and the approximate continuation only within its
lineage. Since the chain carries every earlier block, one tagged block tags all after it.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, hash_block_tokens
from vllm.v1.core.sched.scheduler import Scheduler

from agentcache.engine.eviction import AgentAwarePolicy, Dispatch
from agentcache.engine.protocol import CacheStats
from agentcache.engine.vllm.eviction import AgentAwareFreeQueue
from agentcache.engine.vllm.registry import REGISTRY, key_of

__all__ = ["AgentCacheScheduler", "cached_tokens"]

_LINEAGE = "agentcache_lineage"


def _lineage_hasher(block_size: int, hash_fn: Callable, lineage: str, approx_from: int) -> Callable[[Any], list]:
    """A block hasher for `Request`: vLLM's own up to the block holding `approx_from`, tagged with
    the lineage from there on."""
    first_tagged = approx_from // block_size

    def hasher(request: Any) -> list:
        hashes = []
        parent = request.block_hashes[-1] if request.block_hashes else None
        index = len(request.block_hashes)
        while (index + 1) * block_size <= request.num_tokens:
            start, end = index * block_size, (index + 1) * block_size
            extra, _ = generate_block_hash_extra_keys(request, start, end, 0)  # the salt (first block only)
            if index >= first_tagged:
                extra = (extra or ()) + ((_LINEAGE, lineage),)
            parent = hash_block_tokens(hash_fn, parent, request.all_token_ids[start:end], extra)
            hashes.append(parent)
            index += 1
        return hashes

    return hasher


class AgentCacheScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hash_fn = get_hash_fn_by_name(self.vllm_config.cache_config.prefix_caching_hash_algo)
        self.policy: AgentAwarePolicy | None = None  # None: vLLM's own LRU order
        self.lookup_blocks = self.hit_blocks = self.evictions = 0  # agentcache's CacheStats
        manager = self.kv_cache_manager
        manager.get_computed_blocks = _capped(self, manager)
        pool = manager.block_pool
        evict = pool._maybe_evict_cached_block

        def counted_evict(block: Any) -> bool:
            evicted = evict(block)
            self.evictions += evicted
            return evicted

        pool._maybe_evict_cached_block = counted_evict

    def cache_stats(self) -> CacheStats:
        pool = self.kv_cache_manager.block_pool
        capacity = pool.num_gpu_blocks - 1  # one is vLLM's null block
        return CacheStats(
            capacity_blocks=capacity, cached_blocks=len(pool.cached_block_hashes_by_block),
            blocks_in_use=capacity - pool.get_num_free_blocks(), lookup_blocks=self.lookup_blocks,
            hit_blocks=self.hit_blocks, evictions=self.evictions,
        )

    def use_policy(self, policy: AgentAwarePolicy) -> None:
        """Order free-block reuse by an agent-aware policy's score (CacheScout's Survival: see
        eviction.py); call before the first request."""
        manager = self.kv_cache_manager
        pool = manager.block_pool
        policy.attach(pool.num_gpu_blocks, self.block_size)
        queue = AgentAwareFreeQueue(pool.free_block_queue.get_all_free_blocks(), policy, self.block_size)
        pool.free_block_queue = queue
        self.policy = policy
        free = manager.free

        def tagged_free(request: Any) -> None:
            """Free a request's blocks under the tag of the agent and session that ran it."""
            hooks = REGISTRY.get(key_of(request.sampling_params))
            queue.link_chain(list(manager.get_blocks(request.request_id).blocks[0]))
            queue.releasing = None if hooks is None else hooks.visit
            try:
                free(request)
            finally:
                queue.releasing = None

        manager.free = tagged_free

    def add_request(self, request: Any) -> None:
        hooks = REGISTRY.get(key_of(request.sampling_params))
        if hooks is not None and self.policy is not None and hooks.visit is None:  # the call's dispatch
            hooks.visit = self.policy.begin_request(Dispatch(
                request.prompt_token_ids, hooks.owner, hooks.session, warmup=hooks.warmup))
        if hooks is not None and hooks.approx_from is not None and request.request_id not in self.requests:
            request._block_hasher = _lineage_hasher(self.hash_block_size, self.hash_fn, hooks.lineage_key,
                                                    hooks.approx_from)
            request.block_hashes = []  # computed by vLLM's hasher when the request was built
            request.update_block_hashes()
        super().add_request(request)


def _capped(scheduler: AgentCacheScheduler, manager: Any) -> Callable:
    """The manager's prefix lookup, stopped where a request's plan allows no more (a DENSE
    segment is computed under its real context, never served from the cache), and counted."""
    lookup = manager.get_computed_blocks
    block_size = scheduler.block_size

    def get_computed_blocks(request: Any) -> tuple:
        blocks, hit, boundary = lookup(request)
        hooks = REGISTRY.get(key_of(request.sampling_params))
        limit = None if hooks is None else hooks.lookup_limit
        if limit is not None and hit > limit:
            keep = limit // block_size
            blocks = manager.create_kv_cache_blocks(tuple(list(group[:keep]) for group in blocks.blocks))
            hit, boundary = keep * block_size, 0
        if hooks is not None and not hooks.uncounted:
            scheduler.lookup_blocks += (request.num_tokens - 1) // block_size
            scheduler.hit_blocks += hit // block_size
        return blocks, hit, boundary

    return get_computed_blocks


def cached_tokens(scheduler: Any, token_ids: Sequence[int], salt: str | None,
                  lineage: str | None) -> tuple[int, int | None]:
    """Tokens of `token_ids` a request would be served from vLLM's prefix cache now, along the
    exact chain and then (with a lineage) along the lineage's approximate continuation; and where
    that continuation begins (None: no lineage block hit). Block-aligned; the last token is
    always computed. Run it between engine steps."""
    pool = scheduler.kv_cache_manager.block_pool
    block_size, hash_fn = scheduler.hash_block_size, scheduler.hash_fn
    usable = (len(token_ids) - 1) // block_size

    def cached(parent: Any, index: int, tagged: bool) -> Any:
        extra: tuple = (("cache_salt", salt),) if index == 0 and salt else ()
        if tagged:
            extra += ((_LINEAGE, lineage),)
        block_hash = hash_block_tokens(hash_fn, parent, token_ids[index * block_size : (index + 1) * block_size],
                                       extra or None)
        return block_hash if pool.get_cached_block(block_hash, [0]) is not None else None

    parent, index = None, 0
    while index < usable:
        found = cached(parent, index, False)
        if found is None:
            break
        parent, index = found, index + 1
    exact = index
    while lineage is not None and index < usable:
        found = cached(parent, index, True)
        if found is None:
            break
        parent, index = found, index + 1
    return index * block_size, (exact * block_size if index > exact else None)

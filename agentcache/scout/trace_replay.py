"""Replay a trace through the real block pool (no model): hit rates of eviction policies.

Each request does what the engine does with its pool: look up the prompt's cached prefix
(the last prompt token is always computed), reference the hit, cache every further full block
of the prompt and of the tokens it generated, release. Hit rate is CacheScout's metric:
cached prompt tokens / prompt tokens. With warm-up, the coordinator may prefill the predicted
next agent's prefix between requests; warm-ups are not requests and their tokens are counted
apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from agentcache.engine.blocks import BlockPool
from agentcache.engine.cache_manager import CacheManager
from agentcache.engine.eviction import Dispatch, EvictionPolicy, LFUPolicy, LRUPolicy
from agentcache.errors import CapacityError
from agentcache.scout.config import ScoutConfig
from agentcache.scout.policies import BeladyPolicy, SurvivalPolicy, TTLPolicy
from agentcache.scout.warmup import WarmupCoordinator
from agentcache.scout.workloads import Trace

__all__ = ["ReplayResult", "replay", "serve", "make_replay_policy", "REPLAY_POLICIES"]

# name -> a fresh policy for one replay of `trace` in blocks of `block_size` tokens, under `config`;
# `survival_prefetch` is Survival (warm-up is the replay's job), Belady is built from the trace itself
_REPLAY_FACTORIES: dict[str, Callable[[Trace, int, ScoutConfig | None], EvictionPolicy]] = {
    "lru": lambda trace, block_size, config: LRUPolicy(),
    "lfu": lambda trace, block_size, config: LFUPolicy(),
    "ttl": lambda trace, block_size, config: TTLPolicy(),
    "survival": lambda trace, block_size, config: SurvivalPolicy(config),
    "survival_prefetch": lambda trace, block_size, config: SurvivalPolicy(config),
    "belady": lambda trace, block_size, config: BeladyPolicy((trace.cached_tokens(r) for r in trace), block_size),
}
REPLAY_POLICIES = tuple(_REPLAY_FACTORIES)


@dataclass(frozen=True)
class ReplayResult:
    policy: str
    capacity: int
    requests: int
    prompt_tokens: int
    cached_tokens: int
    evictions: int
    warmups: int
    warmup_tokens: int  # tokens the warm-ups prefilled (their prefixes less what was cached)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def make_replay_policy(name: str, trace: Trace, block_size: int, config: ScoutConfig | None = None) -> EvictionPolicy:
    """A fresh policy for one replay; `survival_prefetch` is Survival (warm-up is the replay's job)."""
    factory = _REPLAY_FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown replay policy {name!r}; choose one of {list(REPLAY_POLICIES)}")
    return factory(trace, block_size, config)


def replay(
    trace: Trace,
    policy: EvictionPolicy | str,
    capacity: int,
    *,
    block_size: int = 16,
    name_agents: bool = True,
    warmup: bool = False,
    config: ScoutConfig | None = None,
) -> ReplayResult:
    """Replay `trace` through a `capacity`-block pool under `policy`.

    name_agents=False hides agent names from the pool, as an engine without a framework sees it
    (the Survival policy then fingerprints prompts). warmup=True runs the warm-up coordinator.
    """
    if type(capacity) is not int or type(block_size) is not int or block_size < 1:
        raise ValueError(f"capacity and block_size must be ints (blocks, tokens), got {capacity!r}, {block_size!r}")
    needed = trace.max_request_blocks(block_size)
    if capacity < needed:
        raise CapacityError(
            f"capacity {capacity} blocks is smaller than one call: the largest request of this trace caches "
            f"{needed} blocks of {block_size} tokens"
        )
    label = policy if isinstance(policy, str) else policy.name
    if isinstance(policy, str):
        policy = make_replay_policy(policy, trace, block_size, config)
    pool = BlockPool(capacity, block_size, policy)
    cache = CacheManager(pool)
    coordinator = None
    if warmup:
        if not isinstance(policy, SurvivalPolicy):
            raise ValueError(f"warm-up needs the Survival policy's transition learner, got policy {label!r}")
        coordinator = WarmupCoordinator(policy.learner, policy.config, min_prefix=block_size)

    prompt_tokens = cached_tokens = warmups = warmup_tokens = 0
    for request in trace:
        agent = request.agent if name_agents else None
        hit = serve(cache, trace.cached_tokens(request), len(request.prompt), agent=agent, session=request.session)
        prompt_tokens += len(request.prompt)
        cached_tokens += hit

        if coordinator is not None:
            coordinator.observe(policy.identify(Dispatch(request.prompt, agent)), request.prompt, request.prefix_len)
            plan = coordinator.next_warmup(
                request.session, lambda prefix, _namespace: len(pool.match(prefix)) == len(prefix) // block_size
            )
            if plan is not None:
                cached = serve(cache, plan.prefix, len(plan.prefix), agent=plan.agent if name_agents else None,
                               warmup=True)
                warmups += 1
                warmup_tokens += len(plan.prefix) - cached  # what the warm-up had to prefill
    return ReplayResult(label, capacity, len(trace), prompt_tokens, cached_tokens, pool.stats.evictions,
                        warmups, warmup_tokens)


def serve(
    cache: CacheManager, tokens: Sequence[int], prompt_len: int, *, agent: str | None = None,
    session: str | None = None, warmup: bool = False,
) -> int:
    """One request's pool traffic, as the engine drives it: admit the prompt (`tokens[:prompt_len]`),
    cache every full block of `tokens` (prompt and output), free. Returns its cached prompt tokens."""
    lease = cache.admit(tokens[:prompt_len], owner=agent, session=session, warmup=warmup)
    try:
        cache.commit(lease, tokens)
        return lease.hit.tokens
    finally:
        cache.free(lease)

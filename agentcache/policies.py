"""Eviction policies by name: the engine's own (LRU, LFU) and CacheScout's (TTL pinning, Survival).

Engines take a policy object, `EngineConfig(eviction=make_policy("survival"))`, and know only
their own names ("lru", "lfu"). Belady needs its future trace: build
`agentcache.scout.BeladyPolicy(future, block_size)` itself.
"""

from __future__ import annotations

from typing import Callable

from agentcache.engine.eviction import BUILTIN_POLICIES, EvictionPolicy
from agentcache.errors import InputError
from agentcache.scout.policies import SurvivalPolicy, TTLPolicy

__all__ = ["EVICTION_POLICIES", "make_policy"]

EVICTION_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    **BUILTIN_POLICIES,
    TTLPolicy.name: TTLPolicy,
    SurvivalPolicy.name: SurvivalPolicy,
}


def make_policy(policy: str | EvictionPolicy) -> EvictionPolicy:
    """A new policy of a registry name with default settings, or the policy object itself."""
    if isinstance(policy, EvictionPolicy):
        return policy
    factory = EVICTION_POLICIES.get(policy) if isinstance(policy, str) else None
    if factory is None:
        raise InputError(
            f"unknown eviction policy {policy!r}; choose one of {sorted(EVICTION_POLICIES)} "
            f"(Belady needs its future trace: pass agentcache.scout.BeladyPolicy(future, block_size) itself)"
        )
    return factory()

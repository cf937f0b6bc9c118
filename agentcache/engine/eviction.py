"""Eviction policies for the block pool: each one is a sort key over blocks.

The pool evicts, among unreferenced leaf blocks, the one with the lowest `priority(block)`
(ties broken by block id, so eviction is deterministic). A policy sees only the narrow
`Block` record; state of its own (agent transitions, a future trace) lives in the policy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from agentcache.engine.blocks import Block

__all__ = ["EvictionPolicy", "LRUPolicy", "LFUPolicy", "EVICTION_POLICIES", "make_policy"]


class EvictionPolicy:
    """Base policy. Subclasses define `priority`; lower is evicted first."""

    name = "base"

    def priority(self, block: "Block") -> Any:
        raise NotImplementedError


class LRUPolicy(EvictionPolicy):
    """Least recently used: the oldest last access goes first."""

    name = "lru"

    def priority(self, block: "Block") -> Any:
        return block.last_access


class LFUPolicy(EvictionPolicy):
    """Least frequently used, then least recently used."""

    name = "lfu"

    def priority(self, block: "Block") -> Any:
        return (block.hits, block.last_access)


EVICTION_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    LRUPolicy.name: LRUPolicy,
    LFUPolicy.name: LFUPolicy,
}


def make_policy(policy: str | EvictionPolicy) -> EvictionPolicy:
    """A policy object from its registry name, or the object itself."""
    if isinstance(policy, EvictionPolicy):
        return policy
    try:
        return EVICTION_POLICIES[policy]()
    except KeyError:
        raise ValueError(
            f"unknown eviction policy '{policy}'; choose one of {sorted(EVICTION_POLICIES)}"
        ) from None

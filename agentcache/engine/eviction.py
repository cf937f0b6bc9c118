"""Eviction policies for the block pool: each one is a sort key over blocks, plus optional hooks.

The pool evicts, among unreferenced leaf blocks, the one with the lowest `priority(block)`
(ties broken by block id, so eviction is deterministic). A policy sees only the narrow
`Block` record and the hooks below; state of its own (agent transitions, a future trace)
lives in the policy. The agent-aware policies (TTL pinning, Survival, Belady) live in
`agentcache.scout.policies` and register themselves in `EVICTION_POLICIES`.

Hooks the pool calls, all O(1) per block:
  attach(capacity, block_size)   once, when the pool is built (`fresh()` gives a policy for another pool)
  begin_request(dispatch)        a request starts (who runs it, its prompt, warm-up or not)
  touch(block)                   the current request acquired or stored `block`
  end_request()                  the current request finished
  forget(block)                  `block` was evicted
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    from agentcache.engine.blocks import Block

__all__ = ["Dispatch", "EvictionPolicy", "LRUPolicy", "LFUPolicy", "EVICTION_POLICIES", "make_policy"]


@dataclass(frozen=True)
class Dispatch:
    """One request reaching the pool: who runs it (None: unknown, fingerprint it) and its prompt."""

    token_ids: Sequence[int]
    agent: str | None = None
    session: str | None = None
    warmup: bool = False  # a background warm-up: fills the cache, never counts as an agent dispatch


class EvictionPolicy:
    """Base policy. Subclasses define `priority`; lower is evicted first. Hooks default to no-ops."""

    name = "base"

    def priority(self, block: "Block") -> Any:
        raise NotImplementedError

    def fresh(self) -> "EvictionPolicy":
        """A new policy with the same settings and no state, for another pool."""
        return type(self)()

    def attach(self, capacity: int, block_size: int) -> None:
        pass

    def begin_request(self, dispatch: Dispatch) -> None:
        pass

    def touch(self, block: "Block") -> None:
        pass

    def end_request(self) -> None:
        pass

    def forget(self, block: "Block") -> None:
        pass


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
    import agentcache.scout.policies  # noqa: F401  (registers the agent-aware policies)

    try:
        return EVICTION_POLICIES[policy]()
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown eviction policy {policy!r}; choose one of {sorted(EVICTION_POLICIES)} "
            f"(Belady needs its future trace: pass agentcache.scout.BeladyPolicy(trace) itself)"
        ) from None

"""Eviction policies for the block pool: each one is a sort key over blocks, plus optional hooks.

The pool evicts, among unreferenced leaf blocks, the one with the lowest `priority(block)`
(ties broken by block id, so eviction is deterministic). A policy sees only the narrow
`Block` record and the hooks below; state of its own (agent transitions, a future trace)
lives in the policy. The agent-aware policies (TTL pinning, Survival, Belady) live in
`agentcache.scout.policies`; `EVICTION_POLICIES` names them for `make_policy`.

Hooks the pool calls, all O(1) per block:
  attach(capacity, block_size)   once, when the pool is built (`fresh()` gives a policy for another pool)
  begin_request(dispatch)        a request is admitted (who runs it, its prompt, warm-up or not);
                                 returns the request's visit, what `touch` needs to attribute a block
  touch(block, visit)            the request of `visit` acquired or stored `block` (None: no request)
  end_request(visit)             that request finished
  forget(block)                  `block` was evicted

Requests overlap in a batching engine, so nothing here may assume one "current" request: all a
hook knows of its request is the visit it is handed.
"""

from __future__ import annotations

import importlib
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
    capacity = 0  # blocks of the pool it serves; 0 until attached
    block_size = 0

    def priority(self, block: "Block") -> Any:
        raise NotImplementedError

    @property
    def attached(self) -> bool:
        return self.capacity > 0

    def fresh(self) -> "EvictionPolicy":
        """A new policy with the same settings and no state, for another pool. Policies whose
        constructor takes settings override this."""
        try:
            return type(self)()
        except TypeError as exc:
            raise TypeError(f"{type(self).__name__} needs its own fresh() to serve another pool: {exc}") from None

    def attach(self, capacity: int, block_size: int) -> None:
        """Bind to one pool; subclasses that size state by capacity extend this."""
        if self.attached:
            raise ValueError(f"this {self.name} policy already serves a block pool; give each pool its own "
                             "policy (policy.fresh() makes one with the same settings)")
        self.capacity, self.block_size = capacity, block_size

    def begin_request(self, dispatch: Dispatch) -> Any:
        return None

    def touch(self, block: "Block", visit: Any = None) -> None:
        pass

    def end_request(self, visit: Any = None) -> None:
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


EVICTION_POLICIES: dict[str, Callable[[], EvictionPolicy] | str] = {
    LRUPolicy.name: LRUPolicy,
    LFUPolicy.name: LFUPolicy,
    # the agent-aware policies live with CacheScout; imported when first asked for
    "ttl": "agentcache.scout.policies:TTLPolicy",
    "survival": "agentcache.scout.policies:SurvivalPolicy",
}


def make_policy(policy: str | EvictionPolicy) -> EvictionPolicy:
    """A policy object from its registry name, or the object itself."""
    if isinstance(policy, EvictionPolicy):
        return policy
    factory = EVICTION_POLICIES.get(policy) if isinstance(policy, str) else None
    if factory is None:
        raise ValueError(
            f"unknown eviction policy {policy!r}; choose one of {sorted(EVICTION_POLICIES)} "
            f"(Belady needs its future trace: pass agentcache.scout.BeladyPolicy(trace) itself)"
        )
    if isinstance(factory, str):
        module, _, name = factory.partition(":")
        factory = getattr(importlib.import_module(module), name)
    return factory()

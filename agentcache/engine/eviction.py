"""Eviction policies for the block pool: each one is a sort key over blocks, plus optional hooks.

The pool evicts, among unreferenced leaf blocks, the one with the lowest `priority(block)`
(ties broken by block id, so eviction is deterministic). A policy sees only the narrow
`BlockView` of a block and the hooks below; state of its own (agent transitions, a future
trace) lives in the policy. The engine knows its own policies by name (`BUILTIN_POLICIES`:
LRU, LFU); every other policy is an object handed to the engine (the agent-aware ones live in
`agentcache.scout`, and `agentcache.make_policy` names them all).

Hooks the pool calls, all O(1) per block:
  attach(capacity, block_size)   once, when the pool is built (`fresh()` gives a policy for another pool)
  begin_request(dispatch)        a request is admitted (who runs it, its prompt, warm-up or not);
                                 returns the request's visit, what `touch` needs to attribute a block
  touch(block, visit)            the request of `visit` acquired or stored `block` (None: no request)
  end_request(visit)             that request finished
  forget(block)                  `block` was evicted

Requests overlap in a batching engine, so nothing here may assume one "current" request: all a
hook knows of its request is the visit it is handed.

`AgentAwarePolicy` is the contract for a policy that ranks blocks by who touched them last and
when: an engine that cannot show it its blocks one by one (vLLM's free-block queue) ranks groups
of blocks with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, Sequence

from agentcache.errors import InputError

__all__ = [
    "AgentAwarePolicy", "BUILTIN_POLICIES", "BlockView", "Dispatch", "EvictionPolicy", "LFUPolicy", "LRUPolicy",
    "SHARED", "Tag", "builtin_policy", "check_eviction",
]


class BlockView(Protocol):
    """What a policy reads of a cached block (the pool's `Block` is one); a policy never changes it."""

    block_id: int  # its row in the pool, 0 .. capacity - 1: index per-block state by it
    block_hash: bytes
    token_ids: tuple[int, ...]
    owner: str | None  # who stored it (an agent name)
    created: int  # the pool's clock when it was stored
    last_access: int  # the pool's clock when it was last acquired or stored
    hits: int  # times it was acquired as a prefix hit


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

    def priority(self, block: BlockView) -> Any:
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

    def touch(self, block: BlockView, visit: Any = None) -> None:
        pass

    def end_request(self, visit: Any = None) -> None:
        pass

    def forget(self, block: BlockView) -> None:
        pass


class LRUPolicy(EvictionPolicy):
    """Least recently used: the oldest last access goes first."""

    name = "lru"

    def priority(self, block: BlockView) -> Any:
        return block.last_access


class LFUPolicy(EvictionPolicy):
    """Least frequently used, then least recently used."""

    name = "lfu"

    def priority(self, block: BlockView) -> Any:
        return (block.hits, block.last_access)


class _Shared:
    def __repr__(self) -> str:
        return "SHARED"


SHARED: Any = _Shared()  # the session of blocks that requests of several sessions touched
Tag = tuple[int, object]  # who touched blocks last: (agent index, or -1 when unknown; session, or SHARED)


class AgentAwarePolicy(EvictionPolicy):
    """A policy that ranks blocks by their tag (the agent and session whose request touched them
    last) and by when that was, so that it can rank blocks it is never shown one by one.

    `begin_request` returns the request's tag as its visit; `step` counts the dispatches seen (the
    clock of `last_step`); `tag_score(tag, last_step, tokens)` is the priority of a block of
    `tokens` tokens that the request of `tag` touched last at dispatch `last_step` (lower is
    evicted first). Tag and age are all it may depend on: blocks of one tag released together
    rank together. vLLM's free-block queue (engine/vllm/eviction.py) needs nothing else."""

    SHARED: ClassVar[object] = SHARED
    step: int = 0

    def begin_request(self, dispatch: Dispatch) -> Tag:
        raise NotImplementedError

    def tag_score(self, tag: Tag, last_step: int, tokens: int) -> float:
        raise NotImplementedError


BUILTIN_POLICIES: dict[str, type[EvictionPolicy]] = {LRUPolicy.name: LRUPolicy, LFUPolicy.name: LFUPolicy}


def builtin_policy(policy: str | EvictionPolicy, setting: str = "eviction") -> EvictionPolicy:
    """`policy` itself, or a new one of the engine's own names ("lru", "lfu")."""
    check_eviction(policy, setting)
    return policy if isinstance(policy, EvictionPolicy) else BUILTIN_POLICIES[policy]()


def check_eviction(policy: object, setting: str = "eviction") -> None:
    """Raises InputError, naming `setting`, unless `policy` is a policy object or one of the
    engine's own names."""
    if isinstance(policy, EvictionPolicy) or (isinstance(policy, str) and policy in BUILTIN_POLICIES):
        return
    raise InputError(f"{setting}: unknown eviction policy {policy!r}; the engine knows {sorted(BUILTIN_POLICIES)} "
                     "by name and takes any other policy as an object, e.g. "
                     "eviction=agentcache.make_policy('survival') (agentcache.EVICTION_POLICIES names them all)")

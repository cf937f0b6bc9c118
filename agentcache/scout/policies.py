"""Agent-aware eviction policies for the block pool: TTL pinning, Survival (CacheScout), Belady.

Each plugs into `BlockPool` through `priority(block)` (lower is evicted first) and the pool's
hooks (see agentcache.engine.eviction); Survival is also an `AgentAwarePolicy`, the contract
vLLM's free-block queue ranks blocks by. Engines take them as objects: `ttl` and `survival` are
named by `agentcache.make_policy`; Belady needs the future trace and is built from it.
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_right
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from agentcache.engine.blocks import block_hash
from agentcache.engine.eviction import SHARED, AgentAwarePolicy, Dispatch, EvictionPolicy, Tag
from agentcache.errors import TraceError
from agentcache.scout.config import ScoutConfig
from agentcache.scout.learner import TransitionLearner, prompt_fingerprint
from agentcache.scout.scorer import SurvivalScorer

if TYPE_CHECKING:
    from agentcache.engine.blocks import Block

__all__ = ["TTLPolicy", "SurvivalPolicy", "BeladyPolicy"]


class TTLPolicy(EvictionPolicy):
    """Continuum-style pinning: when a request ends, the blocks it used stay pinned for `ttl`
    dispatches (the next turn of the same program is expected within that time). Unpinned
    blocks go first, least recently used first; pinned ones only when nothing else is left.
    TTL counts dispatches, not seconds, so replays are deterministic.

    In a pool that only orders evictions, this order is LRU's: the pinned blocks are exactly
    those touched in the last `ttl` dispatches. Continuum's gain comes from its scheduler,
    which keeps pinned KV unevictable and makes other requests wait; the block pool has no
    such scheduler. The policy is kept as the baseline the issue names, and it measures as
    LRU does."""

    name = "ttl"

    def __init__(self, ttl: int = 8) -> None:
        if ttl < 1:
            raise ValueError(f"ttl must be at least 1 dispatch, got {ttl}")
        self.ttl = ttl
        self.step = 0

    def fresh(self) -> "TTLPolicy":
        return TTLPolicy(self.ttl)

    def attach(self, capacity: int, block_size: int) -> None:
        super().attach(capacity, block_size)
        self.pinned_until = array("l", [0] * capacity)

    def begin_request(self, dispatch: Dispatch) -> list["Block"]:
        if not dispatch.warmup:
            self.step += 1
        return []  # the visit: the blocks this request touches

    def touch(self, block: "Block", visit: list["Block"] | None = None) -> None:
        if visit is not None:
            visit.append(block)

    def end_request(self, visit: list["Block"] | None = None) -> None:
        until = self.step + self.ttl
        for block in visit or ():  # still held by the request: none was evicted meanwhile
            self.pinned_until[block.block_id] = until

    def forget(self, block: "Block") -> None:
        self.pinned_until[block.block_id] = 0

    def priority(self, block: "Block") -> Any:
        return (self.pinned_until[block.block_id] > self.step, block.last_access)


_FRESH = object()  # session_of[] before any touch


class SurvivalPolicy(AgentAwarePolicy):
    """CacheScout's survival-guided eviction (Eq. 9):

        score(b) = (survival(b) + delta) * (exp(-lambda * age(b)) + delta) * |b|

    age counts dispatches since the block was last touched. A block belongs to the agent whose
    request touched it last (the block-to-agent map). Observing a touch is a few array writes.

    With `per_session` (our default) a block touched by one session only (its history) is scored
    from that session's current agent, and scores 0 once the session is no longer active; a
    block several sessions touched (an agent's prefix) is scored from the current agents of all
    active sessions. Without it, every block is scored from the last dispatched agent, as in
    the paper's Algorithm 1."""

    name = "survival"

    def __init__(self, config: ScoutConfig | None = None) -> None:
        self.config = config or ScoutConfig()
        c = self.config
        self.learner = TransitionLearner(c.smoothing, max_agents=c.max_agents)
        self.scorer = SurvivalScorer(
            self.learner, edge_threshold=c.edge_threshold, horizon=c.horizon,
            active_sessions=c.active_sessions if c.per_session else 1,
        )
        self.step = 0  # dispatches seen (warm-ups excluded)
        self.warmups = 0

    def fresh(self) -> "SurvivalPolicy":
        return SurvivalPolicy(self.config)

    def attach(self, capacity: int, block_size: int) -> None:
        super().attach(capacity, block_size)
        self.agent_of = array("h", [-1] * capacity)  # block id -> agent index (the block-to-agent map)
        self.last_step = array("l", [0] * capacity)  # block id -> dispatch of its last touch
        self.session_of: list[object] = [_FRESH] * capacity  # block id -> its one session, or SHARED

    def identify(self, dispatch: Dispatch) -> str | None:
        """The agent of a request: its explicit name, else a fingerprint of its leading blocks."""
        if dispatch.agent is not None:
            return dispatch.agent
        return prompt_fingerprint(dispatch.token_ids, self.block_size or 16, self.config.fingerprint_blocks)

    def begin_request(self, dispatch: Dispatch) -> Tag:
        """Learn the dispatch; the visit is (agent index or -1 when unknown, session)."""
        agent = self.identify(dispatch)
        session = dispatch.session if self.config.per_session else None
        if dispatch.warmup:  # fills the cache for `agent`, teaches the learner nothing
            self.warmups += 1
            index = self.learner.index.get(agent) if agent is not None else None  # never a new agent
            session = SHARED  # a prefix warmed for whichever session calls next
        else:
            self.step += 1
            if agent is None:  # too short to fingerprint: nobody to learn from, and the chain breaks
                self.learner.interrupt(session)
                index = None
            else:
                index = self.learner.observe(agent, session)
            self.scorer.maybe_refresh()
        return (-1 if index is None else index, session)

    def touch(self, block: "Block", visit: Tag | None = None) -> None:
        agent, session = visit if visit is not None else (-1, SHARED)
        block_id = block.block_id
        self.agent_of[block_id] = agent
        self.last_step[block_id] = self.step
        owner = self.session_of[block_id]
        if owner is _FRESH:
            self.session_of[block_id] = session
        elif owner is not SHARED and owner != session:
            self.session_of[block_id] = SHARED

    def forget(self, block: "Block") -> None:
        self.agent_of[block.block_id] = -1
        self.session_of[block.block_id] = _FRESH

    def survival(self, block_id: int) -> float:
        return self.survival_of(self.agent_of[block_id], self.session_of[block_id])

    def survival_of(self, agent: int, session: object) -> float:
        """Survival of a block last touched by `agent` (an index; -1: unknown) in `session`
        (`SHARED` when several sessions touched it)."""
        if agent < 0:
            return 0.0
        if session is SHARED or not self.config.per_session:
            return self.scorer.survival_of(agent)
        current = self.scorer.active_now.get(session)  # the session's agent now, if the session is active
        return 0.0 if current is None else self.scorer.survival_from(current)[agent]

    def score(self, survival: float, last_step: int, tokens: int) -> float:
        """Eq. 9 for a block of `tokens` tokens last touched at dispatch `last_step`."""
        c = self.config
        recency = math.exp(-c.decay * (self.step - last_step))
        return (survival + c.floor) * (recency + c.floor) * tokens

    def tag_score(self, tag: Tag, last_step: int, tokens: int) -> float:
        """The priority of a block of `tokens` tokens that `tag` (agent index, session) touched last
        at dispatch `last_step`."""
        return self.score(self.survival_of(*tag), last_step, tokens)

    def priority(self, block: "Block") -> Any:
        block_id = block.block_id
        return self.tag_score((self.agent_of[block_id], self.session_of[block_id]), self.last_step[block_id],
                              len(block.token_ids))

    def state_bytes(self) -> int:
        """Bytes of the runtime state: transition counts, graph, survival tables, block map."""
        n = self.learner.num_agents
        ints = n * n + n + sum(len(s) for s in self.scorer.successors)
        floats = len(self.scorer.survival) + self.scorer.table_entries
        names = sum(len(a.encode()) for a in self.learner.agents)
        block_map = (self.agent_of.itemsize + self.last_step.itemsize + 8) * len(self.agent_of)
        return 4 * ints + 4 * floats + names + block_map


class BeladyPolicy(EvictionPolicy):
    """Belady's rule, for benchmarks: evict the block whose next use is farthest away.

    Built from the future: the token ids each request caches, in replay order (warm-ups are not
    requests). A block the future never mentions is a replay that does not match its trace,
    and raises TraceError. It is the offline bound the benchmarks compare with, not an exact
    optimum: a "use" is any request whose cached tokens contain the block, including blocks a
    request only stores (the last prompt token is always computed), and the pool stores every
    block it is given rather than choosing not to cache one."""

    name = "belady"

    def __init__(self, future: Iterable[Sequence[int]], block_size: int) -> None:
        self.uses: dict[bytes, list[int]] = {}
        self.requests = 0
        for step, token_ids in enumerate(future, start=1):
            self.requests = step
            parent = None
            for i in range(len(token_ids) // block_size):
                parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size], None)
                uses = self.uses.setdefault(parent, [])
                if not uses or uses[-1] != step:
                    uses.append(step)
        self.expected_block_size = block_size
        self.step = 0

    def fresh(self) -> "BeladyPolicy":
        copy = BeladyPolicy((), self.expected_block_size)
        copy.uses, copy.requests = self.uses, self.requests  # read-only after construction
        return copy

    def attach(self, capacity: int, block_size: int) -> None:
        if block_size != self.expected_block_size:
            raise ValueError(f"Belady's trace was cut in {self.expected_block_size}-token blocks, the pool uses {block_size}")
        super().attach(capacity, block_size)

    def begin_request(self, dispatch: Dispatch) -> None:
        if not dispatch.warmup:
            self.step += 1
        return None

    def priority(self, block: "Block") -> Any:
        uses = self.uses.get(block.block_hash)
        if uses is None:
            raise TraceError(
                f"block {block.block_id} (tokens {list(block.token_ids[:4])}...) is not in Belady's trace: "
                "replay the same trace the policy was built from"
            )
        later = bisect_right(uses, self.step)
        return -uses[later] if later < len(uses) else -math.inf


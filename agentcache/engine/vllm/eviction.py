"""Agent-aware eviction inside vLLM (CacheScout's Survival): a free-block queue ordered by the
policy's score.

vLLM reuses free blocks from the front of a queue (LRU: a finished request's blocks go to the
back, its chain's tail first). `AgentAwareFreeQueue` replaces that queue in the engine's block
pool with the same methods, and hands out blocks in this order:

1. blocks that cache nothing (never hashed): nothing is lost;
2. cached blocks, from the tag whose head scores lowest, where a tag is the (agent, session)
   whose request released the block last (several sessions: shared) and a block's score is the
   policy's `tag_score(tag, released at, block size)` (Survival: (survival + delta) * (recency +
   delta) * |b|). Within a tag blocks leave in release order, a chain's tail first;
3. a cached block whose children are still cached waits until they are gone (leaves before
   parents: a child without its parent can never be hit again).

Scores change as the policy learns from each dispatch, and every tag's head is re-scored on each
pop, so an allocation costs one score per tag (agents x active sessions), never a scan of the
free blocks. The queue knows the policy only as an `AgentAwarePolicy` (engine/eviction.py).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any, Iterable

from agentcache.engine.eviction import SHARED, AgentAwarePolicy, Tag

__all__ = ["AgentAwareFreeQueue", "Tag"]

_UNKNOWN: Tag = (-1, SHARED)


class AgentAwareFreeQueue:
    def __init__(self, blocks: Iterable[Any], policy: AgentAwarePolicy, block_size: int) -> None:
        self.policy = policy
        self.block_size = block_size
        self.uncached: OrderedDict[int, Any] = OrderedDict((b.block_id, b) for b in blocks)
        self.tagged: dict[Tag, OrderedDict[int, tuple[Any, int]]] = {}  # tag -> block id -> (block, released at)
        self.waiting: dict[int, tuple[Any, Tag, int]] = {}  # free, cached, with cached children
        self.tag_of: dict[int, Tag] = {}  # a cached block's tag (kept while it is in use too)
        self.parent_of: dict[int, int] = {}
        self.children: Counter[int] = Counter()  # cached children per block id
        self.releasing: Tag | None = None  # set by the scheduler while a request's blocks are freed
        self.num_free_blocks = len(self.uncached)

    # --- what the scheduler tells it ----------------------------------------------------------

    def link_chain(self, blocks: list[Any]) -> None:
        """A request's blocks in token order: each cached block's parent is the one before it."""
        for parent, child in zip(blocks, blocks[1:]):
            if child.block_hash is not None and child.block_id not in self.parent_of:
                self.parent_of[child.block_id] = parent.block_id
                self.children[parent.block_id] += 1

    def tag_for(self, block_id: int, released_by: Tag) -> Tag:
        """The tag a released block goes under: the releasing agent and session, or shared once
        another session released it before."""
        previous = self.tag_of.get(block_id)
        agent, session = released_by
        if previous is not None and previous[1] is not session and previous[1] != session:
            session = SHARED
        return agent, session

    # --- vLLM's FreeKVCacheBlockQueue interface ----------------------------------------------------

    def popleft(self) -> Any:
        if self.uncached:
            _, block = self.uncached.popitem(last=False)
        else:
            tag = self._lowest_tag()
            if tag is not None:
                _, (block, _) = self.tagged[tag].popitem(last=False)
                if not self.tagged[tag]:
                    del self.tagged[tag]
            elif self.waiting:  # only parents left (their children were lost track of): oldest first
                block_id = next(iter(self.waiting))
                block = self.waiting.pop(block_id)[0]
            else:
                raise ValueError("no free block to pop")
        self.num_free_blocks -= 1
        self._forget(block.block_id)
        return block

    def popleft_n(self, n: int) -> list[Any]:
        return [self.popleft() for _ in range(n)]

    def remove(self, block: Any) -> None:
        """A free block is hit again (or reused by vLLM directly): out of the queue, still cached."""
        block_id = block.block_id
        if self.uncached.pop(block_id, None) is None and self.waiting.pop(block_id, None) is None:
            tag = self.tag_of.get(block_id)
            bucket = self.tagged.get(tag)
            if bucket is None or bucket.pop(block_id, None) is None:
                raise ValueError(f"block {block_id} is not in the free queue")
            if not bucket:
                del self.tagged[tag]
        self.num_free_blocks -= 1

    def append(self, block: Any) -> None:
        self.append_n([block])

    def append_n(self, blocks: list[Any]) -> None:
        step = self.policy.step
        released_by = self.releasing or _UNKNOWN
        for block in blocks:
            block_id = block.block_id
            if block.block_hash is None:
                self.uncached[block_id] = block
            else:
                tag = self.tag_of[block_id] = self.tag_for(block_id, released_by)
                if self.children[block_id] > 0:
                    self.waiting[block_id] = (block, tag, step)
                else:
                    self.tagged.setdefault(tag, OrderedDict())[block_id] = (block, step)
            self.num_free_blocks += 1

    def prepend_n(self, blocks: list[Any]) -> None:
        for block in reversed(blocks):  # uncached blocks, to be reused first
            self.uncached[block.block_id] = block
            self.uncached.move_to_end(block.block_id, last=False)
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[Any]:
        tagged = [block for bucket in self.tagged.values() for block, _ in bucket.values()]
        return list(self.uncached.values()) + tagged + [block for block, _, _ in self.waiting.values()]

    # --- order ----------------------------------------------------------------------------------------

    def _lowest_tag(self) -> Tag | None:
        policy, best, best_score = self.policy, None, None
        for tag, bucket in self.tagged.items():
            _, released = next(iter(bucket.values()))
            score = policy.tag_score(tag, released, self.block_size)
            if best_score is None or score < best_score:
                best, best_score = tag, score
        return best

    def _forget(self, block_id: int) -> None:
        """The block is handed out for new KV: its cached content (and place in the tree) goes."""
        self.tag_of.pop(block_id, None)
        self.children.pop(block_id, None)
        parent = self.parent_of.pop(block_id, None)
        if parent is None:
            return
        self.children[parent] -= 1
        if self.children[parent] <= 0:
            del self.children[parent]
            held = self.waiting.pop(parent, None)
            if held is not None:  # now a leaf: evictable, ahead of its tag's later blocks
                block, tag, released = held
                bucket = self.tagged.setdefault(tag, OrderedDict())
                bucket[parent] = (block, released)
                bucket.move_to_end(parent, last=False)

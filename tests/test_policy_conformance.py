"""One conformance suite for every eviction policy: each policy is judged against its own ordering
contract, on facts this harness records itself (who touched a block, at which dispatch, which
request ended when, what the trace uses next), never on the policy's own state.

A contract is a key over blocks: lower must be evicted first. The checks:
- `victims`: replay a multi-agent trace through a tensor-free pool under the policy, tight enough
  to evict on most requests; every block evicted is a lowest-key block among the evictable leaves
  of that moment (and enough evictions had a wrong choice at hand, so the check is not vacuous);
- `order`: between requests, the evictable leaves sorted by the policy's `priority` are sorted by
  the contract's key too;
- `deterministic`: two replays with fresh policies evict the same blocks in the same order;
- `fresh`: a policy serves one pool, and `fresh()` gives one with the same settings and no state.
vLLM's free-block queue ordered by an agent-aware policy (engine/vllm/eviction.py) is checked the
same way on vLLM's own block pool (`vllm`-marked: it imports vLLM). A wrong policy fails the suite
(the last section runs the checks against some and expects the failure).

What the pool guarantees whatever the policy says (only unheld leaves go) is checked once, with a
hostile policy.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

import pytest

from agentcache.engine.blocks import Block, BlockPool
from agentcache.engine.embedded import EngineConfig
from agentcache.engine.eviction import SHARED, AgentAwarePolicy, Dispatch, EvictionPolicy, LFUPolicy, LRUPolicy
from agentcache.engine.vllm.engine import VLLMConfig
from agentcache.errors import CapacityError, InputError
from agentcache.policies import make_policy
from agentcache.scout import BeladyPolicy, SurvivalPolicy, Trace, TTLPolicy
from tests.test_scout import BS, trace_of
from tests.test_scout import SMALL as SPEC


def tight(trace: Trace) -> int:
    """A capacity that holds the largest request plus a few blocks: evictions on most requests."""
    return trace.max_request_blocks(BS) + 3


# --- what the harness sees -----------------------------------------------------------------------------


@dataclass
class Seen:
    """The replay as the harness records it, apart from any policy: contracts are judged on this."""

    trace: Trace
    step: int = 0  # dispatches so far: the running request's number
    touched_at: dict[Any, int] = field(default_factory=dict)  # block -> dispatch of its last toucher
    agent: dict[Any, str] = field(default_factory=dict)  # block -> agent of its last toucher
    sessions: dict[Any, set[str]] = field(default_factory=dict)  # block -> sessions that touched it
    ended_at: dict[Any, int] = field(default_factory=dict)  # block -> dispatch of its last toucher that ended

    def touch(self, blocks, agent: str, session: str) -> None:
        for block in blocks:
            self.touched_at[block] = self.step
            self.agent[block] = agent
            self.sessions.setdefault(block, set()).add(session)

    def end(self, blocks) -> None:
        for block in blocks:
            self.ended_at[block] = self.step

    def tag(self, block) -> tuple[str, object]:
        """(agent, session) of the block's last toucher; SHARED once two sessions touched it."""
        sessions = self.sessions[block]
        return self.agent[block], (SHARED if len(sessions) > 1 else next(iter(sessions)))

    @property
    def _uses(self) -> list[tuple[int, ...]]:
        return [self.trace.cached_tokens(r) for r in self.trace]

    def next_use(self, block: Block) -> float:
        """The first later request (by number) whose cached tokens start with the block's chain."""
        prefix: tuple[int, ...] = ()
        node = block
        while node is not None:
            prefix, node = node.token_ids + prefix, node.parent
        for number, tokens in enumerate(self._uses, start=1):
            if number > self.step and tokens[: len(prefix)] == prefix:
                return number
        return math.inf


# --- the contracts: key(block), lower is evicted first ----------------------------------------------------

Contract = Callable[[EvictionPolicy, Seen], Callable[[Any], Any]]


def lru_contract(policy: EvictionPolicy, seen: Seen) -> Callable[[Block], Any]:
    """The least recently used (the pool's clock of its last acquire or store) goes first."""
    return lambda block: block.last_access


def lfu_contract(policy: EvictionPolicy, seen: Seen) -> Callable[[Block], Any]:
    """The least often hit goes first, the least recently used among equals."""
    return lambda block: (block.hits, block.last_access)


def ttl_contract(policy: TTLPolicy, seen: Seen) -> Callable[[Block], Any]:
    """A block whose request ended less than `ttl` dispatches ago is pinned: unpinned first, LRU."""
    def key(block: Block) -> Any:
        ended = seen.ended_at.get(block)
        return (ended is not None and ended + policy.ttl > seen.step, block.last_access)
    return key


def survival(policy: SurvivalPolicy, agent: str, session: object, last_step: int, now: int, tokens: int) -> float:
    """Eq. 9 from the scorer's survival of (agent, session), for a block of `tokens` tokens last
    touched at dispatch `last_step`, at dispatch `now`: (surv + delta)(e^(-lambda age) + delta)|b|."""
    c = policy.config
    surv = policy.survival_of(policy.learner.index[agent], session)
    return (surv + c.floor) * (math.exp(-c.decay * (now - last_step)) + c.floor) * tokens


def survival_contract(policy: SurvivalPolicy, seen: Seen) -> Callable[[Block], Any]:
    """The lower survival-guided score goes first: the blocks of the agent predicted furthest away,
    and among equals the ones touched longest ago."""
    return lambda block: survival(policy, *seen.tag(block), seen.touched_at[block], seen.step, len(block.token_ids))


def belady_contract(policy: BeladyPolicy, seen: Seen) -> Callable[[Block], Any]:
    """The block used furthest in the future goes first (never again: first of all)."""
    return lambda block: -seen.next_use(block)


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[Trace], EvictionPolicy]
    contract: Contract


CASES = [
    Case("lru", lambda trace: LRUPolicy(), lru_contract),
    Case("lfu", lambda trace: LFUPolicy(), lfu_contract),
    Case("ttl", lambda trace: TTLPolicy(), ttl_contract),
    Case("ttl-1", lambda trace: TTLPolicy(ttl=1), ttl_contract),
    Case("survival", lambda trace: SurvivalPolicy(), survival_contract),
    Case("belady", lambda trace: BeladyPolicy((trace.cached_tokens(r) for r in trace), BS), belady_contract),
]


# --- the checks ---------------------------------------------------------------------------------------------


class JudgedPool(BlockPool):
    """A block pool that evicts one block at a time (as its heap does) and has each victim judged."""

    judge: Callable[[list[Block], Block], None] | None = None

    def evict(self, num_blocks: int) -> list[Block]:
        if self.judge is None or num_blocks > self.num_evictable:
            return super().evict(num_blocks)
        victims = []
        for _ in range(num_blocks):
            candidates = [b for b in self.blocks() if b.ref_count == 0 and b.num_children == 0]
            victim, = super().evict(1)
            self.judge(candidates, victim)
            victims.append(victim)
        return victims


@dataclass
class Report:
    victims: list[tuple[int, bytes]] = field(default_factory=list)
    decided: int = 0  # evictions where a candidate of higher key was at hand (a wrong pick was possible)
    ordered: int = 0  # neighbours in priority order that the contract orders strictly

    def judge(self, who: str, key: Callable[[Any], Any], candidates: list, victim: Any, *,
              verb: str = "evicted") -> None:
        """`victim` must rank lowest among `candidates` under the contract's `key`."""
        worst = key(victim)
        better = [b for b in candidates if key(b) < worst]
        assert not better, (f"{who}: {verb} block {victim.block_id} (key {worst}) while block "
                            f"{better[0].block_id} ranks lower under the contract (key {key(better[0])})")
        self.decided += any(key(b) > worst for b in candidates)
        self.victims.append((victim.block_id, victim.block_hash))


def replay(case: Case, policy: EvictionPolicy | None = None, trace: Trace | None = None, *,
           order: bool = True) -> Report:
    """Replay the trace under the case's policy, judging every victim and (with `order`) the
    priority order between requests against the contract; raises AssertionError naming the first
    violation."""
    trace = trace or trace_of(SPEC)
    policy = policy or case.build(trace)
    seen = Seen(trace)
    key = case.contract(policy, seen)
    report = Report()

    pool = JudgedPool(tight(trace), BS, policy)
    pool.judge = lambda candidates, victim: report.judge(case.name, key, candidates, victim)
    for request in trace:
        seen.step += 1
        tokens = trace.cached_tokens(request)
        full = len(tokens) // BS
        visit = pool.begin_request(request.prompt, request.agent, session=request.session)
        chain = pool.match(tokens[: len(request.prompt) - 1])  # the last prompt token is computed
        pool.acquire(chain, visit=visit)
        seen.touch(chain, request.agent, request.session)
        held = list(chain)
        pool.reserve(full - len(chain))
        parent = chain[-1] if chain else None
        for k in range(len(chain), full):
            parent = pool.store(parent, tokens[k * BS : (k + 1) * BS], owner=request.agent, visit=visit)
            seen.touch([parent], request.agent, request.session)
            held.append(parent)
        pool.end_request(visit)
        seen.end(held)
        pool.release(held)
        if not order:
            continue
        leaves = sorted((b for b in pool.blocks() if b.num_children == 0), key=lambda b: (policy.priority(b), b.block_id))
        for a, b in zip(leaves, leaves[1:]):
            assert key(a) <= key(b), (f"{case.name}: priority ranks block {a.block_id} (key {key(a)}) before block "
                                      f"{b.block_id} (key {key(b)}), the contract the other way round")
            report.ordered += key(a) < key(b)
    return report


def check_victims(case: Case, *, order: bool = True) -> Report:
    report = replay(case, order=order)
    assert report.decided >= 10, f"{case.name}: only {report.decided} evictions had a choice; the check is vacuous"
    assert report.ordered >= 10, f"{case.name}: the contract told only {report.ordered} neighbours apart"
    return report


def check_deterministic(case: Case) -> None:
    assert replay(case).victims == replay(case).victims, f"{case.name}: two replays evicted differently"


def check_fresh(case: Case) -> None:
    trace = trace_of(SPEC)
    used = case.build(trace)
    first = replay(case, used)
    with pytest.raises(ValueError, match="already serves a block pool"):
        BlockPool(8, BS, used)
    again = used.fresh()
    assert type(again) is type(used) and not again.attached, f"{case.name}: fresh() kept state"
    assert replay(case, again).victims == first.victims, f"{case.name}: fresh() changed the settings"


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_policy_evicts_by_its_contract(case):
    check_victims(case)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_policy_replay_is_deterministic(case):
    check_deterministic(case)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_policy_serves_one_pool_and_fresh_copies_its_settings(case):
    check_fresh(case)


# --- vLLM's free-block queue under an agent-aware policy ------------------------------------------------------


def _chain_hashes(tokens: tuple[int, ...]) -> list[bytes]:
    hashes, parent = [], b"root"
    for k in range(len(tokens) // BS):
        parent = hashlib.blake2b(parent + repr(tokens[k * BS : (k + 1) * BS]).encode(), digest_size=16).digest()
        hashes.append(parent)
    return hashes


def replay_vllm(build: Callable[[], AgentAwarePolicy], trace: Trace | None = None) -> Report:
    """Replay the trace through vLLM's own block pool with `AgentAwareFreeQueue` as its free queue,
    wired as the scheduler wires it (the policy learns each dispatch; a request's blocks are freed,
    tail first, under its tag). Each cached block the queue hands out must be a lowest-scoring
    free leaf, by Eq. 9 of the tag and dispatch it was released under, as recorded here; blocks
    that cache nothing go first."""
    from vllm.v1.core.block_pool import BlockPool as VLLMBlockPool

    from agentcache.engine.vllm.eviction import AgentAwareFreeQueue

    trace = trace or trace_of(SPEC)
    policy = build()
    report = Report()
    released: dict[int, tuple[tuple[str, object], int]] = {}  # cached block id -> ((agent, session), dispatch)
    parent_of: dict[int, int] = {}  # cached block id -> its parent's, from the chain that cached it
    now = 0  # dispatches so far

    def key(block) -> float:
        (agent, session), step = released[block.block_id]
        return survival(policy, agent, session, step, now, BS)

    class JudgedQueue(AgentAwareFreeQueue):
        def popleft(self):
            free = self.get_all_free_blocks()
            uncached = [b for b in free if b.block_hash is None]
            parents = set(parent_of.values())
            leaves = [b for b in free if b.block_hash is not None and b.block_id not in parents]
            victim = super().popleft()
            if uncached:
                assert victim.block_hash is None, f"cached block {victim.block_id} went before an uncached one"
            elif leaves:
                report.judge("vllm", key, leaves, victim, verb="handed out")
            released.pop(victim.block_id, None)
            parent_of.pop(victim.block_id, None)
            return victim

    pool = VLLMBlockPool(tight(trace) + 1, enable_caching=True, hash_block_size=BS)  # + vLLM's null block
    policy.attach(pool.num_gpu_blocks, BS)
    queue = pool.free_block_queue = JudgedQueue(pool.free_block_queue.get_all_free_blocks(), policy, BS)
    for request in trace:
        agent, session = request.agent, request.session
        now += 1
        tag = policy.begin_request(Dispatch(request.prompt, agent, session))
        hashes = _chain_hashes(trace.cached_tokens(request))
        hit = []
        for block_hash in hashes[: (len(request.prompt) - 1) // BS]:  # the last prompt token is computed
            found = pool.get_cached_block(block_hash, [0])
            if found is None:
                break
            hit.append(found[0])
        pool.touch(hit)
        blocks = hit + pool.get_new_blocks(len(hashes) - len(hit))
        pool.cache_full_blocks(SimpleNamespace(block_hashes=hashes), blocks, len(hit), len(blocks), BS, 0)
        for parent, child in zip(blocks, blocks[1:]):
            parent_of.setdefault(child.block_id, parent.block_id)
        for block in blocks:
            before = released.get(block.block_id)
            shared = before is not None and before[0][1] != session
            released[block.block_id] = ((agent, SHARED if shared else session), now)
        queue.link_chain(blocks)
        queue.releasing = tag
        pool.free_blocks(reversed(blocks))  # as vLLM frees a request: its chain's tail first
        queue.releasing = None
    return report


@pytest.mark.vllm
def test_vllm_free_queue_hands_out_blocks_by_the_survival_contract():
    from tests.conftest import require_vllm

    require_vllm()
    report = replay_vllm(SurvivalPolicy)
    assert report.decided >= 10, f"only {report.decided} hand-outs had a choice; the check is vacuous"
    assert replay_vllm(SurvivalPolicy).victims == report.victims, "two replays handed out blocks differently"


# --- how engines get a policy ------------------------------------------------------------------------------------


def test_engines_take_their_own_names_and_policy_objects():
    assert EngineConfig(eviction="lfu").eviction == "lfu"
    survival_policy = make_policy("survival")
    assert EngineConfig(eviction=survival_policy).eviction is survival_policy
    assert VLLMConfig(eviction=survival_policy).eviction is survival_policy and VLLMConfig().eviction == "lru"
    with pytest.raises(InputError, match=r"EngineConfig.eviction: unknown eviction policy 'survival'.*"
                                         r"agentcache.make_policy\('survival'\)"):
        EngineConfig(eviction="survival")
    with pytest.raises(InputError, match=r"VLLMConfig.eviction.*agentcache.make_policy\('survival'\)"):
        VLLMConfig(eviction="survival")
    with pytest.raises(InputError, match="agent-aware"):
        VLLMConfig(eviction=LFUPolicy())  # vLLM ranks groups of blocks by tag: LFU cannot say how
    assert isinstance(survival_policy, AgentAwarePolicy) and survival_policy.SHARED is SHARED


# --- the suite fails a wrong policy --------------------------------------------------------------------------------


class NewestFirst(LRUPolicy):
    """A wrong LRU: its priority reversed, the most recently used goes first."""

    def priority(self, block: Block) -> Any:
        return -block.last_access


class DoomsTheNextAgent(SurvivalPolicy):
    """A wrong Survival: the higher the score, the sooner it goes."""

    def tag_score(self, tag, last_step: int, tokens: int) -> float:
        return -super().tag_score(tag, last_step, tokens)


class IgnoresSurvival(SurvivalPolicy):
    """A wrong Survival: recency alone, as if every agent were equally likely to run next."""

    def tag_score(self, tag, last_step: int, tokens: int) -> float:
        return self.score(0.0, last_step, tokens)


class KeepsTheSoonest(BeladyPolicy):
    """A wrong Belady: the block needed next goes first."""

    def priority(self, block: Block) -> Any:
        return -super().priority(block)


class CoinFlip(LRUPolicy):
    """Not a policy at all: a random order."""

    def priority(self, block: Block) -> Any:
        return random.random()


WRONG = [
    Case("lru", lambda trace: NewestFirst(), lru_contract),
    Case("survival", lambda trace: DoomsTheNextAgent(), survival_contract),
    Case("survival", lambda trace: IgnoresSurvival(), survival_contract),
    Case("belady", lambda trace: KeepsTheSoonest((trace.cached_tokens(r) for r in trace), BS), belady_contract),
]


@pytest.mark.parametrize("wrong", WRONG, ids=lambda case: type(case.build(trace_of(SPEC))).__name__)
def test_the_suite_fails_a_policy_that_breaks_its_contract(wrong):
    """The suite catches it, and the victims alone do too (without the priority order check)."""
    with pytest.raises(AssertionError, match=f"{wrong.name}: (priority ranks|evicted) block"):
        check_victims(wrong)
    with pytest.raises(AssertionError, match=f"{wrong.name}: evicted block"):
        check_victims(wrong, order=False)


def test_the_suite_fails_a_policy_that_is_not_deterministic():
    with pytest.raises(AssertionError, match="evicted differently"):
        check_deterministic(Case("lru", lambda trace: CoinFlip(), lambda policy, seen: lambda block: 0))


@pytest.mark.vllm
@pytest.mark.parametrize("wrong", [DoomsTheNextAgent, IgnoresSurvival], ids=lambda cls: cls.__name__)
def test_the_suite_fails_a_wrong_policy_in_vllms_queue(wrong):
    from tests.conftest import require_vllm

    require_vllm()
    with pytest.raises(AssertionError, match="vllm: handed out block"):
        replay_vllm(wrong)


# --- the pool's own guarantee, whatever the policy says ------------------------------------------------------------


class Hostile(EvictionPolicy):
    """Ranks the blocks a pool must never evict first: the oldest (parents) and the latest used (held)."""

    name = "hostile"

    def priority(self, block: Block) -> Any:
        return (block.created, -block.last_access)


def test_the_pool_evicts_only_unheld_leaves_whatever_the_policy_says():
    """Under a hostile policy, evicting everything evictable mid-request leaves exactly the request's
    held chain, and the pool stays a tree of cached parents."""
    trace = trace_of(SPEC)
    pool = BlockPool(tight(trace), BS, Hostile())
    evicted = 0
    for number, request in enumerate(trace):
        tokens = trace.cached_tokens(request)
        chain = pool.match(tokens[: len(request.prompt) - 1])
        pool.acquire(chain)
        held = list(chain)
        parent = chain[-1] if chain else None
        for k in range(len(chain), len(tokens) // BS):
            parent = pool.store(parent, tokens[k * BS : (k + 1) * BS])
            held.append(parent)
        if number % 3 == 0:
            evicted += len(pool.evict(pool.num_evictable))
            assert {id(b) for b in pool.blocks()} == {id(b) for b in held}, "a held block was evicted"
            with pytest.raises(CapacityError):
                pool.evict(1)
        assert all(b in pool.blocks() for b in held), "a held block was evicted during its request"
        pool.release(held)
        for block in pool.blocks():
            assert block.parent is None or pool.get(block.parent.block_hash) is block.parent, "an orphan"
    assert evicted > 0 and pool.stats.evictions > evicted  # flushes and capacity both evicted

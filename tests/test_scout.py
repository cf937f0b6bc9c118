"""CacheScout: the pool under its policies, bad input, learner, scorer, Survival policy, replay,
trace files, and the runtime's warm-up on a tiny model. Every policy's ordering contract is
checked by one suite: test_policy_conformance.py."""

from __future__ import annotations

import importlib
import math
import json
import random
import threading
import time
from functools import lru_cache

import pytest

from agentcache.engine import SamplingParams
from agentcache.engine.blocks import BlockPool
from agentcache.engine.eviction import Dispatch
from agentcache.errors import CapacityError, TraceError
from agentcache.policies import make_policy
from agentcache.runtime import Runtime, RuntimeConfig
from agentcache.scout import (
    BeladyPolicy,
    ScoutConfig,
    SurvivalPolicy,
    SurvivalScorer,
    Trace,
    TraceRecorder,
    TraceRequest,
    TransitionLearner,
    TTLPolicy,
    WorkloadSpec,
    generate,
    prompt_fingerprint,
    replay,
)
from agentcache.engine.cache_manager import CacheManager
from agentcache.scout.trace_replay import serve as replay_serve
from agentcache.segments import AgentCall, Segment
from tests.conftest import make_engine

BS = 16
SMALL = WorkloadSpec(topology="selector", sessions=6, turns=6, prefix_tokens=(64, 160), query_tokens=16,
                     output_tokens=16, seed=3)


@lru_cache(maxsize=None)
def trace_of(spec: WorkloadSpec) -> Trace:
    """Generated traces are deterministic, so each spec is generated once per test run."""
    return generate(spec)


def belady_for(trace: Trace) -> BeladyPolicy:
    """Belady built from the very trace it will replay."""
    return BeladyPolicy((trace.cached_tokens(r) for r in trace), BS)


def tight(trace: Trace) -> int:
    """A capacity that holds the largest request plus a few blocks: evictions on most requests."""
    return trace.max_request_blocks(BS) + 3


# --- 1. the pool under the policies (each policy's own contract: test_policy_conformance.py) ---------


def assert_consistent(pool: BlockPool) -> None:
    """Pool bookkeeping between requests: bounded, nothing held, a tree rooted in cached parents."""
    blocks = pool.blocks()
    members = {id(b) for b in blocks}
    assert pool.num_used <= pool.capacity
    assert pool.num_used + pool.num_free == pool.capacity
    assert len({b.block_id for b in blocks}) == len(blocks)
    for b in blocks:
        assert b.ref_count == 0, f"block {b.block_id} still referenced after its request"
        assert b.parent is None or id(b.parent) in members, f"block {b.block_id} outlived its parent"
        assert pool.get(b.block_hash) is b
        assert b.num_children == sum(1 for c in blocks if c.parent is b)


def test_store_never_evicts_its_own_parent():
    """store(parent, ...) on a full pool must not evict `parent` (here the LRU victim) to make room."""
    pool = BlockPool(2, 4, "lru")
    root = pool.store(None, (1, 2, 3, 4))
    pool.release([root])
    other = pool.store(None, (9, 10, 11, 12))
    pool.release([other])
    parent = pool.match([1, 2, 3, 4, 5, 6, 7, 8])[-1]  # looked up, not acquired
    child = pool.store(parent, (5, 6, 7, 8))
    pool.release([child])
    assert child.parent is root
    assert root in pool.blocks(), "the new block's parent was evicted: the child is an unreachable orphan"
    assert_consistent(pool)


# --- 2. bad input --------------------------------------------------------------------------------


def test_trace_rejects_unknown_agent():
    with pytest.raises(TraceError, match="'mallory'"):
        Trace(("alice",), [TraceRequest("alice", "s", (1, 2)), TraceRequest("mallory", "s", (3,))])


def test_trace_rejects_bad_requests():
    """Empty prompts, negative or non-int token ids, prefix_len past the prompt, duplicate agents."""
    with pytest.raises(TraceError, match="empty prompt"):
        Trace(("a",), [TraceRequest("a", "s", ())])
    with pytest.raises(TraceError, match="-1"):
        Trace(("a",), [TraceRequest("a", "s", (1, -1))])
    with pytest.raises(TraceError, match="output"):
        Trace(("a",), [TraceRequest("a", "s", (1,), ("x",))])
    with pytest.raises(TraceError, match="prefix_len 3"):
        Trace(("a",), [TraceRequest("a", "s", (1, 2), prefix_len=3)])
    with pytest.raises(TraceError):
        Trace(("a", "a"), [])


@pytest.mark.parametrize("content", [
    "",
    "not json\n",
    '["agents"]\n',
    '{"meta": {}}\n',
    '{"agents": ["a"]}\n{"agent": "a", "session": "s"}\n',
    '{"agents": ["a"]}\n{"agent": "a", "session": "s", "prompt": [1]}\n{broken\n',
    '{"agents": ["a"]}\n{"agent": "b", "session": "s", "prompt": [1]}\n',
])
def test_trace_load_malformed(tmp_path, content):
    path = tmp_path / "bad.trace.jsonl"
    path.write_text(content)
    with pytest.raises(TraceError):
        Trace.load(path)


def test_trace_load_names_the_bad_line(tmp_path):
    path = tmp_path / "bad.trace.jsonl"
    path.write_text('{"agents": ["a"]}\n{"agent": "a", "session": "s", "prompt": [1]}\n{"agent": "a"}\n')
    with pytest.raises(TraceError, match="line 3"):
        Trace.load(path)


def test_trace_load_wrong_typed_field_is_trace_error(tmp_path):
    path = tmp_path / "bad.trace.jsonl"
    path.write_text('{"agents": ["a"]}\n{"agent": "a", "session": "s", "prompt": [1, 2], "prefix_len": null}\n')
    with pytest.raises(TraceError):
        Trace.load(path)


def test_replay_capacity_smaller_than_a_request():
    trace = trace_of(SMALL)
    needed = trace.max_request_blocks(BS)
    with pytest.raises(CapacityError) as info:
        replay(trace, "lru", needed - 1)
    assert str(needed - 1) in str(info.value) and str(needed) in str(info.value)
    replay(trace, "lru", needed)  # exactly one request's worth is enough


def test_pool_evict_more_than_evictable():
    pool = BlockPool(4, 4, "lru")
    a = pool.store(None, (1, 2, 3, 4))
    b = pool.store(a, (5, 6, 7, 8))
    pool.release([b])  # a stays held, so b is the only evictable block
    assert pool.num_evictable == 1
    with pytest.raises(CapacityError, match="cannot evict 2"):
        pool.evict(2)
    assert pool.num_used == 2  # a refused eviction evicts nothing
    with pytest.raises(CapacityError):
        BlockPool(0, 4)


def test_belady_on_a_different_trace():
    """Belady built from one trace cannot rank the blocks of another."""
    other = generate(WorkloadSpec(topology="selector", sessions=6, turns=6, prefix_tokens=(64, 160),
                                  query_tokens=16, output_tokens=16, seed=4))
    trace = trace_of(SMALL)
    # different seeds draw different prefix lengths, so the token ids of the blocks differ
    assert {trace.cached_tokens(r)[:BS * 5] for r in trace} != {other.cached_tokens(r)[:BS * 5] for r in other}
    with pytest.raises(TraceError, match="not in Belady's trace"):
        replay(other, belady_for(trace), tight(other))
    with pytest.raises(ValueError, match="16-token blocks"):
        BlockPool(8, 8, belady_for(trace))


def test_acquire_release_foreign_block():
    one, two = BlockPool(4, 4), BlockPool(4, 4)
    block = one.store(None, (1, 2, 3, 4))
    two.store(None, (1, 2, 3, 4))  # same id and tokens in the other pool, still another block
    with pytest.raises(ValueError, match="not cached in this pool"):
        two.acquire([block])
    with pytest.raises(ValueError, match="not cached in this pool"):
        two.release([block])
    one.release([block])
    with pytest.raises(RuntimeError):
        one.release([block])


def test_bad_policies_and_configs():
    with pytest.raises(ValueError, match="fifo"):
        make_policy("fifo")
    with pytest.raises(ValueError, match="edge_threshold"):
        ScoutConfig(edge_threshold=0)
    with pytest.raises(ValueError, match="horizon"):
        ScoutConfig(horizon=0)
    with pytest.raises(ValueError):
        ScoutConfig(per_session=1)
    with pytest.raises(ValueError, match="ring"):
        WorkloadSpec(topology="ring")
    with pytest.raises(ValueError):
        TTLPolicy(ttl=0)


def test_replay_warmup_needs_survival():
    with pytest.raises(ValueError, match="warm-up"):
        replay(trace_of(SMALL), "lru", tight(trace_of(SMALL)), warmup=True)


# --- 3. learner ------------------------------------------------------------------------------------


def test_learner_rows_are_smoothed_distributions():
    """Eq. 3: every row sums to 1, unseen edges keep a small non-zero probability."""
    learner = TransitionLearner(0.1)
    for agent in "ABCABDAB":
        learner.observe(agent)
    # the sequence's transitions: A->B three times, B->C, B->D, C->A, D->A once each
    counts = {"A": {"B": 3}, "B": {"C": 1, "D": 1}, "C": {"A": 1}, "D": {"A": 1}}
    for i in range(learner.num_agents):
        assert sum(learner.row(i)) == pytest.approx(1.0)
        seen = counts[learner.agents[i]]
        total = sum(seen.values())
        # (count + 0.1) / (total + 4 * 0.1): an unseen edge keeps 0.1 / (total + 0.4), never 0
        assert learner.row(i) == pytest.approx([(seen.get(to, 0) + 0.1) / (total + 4 * 0.1) for to in learner.agents])
    a, b = learner.index["A"], learner.index["B"]
    assert learner.row(a)[b] == pytest.approx((3 + 0.1) / (3 + 4 * 0.1))


def test_learner_counts_an_agents_repeated_calls_as_one_turn():
    """Algorithm 1 counts a transition only when the agent changes: a tool loop A,A,A then B is A->B."""
    learner = TransitionLearner()
    for agent in "AAABBBCCC" * 4:
        learner.observe(agent, "s")
    a, b = learner.index["A"], learner.index["B"]
    assert learner.counts[a][a] == 0 and learner.counts[a][b] == 4
    assert learner.predict("A") == "B" and learner.predictability() > 0.7  # 11 transitions, smoothed
    learner.observe("B", "s")  # C -> B
    learner.dirty_rows.clear()
    before = [row[:] for row in learner.counts]
    learner.observe("B", "s")  # a repeat changes no row: the scorer has nothing to refresh
    assert learner.dirty_rows == set() and learner.counts == before


def test_learner_interrupt_breaks_the_chain():
    learner = TransitionLearner()
    learner.observe("A", "s")
    learner.interrupt("s")
    learner.observe("B", "s")
    assert sum(learner.row_totals) == 0


def test_learner_predicts_most_frequent_successor():
    learner = TransitionLearner()
    for agent in ["A", "B", "A", "C", "A", "C", "A", "C", "A"]:
        learner.observe(agent, "s")
    assert learner.predict("A") == "C"
    assert learner.predict(session="s") == "C"  # the session's current agent is A
    assert learner.predict("C") == "A"
    assert learner.predict("nobody") is None
    assert learner.predict(session="other") == "C"  # an untracked session: after the last agent (A)
    assert TransitionLearner().predict(session="s") is None  # nothing learned yet


def test_predictability_cycle_vs_uniform():
    """R is near 1 for a deterministic cycle and about 0.1 when successors are uniformly random."""
    cycle = TransitionLearner()
    for step in range(300):
        cycle.observe("ABCD"[step % 4])
    assert cycle.predictability() > 0.9

    rng = random.Random(7)
    uniform = TransitionLearner()
    agent = "A"
    for _ in range(3000):  # uniformly random over the other agents (a repeat is not a transition)
        agent = rng.choice([a for a in "ABCDEF" if a != agent])
        uniform.observe(agent)
    # knowing the current agent only rules itself out: R = 1 - log 5 / log 6 = 0.10 (the paper's random: 0.12)
    assert uniform.predictability() == pytest.approx(1 - math.log(5) / math.log(6), abs=0.03)
    assert TransitionLearner().predictability() == 0.0


def test_learner_counts_transitions_per_session():
    """Interleaved sessions: A->B in s1 and C->D in s2 count; A->C, C->B, B->D (dispatch order) do not."""
    learner = TransitionLearner()
    for agent, session in [("A", "s1"), ("C", "s2"), ("B", "s1"), ("D", "s2"), ("A", "s3")]:
        learner.observe(agent, session)
    idx = learner.index
    nonzero = {(a, b) for a in "ABCD" for b in "ABCD" if learner.counts[idx[a]][idx[b]]}
    assert nonzero == {("A", "B"), ("C", "D")}
    assert learner.counts[idx["A"]][idx["B"]] == learner.counts[idx["C"]][idx["D"]] == 1
    assert sum(learner.row_totals) == 2  # s3's first dispatch follows nothing (not D of s2)
    assert learner.dispatches == 5
    assert learner.predict(session="s1") is None and learner.predict(session="s3") == "B"


def test_learner_max_agents_counts_untracked():
    learner = TransitionLearner(max_agents=2)
    assert learner.observe("A") == 0
    assert learner.observe("B") == 1
    assert learner.observe("C") is None
    assert learner.observe("C") is None
    assert (learner.num_agents, learner.dispatches, learner.untracked) == (2, 4, 2)
    assert "C" not in learner.index
    with pytest.raises(ValueError):
        learner.observe("")


def test_prompt_fingerprint():
    """Same leading blocks, same name; a different leading block, another name; no full block, None."""
    base = list(range(100, 140))
    same = list(range(100, 132)) + [7] * 20  # same first two blocks, different tail
    other = list(range(100, 116)) + [7] * 24  # second block differs
    fp = prompt_fingerprint(base, 16, 2)
    assert fp is not None and fp.startswith("fp:")
    assert prompt_fingerprint(same, 16, 2) == fp
    assert prompt_fingerprint(other, 16, 2) != fp
    assert prompt_fingerprint(other, 16, 1) == prompt_fingerprint(base, 16, 1)
    assert prompt_fingerprint(list(range(15)), 16, 2) is None
    assert prompt_fingerprint(base[:20], 16, 2) == prompt_fingerprint(base[:16], 16, 1)  # only full blocks


# --- 4. scorer -------------------------------------------------------------------------------------


def pipeline_learner() -> TransitionLearner:
    """A learner that saw an idle agent E once, then the cycle A->B->C->D five times, ending at A."""
    learner = TransitionLearner(0.1)
    learner.observe("E", "old")
    for _ in range(5):
        for agent in "ABCD":
            learner.observe(agent, "s")
    learner.observe("A", "s")
    return learner


def test_scorer_ranks_the_pipeline_by_hops():
    learner = pipeline_learner()
    scorer = SurvivalScorer(learner, edge_threshold=0.25, horizon=5)
    assert scorer.maybe_refresh()
    s = {a: scorer.survival_of(learner.index[a]) for a in "ABCDE"}
    assert s["B"] > s["C"] > s["D"] > s["A"] > 0
    assert s["B"] == pytest.approx(1 - 1 / 5)
    assert s["A"] == pytest.approx(1 - 4 / 5)  # the agent that just ran: its return distance, not 1
    assert s["E"] == 0.0  # nothing leads to E
    assert scorer.survival_of(99) == 0.0


def test_scorer_horizon_cuts_off():
    learner = pipeline_learner()
    scorer = SurvivalScorer(learner, edge_threshold=0.25, horizon=2)
    scorer.maybe_refresh()
    s = {a: scorer.survival_of(learner.index[a]) for a in "ABCD"}
    assert s == pytest.approx({"B": 0.5, "C": 0.0, "D": 0.0, "A": 0.0})


def test_scorer_refreshes_only_on_change():
    learner = pipeline_learner()
    scorer = SurvivalScorer(learner, edge_threshold=0.25, horizon=5)
    assert scorer.maybe_refresh() is True
    assert scorer.maybe_refresh() is False
    assert scorer.refreshes == 1
    learner.observe("B", "s")  # the current agent moved on
    assert scorer.maybe_refresh() is True
    assert scorer.survival_of(learner.index["C"]) > scorer.survival_of(learner.index["D"])
    with pytest.raises(ValueError):
        SurvivalScorer(learner, edge_threshold=0)


# --- 5. Survival policy -----------------------------------------------------------------------------


def serve(pool: BlockPool, agent: str, session: str, tokens: tuple[int, ...], *, warmup: bool = False) -> list:
    """One request: reference the cached chain of `tokens`, cache the rest, release; returns the chain."""
    bs = pool.block_size
    visit = pool.begin_request(tokens, agent, session=session, warmup=warmup)
    chain = pool.match(tokens)
    pool.acquire(chain, hit=not warmup, visit=visit)
    held, parent = list(chain), chain[-1] if chain else None
    for k in range(len(chain), len(tokens) // bs):
        parent = pool.store(parent, tokens[k * bs : (k + 1) * bs], owner=agent, visit=visit)
        held.append(parent)
    pool.end_request(visit)
    pool.release(held)
    return pool.match(tokens)


PREFIX = {"A": (1, 2, 3, 4), "B": (5, 6, 7, 8), "C": (9, 10, 11, 12)}


def run_sessions(policy) -> tuple[BlockPool, dict]:
    """B->A learned in four sessions; A runs in s0; C runs once in s2; then s3 and s4 run B."""
    pool = BlockPool(16, 4, policy)
    blocks = {}
    for t in range(4):
        serve(pool, "B", f"t{t}", PREFIX["B"])
        blocks["A"] = serve(pool, "A", f"t{t}", PREFIX["A"])[0]
    serve(pool, "A", "s0", PREFIX["A"])
    blocks["C"] = serve(pool, "C", "s2", PREFIX["C"])[0]
    blocks["B"] = pool.match(PREFIX["B"])[0]
    return pool, blocks


def test_survival_inactive_private_block_goes_before_shared_prefix():
    """C's block (one session, now inactive) ranks below A's prefix (shared, A predicted next),
    although C's block is more recent; LRU evicts the other way round."""
    policy = SurvivalPolicy(ScoutConfig(active_sessions=2))
    pool, blocks = run_sessions(policy)
    assert policy.survival(blocks["C"].block_id) > 0  # while s2 is active, C's block is worth keeping
    serve(pool, "B", "s3", PREFIX["B"])
    serve(pool, "B", "s4", PREFIX["B"])  # s2 drops out of the two active sessions
    assert policy.survival(blocks["C"].block_id) == 0.0
    assert policy.survival(blocks["A"].block_id) > 0.5
    assert policy.priority(blocks["C"]) < policy.priority(blocks["A"])
    assert blocks["C"].last_access > blocks["A"].last_access
    assert pool.evict(1) == [blocks["C"]]

    lru_pool, lru_blocks = run_sessions("lru")
    serve(lru_pool, "B", "s3", PREFIX["B"])
    serve(lru_pool, "B", "s4", PREFIX["B"])
    assert lru_pool.evict(1) == [lru_blocks["A"]]


def test_warmups_teach_the_learner_nothing():
    """A warm-up (pool or Dispatch) changes no dispatch count, transition or session state."""
    policy = SurvivalPolicy()
    pool = BlockPool(16, 4, policy)
    for session in ("s1", "s2"):
        serve(pool, "A", session, PREFIX["A"])
        serve(pool, "B", session, PREFIX["B"])
    learner = policy.learner
    before = (learner.dispatches, [list(r) for r in learner.counts], list(learner.row_totals),
              dict(learner.last_session_agent), policy.step)
    a_block = pool.match(PREFIX["A"])[0]
    a_hits, hit_blocks = a_block.hits, pool.stats.hit_blocks
    serve(pool, "A", "s1", PREFIX["A"], warmup=True)  # A's prefix is cached: the warm-up re-references it
    policy.end_request(policy.begin_request(Dispatch(PREFIX["C"], "C", "s2", warmup=True)))  # never dispatched
    after = (learner.dispatches, [list(r) for r in learner.counts], list(learner.row_totals),
             dict(learner.last_session_agent), policy.step)
    assert after == before
    assert policy.warmups == 2
    assert sum(learner.row_totals) == 2  # only A->B in each session
    assert "C" not in learner.index  # a warm-up never registers an agent
    assert (a_block.hits, pool.stats.hit_blocks) == (a_hits, hit_blocks) == (1, 2)  # the warm-up was no hit


def test_fingerprinted_agents_learn_the_named_transitions():
    """Without agent names the policy fingerprints prompts and learns the same chain and hit rate."""
    trace = trace_of(SMALL)
    named, anonymous = SurvivalPolicy(), SurvivalPolicy()
    a = replay(trace, named, tight(trace))
    b = replay(trace, anonymous, tight(trace), name_agents=False)
    assert a.hit_rate == b.hit_rate and a.evictions == b.evictions
    assert named.learner.counts == anonymous.learner.counts
    assert all(name.startswith("fp:") for name in anonymous.learner.agents)
    first = {}
    for r in trace:
        first.setdefault(r.agent, r.prompt)
    expected = [prompt_fingerprint(first[agent], BS, 2) for agent in named.learner.agents]
    assert anonymous.learner.agents == expected


# --- 6. replay results ---------------------------------------------------------------------------------


def test_selector_hit_rates_belady_survival_lru():
    """The benchmark's claim at 1.25x the largest request: Belady >= Survival > LRU."""
    trace = trace_of(WorkloadSpec(topology="selector", seed=0))
    capacity = int(1.25 * trace.max_request_blocks(BS))
    rates = {p: replay(trace, p, capacity).hit_rate for p in ("lru", "survival", "belady")}
    assert rates["belady"] >= rates["survival"] > rates["lru"] > 0, rates


def test_pipeline_prefetch_helps_and_warmups_are_not_hits(monkeypatch):
    """Warm-up raises the pipeline hit rate; its tokens are counted apart, never as hits or dispatches."""
    replay_module = importlib.import_module("agentcache.scout.trace_replay")
    pools = []

    class Recorded(BlockPool):
        def __post_init__(self):
            super().__post_init__()
            pools.append(self)

    monkeypatch.setattr(replay_module, "BlockPool", Recorded)
    trace = trace_of(WorkloadSpec(topology="pipeline", seed=0))
    capacity = int(1.25 * trace.max_request_blocks(BS))
    plain = replay(trace, "survival", capacity)
    policy = SurvivalPolicy()
    warm = replay(trace, policy, capacity, warmup=True)
    assert warm.hit_rate >= plain.hit_rate
    assert warm.warmups > 0 and warm.warmup_tokens > 0
    assert plain.warmups == plain.warmup_tokens == 0
    assert warm.prompt_tokens == plain.prompt_tokens == sum(len(r.prompt) for r in trace)
    assert warm.requests == len(trace)
    assert warm.cached_tokens <= sum((len(r.prompt) - 1) // BS * BS for r in trace)
    assert pools[-1].stats.hit_blocks * BS == warm.cached_tokens  # warm-up lookups add no hit blocks
    assert policy.warmups == warm.warmups
    assert policy.learner.dispatches == len(trace)


def test_warmup_works_without_per_session_scoring():
    """One session at a time: per_session changes nothing about the stream, warm-ups should still happen."""
    trace = trace_of(WorkloadSpec(topology="pipeline", concurrent=1, sessions=8, seed=0))
    capacity = int(1.25 * trace.max_request_blocks(BS))
    assert replay(trace, "survival_prefetch", capacity, warmup=True).warmups > 0
    result = replay(trace, "survival_prefetch", capacity, warmup=True, config=ScoutConfig(per_session=False))
    assert result.warmups > 0


# --- 7. trace files and the generator -------------------------------------------------------------------


def test_trace_round_trip(tmp_path):
    trace = trace_of(SMALL)
    path = tmp_path / "small.trace.jsonl"
    trace.save(path)
    loaded = Trace.load(path)
    assert loaded.agents == trace.agents
    assert loaded.requests == trace.requests
    assert loaded.meta == trace.meta
    header = json.loads(path.read_text().splitlines()[0])
    assert header["agents"] == list(trace.agents)


def test_generate_is_deterministic_per_seed():
    spec = SMALL
    again = generate(spec)
    assert again.requests == trace_of(spec).requests and again.agents == trace_of(spec).agents
    other = generate(WorkloadSpec(**{**{k: getattr(spec, k) for k in spec.__dataclass_fields__}, "seed": 4}))
    assert other.requests != again.requests


@pytest.mark.parametrize("topology", ["pipeline", "debate", "selector", "random"])
def test_requests_start_with_their_agents_prefix(topology):
    """Each agent's requests share its prefix_len-token prefix; different agents' prefixes differ."""
    trace = generate(WorkloadSpec(topology=topology, sessions=5, turns=6, prefix_tokens=(20, 40),
                                  query_tokens=8, output_tokens=8, seed=1))
    prefixes: dict[str, tuple[int, ...]] = {}
    for r in trace:
        assert 20 <= r.prefix_len <= 40
        prefix = r.prompt[: r.prefix_len]
        assert prefixes.setdefault(r.agent, prefix) == prefix
        assert len(r.output) == 8
    assert len(set(prefixes.values())) == len(prefixes)
    assert len(trace) == 5 * 6
    if topology == "pipeline":  # a fixed chain through all agents, from the first one
        for session in {r.session for r in trace}:
            order = [r.agent for r in trace if r.session == session]
            assert order == [trace.agents[i % len(trace.agents)] for i in range(6)]


# --- 8. the runtime on a tiny model --------------------------------------------------------------------

AGENTS3 = ("A", "B", "C")
SYSTEM = {a: tuple(range(10 + 40 * i, 41 + 40 * i)) for i, a in enumerate(AGENTS3)}  # 31 tokens + BOS: 2 blocks
ONE = SamplingParams(max_tokens=1)


def cyclic_call(agent: str, round_: int) -> AgentCall:
    query = tuple(200 + (round_ * 7 + k) % 100 for k in range(16))
    return AgentCall(agent=agent, session="s", segments=(
        Segment(kind="pf", token_ids=SYSTEM[agent]), Segment(kind="ph", slot="query", token_ids=query)))


def run_cycle(warmup: bool, rounds: int = 3, eviction: str = "survival"):
    """A->B->C `rounds` times on a 6-block pool (two agents' calls fill it); returns (runtime, results, recorder)."""
    recorder = TraceRecorder()
    rt = Runtime(make_engine("tiny-llama", pool_blocks=6, eviction=make_policy(eviction)), strategy="nonshared",
                 config=RuntimeConfig(warmup=warmup), recorder=recorder)
    results = []
    for r in range(rounds):
        for agent in AGENTS3:
            results.append(rt.run(cyclic_call(agent, r), ONE))
            rt.wait_warmup()
    return rt, results, recorder


def test_runtime_warmup_turns_evicted_prefixes_into_hits():
    rt, results, recorder = run_cycle(warmup=True)
    cold_rt, control, _ = run_cycle(warmup=False)
    calls = len(results)
    warm_hits = [r.cached_tokens for r in results]
    cold_hits = [r.cached_tokens for r in control]
    # a call whose prefix the cold runtime had lost is served from the warmed prefix
    assert any(w > 0 and c == 0 for w, c in zip(warm_hits, cold_hits)), (warm_hits, cold_hits)
    assert sum(warm_hits) > sum(cold_hits)

    summary = rt.summary()
    assert summary["warmups"]["issued"] >= 1
    assert summary["warmup_faults"] == 0 and summary["eviction"] == "survival"
    assert cold_rt.summary()["warmups"] is None and cold_rt.engine.pool.policy.warmups == 0
    pool = rt.engine.pool
    policy = pool.policy
    assert policy.warmups == summary["warmups"]["issued"]  # each warm-up reached the pool marked warmup
    assert policy.learner.dispatches == calls  # warm-ups are no dispatches ...
    assert pool.stats.lookups == calls  # ... and no lookups
    idx = policy.learner.index
    counts = policy.learner.counts
    assert (counts[idx["A"]][idx["B"]], counts[idx["B"]][idx["C"]], counts[idx["C"]][idx["A"]]) == (3, 3, 2)
    assert sum(policy.learner.row_totals) == calls - 1

    trace = recorder.trace()
    assert len(trace) == calls and trace.agents == AGENTS3
    bos = rt.engine.bos_token_id
    for req, res, call_no in zip(trace, results, range(calls)):
        agent = AGENTS3[call_no % 3]
        assert req.agent == agent and req.session == "s"
        assert req.prefix_len == len(SYSTEM[agent]) + 1
        assert req.prompt[: req.prefix_len] == (bos,) + SYSTEM[agent]
        assert req.prompt == tuple(res.prompt_ids) and req.output == tuple(res.token_ids)
    needed = trace.max_request_blocks(BS)
    assert replay(trace, "survival", needed).requests == calls
    assert replay(trace, "survival_prefetch", needed, warmup=True).warmups >= 1


def test_runtime_warmup_with_lru_engine_uses_its_own_learner():
    """An engine policy without a learner: the runtime learns dispatches itself and still warms up."""
    rt, results, _ = run_cycle(warmup=True, rounds=2, eviction="lru")
    assert rt.scout.own_learner is not None and rt.scout.own_learner.dispatches == len(results)
    assert rt.summary()["warmups"]["issued"] >= 1
    assert rt.engine.pool.stats.lookups == len(results)


def test_runtime_config_rejects_bad_scout():
    with pytest.raises(ValueError, match="ScoutConfig"):
        RuntimeConfig(scout="x")
    assert RuntimeConfig(warmup=True).scout == ScoutConfig()


def test_with_config_gives_each_engine_a_fresh_policy_with_the_same_settings():
    """A policy object serves one pool: another engine over the same weights gets a fresh copy."""
    custom = SurvivalPolicy(ScoutConfig(horizon=6, edge_threshold=0.3))
    engine = make_engine("tiny-llama", pool_blocks=32, eviction=custom)
    twin = engine.with_config(engine.config)
    assert twin.pool.policy is not engine.pool.policy
    assert twin.pool.policy.config == custom.config == engine.pool.policy.config
    ttl = TTLPolicy(ttl=3).fresh()
    assert isinstance(ttl, TTLPolicy) and ttl.ttl == 3


def test_runtime_self_check_does_not_teach_the_users_policy():
    """The self-check probes run on engines of their own: no dispatch, no block in the user's pool."""
    engine = make_engine("tiny-llama", pool_blocks=64, eviction=make_policy("survival"))
    rt = Runtime(engine, strategy="kvcmas")
    assert rt.strategy.name == "kvcmas"
    assert engine.pool.policy.learner.dispatches == 0 and engine.pool.num_used == 0


def test_a_call_arriving_during_a_warmup_preempts_it():
    """A warm-up is a low-priority engine request: a call arriving while one runs (the only batch
    place taken) preempts it, and waits at most one warm-up pass."""
    engine = make_engine("tiny-llama", pool_blocks=6, eviction=make_policy("survival"), max_batch=1, warmup_chunk=1)
    rt = Runtime(engine, strategy="nonshared", config=RuntimeConfig(warmup=True))
    forward, submit, warming = engine.runner.forward, engine.submit, threading.Event()
    log, lock = [], threading.Lock()  # "warm": a warm-up pass began; "call": a call's pass began; "arrived"

    def slow_warmup_passes(cache, token_ids, start):  # warm-ups prefill one token per pass here
        warmup = len(token_ids) == 1  # a call's passes prefill at least its 16 new query tokens
        with lock:
            log.append("warm" if warmup else "call")
        if warmup:
            warming.set()
            time.sleep(0.02)  # a long pass: the call below arrives while one runs
        return forward(cache, token_ids, start)

    def logged_submit(request):  # "arrived" once the call is in the engine's queue, before any later pass
        with lock:
            future = submit(request)
            if not request.warmup:
                log.append("arrived")
        return future

    engine.runner.forward, engine.submit = slow_warmup_passes, logged_submit
    with rt:
        for r in range(4):
            for i, agent in enumerate(AGENTS3):
                warming.clear()
                rt.run(cyclic_call(agent, r), ONE)
                if warming.wait(timeout=0.5):  # a warm-up is under way in the engine
                    with lock:
                        before = len(log)
                    rt.run(cyclic_call(AGENTS3[(i + 1) % 3], r), ONE)
                    events = log[before:]
                    after = events[events.index("arrived") + 1:]
                    # from its arrival to its own first pass, at most the warm-up pass already under way
                    assert "call" in after and after[: after.index("call")].count("warm") <= 1, events
                    break
            else:
                continue
            break
        else:
            pytest.fail(f"no warm-up ran: {rt.summary()['warmups']}")
    assert rt.scout._warmup.done()  # leaving the `with` block waited for the warm-up
    assert rt.summary()["warmups"]["preempted"] >= 1 and engine.scheduler.preempted >= 1
    assert rt.summary()["warmup_faults"] == 0
    assert engine.pool.num_evictable == engine.pool.num_used  # the preempted warm-up left nothing held


def test_no_warmups_when_the_engine_does_not_cache_prefixes(caplog):
    rt = Runtime(make_engine("tiny-llama", pool_blocks=16, prefix_caching=False), strategy="nonshared",
                 config=RuntimeConfig(warmup=True))
    assert rt.scout.coordinator is None and "warm-up is off" in caplog.text


def test_reference_prefills_are_not_agent_dispatches():
    """KVComm's context-free reference prefill is internal work: the learner never sees '<reference>'."""
    rt = Runtime(make_engine("tiny-llama", pool_blocks=256, eviction=make_policy("survival")), strategy="kvcomm",
                 config=RuntimeConfig(self_check=False))
    calls = 0
    for r in range(2):
        for agent in AGENTS3:
            rt.run(cyclic_call(agent, r), ONE)
            calls += 1
    learner = rt.engine.pool.policy.learner
    assert "<reference>" not in learner.agents
    assert learner.dispatches == calls and rt.engine.pool.stats.lookups == calls


def test_serving_a_cached_prompt_on_a_full_pool_evicts_nothing():
    pool = BlockPool(4, 4, "lru")
    cache = CacheManager(pool)
    first, second = tuple(range(1, 9)), tuple(range(20, 28))
    for tokens in (first, second):
        replay_serve(cache, tokens, len(tokens))
    assert pool.num_used == 4 and pool.num_free == 0
    assert replay_serve(cache, first, len(first)) == 4  # its last block is not a hit (the last token is computed)
    assert pool.stats.evictions == 0 and pool.num_used == 4


def test_small_teams_and_loose_trace_input_get_clear_answers(tmp_path):
    trace = generate(WorkloadSpec(topology="selector", num_agents=3, sessions=2, turns=4, seed=0))
    assert set(r.agent for r in trace) <= set(trace.agents) and len(trace.agents) == 3
    with pytest.raises(TraceError, match="tuple"):
        Trace(("a",), [TraceRequest("a", "s", [1, 2, 3])])
    path = tmp_path / "bad.jsonl"
    path.write_text('{"meta": {}}\n{"agent": "a", "session": "s", "prompt": [1]}\n')
    with pytest.raises(TraceError, match="line 1"):
        Trace.load(path)
    with pytest.raises(ValueError, match="capacity"):
        replay(generate(WorkloadSpec(sessions=1, turns=2)), "lru", 5.5)

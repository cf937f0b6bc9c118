"""Reuse that pays for itself: verified acceptance, the cost model, learning when idle, and
anchor pools that persist across runtimes (real engines, real tensors)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from agentcache.correction import replays
from agentcache.correction import verification as verification_module
from agentcache.correction.costs import PRIOR_BREAK_EVEN, Continuations, CostModel, OnlineLine
from agentcache.correction.persist import pools_path
from agentcache.correction.records import Edge
from agentcache.correction.strategies import STRATEGIES
from agentcache.correction.verification import (FIRST_AUDIT_GAP, MAX_AUDIT_GAP, EdgeRecord, Verdict,
                                                Verification, compare_outputs)
from agentcache.engine import SamplingParams
from agentcache.errors import InputError
from agentcache.idle import IdleWorker, Lesson
from agentcache.runtime import Runtime, RuntimeConfig
from agentcache.segments import AgentCall, Segment
from tests.conftest import make_engine, text_of_length

ROLES = {
    "planner": "You plan the trip step by step.\n",
    "local": "You know the city and its neighbourhoods well.\n",
    "critic": "You look for mistakes in every plan you read.\n",
}
THREE = SamplingParams(max_tokens=3)
DETERMINISTIC = RuntimeConfig(self_check=False, learn="after_call")


def role_call(agent: str, query: str, tenant: str | None = None) -> AgentCall:
    return AgentCall(agent=agent, tenant=tenant,
                     segments=(Segment.pf(ROLES[agent]), Segment.ph("query", query), Segment.pf("\nNotes:")))


def chain(rt: Runtime, query: str, tenant: str | None = None) -> list:
    return [rt.run(role_call(agent, query, tenant), THREE) for agent in ROLES]


def long_query(rt: Runtime, seed: int) -> str:
    return text_of_length(rt.engine, 60, seed=seed)  # ~300 byte tokens: worth reusing from the prior on


# --- verification --------------------------------------------------------------------------


def test_a_shadow_run_agrees_only_with_the_same_tokens_and_next_token():
    logits = torch.tensor([0.0, 3.0, 1.0])
    same = compare_outputs("raw", logits, [1, 2, 2], logits + 0.01, [1, 2, 2, 5])
    assert same.agrees and same.tokens == 3 and same.kl < 1e-3
    assert not compare_outputs("raw", logits, [1, 2, 2], logits, [1, 2, 0]).agrees  # a later token differs
    flipped = compare_outputs("raw", logits, None, torch.tensor([0.0, 1.0, 3.0]), [2])
    assert not flipped.agrees and flipped.kl > 0.5 and flipped.tokens == 1  # sampled call: next token only


def test_an_edge_serves_a_method_only_while_all_its_verdicts_agree():
    record = EdgeRecord()
    assert record.choice(can_correct=True) is None
    record.record(Verdict("raw", True, 0.02, 8))
    record.record(Verdict("corrected", True, 0.01, 8))
    assert record.choice(can_correct=True) == "corrected"  # the lower KL of two agreeing methods
    assert record.choice(can_correct=False) == "raw"  # no anchor left for a correction
    record.record(Verdict("corrected", False, 0.5, 8))
    assert record.choice(can_correct=True) == "raw"
    for _ in range(verification_module.WINDOW):
        record.record(Verdict("raw", False, 0.3, 8))
    assert record.choice(can_correct=True) is None


def test_audits_grow_rarer_while_the_served_method_agrees_and_reset_when_it_does_not():
    verification, edge = Verification(), Edge(None, "query", "a", "b", True, 0)
    assert not verification.audit_due(edge)  # an edge never verified is not served: nothing to audit
    for _ in range(verification_module.MIN_VERDICTS):
        verification.record(edge, [Verdict("raw", True, 0.0, 4)])
    gaps = []
    for _ in range(6):
        served = 1
        while not verification.audit_due(edge):
            assert verification.decide(edge, can_correct=False) == ("raw", None)  # audits never refuse a call
            served += 1
        gaps.append(served)
        verification.record(edge, [Verdict("raw", True, 0.0, 4)], audit=True)  # the dense replay agreed
    assert gaps == [FIRST_AUDIT_GAP, 4, 8, 16, MAX_AUDIT_GAP, MAX_AUDIT_GAP]
    verification.record(edge, [Verdict("raw", False, 0.4, 4)], audit=True)
    assert verification.decide(edge, can_correct=False) == (None, "unverified")
    assert verification.edges[edge].audit_gap == FIRST_AUDIT_GAP and verification.audits == 7
    assert verification.figures()["audit_disagreements"] == 1
    for _ in range(verification_module.WINDOW):  # agreeing again: served once the window holds no disagreement
        verification.record(edge, [Verdict("raw", True, 0.0, 4)])
    assert verification.decide(edge, can_correct=False) == ("raw", None)


# --- the cost model --------------------------------------------------------------------------


def test_the_cost_model_uses_the_prior_until_timed_then_the_break_even_it_measured():
    costs = CostModel()
    assert not costs.worth(PRIOR_BREAK_EVEN - 1) and costs.worth(PRIOR_BREAK_EVEN)
    for tokens in (100, 200, 400, 800):
        costs.observe_prefill(tokens, 0.01 + 0.001 * tokens)  # 1 ms a token, 10 ms a pass
        costs.observe_reuse(tokens, 0.004 + 0.00001 * tokens)  # 4 ms a segment, 10 µs a token
    # worth when 1 ms · n > 2 · (4 ms + 10 µs · n): n > 8.16 ms / 0.98 ms
    assert costs.break_even() == 9 and costs.worth(9) and not costs.worth(8)
    assert costs.figures()["prefill_s_per_token"] == pytest.approx(0.001)


def test_a_line_without_spread_puts_its_cost_where_it_is_conservative():
    saving, cost = OnlineLine(), OnlineLine(flat=True)
    for _ in range(5):
        saving.add(100, 0.2)
        cost.add(3000, 0.08)
    assert saving.fit() == pytest.approx((0.0, 0.002))  # a prefill's fixed part counts per token
    assert cost.fit() == pytest.approx((0.08, 0.0))  # a reuse of 3,000 tokens costs a short segment as much


def test_continuations_learn_how_much_of_a_prompt_the_agents_next_call_starts_with():
    seen = Continuations()
    expected = []
    for session in ("s0", "s1"):
        expected.append(seen.observe("t", session, "chatty", [1, 2, 3, 4]))
        seen.observe("t", session, "chatty", [1, 2, 3, 4, 5, 6, 7, 8])  # extends its first call whole
        seen.observe("t", session, "once", [1, 2, 3, 4])
    assert expected == [0.0, 1.0]  # learned from the first session, for the second
    assert seen.share("t", "chatty", follow_up=False) == 1.0  # its first call is followed, found whole
    assert seen.share("t", "chatty", follow_up=True) == 0.0  # its second is not followed
    assert seen.share("t", "once", follow_up=False) == 0.0 and seen.share("other", "chatty", False) == 0.0
    costs = CostModel()
    assert costs.worth(PRIOR_BREAK_EVEN + 10) and not costs.worth(PRIOR_BREAK_EVEN + 10, lost=20)


def test_an_agent_that_extends_its_own_prompt_keeps_its_prefix_cache_instead_of_reusing():
    """A conversation: reused KV is never cached, so reusing a long shared segment early in a
    prompt would cost the agent's next turn the prefix hit of everything after it."""
    rt = Runtime(make_engine("tiny-llama", pool_blocks=1024), strategy="kvcmas", config=DETERMINISTIC)
    decisions = []
    for k in range(3):
        topic = Segment.ph("topic", long_query(rt, seed=k))
        rt.run(AgentCall(agent="host", session=f"s{k}", segments=(Segment.pf("You host.\n"), topic)), THREE)
        transcript = []
        for turn in range(2):
            call = AgentCall(agent="guest", session=f"s{k}", segments=(
                Segment.pf("You are a guest.\n"), topic, *transcript, Segment.pf("\nguest:")))
            result = rt.run(call, THREE)
            decisions.append([s.decision for s in result.segments if s.kind == "ph"][0])
            transcript += [Segment.pf("\nguest:"), rt.output_segment("guest", session=f"s{k}")]
    # the first conversation teaches that the guest's second turn starts with its first prompt
    assert decisions[0] == "fallback" and decisions[2] == decisions[4] == "off"
    assert not {"reused", "corrected"} & set(decisions[2:])  # each conversation's later turn: its prefix hit
    assert rt.corrector.costs.continuations.share(None, "guest", follow_up=False) > 0.9


def test_siblings_on_a_new_segment_share_their_leaders_prefill_once_its_edges_are_verified(monkeypatch):
    """Three agents dispatched together on a query new to their session: each prefills it until a
    shadow run verified reusing the first reader's (the leader's) KV of it for the others; then the
    leader's prompt is prefilled through the query once, before any of them is planned (they wait
    with no lock held), the leader is served it as a prefix hit, and the others reuse it."""
    monkeypatch.setattr(replays, "compare_outputs", _always_agrees)  # random weights: fidelity is tested on Gemma
    siblings = STRATEGIES["kvcmas"].replace(siblings=True)
    rt = Runtime(make_engine("tiny-llama", pool_blocks=2048), strategy=siblings, config=DETERMINISTIC)
    read = []
    for k in range(3):
        query = long_query(rt, seed=k)

        async def siblings():
            return await asyncio.gather(*(rt.arun(AgentCall(agent=agent, session=f"s{k}", segments=(
                Segment.pf(ROLES[agent]), Segment.ph("query", query), Segment.pf("\nNotes:"))), THREE)
                for agent in ROLES))

        read.append([next(s for s in r.segments if s.kind == "ph") for r in asyncio.run(siblings())])
    assert [s.decision for s in read[0]] == ["first"] * 3  # the first workflow's reads verify the edges
    for workflow in read[1:]:
        leader, *others = workflow
        # its own prefill: served from the prefix cache but the block the prefix cache does not keep
        assert (leader.decision, leader.reason) == ("fallback", "own_prefill") and leader.computed_tokens < 16
        assert [(s.decision, s.source, s.computed_tokens) for s in others] == [("reused", "planner", 0)] * 2
    figures = rt.summary()
    assert figures["sibling_prefills"] == 2 and figures["faults"] == {}
    default = Runtime(make_engine("tiny-llama", pool_blocks=2048), strategy="kvcmas", config=DETERMINISTIC)
    for k in range(2):  # off by default: every sibling prefills the new segment
        query = long_query(default, seed=k)

        async def unshared():
            return await asyncio.gather(*(default.arun(AgentCall(agent=agent, session=f"s{k}", segments=(
                Segment.pf(ROLES[agent]), Segment.ph("query", query), Segment.pf("\nNotes:"))), THREE)
                for agent in ROLES))

        assert [next(s for s in r.segments if s.kind == "ph").decision for r in asyncio.run(unshared())] == ["first"] * 3
    assert default.summary()["sibling_prefills"] == 0


def _always_agrees(method, dense_logits, dense_tokens, shadow_logits, shadow_tokens):
    return Verdict(method, True, 0.0, len(shadow_tokens))


def test_a_segment_not_worth_reuse_runs_as_nonshared_with_no_reuse_work():
    rt = Runtime(make_engine("tiny-llama", pool_blocks=512), strategy="kvcmas", config=DETERMINISTIC)
    dense = Runtime(make_engine("tiny-llama", pool_blocks=512), strategy="nonshared", config=DETERMINISTIC)
    short = "Go to Rome."
    got, want = chain(rt, short), chain(dense, short)
    assert [s.decision for r in got for s in r.segments if s.kind == "ph"] == ["off"] * 3
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    figures = rt.summary()
    assert figures["eligible_tokens"] == 0 and figures["store_entries"] == 0 and figures["anchors"] == 0
    assert figures["lessons_done"] == 0 and figures["not_worth_segments"] >= 3


# --- verified acceptance on real engines -----------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gemma3"])
def test_reuse_is_served_only_on_edges_whose_shadow_runs_agreed(preset):
    rt = Runtime(make_engine(preset, pool_blocks=1024), strategy="kvcmas", config=DETERMINISTIC)
    served = 0
    for seed in range(5):
        query = long_query(rt, seed)
        chosen = {(edge.source, edge.consumer): record.choice(can_correct=True) for edge, record in rt.corrector.verification.edges.items()
                  if record.choice(can_correct=True) is not None}
        for got in chain(rt, query):
            segment = got.segments[1]
            if segment.decision in ("reused", "corrected"):
                assert (segment.source, got.agent) in chosen, "reuse on an edge never verified"
                served += 1
            elif segment.source is not None:
                assert segment.reason in ("unverified", "not_worth")
    figures = rt.summary()
    assert figures["verified_edges"] >= 2  # planner->local, local->critic, ...
    # every shadow run is one verdict, agreed or not, and every verified edge had one at least
    runs = sum(figures["shadow_agreed"].values()) + sum(figures["shadow_disagreed"].values())
    assert figures["shadow_runs"] == runs >= figures["verified_edges"]
    assert served > 0 or sum(figures["shadow_agreed"].values()) == 0, "an agreeing edge was never served"


def test_an_edge_whose_shadow_runs_disagree_is_always_prefilled(monkeypatch):
    monkeypatch.setattr("agentcache.correction.replays.compare_outputs",
                        lambda method, *args: Verdict(method, False, 1.0, 1))
    rt = Runtime(make_engine("tiny-llama", pool_blocks=1024), strategy="kvcmas", config=DETERMINISTIC)
    results = [r for seed in range(4) for r in chain(rt, long_query(rt, seed))]
    decisions = {s.decision for r in results for s in r.segments if s.kind == "ph"}
    assert decisions == {"first", "fallback"} and rt.summary()["reused_tokens"] == 0
    figures = rt.summary()  # every shadow run disagreed
    assert sum(figures["shadow_agreed"].values()) == 0 and figures["shadow_disagreed"]["raw"] > 0
    assert sum(figures["shadow_disagreed"].values()) == figures["shadow_runs"]


def test_a_shadow_run_never_caches_approximate_kv_or_counts_as_a_call():
    engine = make_engine("tiny-llama", pool_blocks=1024)
    rt = Runtime(engine, strategy="kvcmas", config=DETERMINISTIC)
    seen = []
    submit = engine.submit
    engine.submit = lambda request: seen.append(request) or submit(request)
    chain(rt, long_query(rt, 0))
    shadows = [r for r in seen if r.internal]
    assert shadows and all(r.lineage is None and not r.capture_kv for r in shadows)
    assert len(rt.results) == 3 and rt.summary()["calls"] == 3


# --- learning when idle ------------------------------------------------------------------------


def test_lessons_wait_for_idle_time_and_the_oldest_go_first_when_they_pile_up():
    busy, ran = threading.Event(), []
    busy.set()
    faults = []
    worker = IdleWorker(lambda: not busy.is_set(), threading.RLock(), on_fault=lambda name, exc: faults.append(name),
                        max_pending=3)
    worker.submit([Lesson(f"l{i}", lambda i=i: i, ran.append) for i in range(5)])
    worker.submit([Lesson("bad", lambda: 1 / 0, ran.append)])
    time.sleep(0.3)
    assert ran == []  # a call is in flight (and no lesson waited past MAX_WAIT_S)
    busy.clear()
    worker.poke()
    assert worker.drain(5.0)
    assert ran == [3, 4] and faults == ["bad"]
    assert worker.figures()["lessons_dropped"] == 3 and worker.figures()["lessons_failed"] == 1
    worker.stop()


def test_idle_time_counts_from_the_last_call_that_landed():
    """A sequential workflow's next agent arrives some 50 ms after the last one landed (over HTTP):
    that gap is not idle time, however long ago the worker last looked."""
    from agentcache.idle import IDLE_GRACE_S

    ran = []
    worker = IdleWorker(lambda: True, threading.RLock(), on_fault=lambda name, exc: None)
    time.sleep(IDLE_GRACE_S + 0.1)  # the worker has seen no call for longer than the grace
    worker.submit([Lesson("later", lambda: 1, ran.append)])
    for _ in range(4):
        worker.poke()  # a call just landed
        time.sleep(IDLE_GRACE_S / 5)
        assert ran == []
    assert worker.drain(5.0) and ran == [1]
    worker.stop()


def test_a_call_in_another_runtime_of_the_process_is_no_idle_time():
    """Runtimes side by side in one process (a benchmark's strategies) share its cores: a runtime
    learns when no runtime of the process has a call in flight."""
    from agentcache.idle import IDLE_GRACE_S, calls_in_flight

    ran, other_runtimes_call = [], object()
    runtime = Runtime(make_engine("tiny-llama"), strategy="nonshared", config=RuntimeConfig(self_check=False))
    worker = runtime._idle  # the runtime's own worker, as it was made
    calls_in_flight.enter(other_runtimes_call)
    try:
        time.sleep(IDLE_GRACE_S + 0.1)  # this runtime has had no call for longer than the grace
        worker.submit([Lesson("when idle", lambda: 1, ran.append)])
        time.sleep(0.2)  # (a lesson waiting MAX_WAIT_S may run beside calls, within a budget)
        assert ran == [] and not calls_in_flight.idle()
    finally:
        calls_in_flight.leave(other_runtimes_call)
    assert worker.drain(5.0) and ran == [1]
    runtime.close()


def test_a_lesson_beside_calls_computes_on_one_thread_and_an_idle_one_on_the_machines():
    from agentcache.idle import BESIDE_CALLS_THREADS

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        busy, seen = threading.Event(), []
        busy.set()
        worker = IdleWorker(lambda: not busy.is_set(), threading.RLock(), on_fault=lambda name, exc: None)
        worker.submit([Lesson("first verdict", torch.get_num_threads, seen.append, urgent=True)])
        assert worker.drain(5.0)  # urgent: runs while a call is in flight
        busy.clear()
        worker.submit([Lesson("when idle", torch.get_num_threads, seen.append)])
        assert worker.drain(5.0)
        assert seen == [BESIDE_CALLS_THREADS, 2]
        worker.stop()
    finally:
        torch.set_num_threads(before)


def test_idle_learning_reaches_the_same_pools_as_learning_after_each_call():
    rts = {mode: Runtime(make_engine("tiny-llama", pool_blocks=1024), strategy="kvcmas",
                         config=RuntimeConfig(self_check=False, learn=mode)) for mode in ("idle", "after_call")}
    for seed in range(2):
        for rt in rts.values():
            chain(rt, long_query(rt, seed))
            assert rt.learned(30.0)
    idle, after = (rts[m].summary() for m in ("idle", "after_call"))
    for key in ("anchors", "anchor_bytes", "shadow_runs", "verified_edges"):
        assert idle[key] == after[key], key
    assert idle["lessons_done"] == after["lessons_done"] > 0 and idle["lessons_pending"] == 0


# --- anchor pools that persist -----------------------------------------------------------------


def persisting(base, directory, workflows: int, tenant: str | None = None) -> Runtime:
    """A runtime over `directory` that ran `workflows` chains (its pools not yet saved)."""
    rt = Runtime(base.fresh(), strategy="kvcmas", config=DETERMINISTIC, anchors_dir=directory)
    for seed in range(workflows):
        chain(rt, long_query(rt, seed), tenant=tenant)
    return rt


def test_a_new_runtime_warm_starts_from_the_saved_pools_and_verdicts(tmp_path):
    base = make_engine("tiny-llama", pool_blocks=1024)
    first = persisting(base, tmp_path, 3)
    first.close()
    saved = first.summary()
    path = pools_path(tmp_path, first.anchors.digest, None)
    assert path.is_file() and saved["verified_edges"] > 0  # anchors too, where raw reuse failed its shadow runs

    second = Runtime(base.fresh(), strategy="kvcmas", config=DETERMINISTIC, anchors_dir=tmp_path)
    loaded = second.summary()
    assert loaded["anchors_loaded"] == saved["anchors"] and loaded["anchor_bytes"] == saved["anchor_bytes"]
    assert second.corrector.verification.edges.keys() == first.corrector.verification.edges.keys()
    choices = {edge: r.choice(can_correct=True) for edge, r in first.corrector.verification.edges.items()}
    got = chain(second, long_query(second, 99))  # its first workflow
    for result in got[1:]:
        segment = result.segments[1]
        if segment.decision in ("reused", "corrected"):
            assert any((edge.source, edge.consumer) == (segment.source, result.agent) and choice for edge, choice in choices.items())
    assert second.summary()["reused_tokens"] > 0 or not any(choices.values())


def test_one_tenants_file_never_reaches_another_tenant(tmp_path):
    base = make_engine("tiny-llama", pool_blocks=1024)
    first = persisting(base, tmp_path, 2, tenant="acme")
    assert [p.name.startswith("tenant-") for p in first.save_anchors()] == [True]
    second = Runtime(base.fresh(), strategy="kvcmas", config=DETERMINISTIC, anchors_dir=tmp_path)
    chain(second, long_query(second, 5), tenant="globex")
    assert second.summary()["anchors_loaded"] == 0 and not any(
        edge.tenant == "acme" for edge in second.corrector.verification.edges)
    assert set(second.anchors.loaded) == {None, "globex"}
    chain(second, long_query(second, 6), tenant="acme")
    assert "acme" in second.anchors.loaded and any(edge.tenant == "acme" for edge in second.corrector.verification.edges)
    assert second.anchors.loaded["acme"] == first.summary()["anchors"]


def test_a_file_of_other_settings_or_weights_is_refused_with_a_clear_error(tmp_path):
    base = make_engine("tiny-llama", pool_blocks=1024)
    persisting(base, tmp_path, 2).close()
    with pytest.raises(InputError, match="strategy settings differ"):
        Runtime(base.fresh(), strategy=STRATEGIES["kvcmas"].replace(max_anchors=4), config=DETERMINISTIC,
                anchors_dir=tmp_path)
    other = make_engine("tiny-llama", pool_blocks=1024, seed=1) if "seed" in make_engine.__code__.co_varnames else None
    if other is not None:  # other weights: another digest, so another file (a cold start, not a refusal)
        assert Runtime(other, strategy="kvcmas", config=DETERMINISTIC, anchors_dir=tmp_path).summary()["anchors_loaded"] == 0
    with pytest.raises(InputError, match="anchors_dir"):
        Runtime(base.fresh(), strategy="kvcmas", config=DETERMINISTIC, anchors_dir=42)


def test_reused_calls_are_audited_by_a_dense_replay_and_a_failed_audit_stops_reuse(monkeypatch):
    monkeypatch.setattr(CostModel, "worth", lambda self, tokens, lost=0: True)  # timing-free
    agrees = {"value": True}
    monkeypatch.setattr("agentcache.correction.replays.compare_outputs",
                        lambda method, *args: Verdict(method, agrees["value"], 0.0, 1))
    engine = make_engine("tiny-llama", pool_blocks=1024)
    rt = Runtime(engine, strategy="kvcmas", config=DETERMINISTIC)
    seen = []
    submit = engine.submit
    engine.submit = lambda request: seen.append(request) or submit(request)
    seed = 0
    while rt.summary()["audits"] == 0:
        chain(rt, long_query(rt, seed))
        seed += 1
        assert seed < 12, "no reused call was ever audited"
    replays = [r for r in seen if r.internal and all(s.step.value == "prefix" for s in r.segments)]
    assert replays and all(r.lineage is None for r in replays)  # the audit: a dense replay, nothing cached
    agrees["value"] = False
    while rt.summary()["shadow_disagreed"]["raw"] + rt.summary()["shadow_disagreed"]["corrected"] == 0:
        chain(rt, long_query(rt, seed))
        seed += 1
        assert seed < 40, "no second audit"
    for edge, record in rt.corrector.verification.edges.items():
        failed = {v.method for kept in record.verdicts.values() for v in kept if not v.agrees}
        assert record.choice(can_correct=True) not in failed  # a method that failed its audit is not served

"""Shared text found anywhere in a prompt (`correction.spans`, `SourcedStrategy.refine`) and its
verification under traffic (urgent lessons, `idle`): unit tests of the detector on token lists, and
runtime tests on real engines and a real trained model."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from agentcache.correction.sourced import SPAN_SLOT
from agentcache.correction.spans import MIN_SPAN_TOKENS, WINDOW, SpanIndex
from agentcache.correction.store import SegmentStore
from agentcache.engine import SamplingParams
from agentcache.engine.kv import SegmentKV
from agentcache.idle import IdleWorker, Lesson
from agentcache.isolation import Scope
from agentcache.runtime import Runtime, RuntimeConfig
from agentcache.segments import AgentCall, Segment
from agentcache.serve.messages import read_messages
from tests.conftest import TINY_PRESETS, make_engine, text_of_length

SCOPE = Scope(None, "s")


def tokens(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def finder(entries: dict[str, list[int]], scope: Scope = SCOPE) -> SpanIndex:
    index = SpanIndex()
    for entry_id, ids in entries.items():
        index.add(scope, entry_id, ids)
    return index


def find(index: SpanIndex, entries: dict[str, list[int]], query: list[int], scope: Scope = SCOPE, **kw):
    return index.find(scope, query, lambda i: entries.get(i), lambda i: (0, i), **kw)


# --- the detector --------------------------------------------------------------------------------


def test_a_span_is_found_wherever_it_sits_and_extended_to_its_exact_ends():
    document = tokens(1000, 300)
    entries = {"reader": [7, 8, 9, *document, 11, 12]}  # the document after the reader's own task line
    index = finder(entries)
    query = [50, 51, 52, 53, 54, *document, 60, 61]  # another task line before it, other text after
    [span] = find(index, entries, query)
    assert (span.start, span.end, span.entry_id, span.offset) == (5, 305, "reader", 3)
    # a boundary token that differs (text joined differently) shortens the span by that token only
    joined = [50, 51, 999, *document[1:], 60]
    [span] = find(index, entries, joined)
    assert (span.start, span.end, span.offset) == (3, 302, 4)


def test_several_spans_from_several_sources_come_back_in_order_without_overlap():
    document, notes = tokens(1000, 200), tokens(5000, 80)
    entries = {"doc": [1, *document], "notes": notes}
    index = finder(entries)
    query = [9, 9, *document, 3, 3, 3, *notes, 4]
    spans = find(index, entries, query)
    assert [(s.entry_id, s.start, s.end) for s in spans] == [("doc", 2, 202), ("notes", 205, 285)]


def test_runs_shorter_than_the_minimum_and_unindexed_scopes_find_nothing():
    entries = {"a": tokens(0, 200)}
    index = finder(entries)
    short = [9, *tokens(50, MIN_SPAN_TOKENS - 1), 9]
    assert find(index, entries, short) == []
    assert find(index, entries, tokens(0, 200), scope=Scope("other", "s")) == []  # another tenant's session
    # any run of 2W-1 tokens holds an indexed window, wherever it starts
    assert all(len(find(index, entries, tokens(at, 2 * WINDOW - 1), min_tokens=2 * WINDOW - 1)) == 1 for at in range(40))


def test_the_longest_match_wins_then_the_rank_and_removed_entries_are_gone():
    document = tokens(1000, 120)
    entries = {"old": [*document[:60], 1, 2, 3], "long": list(document), "twin": list(document)}
    index = finder(entries)
    ranked = index.find(SCOPE, [5, *document, 5], entries.get, lambda i: {"old": 3, "long": 2, "twin": 1}[i])
    assert [(s.entry_id, s.length) for s in ranked] == [("long", 120)]  # longest first, then rank
    index.remove("long")
    index.remove("twin")
    [span] = find(index, entries, [5, *document, 5])
    assert (span.entry_id, span.length) == ("old", 60)
    index.remove("old")
    assert len(index) == 0 and find(index, entries, [5, *document, 5]) == []


def test_the_store_indexes_what_it_keeps_and_forgets_what_it_drops():
    store = SegmentStore(byte_budget=1 << 30)

    def kv(length: int) -> SegmentKV:
        shape = (2, 1, length, 4)  # (L, H, T, D)
        return SegmentKV(torch.zeros(shape), torch.zeros(shape), 7)

    document = tokens(100, 150)
    entry = store.put(SCOPE, "query", "reader", [1, 2, *document], kv(152), "dense")
    [(span, found)] = store.spans(SCOPE, [9, 9, 9, *document])
    assert found is entry and (span.offset, span.length) == (2, 150)
    assert store.spans(Scope("t", "s"), [9, *document]) == []  # only its own scope
    store.drop_scope(SCOPE)
    assert store.spans(SCOPE, [9, 9, 9, *document]) == []


# --- the runtime: a document after each agent's own task line ------------------------------------


ASK = SamplingParams(max_tokens=6)


def inline_team(rt: Runtime, session: str, document: str) -> list:
    """A reader, then a checker whose one shared message opens with its own task line."""
    reader = rt.run(AgentCall(agent="reader", session=session, segments=(
        Segment.pf("You read documents.\n"), Segment.ph("query", "Note the facts of this document.\n" + document))), ASK)
    checker = rt.run(AgentCall(agent="checker", session=session, segments=(
        Segment.pf("You check notes.\n"),
        Segment.ph("query", "Check the notes below against this document.\n\n" + document + "\n\nAnswer now.")),
    ), ASK)
    return [reader, checker]


def span_of(result):
    return next(s for s in result.segments if s.name == SPAN_SLOT.format(slot="query"))


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_a_document_inside_another_agents_message_is_read_from_its_producer(preset):
    rt = Runtime(make_engine(preset, pool_blocks=2048), strategy="kvcmas",
                 config=RuntimeConfig(self_check=False, learn="after_call"))
    document = text_of_length(rt.engine, 80, seed=3)
    reader, checker = inline_team(rt, "s0", document)
    span = span_of(checker)
    doc_tokens = len(rt.engine.tokenize(document))
    assert span.source == "reader" and abs(span.length - doc_tokens) <= 3  # its boundary tokens may join others
    assert span.decision == "fallback" and span.reason == "unverified"  # the edge's first call: prefilled, shadowed
    # the checker's own words around the document keep the message's slot
    assert [s.name for s in checker.segments if s.kind == "ph"] == ["query", span.name, "query"]
    [record] = [r for edge, r in rt.corrector.verification.edges.items() if edge.slot == span.name]
    served = {"raw": "reused", "corrected": "corrected", None: "fallback"}[record.choice(can_correct=True)]
    _, again = inline_team(rt, "s1", text_of_length(rt.engine, 80, seed=4))
    assert span_of(again).decision == served and span_of(again).source == "reader"  # as its shadow run said


def test_the_baselines_do_not_split_segments():
    rt = Runtime(make_engine("tiny-llama", pool_blocks=2048), strategy="fullshared",
                 config=RuntimeConfig(self_check=False, learn="after_call"))
    _, checker = inline_team(rt, "s0", text_of_length(rt.engine, 80, seed=3))
    assert [s.name for s in checker.segments if s.kind == "ph"] == ["query"]


@pytest.mark.slow
def test_under_traffic_a_real_models_inline_document_is_verified_at_once_and_reused():
    """Gemma 3 270M (trained): with another caller keeping the runtime busy all along, the edge's
    first verification does not wait for idle time, and the next workflow reuses the document found
    inside the checker's message. (How often reuse keeps NonShared's tokens is measured by
    benchmarks/real_fidelity.py: a verified edge is not a promise about every later document.)"""
    rt = Runtime(model="gemma3-270m", strategy="kvcmas", config=RuntimeConfig(self_check=False))
    stop, busy_calls = threading.Event(), []

    def traffic() -> None:
        while not stop.is_set():
            busy_calls.append(rt.run(AgentCall(agent="other", session="busy", segments=(
                Segment.pf("Write a list of colours.\n" + text_of_length(rt.engine, 20, seed=len(busy_calls))),)),
                SamplingParams(max_tokens=24)))

    caller = threading.Thread(target=traffic)
    caller.start()
    try:
        while not busy_calls:
            time.sleep(0.05)
        first = inline_team(rt, "w0", text_of_length(rt.engine, 120, seed=11))
        assert span_of(first[1]).reason == "unverified"
        deadline = time.monotonic() + 120
        while rt.summary()["shadow_runs"] == 0 and time.monotonic() < deadline:
            time.sleep(0.1)  # the runtime is never idle meanwhile
        document = text_of_length(rt.engine, 120, seed=12)
        second = inline_team(rt, "w1", document)
    finally:
        stop.set()
        caller.join()
    figures = rt.summary()
    assert figures["lessons_urgent"] >= 1 and figures["shadow_runs"] >= 1
    span = span_of(second[1])
    if figures["shadow_agreed"]["raw"] + figures["shadow_agreed"]["corrected"] == 0:
        pytest.fail(f"the edge's shadow run disagreed on a trained model: {figures['shadow_disagreed']}")
    assert span.decision in ("reused", "corrected") and abs(span.length - len(rt.engine.tokenize(document))) <= 3
    assert span.source == "reader" and second[1].reused_tokens >= span.length


# --- verification does not wait for idle time ----------------------------------------------------


def test_an_urgent_lesson_runs_while_calls_are_in_flight_and_a_learned_one_is_skipped():
    lock = threading.RLock()
    worker = IdleWorker(lambda: False, lock, on_fault=lambda name, exc: None)  # never idle
    ran = []
    worker.submit([Lesson("later", lambda: ran.append("later"), lambda _: None),
                   Lesson("first verdict", lambda: ran.append("urgent"), lambda _: None, urgent=True),
                   Lesson("known by now", lambda: ran.append("skipped"), lambda _: None, urgent=True,
                          needed=lambda: False)])
    deadline = time.monotonic() + 5
    while not ran and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert ran == ["urgent"]  # the budgeted lesson still waits: it has not waited MAX_WAIT_S yet
    figures = worker.figures()
    assert figures["lessons_urgent"] == 1 and figures["lessons_skipped"] == 1
    worker.stop()


def test_a_method_without_a_verdict_is_untested_until_the_edge_serves():
    from agentcache.correction.records import Edge
    from agentcache.correction.verification import Verdict, Verification

    verification = Verification()
    edge = Edge.of(None, "query", "reader", True, "checker", tokens_after=70)
    assert verification.untested(edge, ["raw"]) == ["raw"]  # never judged
    verification.record(edge, [Verdict("raw", False, 0.9, 8)])
    assert verification.untested(edge, ["raw"]) == []  # raw disagreed and nothing else can be tried yet
    assert verification.untested(edge, ["raw", "corrected"]) == ["corrected"]  # the edge has anchors now
    verification.record(edge, [Verdict("corrected", True, 0.01, 8)])
    assert verification.untested(edge, ["raw", "corrected"]) == []  # it serves the correction


def test_an_edge_whose_raw_reuse_disagreed_verifies_its_correction_on_its_next_call_at_once(monkeypatch):
    """Raw reuse disagrees on the edge's first call (forced here; a random model may agree): the
    anchor that call taught makes the correction testable, and the next call's shadow run of it is
    urgent too. Once both methods have verdicts, nothing on the edge is urgent."""
    from agentcache.correction import replays
    from agentcache.correction.verification import Verdict

    real = replays.compare_outputs

    def raw_disagrees(method, *args):
        verdict = real(method, *args)
        return Verdict(method, False, verdict.kl, verdict.tokens) if method == "raw" else verdict

    monkeypatch.setattr(replays, "compare_outputs", raw_disagrees)
    rt = Runtime(make_engine("tiny-llama", pool_blocks=2048), strategy="kvcmas",
                 config=RuntimeConfig(self_check=False, learn="after_call"))
    urgent = []
    for index in range(3):
        _, checker = inline_team(rt, f"s{index}", text_of_length(rt.engine, 80, seed=20 + index))
        urgent.append(rt.summary()["lessons_urgent"])
        if index == 1:
            assert span_of(checker).reason == "unverified"  # raw disagreed, the correction not yet tried
    figures = rt.summary()
    assert urgent[:2] == [1, 2] and urgent[2] == 2
    assert figures["shadow_disagreed"]["raw"] >= 2
    assert figures["shadow_agreed"]["corrected"] + figures["shadow_disagreed"]["corrected"] >= 1


def test_the_users_later_messages_have_slots_of_their_own():
    transcript = read_messages([{"role": "system", "content": "You check."},
                                {"role": "user", "content": "the document"},
                                {"role": "user", "name": "reader", "content": "the notes"},
                                {"role": "user", "content": "Check the notes."}])
    assert [turn.slot for turn in transcript.turns("checker")] == ["query", "out:reader", "user:1"]


def test_an_edge_never_judged_at_this_distance_takes_its_neighbours_method_and_is_audited_once():
    from agentcache.correction.records import Edge
    from agentcache.correction.verification import Verdict, Verification

    verification = Verification()
    judged = Edge.of(None, "query@span", "reader", False, "checker", tokens_after=70)  # bucket 3
    verification.record(judged, [Verdict("raw", True, 0.01, 8)])
    nearer = Edge.of(None, "query@span", "reader", False, "checker", tokens_after=30)  # bucket 2
    farther = Edge.of(None, "query@span", "reader", False, "checker", tokens_after=300)  # bucket 4
    far_off = Edge.of(None, "query@span", "reader", False, "checker", tokens_after=1100)  # bucket 5
    other = Edge.of(None, "query@span", "reader", False, "critic", tokens_after=30)
    assert verification.decide(nearer, can_correct=False) == ("raw", None)
    assert verification.decide(farther, can_correct=False) == ("raw", None)
    assert verification.decide(far_off, can_correct=False) == (None, "unverified")  # two buckets away
    assert verification.decide(other, can_correct=False) == (None, "unverified")  # another consumer
    assert verification.figures()["borrowed_edges"] == 2
    assert verification.audit_due(nearer) and not verification.audit_due(nearer)  # its first reuse is audited
    # once the edge has a verdict of its own, that verdict decides: a disagreement stops the borrowing
    verification.record(nearer, [Verdict("raw", False, 0.9, 8)], audit=True)
    assert verification.decide(nearer, can_correct=False) == (None, "unverified")


def test_a_fault_while_finding_spans_is_counted_and_the_call_runs_unsplit(monkeypatch):
    rt = Runtime(make_engine("tiny-llama", pool_blocks=2048), strategy="kvcmas",
                 config=RuntimeConfig(self_check=False, learn="after_call"))

    def broken(*args, **kwargs):
        raise RuntimeError("index corrupted")

    monkeypatch.setattr(SegmentStore, "spans", broken)
    reader, checker = inline_team(rt, "s0", text_of_length(rt.engine, 80, seed=3))
    assert [s.name for s in checker.segments if s.kind == "ph"] == ["query"] and checker.token_ids
    assert rt.summary()["faults"]["span_error"] == 2  # each call that looked, the reader's and the checker's


def test_removing_a_spans_source_removes_the_entry_it_was_cut_from():
    store = SegmentStore(byte_budget=1 << 30)
    shape = (2, 1, 152, 4)  # (L, H, T, D)
    document = tokens(100, 150)
    entry = store.put(SCOPE, "query", "reader", [1, 2, *document], SegmentKV(torch.zeros(shape), torch.zeros(shape), 0),
                      "dense")
    from agentcache.correction.sourced import span_source

    span = span_source(entry, 2, 150)
    assert span.slot == "query@span" and span.token_ids == tuple(document) and span.kv.start == 2 and not span.exact
    store.remove(span.entry_id)  # a refused or unsound span source: its entry stops being offered
    assert len(store) == 0 and store.spans(SCOPE, [9, 9, *document]) == []

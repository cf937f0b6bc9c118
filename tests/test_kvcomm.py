"""The `kvcomm` strategy follows KVCOMM's reference procedure (`correction.kvcomm`): one test per
point where it differs from agentcache's own construction (`kvcomm_canonical`), on a real tiny
model and its real KV."""

from __future__ import annotations

import pytest
import torch

import agentcache.correction.kvcomm as kvcomm
from agentcache.correction.anchors import AnchorBank, Correction
from agentcache.correction.lowrank import Factors, as_rows
from agentcache.correction.strategies import STRATEGIES
from agentcache.engine.protocol import ExecRequest, SamplingParams, SegmentPlan, Step
from agentcache.isolation import Scope, tenant_salt
from agentcache.runtime import Runtime, RuntimeConfig
from agentcache.segments import AgentCall, Segment
from tests.conftest import text_of_length

SYSTEMS = {
    "planner": "You plan the trip step by step.\n\nQuestion:",
    "critic": "You look for mistakes in every plan you read, and you say where they are.\n\nQuestion:",
}
GLUE = "\nNotes for the team:"
ONE = SamplingParams(max_tokens=1)
SCOPE = Scope(None, None)


@pytest.fixture
def kvcomm_runtime(new_engine):
    """A factory of `kvcomm` runtimes, each on a fresh tiny engine of the test's kind (every test that
    takes it runs on every engine kind); the gate is open (τ = 1) unless asked, so the tests do not
    depend on random-weight entropies."""

    def build(tau: float = 1.0, **changes) -> Runtime:
        strategy = STRATEGIES["kvcomm"].replace(tau=tau, **changes)
        return Runtime(new_engine("tiny-llama", pool_blocks=512), strategy=strategy,
                       config=RuntimeConfig(self_check=False, keep_kv=True, learn="after_call"))

    return build


def call(agent: str, query: str) -> AgentCall:
    return AgentCall(agent=agent, segments=(Segment.pf(SYSTEMS[agent]), Segment.ph("query", query), Segment.pf(GLUE)))


def round_of(rt: Runtime, query: str) -> list:
    return [rt.run(call(agent, query), ONE) for agent in SYSTEMS]


def ph(result):
    return next(s for s in result.segments if s.kind == "ph")


def warm(rt: Runtime, words: int = 40, rounds: int = 2) -> None:
    """Two long queries: each becomes an anchor (fewer than two anchors cover it) that both agents learn."""
    for seed in range(rounds):
        for result in round_of(rt, text_of_length(rt.engine, words, seed=100 + seed)):
            assert ph(result).decision == "fallback" and ph(result).reason == "few_anchors"


class CountingGate:
    """Wraps `gate_distances` to count gate evaluations and how many anchors each compared."""

    def __init__(self, monkeypatch) -> None:
        self.compared: list[int] = []
        original = kvcomm.gate_distances

        def counted(values, anchors, length):
            self.compared.append(len(anchors))
            return original(values, anchors, length)

        monkeypatch.setattr(kvcomm, "gate_distances", counted)


def test_the_gate_runs_once_per_segment_and_every_consumer_follows_it(kvcomm_runtime, monkeypatch):
    rt = kvcomm_runtime()
    warm(rt)
    gate = CountingGate(monkeypatch)
    results = round_of(rt, text_of_length(rt.engine, 30, seed=7))
    assert gate.compared == [2]  # one evaluation for the segment, not one per consumer
    assert [ph(r).decision for r in results] == ["corrected", "corrected"]
    assert len(rt.corrector.verdicts) == 3


def test_a_rejected_segment_sends_every_consumer_to_a_dense_prefill_that_teaches_its_anchor(
        kvcomm_runtime, monkeypatch):
    rt = kvcomm_runtime(tau=0.3)
    warm(rt)
    monkeypatch.setattr(kvcomm, "normalized_entropy", lambda weights: 0.9)  # above τ: the segment becomes an anchor
    query = text_of_length(rt.engine, 30, seed=7)
    results = round_of(rt, query)
    for result in results:
        assert (ph(result).decision, ph(result).reason) == ("fallback", "gate")
        assert result.reused_tokens == 0 and all(s.injected_tokens == 0 for s in result.segments)
    source = next(v for v in rt.corrector.store if v.agent == "<reference>" and v.token_ids == tuple(rt.engine.tokenize(query)))
    anchor = rt.corrector.bank.anchor((None, "query"), source.id)
    assert anchor is not None and set(anchor.corrections) == set(SYSTEMS)


def test_only_anchors_covering_the_whole_segment_qualify(kvcomm_runtime, monkeypatch):
    rt = kvcomm_runtime()
    warm(rt)
    for result in round_of(rt, text_of_length(rt.engine, 8, seed=50)):  # a short query: anchors cover it, gate passes
        assert ph(result).decision == "corrected"
    for result in round_of(rt, text_of_length(rt.engine, 80, seed=51)):  # longer than every anchor
        assert (ph(result).decision, ph(result).reason) == ("fallback", "few_anchors")
    pool = rt.corrector.bank.pools[(None, "query")]
    long_query = text_of_length(rt.engine, 60, seed=52)  # covered only by the 80-word anchor
    gate = CountingGate(monkeypatch)
    results = round_of(rt, long_query)
    assert gate.compared == [] and [ph(r).reason for r in results] == ["few_anchors"] * 2
    assert len(pool) == 4  # the two warm-up anchors, the 80-word one and now this one
    results = round_of(rt, text_of_length(rt.engine, 30, seed=53))
    assert gate.compared == [4]  # the short 8-word query never became an anchor; all four cover 30 words


def test_correction_weights_one_per_token_shared_by_all_layers_layer_0_included():
    tokens, features = 3, 4
    real = torch.zeros(3, tokens, features)  # (L, T, F)
    near_but_layer_0 = real.clone()
    near_but_layer_0[0, 1] = 2.0  # differs from the real cache only at layer 0, token 1
    far = real + 0.5
    weights = kvcomm.token_weights(real, [near_but_layer_0, far])
    assert weights.shape == (2, tokens)
    assert weights[0, 0] > weights[1, 0] and weights[0, 2] > weights[1, 2]
    assert weights[0, 1] < weights[1, 1]  # layer 0 alone turned token 1 toward the other anchor
    assert torch.allclose(weights.sum(dim=0), torch.ones(tokens))


def test_a_reuse_adds_unrotated_position_stored_corrections_to_the_placed_source(kvcomm_runtime):
    rt = kvcomm_runtime()
    warm(rt)
    engine = rt.engine
    query = text_of_length(engine, 30, seed=7)
    tokens = engine.tokenize(query)
    start = len(engine.tokenize(SYSTEMS["critic"], bos=True))
    lead_in = kvcomm.header_lead_in(engine, engine.tokenize(SYSTEMS["critic"], bos=True))
    decision = rt.corrector.plan(SCOPE, "critic", "query", tokens, None, start=start, lead_in=lead_in)
    assert decision.decision == "corrected" and len(decision.detail.anchors) == 2
    placed = engine.realign(decision.source.kv.slice(0, len(tokens)), start)
    for part in ("keys", "values"):
        real = as_rows(getattr(placed, part)).float()  # (L, T, F)
        bases = [getattr(a, part).rows() for a in decision.detail.anchors]
        distance = torch.stack([(real - b[:, :len(tokens)]).abs().mean(dim=(0, 2)) for b in bases])  # (2, T)
        weights = torch.softmax(-distance, dim=0)
        expected = real.clone()
        for w, anchor in zip(weights, decision.detail.anchors):
            expected[1:] += w[None, :, None] * getattr(anchor.corrections["critic"], part).rows(len(tokens))
        got = as_rows(getattr(decision.inject, part)).float()
        assert torch.allclose(got[0], real[0], atol=1e-5)  # layer 0: the placed source, uncorrected
        assert torch.allclose(got, expected.to(got.dtype).float(), atol=1e-5)
    # Each anchor's base is its source where its first learner (the planner) read it, not at position 0.
    planner_start = len(engine.tokenize(SYSTEMS["planner"], bos=True))
    for anchor in decision.detail.anchors:
        source = next(v for v in rt.corrector.store if v.id == anchor.source_id)
        at_planner = engine.realign(source.kv.slice(0, anchor.length), planner_start)
        assert torch.allclose(anchor.keys.rows(), as_rows(at_planner.keys).float(), atol=1e-5)
        at_zero = engine.realign(source.kv.slice(0, anchor.length), 0)
        assert not torch.allclose(anchor.keys.rows(), as_rows(at_zero.keys).float(), atol=1e-3)


def test_a_reused_call_prefills_only_its_last_token_the_template_text_corrected(kvcomm_runtime):
    rt = kvcomm_runtime()
    warm(rt)
    engine = rt.engine
    result = rt.run(call("critic", text_of_length(engine, 30, seed=7)), ONE)
    system, query, glue = result.segments
    glue_tokens = engine.tokenize(GLUE)
    assert query.decision == "corrected" and glue.decision == "corrected"
    assert (glue.injected_tokens, glue.computed_tokens) == (len(glue_tokens) - 1, 1)
    assert query.prefill_tokens == 0 and glue.prefill_tokens == 1  # the system prompt is a prefix hit
    # The template text's KV: its template prefill (the query replaced by "{query}") placed where it
    # sits, plus the anchors' observed template corrections weighted per layer and channel.
    template = engine.execute(ExecRequest(
        [SegmentPlan("pf0", engine.tokenize(SYSTEMS["critic"], bos=True), Step.PREFIX),
         SegmentPlan("ph1", engine.tokenize("{query}"), Step.PREFIX), SegmentPlan("pf2", glue_tokens, Step.PREFIX)],
        ONE, owner="test", internal=True)).segments[2].kv
    placed = engine.realign(template, glue.start)
    dense_glue = result.segment_kv[2]
    uncorrected = as_rows(placed.keys).float()[1:, : len(glue_tokens) - 1]
    got = as_rows(dense_glue.keys).float()[1:, : len(glue_tokens) - 1]
    assert not torch.allclose(got, uncorrected, atol=1e-4)  # the anchors' template corrections were added
    pool = rt.corrector.bank.pools[(None, "query")]
    for anchor in pool.anchors.values():
        assert anchor.corrections["critic"].glue_tokens == tuple(glue_tokens)
        assert anchor.corrections["critic"].glue_keys.rows().shape[1] == len(glue_tokens)


def test_template_text_no_anchor_saw_is_prefilled_and_the_segment_still_reused(kvcomm_runtime):
    rt = kvcomm_runtime()
    warm(rt)
    query = text_of_length(rt.engine, 30, seed=7)
    changed = AgentCall(agent="critic", segments=(Segment.pf(SYSTEMS["critic"]), Segment.ph("query", query),
                                                   Segment.pf("\nSomething the anchors never saw:")))
    result = rt.run(changed, ONE)
    assert result.segments[1].decision == "corrected" and result.segments[2].decision != "corrected"
    assert result.segments[2].injected_tokens == 0


def test_glue_weights_are_per_layer_and_channel_from_the_last_tokens():
    real = torch.zeros(2, 2, 3)  # (L, T, F)
    near = torch.zeros(2, 5, 3)
    near[:, :3] = 9.0  # differs only before its last two tokens: those do not count
    far = torch.zeros(2, 5, 3)
    far[1, -1, 2] = 1.0  # differs at layer 1, channel 2 of its last token
    weights = kvcomm.channel_weights(real, [near, far])
    assert weights.shape == (2, 2, 3)
    assert torch.allclose(weights[:, 0], torch.full((2, 3), 0.5))
    assert weights[0, 1, 2] > weights[1, 1, 2] and torch.allclose(weights[:, 1, :2], torch.full((2, 2), 0.5))


def test_the_reference_prefill_leads_with_the_prompts_own_line_before_the_segment(kvcomm_runtime):
    rt = kvcomm_runtime()
    engine = rt.engine
    preceding = engine.tokenize(SYSTEMS["critic"], bos=True)
    lead = kvcomm.header_lead_in(engine, preceding)
    assert lead == [engine.bos_token_id] + engine.tokenize("Question:")[-kvcomm.HEADER_TOKENS:]
    assert len(lead) == 1 + min(kvcomm.HEADER_TOKENS, len(engine.tokenize("Question:")))
    query = text_of_length(engine, 20, seed=3)
    rt.run(call("critic", query), ONE)
    reference = next(v for v in rt.corrector.store if v.agent == "<reference>")
    expected = engine.execute(ExecRequest([SegmentPlan("lead", lead, Step.PREFIX),
                                           SegmentPlan("q", engine.tokenize(query), Step.PREFIX)],
                                          ONE, owner="test", internal=True)).segments[1].kv
    assert torch.allclose(reference.kv.keys.float(), expected.keys.float(), atol=1e-5)


def test_a_passed_gate_credits_the_anchors_holding_90_percent_of_its_weight():
    assert kvcomm.credited(torch.tensor([0.15, 0.5, 0.05, 0.3])) == [1, 3]  # cumulative 0.5, 0.8 < 0.9
    assert kvcomm.credited(torch.tensor([0.95, 0.05])) == [0, 1]  # the heaviest alone reaches it: all of them


def test_passed_gates_credit_uses_once_per_segment(kvcomm_runtime, monkeypatch):
    rt = kvcomm_runtime()
    warm(rt)
    pool = rt.corrector.bank.pools[(None, "query")]
    before = {a.source_id: a.uses for a in pool.anchors.values()}
    monkeypatch.setattr(kvcomm, "credited", lambda weights: [1])  # the second of the gate's anchors alone
    round_of(rt, text_of_length(rt.engine, 30, seed=7))
    gained = [a.uses - before[a.source_id] for a in pool.anchors.values() if a.source_id in before]
    assert gained == [0, 1]  # credited once for the segment, not again per consumer


@pytest.mark.parametrize("name, held", [("kvcomm", 21), ("kvcomm_canonical", 20)])
def test_kvcomm_pools_evict_only_above_20_anchors(name, held):
    bank = AnchorBank(STRATEGIES[name].max_anchors, 1 << 30)
    base = Factors(torch.zeros(2, 3, 4), None)
    for i in range(25):
        bank.add("query", f"s{i}", "<reference>", base, base, "a", Correction(Factors(torch.zeros(1, 3, 4), None),
                                                                                Factors(torch.zeros(1, 3, 4), None)))
    assert len(bank.pools["query"]) == held


def test_setup_time_is_reported_so_ttft_can_be_read_both_ways(kvcomm_runtime):
    rt = kvcomm_runtime()
    first = rt.run(call("critic", text_of_length(rt.engine, 20, seed=3)), ONE)
    setup = sum(s.setup_s for s in first.segments)
    assert 0 < setup < first.ttft_s  # the reference prefill, inside the TTFT
    assert setup <= sum(s.plan_s for s in first.segments)


def test_template_prefills_stay_in_their_tenants_namespace(kvcomm_runtime):
    """The template prefill holds the tenant's prompt text: exact, but cached for that tenant only,
    and one tenant's templates are never served to another."""
    rt = kvcomm_runtime()
    engine = rt.engine

    def tenant_round(query: str, tenant: str) -> list:
        return [rt.run(AgentCall(agent=agent, tenant=tenant, segments=call(agent, query).segments), ONE)
                for agent in SYSTEMS]

    for seed in range(2):
        tenant_round(text_of_length(engine, 40, seed=100 + seed), "acme")
    results = tenant_round(text_of_length(engine, 30, seed=7), "acme")
    assert results[1].segments[2].decision == "corrected"  # the template was made and used
    template = engine.tokenize(SYSTEMS["critic"], bos=True) + engine.tokenize("{query}")
    assert engine.cached_prefix_length(template, cache_salt=tenant_salt("acme")) > 0
    assert engine.cached_prefix_length(template) == 0
    assert {key[0] for key in rt.corrector.templates} == {"acme"}

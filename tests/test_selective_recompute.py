"""Selective recomputation (CacheBlend token-wise, DroidSpeak layer-wise) on the embedded engine.

The engine part is checked against dense prefill and HF's own hidden states; the strategies
against the runtime's figures.
"""

from __future__ import annotations

import pytest
import torch

from agentcache.correction.selective import LayerProfile, layer_count
from agentcache.correction.strategies import STRATEGIES
from agentcache.engine.kv import SegmentKV
from agentcache.engine.protocol import (
    ExecRequest,
    LayerRecompute,
    SamplingParams,
    SegmentPlan,
    Step,
    TokenRecompute,
)
from agentcache.errors import InputError, KVShapeError, PlanError
from agentcache.isolation import Scope
from agentcache.runtime import Runtime, RuntimeConfig
from agentcache.tasks import FourAgentWorkflow, fact_problem
from tests.conftest import make_engine, text_of_length

NO_CHECK = RuntimeConfig(self_check=False, learn="after_call")


def _prompt(engine, seed: int = 0):
    pre = engine.tokenize("You are the planner. Think step by step.", bos=True)
    other = engine.tokenize("You are a critic; be terse and exact.", bos=True)
    shared = engine.tokenize(" " + text_of_length(engine, 60, seed=seed))
    glue = engine.tokenize(" Answer:")
    return pre, other, shared, glue


def _run(engine, pre, shared, glue, step=Step.PREFIX, kv=None, recompute=None, hidden_layer=None, max_tokens=4):
    segments = [SegmentPlan("pf", pre), SegmentPlan("ph", shared, step, kv, recompute=recompute), SegmentPlan("g", glue)]
    return engine.fresh().execute(ExecRequest(segments, SamplingParams(max_tokens=max_tokens), hidden_layer=hidden_layer))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _source(engine, other, shared, glue, hidden_layer=None):
    """The shared segment as another agent computed it, moved to canonical positions."""
    result = _run(engine, other, shared, glue, hidden_layer=hidden_layer)
    return result, engine.realign(result.segments[1].kv, 0)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-gemma3", "gemma3-270m"])
def test_recomputing_every_token_or_every_layer_gives_dense_prefill(preset):
    engine = make_engine(preset, pool_blocks=512)
    pre, other, shared, glue = _prompt(engine)
    dense = _run(engine, pre, shared, glue)
    want = dense.segments[1].kv
    source, aligned = _source(engine, other, shared, glue, hidden_layer=0)
    reused = _run(engine, pre, shared, glue, Step.INJECT, aligned)
    assert _rel(reused.segments[1].kv.keys[1:], want.keys[1:]) > 1e-3  # the source is another context's
    blended = _run(engine, pre, shared, glue, Step.INJECT, aligned, TokenRecompute(1.0))
    layered = _run(engine, pre, shared, glue, Step.INJECT, aligned,
                   LayerRecompute(0, engine.layout.num_layers - 1, source.segments[1].hidden))
    for got in (blended, layered):
        kv = got.segments[1].kv
        assert _rel(kv.keys, want.keys) < 1e-4 and _rel(kv.values, want.values) < 1e-4
        assert got.token_ids == dense.token_ids
        assert got.segments[1].recomputed_tokens == pytest.approx(len(shared) - 0)
    assert blended.segments[1].probe_tokens == pytest.approx(len(shared) * 2 / engine.layout.num_layers)


def test_cacheblend_picks_the_most_deviating_tokens_and_they_come_back_exact(tiny_engine):
    engine = tiny_engine
    pre, _, shared, glue = _prompt(engine, seed=3)
    dense = _run(engine, pre, shared, glue)
    want = dense.segments[1].kv
    broken = [4, 17, 30]
    keys, values = want.keys.clone(), want.values.clone()
    keys[:, :, broken] += 3.0  # every layer of three tokens: the largest KV deviation at layer 1
    values[:, :, broken] -= 3.0
    injected = SegmentKV(keys, values, want.start)
    got = _run(engine, pre, shared, glue, Step.INJECT, injected, TokenRecompute(len(broken) / len(shared)))
    kv = got.segments[1].kv
    assert got.segments[1].recomputed_tokens == len(broken)
    assert _rel(kv.keys, want.keys) < 1e-4 and _rel(kv.values, want.values) < 1e-4
    assert got.token_ids == dense.token_ids
    fewer = _run(engine, pre, shared, glue, Step.INJECT, injected, TokenRecompute(1 / len(shared)))
    assert _rel(fewer.segments[1].kv.keys, want.keys) > 1e-3  # two broken tokens were left as they were


def test_cacheblend_probe_makes_the_first_layers_exact_and_keeps_unpicked_tokens_reused(tiny_engine):
    engine = tiny_engine
    pre, other, shared, glue = _prompt(engine, seed=5)
    want = _run(engine, pre, shared, glue).segments[1].kv
    _, aligned = _source(engine, other, shared, glue)
    got = _run(engine, pre, shared, glue, Step.INJECT, aligned, TokenRecompute(0.0)).segments[1].kv
    assert _rel(got.keys[:2], want.keys[:2]) < 1e-4  # layers 0..probe ran for every token
    placed = engine.realign(aligned, want.start)
    assert torch.equal(got.keys[2:], placed.keys[2:]) and torch.equal(got.values[2:], placed.values[2:])


def test_droidspeak_rebuilds_only_its_layer_group(tiny_engine):
    engine = tiny_engine
    pre, _, shared, glue = _prompt(engine, seed=7)
    dense = _run(engine, pre, shared, glue, hidden_layer=1)
    want = dense.segments[1].kv
    keys, values = want.keys.clone(), want.values.clone()
    keys[1:] += 0.5  # every layer but 0 is off
    values[1:] += 0.5
    injected = SegmentKV(keys, values, want.start)
    got = _run(engine, pre, shared, glue, Step.INJECT, injected, LayerRecompute(1, 1, dense.segments[1].hidden))
    kv = got.segments[1].kv
    assert _rel(kv.keys[1], want.keys[1]) < 1e-4 and _rel(kv.values[1], want.values[1]) < 1e-4  # rebuilt
    assert torch.equal(kv.keys[2:], keys[2:])  # the other layers keep what was injected
    assert got.segments[1].recomputed_tokens == pytest.approx(len(shared) / engine.layout.num_layers)


def test_hidden_states_handed_back_are_the_models_own(tiny_engine):
    engine = tiny_engine
    pre, _, shared, glue = _prompt(engine, seed=9)
    layer = 1
    result = _run(engine, pre, shared, glue, hidden_layer=layer, max_tokens=5)
    prompt = pre + shared + glue
    full = prompt + result.token_ids[:-1]
    with torch.inference_mode():
        states = engine.model(input_ids=torch.tensor([full]), output_hidden_states=True).hidden_states
    expected = states[layer][0].float()  # (T, hidden): the input of decoder layer `layer`
    start, end = len(pre), len(pre) + len(shared)
    assert torch.allclose(result.segments[1].hidden, expected[start:end], atol=1e-4)
    assert torch.allclose(result.generated_hidden, expected[len(prompt):], atol=1e-4)


def test_hidden_states_of_prefix_hits_are_unknown_and_those_tokens_are_prefilled(tiny_engine):
    engine = tiny_engine.fresh()
    pre, _, shared, glue = _prompt(engine, seed=11)
    segments = [SegmentPlan("pf", pre), SegmentPlan("ph", shared), SegmentPlan("g", glue)]
    dense = engine.execute(ExecRequest(segments, SamplingParams(max_tokens=2)))
    again = engine.execute(ExecRequest(segments, SamplingParams(max_tokens=2), hidden_layer=0))
    hidden, hit = again.segments[1].hidden, again.cached_tokens - len(pre)  # the hit reaches into the segment
    assert 0 < hit < len(shared)
    assert torch.isnan(hidden[:hit]).all() and torch.isfinite(hidden[hit:]).all()
    want = dense.segments[1].kv
    off = SegmentKV(want.keys + 0.5, want.values + 0.5, want.start)
    got = _run(engine, pre, shared, glue, Step.INJECT, off, LayerRecompute(0, engine.layout.num_layers - 1, hidden))
    assert _rel(got.segments[1].kv.keys, want.keys) < 1e-4  # the unknown rows' tokens were prefilled
    assert got.segments[1].recomputed_tokens == pytest.approx(len(shared))


def test_bad_recompute_requests_are_refused_and_the_engine_goes_on(tiny_engine):
    engine = tiny_engine
    pre, _, shared, glue = _prompt(engine)
    want = _run(engine, pre, shared, glue).segments[1].kv
    width = engine.hidden_size
    with pytest.raises(PlanError, match="fraction"):
        TokenRecompute(1.5)
    with pytest.raises(PlanError, match="rows"):
        SegmentPlan("ph", shared, Step.INJECT, want, recompute=LayerRecompute(0, 1, torch.zeros(3, width)))
    with pytest.raises(PlanError, match="only an injected"):
        SegmentPlan("ph", shared, recompute=TokenRecompute(0.5))
    with pytest.raises(PlanError, match="past"):
        _run(engine, pre, shared, glue, Step.INJECT, want,
             LayerRecompute(0, engine.layout.num_layers, torch.zeros(len(shared), width)))
    middle_unknown = torch.zeros(len(shared), width)
    middle_unknown[5] = float("nan")
    with pytest.raises(KVShapeError, match="leading"):
        _run(engine, pre, shared, glue, Step.INJECT, want, LayerRecompute(0, 1, middle_unknown))
    with pytest.raises(PlanError, match="hidden_layer"):
        _run(engine, pre, shared, glue, hidden_layer=engine.layout.num_layers)
    assert _run(engine, pre, shared, glue).token_ids  # still serving


def test_layer_profile_picks_the_group_that_deviates_most():
    profile = LayerProfile(num_layers=6, needed=1)
    dense = SegmentKV(torch.ones(6, 1, 4, 2), torch.ones(6, 1, 4, 2), 0)
    off = torch.tensor([0.0, 0.1, 0.9, 0.8, 0.2, 0.1])[:, None, None, None]
    assert not profile.ready
    profile.observe(SegmentKV(dense.keys + off, dense.values + off, 0), dense)
    assert profile.ready and profile.group(2) == (2, 3) and profile.group(1) == (2, 2)
    assert layer_count(0.8, 18) == 4 and layer_count(0.9, 18) == 2 and layer_count(1.0, 18) == 0


@pytest.mark.parametrize("name", ["cacheblend", "droidspeak"])
def test_selective_strategies_reuse_their_share_and_beat_fullshared_on_gemma(gemma_engine, name):
    """On the real model, over the four-agent workflow: the reuse ratio is what ρ asks (DroidSpeak
    in whole layers) and the reused KV is closer to dense prefill than FullShared's."""
    workflow = FourAgentWorkflow(role_tokens=4, final_tokens=4)
    runs = {n: Runtime(gemma_engine.fresh(), strategy=n, config=RuntimeConfig(self_check=False, keep_kv=True))
            for n in (name, "fullshared", "nonshared")}
    for seed in (200, 201):  # DroidSpeak profiles its layers on the first transitions
        workflow.run(runs[name].run, fact_problem(seed, records=4))
    problem = fact_problem(3, records=4)
    got = {n: workflow.run(rt.run, problem) for n, rt in runs.items()}
    dense = {(r.agent, tuple(r.prompt_ids)): r for r in got["nonshared"]}
    errors = {}
    for n in (name, "fullshared"):
        pairs = [(r, dense[(r.agent, tuple(r.prompt_ids))]) for r in got[n][1:3]]
        errors[n] = sum(_rel(r.segment_kv[1].keys[1:], d.segment_kv[1].keys[1:]) for r, d in pairs)
    assert errors[name] < errors["fullshared"]
    strategy = STRATEGIES[name]
    reused = [s for r in got[name] for s in r.segments if s.decision == "recomputed"]
    assert reused
    layers = gemma_engine.layout.num_layers
    share = 1 - (layer_count(strategy.rho, layers) / layers if name == "droidspeak" else 1 - strategy.rho)
    for seg in reused:  # CacheBlend picks whole tokens: round((1 − ρ) · n) of each segment's n
        rebuilt = (1 - share) * seg.injected_tokens
        assert seg.recomputed_tokens == pytest.approx(round(rebuilt) if name == "cacheblend" else rebuilt)
    kept = sum(s.injected_tokens - s.recomputed_tokens for s in reused) / sum(s.injected_tokens for s in reused)
    assert kept == pytest.approx(share, abs=0.03)
    assert runs[name].summary()["faults"] == {}


def test_selective_strategies_are_refused_on_an_engine_that_cannot_recompute(tiny_engine):
    class NoRecompute(type(tiny_engine)):
        @property
        def supports_recompute(self) -> bool:
            return False

    engine = NoRecompute(tiny_engine.loaded)
    with pytest.raises(InputError, match="cannot do"):
        Runtime(engine, strategy="cacheblend", config=NO_CHECK)
    pre = _prompt(engine)[0]
    with pytest.raises(PlanError, match="EmbeddedEngine"):
        engine.execute(ExecRequest([SegmentPlan("pf", pre)], hidden_layer=0))
    assert Runtime(engine, strategy="kvcmas", config=NO_CHECK).corrector.hidden_layer(Scope(None, None)) is None

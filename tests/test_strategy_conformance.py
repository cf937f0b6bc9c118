"""One conformance suite for every registered shared-context strategy (`correction.STRATEGIES`,
each run by its class from `correction.STRATEGY_KINDS`), on a real engine. Each contract is
judged on what the calls served, never on the strategy's own state:

- `exact first`: a workflow's first agent is served exactly what NonShared serves it;
- `fault`: a fault while planning (a source lookup that raises) falls back to dense prefill, gives
  NonShared's output, and is counted once per segment it touched;
- `isolation`: another tenant's first call on the same text reuses nothing of this tenant's;
- `named`: every fallback names its reason, and a strategy without a gate refuses calibration by name;
- `exact blocks`: after a strategy ran its workflows, the blocks the engine serves as exact
  prefix hits hold the KV a fresh dense prefill computes.
The last section runs the checks against broken strategies and expects each to fail.
"""

from __future__ import annotations

import pytest
import torch

from agentcache.correction import STRATEGY_KINDS, FullShared, KVCMAS
from agentcache.correction.strategies import KINDS, STRATEGIES
from agentcache.correction.sources import SourceFinder
from agentcache.engine import SamplingParams
from agentcache.errors import InputError
from agentcache.runtime import Runtime, RuntimeConfig
from agentcache.segments import AgentCall, Segment
from tests.conftest import make_engine, text_of_length

ROLES = {
    "planner": "You plan the trip step by step.\n",
    "critic": "You look for mistakes in every plan you read.\n",
    "writer": "You write the final answer for the traveller.\n",
}
GREEDY = SamplingParams(max_tokens=3)
CONFIG = RuntimeConfig(self_check=False, keep_kv=True, learn="after_call")
KNOWN_REASONS = {"not_worth", "no_source", "own_prefill", "not_realignable", "unverified", "few_anchors",
                 "bad_source", "bad_anchor", "nonfinite", "gate", "budget", "error", "prefix_covers_source",
                 "engine_recomputed", "engine_rejected", "profiling", "no_hidden_states", "call_dense", "no_anchor"}


def role_call(agent: str, query: str, tenant: str | None = None) -> AgentCall:
    return AgentCall(agent=agent, tenant=tenant,
                     segments=(Segment.pf(ROLES[agent]), Segment.ph("query", query), Segment.pf("\nNotes:")))


def workflow(rt: Runtime, query: str, tenant: str | None = None) -> list:
    return [rt.run(role_call(agent, query, tenant), GREEDY) for agent in ROLES]


def runtime(strategy: str, engine=None) -> Runtime:
    return Runtime(engine or make_engine("tiny-llama", pool_blocks=512), strategy=strategy, config=CONFIG)


def dense_tokens(engine, call: AgentCall) -> list[int]:
    """What NonShared generates for `call` on a fresh copy of `engine`."""
    return list(runtime("nonshared", engine.fresh()).run(call, GREEDY).token_ids)


# --- the checks ------------------------------------------------------------------------------------------


def check_exact_first(strategy: str) -> None:
    rt = runtime(strategy)
    for seed in range(2):  # a second workflow: the pools hold what the first taught
        query = text_of_length(rt.engine, 40, seed=seed)
        first = workflow(rt, query)[0]
        assert first.reused_tokens == 0, f"{strategy}: the first agent was served reused KV"
        assert list(first.token_ids) == dense_tokens(rt.engine, role_call("planner", query)), \
            f"{strategy}: the first agent's output differs from NonShared's"


def check_fault(strategy: str, monkeypatch) -> None:
    rt = runtime(strategy)
    query = text_of_length(rt.engine, 40, seed=3)
    rt.run(role_call("planner", query), GREEDY)  # the source of the next call

    def broken(*args, **kwargs):
        raise RuntimeError("a source table that went missing")

    before = dict(rt.summary()["faults"])
    with monkeypatch.context() as patch:
        patch.setattr(SourceFinder, "find", broken)
        result = rt.run(role_call("critic", query), GREEDY)
    faults = rt.summary()["faults"]
    assert result.reused_tokens == 0, f"{strategy}: a faulty plan served reused KV"
    assert list(result.token_ids) == dense_tokens(rt.engine, role_call("critic", query))
    if rt.strategy.reuse:  # NonShared never looks a source up: nothing to fault
        assert faults.get("plan_error", 0) - before.get("plan_error", 0) == 1, f"{strategy}: fault not counted once"
        assert result.segments[1].decision == "fallback" and result.segments[1].reason == "error"
    rt.run(role_call("writer", query), GREEDY)  # the runtime stays usable


def check_isolation(strategy: str) -> None:
    rt = runtime(strategy)
    query = text_of_length(rt.engine, 40, seed=4)
    for _ in range(2):
        workflow(rt, query, tenant="acme")
    theirs = rt.run(role_call("critic", query, tenant="globex"), GREEDY)
    assert theirs.reused_tokens == 0 and all(s.source in (None, "<reference>") for s in theirs.segments), \
        f"{strategy}: another tenant's call reused this tenant's KV"
    assert list(theirs.token_ids) == dense_tokens(rt.engine, role_call("critic", query, tenant="globex"))


def check_named(strategy: str) -> None:
    rt = runtime(strategy)
    for seed in range(2):
        for result in workflow(rt, text_of_length(rt.engine, 40, seed=10 + seed)):
            for segment in result.segments:
                if segment.decision == "fallback":
                    assert segment.reason in KNOWN_REASONS, f"{strategy}: fallback reason {segment.reason!r}"
    if not rt.strategy.correct:
        with pytest.raises(InputError, match="calibrate|gate"):
            rt.calibrate_gate(0.5)


def check_exact_blocks(strategy: str) -> None:
    engine = make_engine("tiny-llama", pool_blocks=512)
    rt = runtime(strategy, engine)
    queries = [text_of_length(engine, 40, seed=20 + i) for i in range(4)]  # enough for most gates to open
    for query in queries:
        workflow(rt, query)
    reader = runtime("nonshared", engine)  # another runtime on the same engine: exact blocks only
    fresh = runtime("nonshared", engine.fresh())
    checked = 0
    for query in queries:
        for agent in ROLES:
            served, want = reader.run(role_call(agent, query), GREEDY), fresh.run(role_call(agent, query), GREEDY)
            hits = sum(s.cached_tokens for s in served.segments)
            checked += hits
            for got_kv, want_kv in zip(served.segment_kv, want.segment_kv):
                if got_kv is not None and want_kv is not None:
                    tolerance = 1e-4 * want_kv.keys.abs().max().item() + 1e-5
                    assert torch.allclose(got_kv.keys, want_kv.keys, atol=tolerance), \
                        f"{strategy}: a prefix hit served keys no dense prefill computes"
                    assert torch.allclose(got_kv.values, want_kv.values, atol=tolerance), \
                        f"{strategy}: a prefix hit served values no dense prefill computes"
    assert checked > 0  # the reader was served prefix hits: the check compared cached blocks


# --- every registered strategy -----------------------------------------------------------------------------


def test_every_kind_has_a_class_and_every_strategy_a_kind():
    assert set(STRATEGY_KINDS) == set(KINDS)
    assert {s.kind for s in STRATEGIES.values()} == set(KINDS)


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_the_first_agent_is_exact(strategy):
    check_exact_first(strategy)


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_a_fault_falls_back_dense_and_is_counted(strategy, monkeypatch):
    check_fault(strategy, monkeypatch)


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_isolation_holds(strategy):
    check_isolation(strategy)


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_refusals_are_named(strategy):
    check_named(strategy)


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_no_strategy_changes_an_exact_prefix_block(strategy):
    check_exact_blocks(strategy)


# --- the suite fails broken strategies --------------------------------------------------------------------


class ReusesOnFirstRead(FullShared):
    """Broken: a segment with no source yet is served zeros instead of being prefilled."""

    def decide(self, scope, agent, slot, token_ids, source_agent, start=0, lead_in=None, after=0, origin=None):
        decision = super().decide(scope, agent, slot, token_ids, source_agent, start, lead_in, after, origin)
        if decision.decision != "first":
            return decision
        from agentcache.correction.plan import PHDecision
        from agentcache.engine.kv import SegmentKV

        layout = self.engine.layout
        shape = (layout.num_layers, layout.num_kv_heads, len(token_ids), layout.head_dim)
        zeros = torch.zeros(shape, dtype=layout.dtype, device=layout.device)
        return PHDecision("reused", covered=len(token_ids), inject=SegmentKV(zeros, zeros.clone(), 0))


class SilentFaults(FullShared):
    """Broken: a fault while planning is swallowed, neither counted nor logged."""

    def fault(self, kind, what, exc=None):
        pass


class ReadsEveryTenant(FullShared):
    """Broken: sources are looked up in the default tenant's scope, whoever calls."""

    def decide(self, scope, agent, slot, token_ids, source_agent, start=0, lead_in=None, after=0, origin=None):
        from agentcache.isolation import Scope

        found = self.store.find(Scope("acme", scope.session), slot, token_ids)
        if found is not None and scope.tenant != "acme":
            from agentcache.correction.sourced import raw_reuse

            return raw_reuse(found[0], found[1])
        return super().decide(scope, agent, slot, token_ids, source_agent, start, lead_in, after)


class UnnamedFallbacks(KVCMAS):
    """Broken: a fallback says nothing of why."""

    def decide(self, *args, **kwargs):
        from dataclasses import replace

        decision = super().decide(*args, **kwargs)
        return replace(decision, reason="") if decision.decision == "fallback" else decision


@pytest.mark.parametrize("mutant, check", [
    (ReusesOnFirstRead, check_exact_first),
    (SilentFaults, check_fault),
    (ReadsEveryTenant, check_isolation),
    (UnnamedFallbacks, check_named),
], ids=["exact_first", "fault", "isolation", "named"])
def test_the_suite_fails_a_broken_strategy(mutant, check, monkeypatch):
    kind = "kvcmas" if issubclass(mutant, KVCMAS) else "fullshared"
    monkeypatch.setitem(STRATEGY_KINDS, kind, mutant)
    name = "kvcmas_entropy" if kind == "kvcmas" else "fullshared"
    with pytest.raises(AssertionError):
        check(name, monkeypatch) if check is check_fault else check(name)

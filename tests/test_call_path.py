"""The runtime tells a call's story in order: following `Runtime.run`, the call goes through each
part of the package once (`scripts/call_path.py`), with no return to a part it already left."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from agentcache import Runtime, RuntimeConfig, SamplingParams
from agentcache.segments import AgentCall, DispatchEvent, Segment
from tests.conftest import make_engine

_spec = importlib.util.spec_from_file_location("call_path", Path(__file__).parents[1] / "scripts" / "call_path.py")
call_path = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(call_path)

QUERY = Segment.ph("query", "Plan a three day trip to Paris with trains, museums and a budget.")


def _call(agent: str) -> AgentCall:
    return AgentCall(agent=agent, segments=(Segment.pf(f"You are the {agent}.\n"), QUERY, Segment.pf("\nAnswer:")))


@pytest.mark.parametrize("strategy", ["kvcmas", "kvcomm", "cacheblend", "nonshared"])
def test_a_call_visits_each_part_once_in_the_story_order(strategy):
    rt = Runtime(make_engine("tiny-llama", pool_blocks=128), strategy=strategy,
                 config=RuntimeConfig(self_check=False, warmup=True))
    for agent in ("planner", "critic"):
        rt.run(_call(agent), SamplingParams(max_tokens=2))
    event = DispatchEvent(agent="writer", framework="runtime")
    stops = call_path.trace(lambda: rt.run(_call("writer"), SamplingParams(max_tokens=2), event=event))
    parts = call_path.path(stops)
    assert parts == ["input", "calls", "engine", "strategy", "sessions", "scout", "figures"], stops
    assert call_path.returns(parts) == []
    planning = next(calls for part, name, calls in stops if name == "plan_call")
    assert "strategy" in planning  # calls hands the planning to the strategy


def test_the_tracer_sees_a_return_to_a_part_already_left():
    assert call_path.returns(["input", "calls", "engine", "calls", "figures"]) == ["calls"]
    stops = [("calls", "plan_call", []), ("engine", "submit", []), ("calls", "served", []), ("figures", "of", [])]
    assert call_path.path(stops) == ["calls", "engine", "calls", "figures"]

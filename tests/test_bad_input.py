"""Every bad input to the public API raises an agentcache error naming the argument, before any work,
and the runtime stays usable. One table: add a row per new case. (The CLI's table is
tests/test_cli_bad_input.py.)"""

from __future__ import annotations

import pytest

from agentcache import AgentCall, EngineConfig, ExecRequest, Runtime, RuntimeConfig, SamplingParams, Segment, SegmentPlan
from agentcache.errors import AgentCacheError, InputError, PlanError, SegmentError
from tests.conftest import make_engine

_RT: dict[str, Runtime] = {}


def rt() -> Runtime:
    if "rt" not in _RT:
        _RT["rt"] = Runtime(make_engine("tiny-llama", pool_blocks=64), strategy="kvcmas",
                            config=RuntimeConfig(self_check=False))
    return _RT["rt"]


def good_call(**changes) -> AgentCall:
    fields = dict(agent="planner", segments=(Segment.pf("You plan.\n"), Segment.ph("query", "Two days in Porto.")))
    return AgentCall(**(fields | changes))


def graph_thread(thread_id: str):
    """Run a one-node LangGraph graph whose model call has `thread_id` as its session."""
    pytest.importorskip("langgraph")
    from langchain_core.messages import HumanMessage
    from langgraph.graph import END, START, StateGraph

    from agentcache_langgraph import AgentCacheChatModel

    model = AgentCacheChatModel(runtime=rt(), agent="planner", max_tokens=1)
    graph = StateGraph(dict)
    graph.add_node("plan", lambda state: {"reply": model.invoke([HumanMessage("hi")]).content})
    graph.add_edge(START, "plan")
    graph.add_edge("plan", END)
    return graph.compile().invoke({}, {"configurable": {"thread_id": thread_id}})


CASES = [
    # (id, what to run, error type, a fragment of the message)
    ("stop-none", lambda: SamplingParams(stop=None), PlanError, "SamplingParams.stop must be a string"),
    ("stop-number", lambda: SamplingParams(stop=5), PlanError, "pass () for no stop strings"),
    ("temperature-str", lambda: SamplingParams(temperature="hot"), PlanError, "SamplingParams.temperature"),
    ("top-p-none", lambda: SamplingParams(top_p=None), PlanError, "SamplingParams.top_p"),
    ("seed-float", lambda: SamplingParams(seed=1.5), PlanError, "SamplingParams.seed"),
    ("token-id-2**63", lambda: Segment(kind="ph", slot="query", token_ids=(2**63,)), InputError, "outside [0,"),
    ("token-id-bool", lambda: Segment(kind="pf", token_ids=(True,)), InputError, "Segment.token_ids.0"),
    ("token-id-past-vocab", lambda: rt().run(AgentCall(agent="a", segments=(Segment(kind="pf", token_ids=(1, 4000)),))),
     SegmentError, "not in tiny-llama's vocabulary of 320"),
    ("engine-prefix-id-2**63", lambda: rt().engine.cached_prefix_length([1, 2**63]), SegmentError, "not ints in"),
    ("engine-sampling-dict", lambda: ExecRequest([SegmentPlan("a", [1])], {"max_tokens": 2}), PlanError,
     "ExecRequest.sampling must be a SamplingParams"),
    ("sampling-dict", lambda: rt().run(good_call(), {"max_tokens": 3}), InputError,
     "sampling=...) must be a SamplingParams, got dict"),
    ("on-token-not-callable", lambda: rt().run(good_call(), on_token=5), InputError, "on_token=...) must be callable"),
    ("event-not-event", lambda: rt().run(good_call(), event={"agent": "planner"}), InputError, "DispatchEvent"),
    ("call-not-call", lambda: rt().run("plan a trip"), InputError, "takes an AgentCall, got str"),
    ("session-empty", lambda: good_call(session=""), InputError, "AgentCall.session: session must be a non-empty"),
    ("session-blank", lambda: good_call(session="  "), InputError, "AgentCall.session"),
    ("tenant-empty", lambda: good_call(tenant=""), InputError, "AgentCall.tenant"),
    ("langgraph-thread-empty", lambda: graph_thread(""), InputError, "thread_id is ''"),
    ("device-missing", lambda: EngineConfig(device="cuda:3"), InputError, "EngineConfig.device 'cuda:3'"),
    ("device-nonsense", lambda: EngineConfig(device="gpu please"), InputError, "is not a torch device"),
    ("device-type", lambda: EngineConfig(device=7), InputError, "EngineConfig.device 7"),
    ("pool-beyond-memory", lambda: rt().engine.with_config(EngineConfig(pool_blocks=10**10)), InputError,
     "a pool of 10000000000 blocks needs"),
    ("check-not-report", lambda: Runtime(rt().engine, check="passed"), InputError, "Runtime(check=...) must be a CheckReport"),
    ("check-bool", lambda: Runtime(rt().engine, check=True), InputError, "got bool"),
    ("config-dict", lambda: Runtime(rt().engine, config={"keep_calls": 3}), InputError, "must be a RuntimeConfig"),
    ("keep-calls-negative", lambda: RuntimeConfig(keep_calls=-1), InputError, "RuntimeConfig.keep_calls"),
    ("max-sessions-zero", lambda: RuntimeConfig(max_sessions=0), InputError, "RuntimeConfig.max_sessions"),
    ("on-call-not-callable", lambda: Runtime(rt().engine, on_call="log.jsonl"), InputError, "on_call"),
    ("output-no-session-kw", lambda: rt().output_segment("planner"), TypeError, "session"),
    ("tokenize-none", lambda: rt().engine.tokenize(None), InputError, "tokenize takes a str, got NoneType"),
]


@pytest.mark.parametrize("run, error, fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises_a_clear_error_before_any_work(run, error, fragment):
    runtime = rt()
    calls, lookups = runtime.summary()["calls"], runtime.engine.pool.stats.lookups
    with pytest.raises(error) as raised:
        run()
    assert fragment in str(raised.value)
    if error is not TypeError:  # a Python-level signature error is not ours to word
        assert isinstance(raised.value, AgentCacheError)
    assert runtime.summary()["calls"] == calls and runtime.engine.pool.stats.lookups == lookups  # nothing ran
    after = runtime.run(good_call(), SamplingParams(max_tokens=1))  # and it stays usable
    assert len(after.token_ids) == 1 and runtime.summary()["calls"] == calls + 1


@pytest.mark.parametrize("adapter, framework, extra", [
    ("agentcache_autogen", "autogen_core", "agentcache[autogen]"),
    ("agentcache_langgraph", "langchain_core", "agentcache[langgraph]"),
])
def test_a_missing_framework_names_the_extra_to_install(adapter, framework, extra):
    """Run where the framework cannot be imported (a None entry in sys.modules blocks it)."""
    import subprocess
    import sys

    code = f"import sys; sys.modules[{framework!r}] = None; import {adapter}"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError:") and extra in last and "ModuleNotFoundError" not in last

"""End-to-end economics of the default strategy against NonShared: what an app gets from
`Runtime(engine, strategy="kvcmas")` with the default RuntimeConfig, workflow by workflow.

Every workload is a multi-agent workflow run several times with new content each time, under
KVCMAS and NonShared in turn (which strategy goes first alternates per workflow). Each strategy
has a runtime and an engine cache of its own (`engine.fresh()`: the same weights, an empty
prefix cache), made new for every workload, so neither warms the other and no workload warms the
next. Every call decodes greedily (`SamplingParams(max_tokens=--out-tokens, ignore_eos=True)`),
so both strategies do the same decode work and outputs compare token for token.

Workloads (`--workloads`, comma-separated):
- `swarm`: a GSM8K-style problem (`tasks.gsm8k_style_problem`, 4 background sentences: about 80
  Gemma tokens) read by 3 experts dispatched together, then a decider reading the problem and
  their outputs (`out:<agent>`). Consumers: the decider (the experts plan before any has
  materialized the problem).
- `group_chat`: 4 agents take turns for `--rounds` rounds on a records question
  (`tasks.fact_problem`, 6 records: about 100 Gemma tokens); each turn reads the question and
  every earlier message, each the PH `out:<speaker>` segment `rt.output_segment` gave right after
  that turn, so the shared context grows. Consumers: every turn but the first.
- `long_doc_1k`, `long_doc_3k`: a staff directory (`tasks.document_problem`, people chosen for
  about `--doc-tokens` tokens on the model's tokenizer) read by a reader; then 3 agents
  dispatched together (asyncio, `Runtime.arun`) read the document and the reader's notes; then a
  writer reads the document and all four notes. Consumers: the 4 agents after the reader.
- `tool_fanout`: a tool result (a staff directory of about the first `--doc-tokens` tokens) new to
  the session, read by the same 3 agents dispatched together with no reader before them (siblings
  on a new segment), then the writer reading it and their notes. Consumers: the writer.
- `cold_start`: a new runtime per strategy (fresh engine cache), its first 2 long_doc_1k
  workflows, all scored. When `long_doc_1k` runs too (with at least 2 workflows) these are its
  own first 2 workflows, which are exactly that (`derived_from` says so); otherwise it runs them.
- `warm_start`: runtime A, `Runtime(engine, strategy="kvcmas", anchors_dir=DIR)`, runs
  `--warm-workflows` long_doc_1k workflows and `close()`s (saving its anchor pools to DIR); a new
  runtime B over DIR (fresh engine cache) runs one new workflow, against a new NonShared
  runtime's first workflow.

The first `--warmup` workflows of swarm, group_chat and long_doc_* are run but not scored.
Per workload and strategy, over scored calls: mean TTFT (`ttft_s`, queueing included) overall,
of the consumers and per agent; workflow wall time (first call entering to last call returning);
prefill work (`CallResult.prefill_tokens`: here prompt − cached − reused tokens, per workflow and
summed); reuse ratio (reused /
PH tokens); ratios KVCMAS / NonShared; greedy agreement (calls whose generated token ids equal
NonShared's for the same workflow and turn); and the KVCMAS runtime's `summary()` figures at the
end (`anchor_bytes`, `anchor_dense_bytes` when reported, `ph_decisions`, `fallback_reasons`).

Top-level keys: `worst_ttft_ratio`, `worst_wall_ratio`, `long_context_consumer_ttft_ratio` and
`long_context_wall_ratio` (long_doc_3k when it ran, else long_doc_1k),
`warm_start_first_workflow_ttft_ratio` (warm_start's consumers), `greedy_agreement` (all scored
calls of all workloads), `anchor_bytes_per_kv_byte` (anchor bytes / dense KV bytes they describe,
over the KVCMAS runtimes that report the latter; null when none does), `aims`, `aims_met`,
`sizes`, `model`, `engine`, `machine`, `workloads`, `elapsed_s`.

`--quick`: 2 workflows per workload (1 scored after 1 warm-up), 2 warm-start workflows for
runtime A, documents of about 256 tokens ("1k" scaled down; no 3k), 2-token outputs, no
self-check (as fidelity.py's quick run). Threads: `--threads` pins the engine's torch threads
(default: the engine's own choice, which follows OMP_NUM_THREADS).

    python benchmarks/economics.py [--quick] [--engine embedded|vllm] [--model gemma3-270m]
        [--workloads swarm,group_chat,long_doc_1k,long_doc_3k,tool_fanout,cold_start,warm_start] [--out PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

import torch

from _report import fill_defaults, judge_aims, machine, run_and_emit, torch_build  # benchmarks/, this folder

from agentcache.engine.choice import ENGINE_KINDS, open_engine
from agentcache.engine.protocol import SamplingParams
from agentcache.errors import PlanError
from agentcache.metrics import CallResult
from agentcache.models import DEFAULT_MODEL
from agentcache.runtime import Runtime, RuntimeConfig
from agentcache.segments import AgentCall, Segment
from agentcache.selfcheck import check_model
from agentcache.tasks import directory_people, document_problem, fact_problem, gsm8k_style_problem

KVCMAS, NONSHARED = "kvcmas", "nonshared"
STRATEGIES = (KVCMAS, NONSHARED)
WORKLOADS = ("swarm", "group_chat", "long_doc_1k", "long_doc_3k", "tool_fanout", "cold_start", "warm_start")
QUICK_WORKLOADS = ("swarm", "group_chat", "long_doc_1k", "cold_start", "warm_start")
LONG_DOCS = {"long_doc_1k": 0, "long_doc_3k": 1}  # index into --doc-tokens
COLD_WORKFLOWS = 2
SEEDS = {"swarm": 1000, "group_chat": 2000, "long_doc_1k": 3000, "long_doc_3k": 4000, "cold_start": 5000,
         "warm_start": 6000, "tool_fanout": 7000}
AIMS = {  # the aims: key -> (comparison, bound)
    "worst_ttft_ratio": ("<=", 1.02),
    "worst_wall_ratio": ("<=", 1.05),
    "long_context_consumer_ttft_ratio": ("<=", 0.2),
    "long_context_wall_ratio": ("<=", 0.6),
    "warm_start_first_workflow_ttft_ratio": ("<=", 0.3),
    "greedy_agreement": (">=", 0.97),
    "anchor_bytes_per_kv_byte": ("<=", 1.0),
}

EXPERTS = {
    "math_solver": "You are the Math Solver. You solve grade-school word problems step by step.\n\n",
    "math_analyst": "You are the Mathematical Analyst. You list the quantities in a word problem and how they "
                    "combine.\n\n",
    "programmer": "You are the Programming Expert. You compute the answer with one Python expression.\n\n",
}
DECIDER = "You are the Final Decision agent. You read a word problem and three experts' answers and give the " \
          "final answer.\n\n"
CHAT = {
    "planner": "You are the planner in a group chat. You say how the team should find the answer.\n\n",
    "researcher": "You are the researcher in a group chat. You quote the records that matter.\n\n",
    "critic": "You are the critic in a group chat. You check what the others said against the records.\n\n",
    "summarizer": "You are the summarizer in a group chat. You state the answer the team agreed on.\n\n",
}
READER = "reader"
REVIEWERS = {
    "fact_checker": "You are the Fact-Checker. You check the reader's notes against the document and state the "
                    "number the document gives.\n\nDocument:\n",
    "critic": "You are the Critic. You say whether the reader's notes match the document, briefly.\n\nDocument:\n",
    "analyst": "You are the Analyst. You list what the document says about the person in the question.\n\n"
               "Document:\n",
}
WRITER = "writer"
DOC_SYSTEM = {
    READER: "You are the Reader. You find the sentence of the document that answers the question and quote the "
            "number in it.\n\nDocument:\n",
    **REVIEWERS,
    WRITER: "You are the Writer. You read the document and your team's notes and write the final answer.\n\n"
            "Document:\n",
}


# --- one workflow -------------------------------------------------------------------------------------

@dataclass
class Turn:
    key: str  # the call's place in its workflow (agent, or round and agent): what greedy agreement pairs
    consumer: bool  # reads shared context an earlier call of the workflow materialized
    result: CallResult


@dataclass
class Flow:
    """One workflow's run under one strategy."""

    index: int
    turns: list[Turn]
    wall_s: float  # from its first call entering the runtime to its last call returning


def _output(rt: Runtime, agent: str, session: str) -> Segment:
    """The agent's latest output as a PH `out:<agent>` segment; a PF note when it decoded to nothing."""
    try:
        return rt.output_segment(agent, session=session)
    except PlanError:
        return Segment.pf(" (nothing)")


async def swarm_flow(rt: Runtime, seed: int, session: str, sampling: SamplingParams) -> list[Turn]:
    query = Segment.ph("query", gsm8k_style_problem(seed, background=4).text)

    async def expert(name: str) -> Turn:
        call = AgentCall(agent=name, session=session,
                         segments=(Segment.pf(EXPERTS[name]), query, Segment.pf("\nAnswer:")))
        return Turn(name, False, await rt.arun(call, sampling))

    turns = list(await asyncio.gather(*(expert(name) for name in EXPERTS)))  # dispatched together
    segments = [Segment.pf(DECIDER), query]
    for name in EXPERTS:
        segments += [Segment.pf(f"\n{name} said:"), _output(rt, name, session)]
    decision = AgentCall(agent="decider", session=session, segments=(*segments, Segment.pf("\nFinal answer:")))
    turns.append(Turn("decider", True, await rt.arun(decision, sampling)))
    return turns


async def group_chat_flow(rt: Runtime, seed: int, session: str, sampling: SamplingParams,
                          rounds: int) -> list[Turn]:
    topic = Segment.ph("topic", fact_problem(seed, records=6).text)
    transcript: list[Segment] = []  # PF speaker line and PH message, for every turn so far
    turns = []
    for round_index in range(rounds):
        for agent, system in CHAT.items():
            call = AgentCall(agent=agent, session=session, segments=(
                Segment.pf(system), topic, *transcript, Segment.pf(f"\n\n{agent}:")))
            turns.append(Turn(f"r{round_index}:{agent}", bool(turns), await rt.arun(call, sampling)))
            transcript += [Segment.pf(f"\n\n{agent}:"), _output(rt, agent, session)]
    return turns


async def long_doc_flow(rt: Runtime, seed: int, session: str, sampling: SamplingParams,
                        people: int) -> list[Turn]:
    problem = document_problem(seed, people=people)
    document = Segment.ph("document", problem.text)
    call = AgentCall(agent=READER, session=session, segments=(
        Segment.pf(DOC_SYSTEM[READER]), document, Segment.pf(f"\n\nReader's notes: {problem.subject}")))
    turns = [Turn(READER, False, await rt.arun(call, sampling))]
    notes = _output(rt, READER, session)

    async def review(name: str) -> Turn:
        call = AgentCall(agent=name, session=session, segments=(
            Segment.pf(DOC_SYSTEM[name]), document, Segment.pf("\n\nThe reader wrote:"), notes,
            Segment.pf(f"\n\nThe {name} writes:")))
        return Turn(name, True, await rt.arun(call, sampling))

    turns += await asyncio.gather(*(review(name) for name in REVIEWERS))  # dispatched together
    segments = [Segment.pf(DOC_SYSTEM[WRITER]), document]
    for name in (READER, *REVIEWERS):  # a fixed order, whichever reviewer finished first
        segments += [Segment.pf(f"\n\nThe {name} wrote:"), _output(rt, name, session)]
    call = AgentCall(agent=WRITER, session=session,
                     segments=(*segments, Segment.pf(f"\n\nFinal answer: {problem.subject}")))
    turns.append(Turn(WRITER, True, await rt.arun(call, sampling)))
    return turns


async def tool_fanout_flow(rt: Runtime, seed: int, session: str, sampling: SamplingParams,
                           people: int) -> list[Turn]:
    problem = document_problem(seed, people=people)
    result = Segment.ph("tool_result", problem.text)

    async def review(name: str) -> Turn:
        call = AgentCall(agent=name, session=session, segments=(
            Segment.pf(DOC_SYSTEM[name]), result, Segment.pf(f"\n\nQuestion: {problem.subject}\nThe {name} writes:")))
        return Turn(name, False, await rt.arun(call, sampling))

    turns = list(await asyncio.gather(*(review(name) for name in REVIEWERS)))  # siblings: dispatched together
    segments = [Segment.pf(DOC_SYSTEM[WRITER]), result]
    for name in REVIEWERS:
        segments += [Segment.pf(f"\n\nThe {name} wrote:"), _output(rt, name, session)]
    call = AgentCall(agent=WRITER, session=session,
                     segments=(*segments, Segment.pf(f"\n\nFinal answer: {problem.subject}")))
    turns.append(Turn(WRITER, True, await rt.arun(call, sampling)))
    return turns


def run_flow(flow: Callable[..., Awaitable[list[Turn]]], rt: Runtime, index: int, *args: Any) -> Flow:
    """One workflow on its own event loop; its wall time from the first call entering to the last returning."""
    async def timed() -> Flow:
        started = time.perf_counter()
        turns = await flow(rt, *args)
        return Flow(index, turns, time.perf_counter() - started)

    return asyncio.run(timed())


# --- runtimes ---------------------------------------------------------------------------------------

@dataclass
class Setup:
    base: Any  # the engine whose fresh() twins every runtime runs on
    check: Any  # the self-check report every KVCMAS runtime trusts (None: skipped)
    config: RuntimeConfig | None  # None: the default RuntimeConfig
    sampling: SamplingParams
    args: argparse.Namespace
    people: dict[str, int] = field(default_factory=dict)  # long-doc workload -> people per directory
    turn: int = 0  # interleaved pairs so far: which strategy goes first alternates

    def runtime(self, strategy: str, **extra: Any) -> Runtime:
        return Runtime(self.base.fresh(), strategy=strategy, check=self.check, config=self.config, **extra)

    def order(self) -> tuple[str, ...]:
        self.turn += 1
        return STRATEGIES if self.turn % 2 else STRATEGIES[::-1]


def flow_of(name: str, setup: Setup) -> tuple[Callable[..., Awaitable[list[Turn]]], tuple]:
    """The workflow coroutine of a workload and its extra arguments (after rt, seed, session, sampling)."""
    if name == "swarm":
        return swarm_flow, ()
    if name == "group_chat":
        return group_chat_flow, (setup.args.rounds,)
    if name == "tool_fanout":
        return tool_fanout_flow, (setup.people["long_doc_1k"],)
    doc = name if name in LONG_DOCS else "long_doc_1k"
    return long_doc_flow, (setup.people[doc],)


def interleaved(name: str, setup: Setup, workflows: int, seed_base: int) -> tuple[dict[str, list[Flow]], dict]:
    """`workflows` workflows of a workload under both strategies in turn, each strategy on a new
    runtime over a fresh engine cache; the runtimes' summaries at the end."""
    flow, extra = flow_of(name, setup)
    runtimes = {s: setup.runtime(s) for s in STRATEGIES}
    flows: dict[str, list[Flow]] = {s: [] for s in STRATEGIES}
    try:
        for index in range(workflows):
            for strategy in setup.order():
                flows[strategy].append(run_flow(flow, runtimes[strategy], index, seed_base + index,
                                                f"{name}-{index}", setup.sampling, *extra))
        summaries = {s: rt.summary() for s, rt in runtimes.items()}
        summaries[KVCMAS]["_refusal"] = runtimes[KVCMAS].refusal
    finally:
        for rt in runtimes.values():
            rt.close()
    return flows, summaries


# --- figures ----------------------------------------------------------------------------------------

def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def strategy_figures(flows: list[Flow]) -> dict[str, Any]:
    turns = [t for f in flows for t in f.turns]
    results = [t.result for t in turns]
    agents = sorted({r.agent for r in results})
    ph = sum(r.ph_tokens for r in results)
    reused = sum(r.reused_tokens for r in results)
    eligible = sum(r.eligible_tokens for r in results)
    decisions: dict[str, int] = {}
    for r in results:
        for seg in r.segments:
            if seg.kind == "ph":
                key = seg.decision if seg.reason is None else f"{seg.decision}:{seg.reason}"
                decisions[key] = decisions.get(key, 0) + 1
    return {
        "calls": len(results),
        "ttft_mean_s": _mean([r.ttft_s for r in results]),
        "consumer_ttft_mean_s": _mean([t.result.ttft_s for t in turns if t.consumer]),
        "service_ttft_mean_s": _mean([r.ttft_s - r.queued_s for r in results]),  # TTFT less queueing
        "per_agent_ttft_s": {a: _mean([r.ttft_s for r in results if r.agent == a]) for a in agents},
        "wall_mean_s": _mean([f.wall_s for f in flows]),
        "wall_s": [f.wall_s for f in flows],
        "prompt_tokens": sum(r.prompt_tokens for r in results),
        "cached_tokens": sum(r.cached_tokens for r in results),
        "reused_tokens": reused,
        "ph_tokens": ph,
        "eligible_tokens": eligible,
        "prefill_work_tokens": sum(r.prefill_tokens for r in results),  # full-forward tokens computed (CallResult)
        "prefill_work_per_workflow": [sum(t.result.prefill_tokens for t in f.turns) for f in flows],
        "reuse_ratio": reused / ph if ph else 0.0,  # reused / shared tokens
        "reuse_ratio_of_eligible": reused / eligible if eligible else 0.0,  # as Runtime.summary() reports it
        "ph_decisions": decisions,
    }


def agreement_pairs(name: str, flows: dict[str, list[Flow]]) -> dict[tuple, bool]:
    """(workload, workflow, turn) -> KVCMAS's generated ids equal NonShared's."""
    theirs = {(f.index, t.key): t.result.token_ids for f in flows[NONSHARED] for t in f.turns}
    return {(name, f.index, t.key): list(t.result.token_ids) == list(theirs[(f.index, t.key)])
            for f in flows[KVCMAS] for t in f.turns if (f.index, t.key) in theirs}


RUNTIME_KEYS = ("strategy", "anchors", "anchor_bytes", "anchor_dense_bytes", "anchors_evicted", "store_bytes",
                "anchor_build_s", "reuse_ratio", "ph_decisions", "fallback_reasons", "decisions", "faults", "gate_tau")
RUNTIME_KEY_PARTS = ("accept", "verif", "cost", "decision", "sibling", "break_even", "not_worth")  # the strategy's own figures, where it reports them


def runtime_figures(summary: dict[str, Any]) -> dict[str, Any]:
    """The KVCMAS runtime's summary() figures at the end of a workload (keys it does not report are left out)."""
    out = {k: summary[k] for k in RUNTIME_KEYS if k in summary}
    out.update({k: v for k, v in summary.items() if k not in out and any(part in k for part in RUNTIME_KEY_PARTS)})
    out["refusal"] = summary.get("_refusal")
    return json.loads(json.dumps(out, default=str))  # JSON as emitted, whatever types the figures hold


def score(name: str, flows: dict[str, list[Flow]], scored: range, summary: dict[str, Any] | None,
          **extra: Any) -> tuple[dict[str, Any], dict[tuple, bool]]:
    """A workload's figures over its scored workflows, and its greedy-agreement pairs."""
    kept = {s: [f for f in flows[s] if f.index in scored] for s in STRATEGIES}
    mine, theirs = (strategy_figures(kept[s]) for s in STRATEGIES)
    pairs = agreement_pairs(name, kept)
    agents = sorted(set(mine["per_agent_ttft_s"]) | set(theirs["per_agent_ttft_s"]))
    report = {
        "workflows": len(flows[KVCMAS]),
        "scored_workflows": len(kept[KVCMAS]),
        "warmup_workflows": len(flows[KVCMAS]) - len(kept[KVCMAS]),
        **extra,
        "ttft_ratio": _ratio(mine["ttft_mean_s"], theirs["ttft_mean_s"]),
        "consumer_ttft_ratio": _ratio(mine["consumer_ttft_mean_s"], theirs["consumer_ttft_mean_s"]),
        "per_agent_ttft_ratio": {a: _ratio(mine["per_agent_ttft_s"].get(a), theirs["per_agent_ttft_s"].get(a))
                                 for a in agents},
        "wall_ratio": _ratio(mine["wall_mean_s"], theirs["wall_mean_s"]),
        "prefill_work_ratio": _ratio(mine["prefill_work_tokens"], theirs["prefill_work_tokens"]),
        "reuse_ratio": mine["reuse_ratio"],
        "greedy_agreement": sum(pairs.values()) / len(pairs) if pairs else None,
        "greedy_pairs": len(pairs),
        KVCMAS: mine,
        NONSHARED: theirs,
        "kvcmas_runtime": runtime_figures(summary) if summary is not None else None,
    }
    return report, pairs


def shared_tokens(flows: list[Flow], slot: str) -> float | None:
    """Mean length of the workflow's first materialization of `slot` (its first call's segment)."""
    lengths = [s.length for f in flows for s in f.turns[0].result.segments if s.name == slot]
    return _mean(lengths)


# --- workloads --------------------------------------------------------------------------------------

def warm_workload(name: str, setup: Setup) -> tuple[dict, dict, dict[str, list[Flow]]]:
    workflows = setup.args.workflows
    flows, summaries = interleaved(name, setup, workflows, setup.args.seed + SEEDS[name])
    slot = {"swarm": "query", "group_chat": "topic", "tool_fanout": "tool_result"}.get(name, "document")
    extra = {"shared_tokens_mean": shared_tokens(flows[NONSHARED], slot)}
    if name in LONG_DOCS or name == "tool_fanout":
        extra["people"] = setup.people.get(name, setup.people["long_doc_1k"])
        extra["target_document_tokens"] = setup.args.doc_tokens[LONG_DOCS.get(name, 0)]
    if name == "group_chat":
        extra["rounds"] = setup.args.rounds
    report, pairs = score(name, flows, range(setup.args.warmup, workflows), summaries[KVCMAS], **extra)
    return report, pairs, flows


def cold_start(setup: Setup, long_doc: dict[str, list[Flow]] | None) -> tuple[dict, dict]:
    extra = {"people": setup.people["long_doc_1k"]}
    if long_doc is not None and len(long_doc[KVCMAS]) >= COLD_WORKFLOWS:
        flows = {s: [f for f in long_doc[s] if f.index < COLD_WORKFLOWS] for s in STRATEGIES}
        extra["derived_from"] = "long_doc_1k"  # its runtimes were new: their first workflows are a cold start
        summary = None  # the runtime went on past the cold start: its end figures are long_doc_1k's
        name = "long_doc_1k"  # the same calls: counted once in the pooled agreement
    else:
        flows, summaries = interleaved("cold_start", setup, COLD_WORKFLOWS, setup.args.seed + SEEDS["cold_start"])
        summary, name = summaries[KVCMAS], "cold_start"
    extra["shared_tokens_mean"] = shared_tokens(flows[NONSHARED], "document")
    return score(name, flows, range(COLD_WORKFLOWS), summary, **extra)


def warm_start(setup: Setup) -> tuple[dict, dict]:
    args = setup.args
    keep = args.anchors_dir is not None
    directory = Path(args.anchors_dir) if keep else Path(tempfile.mkdtemp(prefix="agentcache-anchors-"))
    directory.mkdir(parents=True, exist_ok=True)
    seed = args.seed + SEEDS["warm_start"]
    people = setup.people["long_doc_1k"]
    runtimes: list[Runtime] = []
    try:
        first = setup.runtime(KVCMAS, anchors_dir=str(directory))
        runtimes.append(first)
        for index in range(args.warm_workflows):
            run_flow(long_doc_flow, first, index, seed + index, f"warm-a-{index}", setup.sampling, people)
        first_figures = runtime_figures(first.summary() | {"_refusal": first.refusal})
        runtimes.remove(first)
        first.close()  # saves its anchor pools to the directory
        saved = [p.stat().st_size for p in directory.rglob("*.safetensors")]  # what A's close() wrote (not the lock)
        second = setup.runtime(KVCMAS, anchors_dir=str(directory))
        baseline = setup.runtime(NONSHARED)
        runtimes += [second, baseline]
        loaded = second.summary().get("anchors_loaded")
        flows: dict[str, list[Flow]] = {s: [] for s in STRATEGIES}
        for strategy in setup.order():
            rt = second if strategy == KVCMAS else baseline
            flows[strategy].append(run_flow(long_doc_flow, rt, 0, seed + 100, "warm-b-0", setup.sampling, people))
        summary = second.summary() | {"_refusal": second.refusal}
    finally:
        for rt in runtimes:
            rt.close()
        if not keep:
            shutil.rmtree(directory, ignore_errors=True)
    return score("warm_start", flows, range(1), summary, people=people,
                 shared_tokens_mean=shared_tokens(flows[NONSHARED], "document"),
                 first_runtime_workflows=args.warm_workflows, first_runtime=first_figures,
                 anchor_files_saved=len(saved), anchor_file_bytes=sum(saved),
                 anchors_loaded=loaded)


# --- the run ----------------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    settings = {"threads": args.threads} if args.threads else {}
    base = open_engine(args.engine, args.model, **settings)
    threads = args.threads or getattr(base, "threads", None)
    if threads:
        torch.set_num_threads(threads)  # this thread's torch work (planning, correcting) as the engine's steps
    check = check_model(base) if args.check else None
    config = None if args.check else dataclasses.replace(RuntimeConfig(), self_check=False)
    setup_s = time.perf_counter() - started
    setup = Setup(base, check, config, SamplingParams(max_tokens=args.out_tokens, ignore_eos=True), args)
    chosen = args.workloads
    for name, position in LONG_DOCS.items():
        if name in chosen or (name == "long_doc_1k" and {"cold_start", "warm_start", "tool_fanout"} & set(chosen)):
            setup.people[name] = directory_people(base.tokenize, args.doc_tokens[position])

    workloads: dict[str, dict] = {}
    pairs: dict[tuple, bool] = {}
    kept_long_doc: dict[str, list[Flow]] | None = None
    for name in WORKLOADS:  # a fixed order: cold_start may reuse long_doc_1k's first workflows
        if name not in chosen:
            continue
        if name == "cold_start":
            report, found = cold_start(setup, kept_long_doc)
        elif name == "warm_start":
            report, found = warm_start(setup)
        else:
            report, found, flows = warm_workload(name, setup)
            if name == "long_doc_1k":
                kept_long_doc = flows
        report["elapsed_s"] = round(time.perf_counter() - started, 1)
        workloads[name] = report
        pairs.update(found)
        gc.collect()  # the workload's engines and runtimes go

    def ratios(key: str) -> list[float]:
        return [w[key] for w in workloads.values() if w.get(key) is not None]

    long_name = next((n for n in ("long_doc_3k", "long_doc_1k") if n in workloads), None)
    dense: list[tuple[int, int]] = []  # (anchor bytes, dense bytes) of each KVCMAS runtime that reports both
    for w in workloads.values():
        figures = w.get("kvcmas_runtime") or {}
        if figures.get("anchor_dense_bytes"):
            dense.append((figures["anchor_bytes"], figures["anchor_dense_bytes"]))
    result = {
        "worst_ttft_ratio": max(ratios("ttft_ratio"), default=None),
        "worst_wall_ratio": max(ratios("wall_ratio"), default=None),
        "long_context_consumer_ttft_ratio": workloads[long_name]["consumer_ttft_ratio"] if long_name else None,
        "long_context_wall_ratio": workloads[long_name]["wall_ratio"] if long_name else None,
        "long_context_workload": long_name,
        "warm_start_first_workflow_ttft_ratio": workloads.get("warm_start", {}).get("consumer_ttft_ratio"),
        "greedy_agreement": sum(pairs.values()) / len(pairs) if pairs else None,
        "greedy_pairs": len(pairs),
        "anchor_bytes_per_kv_byte": (sum(a for a, _ in dense) / sum(d for _, d in dense)) if dense else None,
    }
    judge_aims(result, AIMS)
    result.update(
        model=base.model_name,
        engine=args.engine,
        quick=args.quick,
        sizes={
            "workflows": args.workflows, "warmup_workflows": args.warmup, "warm_start_first_workflows":
            args.warm_workflows, "cold_start_workflows": COLD_WORKFLOWS, "out_tokens": args.out_tokens,
            "rounds": args.rounds,
            "long_docs": {name: {"target_tokens": args.doc_tokens[LONG_DOCS[name]], "people": people}
                          for name, people in setup.people.items()},
            "workloads_run": list(workloads),
        },
        self_check=None if check is None else check.to_dict(),
        self_check_skipped=check is None,
        machine=machine(affinity_cpus=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                        **torch_build(threads)),
        workloads=workloads,
        setup_s=round(setup_s, 2),
    )
    return result


def _names(text: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown workloads {unknown}; choose from {', '.join(WORKLOADS)}")
    return names


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {value}")
    return value


def _doc_tokens(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x]
    if not 1 <= len(values) <= 2 or min(values) < 1:
        raise argparse.ArgumentTypeError("give the 1k size, or the 1k and 3k sizes, e.g. 1024,3072")
    return values if len(values) == 2 else [values[0], 3 * values[0]]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 workflows per workload, ~256-token documents, "
                        "no 3k, 2-token outputs, no self-check (< 60 s on 2 cores)")
    parser.add_argument("--engine", choices=ENGINE_KINDS, default="embedded")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--workloads", type=_names, default=None, help=f"comma-separated, of {', '.join(WORKLOADS)}")
    parser.add_argument("--workflows", type=_positive, default=None, help="workflows per warm workload")
    parser.add_argument("--warmup", type=int, default=None, help="first workflows of each warm workload not scored")
    parser.add_argument("--warm-workflows", type=_positive, default=None,
                        help="long_doc_1k workflows warm_start's first runtime runs before saving its anchors")
    parser.add_argument("--doc-tokens", type=_doc_tokens, default=None,
                        help="document sizes of long_doc_1k and long_doc_3k in tokens, e.g. 1024,3072")
    parser.add_argument("--rounds", type=_positive, default=None, help="group_chat rounds (4 turns each)")
    parser.add_argument("--out-tokens", type=_positive, default=None, help="tokens every call generates")
    parser.add_argument("--threads", type=_positive, default=None,
                        help="torch threads for the engine's steps (default: the engine's own choice)")
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                        help="run the model self-check once and hand its report to every runtime "
                             "(default: yes; --quick: no, runtimes then skip it)")
    parser.add_argument("--anchors-dir", default=None, help="warm_start's anchor directory (default: a temporary one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", "--json", dest="out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    quick = dict(workloads=list(QUICK_WORKLOADS), workflows=2, warmup=1, warm_workflows=2, doc_tokens=[256, 768],
                 rounds=2, out_tokens=2, check=False)
    full = dict(workloads=list(WORKLOADS), workflows=6, warmup=1, warm_workflows=3, doc_tokens=[1024, 3072],
                rounds=2, out_tokens=12, check=True)
    fill_defaults(args, quick, full)
    if not 0 <= args.warmup < args.workflows:
        parser.error(f"--warmup must be at least 0 and below --workflows ({args.workflows}), got {args.warmup}")
    return run_and_emit(run, args)


if __name__ == "__main__":
    main()
    sys.exit(0)

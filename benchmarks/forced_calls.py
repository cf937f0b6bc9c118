"""Forced tool calls: does every call a grammar forces come back as a call?

Sends `--calls` requests with `tool_choice` forced (alternately "required" and a named tool) to a
model on one engine, at temperature 1, with a tool whose argument is a free string, so that a
random-weight model writes long strings holding tags such as `</tool_call>`. Each reply is parsed as
the server parses it (`ToolFormat.parse`).

Keys: `forced_calls`, `finished` (replies that ended before `max_tokens`: a reply cut by its budget
cannot hold a whole call), `as_text` (finished replies with no call: the aim is 0),
`cut_by_length`, `tags_in_strings` (finished or not, replies holding more than one closing tag).

    python benchmarks/forced_calls.py [--quick] [--calls 320] [--model tiny-qwen2-chat] [--out PATH]

`--quick` (< 60 s on 2 cores): 48 calls.
"""

from __future__ import annotations

import argparse
import sys

from agentcache import SamplingParams
from agentcache.engine.choice import open_engine
from agentcache.engine.protocol import ExecRequest, SegmentPlan
from agentcache.toolcalls import HERMES

from _report import fill_defaults, judge_aims, machine, run_and_emit  # benchmarks/, this folder

SAY = {"name": "say", "parameters": {"type": "object", "properties": {"text": {"type": "string"},
                                                                      "loud": {"type": "boolean"}},
                                     "required": ["text"]}}
LAMP = {"name": "lamp", "parameters": {"type": "object", "properties": {"on": {"type": "boolean"}},
                                       "required": ["on"]}}
NAMES = ["say", "lamp"]


def run(args: argparse.Namespace) -> dict:
    engine = open_engine(args.engine, args.model, pool_blocks=1024)
    futures = []
    for i in range(args.calls):
        ids = engine.tokenize(f"request {i}: speak", bos=engine.requires_bos)
        constraint = HERMES.constraint([SAY, LAMP], ("required", "say")[i % 2])
        sampling = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=args.seed + i,
                                  constraint=constraint)
        futures.append(engine.submit(ExecRequest([SegmentPlan("p", ids)], sampling=sampling)))
    replies = [future.result() for future in futures]
    finished = [r.text for r in replies if r.finish_reason != "length"]
    result = {
        "forced_calls": len(replies),
        "finished": len(finished),
        "as_text": sum(1 for text in finished if not HERMES.parse(text, NAMES).calls),
        "cut_by_length": len(replies) - len(finished),
        "tags_in_strings": sum(1 for r in replies if r.text.count("</tool_call>") > 1),
        "model": engine.model_name, "engine": args.engine, "max_tokens": args.max_tokens, "quick": args.quick,
        "machine": machine(),
    }
    judge_aims(result, {"as_text": ("<=", 0)})
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="48 calls (< 60 s on 2 cores)")
    parser.add_argument("--calls", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--model", default="tiny-qwen2-chat")
    parser.add_argument("--engine", default="embedded", choices=("embedded", "vllm"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    fill_defaults(args, {"calls": 48}, {"calls": 320})
    run_and_emit(run, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The `agentcache` command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["main"]


def _cmd_demo(args: argparse.Namespace) -> int:
    from agentcache.demo import run_demo

    run_demo(model=args.model, max_tokens=args.max_tokens, results_dir=Path(args.results))
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    from agentcache.models import PRESETS, ensure_gemma3_270m

    for name, preset in PRESETS.items():
        print(f"{name:<14} {preset.description}")
    if args.prepare:
        print(f"default model ready at {ensure_gemma3_270m()}")
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    import json

    from agentcache.engine import EmbeddedEngine
    from agentcache.selfcheck import check_model

    report = check_model(EmbeddedEngine(args.model))
    print(json.dumps(report.to_dict(), indent=2))
    print(("PASSED: " if report.passed else "FAILED: ") + report.reason, file=sys.stderr)
    return 0 if report.passed else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentcache", description="KV-cache middleware for multi-agent LLM apps.")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="run a short multi-agent workflow and print what it measured")
    demo.add_argument("--model", default="gemma3-270m", help="preset name or local HF model directory")
    demo.add_argument("--max-tokens", type=int, default=32)
    demo.add_argument("--results", default="results", help="directory for the JSON report")
    demo.set_defaults(run=_cmd_demo)

    models = commands.add_parser("models", help="list model presets; --prepare converts the default model")
    models.add_argument("--prepare", action="store_true")
    models.set_defaults(run=_cmd_models)

    check = commands.add_parser(
        "check", help="verify RoPE re-alignment and correction fidelity on a model before trusting reuse")
    check.add_argument("--model", default="gemma3-270m", help="preset name or local HF model directory")
    check.set_defaults(run=_cmd_check)

    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

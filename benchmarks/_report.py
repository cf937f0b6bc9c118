"""How every benchmark hands back its result: one JSON object on stdout, and optionally a file; and
what the benchmarks that judge aims record beside their figures (the aims, the machine, the time)."""

from __future__ import annotations

import argparse
import gc
import json
import operator
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable

# an aim is (comparison, bound): the figure must compare so with the bound
_COMPARE = {"<=": operator.le, "<": operator.lt, ">=": operator.ge, ">": operator.gt}


def emit(result: dict, out: str | None) -> None:
    print(json.dumps(result))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2))


def fill_defaults(args, quick: dict, full: dict) -> None:
    """Set every option the command line left None from the quick or the full run's defaults."""
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def run_and_emit(run: Callable[[argparse.Namespace], dict], args: argparse.Namespace) -> dict:
    """A benchmark's `main` ending: `run(args)`, its wall time added as `elapsed_s`, emitted (stdout,
    and `args.out` when given); the result."""
    started = time.perf_counter()
    result = run(args)
    result["elapsed_s"] = round(time.perf_counter() - started, 2)
    emit(result, args.out)
    return result


def settle_heap() -> None:
    """Collect what loading the models left before anything is timed, so that one full collection of
    the import-time heap (over 100 ms) does not land inside a single sampled call."""
    gc.collect()


def judge_aims(result: dict, aims: dict[str, tuple[str, float]]) -> None:
    """Add the aims to `result` ("<= 0.3" per figure) and `aims_met`: whether each figure meets its
    aim, None when the result has no such figure."""
    result["aims"] = {key: f"{op} {bound}" for key, (op, bound) in aims.items()}
    result["aims_met"] = {key: None if result.get(key) is None else _COMPARE[op](result[key], bound)
                          for key, (op, bound) in aims.items()}


def machine(**extra: Any) -> dict:
    """The machine the figures came from: its architecture and CPU count, then `extra` (which may
    replace either, and adds what the figures also depend on: see `torch_build`, the Python version)."""
    return {"platform": platform.machine(), "cpus": os.cpu_count(), **extra}


def torch_build(threads: int | None = None) -> dict:
    """The threads torch ran on (`threads`, else torch's own count) and its version."""
    import torch  # only the benchmarks that record it load it

    return {"torch_threads": threads or torch.get_num_threads(), "torch": torch.__version__}

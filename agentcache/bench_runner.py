"""`agentcache bench`: run the benchmark scripts of a source checkout and collect their JSON.

Each script in `benchmarks/` prints one JSON object on stdout. They run one at a time, each in
its own process (so one benchmark's memory and threads never skew the next), under a progress
bar; their results are gathered into one report.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

__all__ = ["benchmarks_dir", "available", "run_benchmarks"]


def benchmarks_dir() -> Path:
    """`benchmarks/` beside the package: the benchmarks ship with the source, not the wheel."""
    path = Path(__file__).resolve().parents[1] / "benchmarks"
    if not path.is_dir():
        raise FileNotFoundError(f"no benchmarks directory at {path}: `agentcache bench` runs from a source checkout "
                                "(git clone the repository and install it with scripts/setup.sh)")
    return path


def available() -> dict[str, Path]:
    return {p.stem: p for p in sorted(benchmarks_dir().glob("*.py")) if not p.stem.startswith("_")}


def run_benchmarks(
    names: Sequence[str] = (), *, quick: bool = False, extra: Sequence[str] = (), progress: bool = True,
    timeout_s: float = 3600.0,
) -> dict[str, Any]:
    """Run `names` (all when empty); each entry is its JSON, or its error and the tail of stderr."""
    from tqdm import tqdm

    scripts = available()
    unknown = [n for n in names if n not in scripts]
    if unknown:
        raise ValueError(f"unknown benchmark(s) {unknown}; available: {sorted(scripts)}")
    chosen = list(names) or list(scripts)
    report: dict[str, Any] = {}
    bar = tqdm(chosen, desc="benchmarks", unit="bench", disable=not progress)
    for name in bar:
        bar.set_postfix_str(name)
        command = [sys.executable, str(scripts[name]), *(["--quick"] if quick else []), *extra]
        started = time.perf_counter()
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            report[name] = {"error": f"timed out after {timeout_s:.0f} s"}
            continue
        elapsed = time.perf_counter() - started
        if proc.returncode != 0:
            report[name] = {"error": f"exit code {proc.returncode}", "stderr": proc.stderr[-2000:], "elapsed_s": elapsed}
            continue
        try:
            report[name] = {"result": json.loads(proc.stdout), "elapsed_s": elapsed}
        except json.JSONDecodeError:
            report[name] = {"error": "did not print one JSON object", "stdout": proc.stdout[-2000:], "elapsed_s": elapsed}
    return report

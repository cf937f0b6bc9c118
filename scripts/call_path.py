"""Follow one call's way through the package: which parts `Runtime.run` hands the call to, in order.

Every function the runtime calls directly while running a call is a stop; each stop is named by
the part of the package it lives in (the runtime, the call's plan, the strategy, the engine, the
session table, the figures, CacheScout), or "input" for the argument checks each input type owns
(`AgentCall.checked`, `SamplingParams.checked`, `DispatchEvent.checked_for`), and so are the parts
each stop itself calls (its excursions). Consecutive stops in one part count once. The path
the runtime's story should read is printed beside it, with every return to a part already left.

    .venv/bin/python scripts/call_path.py [--strategy kvcmas] [--warmup] [--deep | --files]
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import threading
from collections.abc import Callable

PARTS = (  # module prefix -> part, first match wins
    ("agentcache.runtime", "runtime"),
    ("agentcache.calls", "calls"),
    ("agentcache.correction", "strategy"),
    ("agentcache.engine", "engine"),
    ("agentcache.sessions", "sessions"),
    ("agentcache.metrics", "figures"),
    ("agentcache.scout", "scout"),
    ("agentcache.segments", "input"),
    ("agentcache.config", "input"),
    ("agentcache.isolation", "salts"),
)


CHECKS = ("checked", "checked_for")  # an input type's own argument check


def part_of(module: str, function: str = "") -> str | None:
    if module.startswith("agentcache.") and function in CHECKS:
        return "input"
    return next((part for prefix, part in PARTS if module == prefix or module.startswith(prefix + ".")), None)


def trace(run: Callable[[], object]) -> list[tuple[str, str, list[str]]]:
    """(part, function, parts it called) for every function the runtime called directly, in order."""
    stops: list[tuple[str, str, list[str]]] = []
    depth = 0  # frames since entering the runtime's own functions
    runtime_depth: list[int] = []

    def profile(frame, event, arg):
        nonlocal depth
        if event == "call":
            depth += 1
            module = frame.f_globals.get("__name__", "")
            part = part_of(module, frame.f_code.co_name)
            caller = frame.f_back
            caller_part = part_of(caller.f_globals.get("__name__", "")) if caller is not None else None
            if part == "runtime":
                runtime_depth.append(depth)
            elif part is not None and caller_part == "runtime" and runtime_depth and depth == runtime_depth[-1] + 1:
                stops.append((part, frame.f_code.co_qualname, []))
            elif part is not None and stops and runtime_depth and depth == runtime_depth[-1] + 2:
                if part != stops[-1][0] and part not in stops[-1][2]:
                    stops[-1][2].append(part)
        elif event == "return":
            if runtime_depth and runtime_depth[-1] == depth:
                runtime_depth.pop()
            depth -= 1

    threading.setprofile(None)
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return stops


def deep_trace(run: Callable[[], object]) -> list[str]:
    """The part of every function of the package called on this thread while `run` runs, at any
    depth, consecutive repeats once: the module-by-module way of the call, excursions included."""
    parts: list[str] = []

    def profile(frame, event, arg):
        if event == "call":
            part = part_of(frame.f_globals.get("__name__", ""), frame.f_code.co_name)
            if part is not None and (not parts or parts[-1] != part):
                parts.append(part)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return parts


def file_trace(run: Callable[[], object]) -> list[str]:
    """The module of every function of the package (the engine's inside excepted: it is one stop)
    called on this thread while `run` runs, at any depth, consecutive repeats once: the
    file-by-file way of the call."""
    files: list[str] = []
    resumed: set[int] = set()  # generator frames already entered: a resume is not a new stop

    def profile(frame, event, arg):
        if event == "call" and not _plumbing(frame, resumed):
            module = frame.f_globals.get("__name__", "")
            if module.startswith("agentcache.engine"):
                module = "agentcache.engine"
            if module.startswith("agentcache") and (not files or files[-1] != module):
                files.append(module)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return files


def _plumbing(frame, resumed: set[int]) -> bool:
    """Calls that do no work of their own: a record's generated or dunder method, a property, a
    lambda or comprehension, a generator resumed."""
    code = frame.f_code
    if code.co_flags & inspect.CO_GENERATOR:
        if id(frame) in resumed:
            return True
        resumed.add(id(frame))
    if code.co_name.startswith("<") or (code.co_name.startswith("__") and code.co_name.endswith("__")):
        return True
    owner = frame.f_locals.get("self", frame.f_locals.get("cls"))
    return isinstance(inspect.getattr_static(type(owner), code.co_name, None), property)


def path(stops: list[tuple[str, str, list[str]]], ignore: tuple[str, ...] = ("salts",)) -> list[str]:
    """The parts in the order the runtime visits them, consecutive repeats once."""
    out: list[str] = []
    for part, _, _ in stops:
        if part not in ignore and (not out or out[-1] != part):
            out.append(part)
    return out


def returns(parts: list[str]) -> list[str]:
    """Each part the path comes back to after leaving it."""
    seen: set[str] = set()
    back = []
    for part in parts:
        if part in seen:
            back.append(part)
        seen.add(part)
    return back


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="kvcmas")
    parser.add_argument("--warmup", action="store_true")
    parser.add_argument("--deep", action="store_true", help="every module the call passes through, at any depth")
    parser.add_argument("--files", action="store_true",
                        help="every file of the package the call passes through (the engine as one), at any depth")
    args = parser.parse_args()

    from agentcache import Runtime, RuntimeConfig, SamplingParams
    from agentcache.engine import EmbeddedEngine, EngineConfig
    from agentcache.segments import AgentCall, DispatchEvent, Segment

    engine = EmbeddedEngine("tiny-llama", EngineConfig(pool_blocks=128))
    rt = Runtime(engine, strategy=args.strategy, config=RuntimeConfig(self_check=False, warmup=args.warmup))
    query = Segment.ph("query", "Plan a three day trip to Paris with trains, museums and a budget.")

    def call(agent: str) -> AgentCall:
        return AgentCall(agent=agent, segments=(Segment.pf(f"You are the {agent}.\n"), query, Segment.pf("\nAnswer:")))

    for agent in ("planner", "critic"):  # the query gets a source, then the traced call reuses it
        rt.run(call(agent), SamplingParams(max_tokens=2))
    event = DispatchEvent(agent="writer", framework="runtime")
    if args.files:
        files = file_trace(lambda: rt.run(call("writer"), SamplingParams(max_tokens=2), event=event))
        entries = {module: files.count(module) for module in dict.fromkeys(files)}
        print(json.dumps({"strategy": rt.strategy.name, "stops": len(files), "files": len(entries),
                          "returns": len(returns(files)), "entries": entries, "path": " -> ".join(files)}, indent=2))
        return
    if args.deep:
        parts = deep_trace(lambda: rt.run(call("writer"), SamplingParams(max_tokens=2), event=event))
        print(json.dumps({"strategy": rt.strategy.name, "stops": len(parts), "parts": len(set(parts)),
                          "returns": len(returns(parts)), "path": " -> ".join(parts)}, indent=2))
        return
    stops = trace(lambda: rt.run(call("writer"), SamplingParams(max_tokens=2), event=event))
    parts = path(stops)
    print(json.dumps({
        "strategy": rt.strategy.name,
        "stops": [f"{part}: {name}" + (f" -> {', '.join(calls)}" if calls else "") for part, name, calls in stops],
        "path": " -> ".join(parts),
        "returns": returns(parts),
    }, indent=2))


if __name__ == "__main__":
    main()

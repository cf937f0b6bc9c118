"""Multi-agent workload traces: the format, a generator, and file I/O.

A trace is the stream of requests an engine sees: who calls (agent, session), the prompt's
token ids, the tokens generated, and how many leading prompt tokens are the agent's fixed
prefix (system prompt and tools; what a warm-up prefills). Traces come from the generator
below or from real runs of the runtime (`agentcache.scout.recorder`).

The generator follows the CacheScout paper's setting: six agents with fixed prefixes, sessions
that each answer one user query in a group chat (every agent reads the query and the whole
conversation so far, so a session's history grows by one output per turn), several sessions
running concurrently with their turns interleaved, and four coordination topologies:
pipeline (a fixed chain through all six agents), debate (a coder-reviewer exchange adjudicated
by a judge), selector (the next agent picked by an LLM, modelled by a routing matrix with a few
likely edges per agent) and random (any other agent, uniformly).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from agentcache.errors import TraceError

__all__ = ["TraceRequest", "Trace", "WorkloadSpec", "generate", "TOPOLOGIES", "AGENTS"]

AGENTS = ("planner", "researcher", "coder", "reviewer", "judge", "writer")

# next-agent probabilities per topology, over AGENTS (rows need not sum to 1; they are normalized)
_ROUTING: dict[str, dict[str, dict[str, float]]] = {
    "debate": {
        "planner": {"coder": 0.9, "researcher": 0.1},
        "researcher": {"coder": 0.9, "planner": 0.1},
        "coder": {"reviewer": 0.95, "judge": 0.05},
        "reviewer": {"coder": 0.75, "judge": 0.25},
        "judge": {"coder": 0.6, "writer": 0.3, "planner": 0.1},
        "writer": {"planner": 0.9, "researcher": 0.1},
    },
    "selector": {
        "planner": {"researcher": 0.5, "coder": 0.4, "writer": 0.1},
        "researcher": {"planner": 0.65, "coder": 0.3, "writer": 0.05},
        "coder": {"reviewer": 0.7, "judge": 0.25, "planner": 0.05},
        "reviewer": {"coder": 0.6, "planner": 0.3, "writer": 0.1},
        "judge": {"coder": 0.6, "planner": 0.3, "reviewer": 0.1},
        "writer": {"planner": 0.85, "reviewer": 0.15},
    },
}
TOPOLOGIES = ("pipeline", "debate", "selector", "random")
TOKEN_ID_LIMIT = 2**31  # token ids are vocabulary indices: ints in [0, 2**31)


@dataclass(frozen=True)
class TraceRequest:
    agent: str
    session: str
    prompt: tuple[int, ...]
    output: tuple[int, ...] = ()
    prefix_len: int = 0  # leading prompt tokens that are the agent's fixed prefix; 0: unknown

    def to_json(self) -> dict[str, Any]:
        return {"agent": self.agent, "session": self.session, "prompt": list(self.prompt),
                "output": list(self.output), "prefix_len": self.prefix_len}


@dataclass
class Trace:
    agents: tuple[str, ...]
    requests: list[TraceRequest]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.agents = tuple(self.agents)
        self.validate()

    def validate(self) -> None:
        """Raise TraceError naming the first problem: unknown agents, empty or bad prompts, ..."""
        if not self.agents or any(not isinstance(a, str) or not a for a in self.agents):
            raise TraceError(f"a trace names its agents with non-empty strings, got {list(self.agents)}")
        if len(set(self.agents)) != len(self.agents):
            raise TraceError(f"a trace lists each of its agents once, got {list(self.agents)}")
        known = set(self.agents)
        for i, r in enumerate(self.requests):
            if not isinstance(r, TraceRequest):
                raise TraceError(f"request {i} is a {type(r).__name__}, not a TraceRequest")
            if not isinstance(r.agent, str) or not isinstance(r.session, str):
                raise TraceError(f"request {i}: agent and session must be strings, got {r.agent!r}, {r.session!r}")
            if type(r.prefix_len) is not int:
                raise TraceError(f"request {i} ({r.agent}): prefix_len must be an int, got {r.prefix_len!r}")
            if r.agent not in known:
                raise TraceError(f"request {i} is by unknown agent {r.agent!r}; the trace's agents are {list(self.agents)}")
            if not r.prompt:
                raise TraceError(f"request {i} ({r.agent}) has an empty prompt")
            for name, ids in (("prompt", r.prompt), ("output", r.output)):
                if not isinstance(ids, tuple):
                    raise TraceError(f"request {i} ({r.agent}): {name} must be a tuple of token ids, got {type(ids).__name__}")
                bad = next((t for t in ids if type(t) is not int or not 0 <= t < TOKEN_ID_LIMIT), None)
                if bad is not None:
                    raise TraceError(f"request {i} ({r.agent}): {name} token id {_show(bad)} is not an int "
                                     "in [0, 2**31); token ids index a vocabulary")
            if not 0 <= r.prefix_len <= len(r.prompt):
                raise TraceError(f"request {i} ({r.agent}): prefix_len {r.prefix_len} outside its {len(r.prompt)}-token prompt")

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    def cached_tokens(self, request: TraceRequest) -> tuple[int, ...]:
        """What an engine caches for a request: the prompt and every generated token it fed back."""
        return request.prompt + request.output[:-1]

    def max_request_blocks(self, block_size: int) -> int:
        return max((len(self.cached_tokens(r)) // block_size for r in self.requests), default=0)

    def total_blocks(self, block_size: int) -> int:
        """Full blocks over every request's cached tokens: more than a pool can ever hold of this trace."""
        return sum(len(self.cached_tokens(r)) // block_size for r in self.requests)

    def save(self, path: str | Path) -> None:
        """JSON lines: a header with the agents and metadata, then one request per line."""
        with open(path, "w") as f:
            f.write(json.dumps({"agents": list(self.agents), "meta": self.meta}) + "\n")
            for r in self.requests:
                f.write(json.dumps(r.to_json()) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        """Read a trace `save` wrote; any problem is a TraceError naming the file (and the line)."""
        lines = _read_lines(path)
        number = 1
        try:
            header = json.loads(lines[0])
            if not isinstance(header["agents"], list):
                raise TypeError(f"'agents' must be a list of names, got {_show(header['agents'])}")
            agents, meta = tuple(header["agents"]), header.get("meta", {})
            requests = []
            for number, line in enumerate(lines[1:], start=2):  # noqa: B007 (named in the error)
                d = json.loads(line)
                requests.append(TraceRequest(d["agent"], d["session"], tuple(d["prompt"]),
                                             tuple(d.get("output", ())), d.get("prefix_len", 0)))
        except RecursionError:
            raise TraceError(f"{path}, line {number}: JSON nested too deeply; "
                             "a trace line is one flat JSON object") from None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # ValueError: bad JSON, an int too long
            raise TraceError(f"{path}, line {number}: not a trace line ({type(exc).__name__}: {exc})") from None
        try:
            return cls(agents, requests, meta)
        except TraceError as exc:
            raise TraceError(f"{path}: {exc}") from None


def _read_lines(path: str | Path) -> list[str]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not UTF-8 text (bad byte at offset {exc.start}); "
                         "a trace is a JSON lines file") from None
    if not lines:
        raise TraceError(f"{path}: empty trace file")
    return lines


@dataclass(frozen=True)
class WorkloadSpec:
    topology: str = "selector"
    num_agents: int = 6  # six: AGENTS with the topology's routing; other sizes get a drawn routing
    sessions: int = 24
    concurrent: int = 4  # sessions whose turns interleave
    turns: int = 12  # agent turns per session
    prefix_tokens: tuple[int, int] = (256, 640)  # each agent's fixed prefix length, drawn in this range
    query_tokens: int = 64
    output_tokens: int = 48  # per turn: the session history grows by this much
    seed: int = 0

    def __post_init__(self) -> None:
        """Raise TraceError (a ValueError) naming the first bad field and what it must be."""
        if self.topology not in TOPOLOGIES:
            raise TraceError(f"unknown topology {_show(self.topology)}; choose one of {', '.join(TOPOLOGIES)}")
        if not _is_int(self.num_agents) or self.num_agents < 2:
            raise TraceError(f"a multi-agent workload needs num_agents of at least 2, got {_show(self.num_agents)}")
        for name in ("sessions", "concurrent", "turns", "query_tokens", "output_tokens"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise TraceError(f"{name} must be a positive int (at least 1), got {_show(value)}")
        if not _is_range(self.prefix_tokens):
            raise TraceError(f"prefix_tokens must be a range (low, high) of ints with 1 <= low <= high, "
                             f"got {_show(self.prefix_tokens)}")


def _is_int(value: object) -> bool:
    return type(value) is int  # not a bool, not a float


def _is_range(value: object) -> bool:
    return (isinstance(value, (tuple, list)) and len(value) == 2 and all(map(_is_int, value))
            and 1 <= value[0] <= value[1])


def _show(value: object) -> str:
    """A short repr for error messages: a huge int or a long string would flood the line."""
    if _is_int(value) and value.bit_length() > 256:
        return f"<an int of {value.bit_length()} bits>"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _agent_names(n: int) -> tuple[str, ...]:
    return AGENTS[:n] + tuple(f"agent{i}" for i in range(len(AGENTS), n))


def _routing(spec: WorkloadSpec, agents: Sequence[str], rng: random.Random) -> list[list[float]]:
    """Row-normalized next-agent matrix over `agents` for the spec's topology."""
    n = len(agents)
    if spec.topology == "pipeline":
        return [[1.0 if j == (i + 1) % n else 0.0 for j in range(n)] for i in range(n)]
    if spec.topology == "random":
        return [[0.0 if j == i else 1.0 / (n - 1) for j in range(n)] for i in range(n)]
    if n == len(AGENTS):
        table = _ROUTING[spec.topology]
        rows = [[table[a].get(b, 0.0) for b in agents] for a in agents]
    else:  # other team sizes: a likely next agent along a cycle (so every agent runs) and two drawn ones
        rows = []
        for i in range(n):
            row = [0.0] * n
            row[(i + 1) % n] = 0.5
            others = [j for j in range(n) if j not in (i, (i + 1) % n)]
            for j, p in zip(rng.sample(others, min(2, len(others))), (0.3, 0.2)):
                row[j] = p
            rows.append(row)
    return [[p / sum(row) for p in row] for row in rows]


class _Tokens:
    """Fresh token ids: each piece of content gets ids no other piece uses."""

    def __init__(self) -> None:
        self.next = 1000

    def take(self, n: int) -> tuple[int, ...]:
        ids = tuple(range(self.next, self.next + n))
        self.next += n
        return ids


def generate(spec: WorkloadSpec) -> Trace:
    """A deterministic trace (same spec, same trace) of `spec.sessions` sessions, `spec.concurrent` at a time."""
    rng = random.Random(spec.seed)
    agents = _agent_names(spec.num_agents)
    routing = _routing(spec, agents, rng)
    tokens = _Tokens()
    prefixes = [tokens.take(rng.randint(*spec.prefix_tokens)) for _ in agents]
    first_agent = 0

    def session_steps(number: int) -> Iterator[TraceRequest]:
        name = f"s{number}"
        history: tuple[int, ...] = tokens.take(spec.query_tokens)  # the user query opens the conversation
        agent = first_agent if spec.topology != "random" else rng.randrange(len(agents))
        for _ in range(spec.turns):
            output = tokens.take(spec.output_tokens)
            yield TraceRequest(agents[agent], name, prefixes[agent] + history, output, len(prefixes[agent]))
            history = history + output
            agent = rng.choices(range(len(agents)), weights=routing[agent])[0]

    requests: list[TraceRequest] = []
    started = 0
    running: list[Iterator[TraceRequest]] = []
    while started < spec.sessions or running:
        while len(running) < spec.concurrent and started < spec.sessions:
            running.append(session_steps(started))
            started += 1
        session = rng.choice(running)  # the next turn comes from any running session
        step = next(session, None)
        if step is None:
            running.remove(session)
        else:
            requests.append(step)
    meta = {"generator": "agentcache.scout.workloads", **{k: getattr(spec, k) for k in spec.__dataclass_fields__}}
    meta["prefix_tokens"] = list(spec.prefix_tokens)
    return Trace(agents, requests, meta)

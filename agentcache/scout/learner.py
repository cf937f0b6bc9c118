"""Transition learner: an online first-order Markov chain over agent dispatches (CacheScout Sec. 3.2).

Each dispatch of agent j after a different agent i (in the same session) adds one to C[i][j];
an agent calling the model several times in a row (a tool loop) is one turn, as in the paper's
Algorithm 1, so the prediction is always the next *other* agent. Probabilities
are smoothed, P[i][j] = (C[i][j] + eps) / (sum_k C[i][k] + n * eps) (Eq. 3), so an unseen edge is
never impossible. Transitions are counted per session: concurrent sessions interleave their
dispatches, and the workflow's structure lives within each session. Requests without a session
form one stream of their own.

Agents are named by the caller, or by a fingerprint of their prompt's leading blocks when no
framework names them (the same system prompt gives the same fingerprint).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Sequence

from agentcache.engine.blocks import block_hash

__all__ = ["TransitionLearner", "prompt_fingerprint"]


def prompt_fingerprint(token_ids: Sequence[int], block_size: int, blocks: int) -> str | None:
    """An agent name from the hashes of the prompt's first `blocks` full blocks; None if it has none."""
    full = min(blocks, len(token_ids) // block_size)
    if full == 0:
        return None
    parent = None
    for i in range(full):
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size], None)
    return "fp:" + parent.hex()[:12]


class TransitionLearner:
    """Counts agent-to-agent transitions online; predicts the next agent and how predictable that is."""

    def __init__(self, smoothing: float = 0.1, *, max_agents: int = 64, max_sessions: int = 1024) -> None:
        if not smoothing > 0:
            raise ValueError(f"smoothing must be positive, got {smoothing}")
        if max_agents < 1 or max_sessions < 1:
            raise ValueError(f"max_agents and max_sessions must be at least 1, got {max_agents}, {max_sessions}")
        self.smoothing = smoothing
        self.max_agents = max_agents
        self.max_sessions = max_sessions
        self.agents: list[str] = []
        self.index: dict[str, int] = {}
        self.counts: list[list[int]] = []  # (n, n): counts[i][j] = dispatches of j right after i
        self.row_totals: list[int] = []
        self.dispatches = 0
        self.untracked = 0  # dispatches of agents beyond max_agents
        self.last_session_agent: OrderedDict[str | None, int] = OrderedDict()  # session -> its current agent
        self.dirty_rows: set[int] = set()  # rows whose probabilities changed since the scorer last looked

    @property
    def num_agents(self) -> int:
        return len(self.agents)

    def agent_id(self, agent: str) -> int | None:
        """Index of `agent`, registering it if new; None when max_agents are already tracked."""
        index = self.index.get(agent)
        if index is not None:
            return index
        if len(self.agents) >= self.max_agents:
            return None
        index = len(self.agents)
        self.index[agent] = index
        self.agents.append(agent)
        for row in self.counts:
            row.append(0)
        self.counts.append([0] * (index + 1))
        self.row_totals.append(0)
        self.dirty_rows.update(range(index + 1))  # n grew: every row's smoothing changed
        return index

    def observe(self, agent: str, session: str | None = None) -> int | None:
        """Record that `agent` runs now in `session`; returns its index (None if untracked)."""
        if not isinstance(agent, str) or not agent:
            raise ValueError(f"an agent name must be a non-empty string, got {agent!r}")
        index = self.agent_id(agent)
        self.dispatches += 1
        if index is None:
            self.untracked += 1
            self.last_session_agent.pop(session, None)  # the next agent did not follow the previous one
            return None
        previous = self.last_session_agent.pop(session, None)
        if previous is not None and previous != index:  # an agent's repeated calls are one turn (Alg. 1, l. 18)
            self.counts[previous][index] += 1
            self.row_totals[previous] += 1
            self.dirty_rows.add(previous)
        self.last_session_agent[session] = index
        if len(self.last_session_agent) > self.max_sessions:
            self.last_session_agent.popitem(last=False)
        return index

    def interrupt(self, session: str | None = None) -> None:
        """A request nobody could name ran in `session`: the next agent did not follow the last one."""
        self.last_session_agent.pop(session, None)

    def row(self, i: int) -> list[float]:
        """P[i][:] (Eq. 4)."""
        eps = self.smoothing
        denominator = self.row_totals[i] + eps * len(self.agents)
        return [(c + eps) / denominator for c in self.counts[i]]

    def predict(self, agent: str | None = None, session: str | None = None) -> str | None:
        """The most likely next agent after `agent` (default: the session's current one, or the last
        dispatched agent for a session not tracked), Eq. 5.

        None when that agent is unknown or has never been followed by anyone. Ties go to the
        agent registered first, so the answer is deterministic.
        """
        if agent is not None:
            i = self.index.get(agent)
        elif session in self.last_session_agent:
            i = self.last_session_agent[session]
        else:  # a session the learner does not track (e.g. all dispatches learned as one stream): the last agent
            i = next(reversed(self.last_session_agent.values()), None)
        if i is None or self.row_totals[i] == 0:
            return None
        row = self.counts[i]
        return self.agents[max(range(len(row)), key=lambda j: (row[j], -j))]

    def predictability(self) -> float:
        """R = 1 - H(A_t+1 | A_t) / H(A_t+1) (Eq. 2), from the smoothed rows weighted by how often
        each agent was followed. 0 with no transitions yet, or when every successor is equally likely."""
        total = sum(self.row_totals)
        n = len(self.agents)
        if total == 0 or n < 2:
            return 0.0
        conditional = 0.0
        marginal = [0.0] * n
        for i in range(n):
            weight = self.row_totals[i] / total
            if weight == 0:
                continue
            row = self.row(i)
            conditional -= weight * sum(p * math.log(p) for p in row)
            for j, p in enumerate(row):
                marginal[j] += weight * p
        entropy = -sum(p * math.log(p) for p in marginal if p > 0)
        return 0.0 if entropy <= 0 else max(0.0, 1.0 - conditional / entropy)

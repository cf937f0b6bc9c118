"""Survival scorer: how soon each agent is likely to run again (CacheScout Sec. 3.3, Eq. 7-8).

The learned transition matrix is pruned to a sparse graph of likely edges, P(b | a) >= tau
(Eq. 7). A breadth-first search from the agents that just ran gives each agent its hop
distance E[a], and its survival 1 - min(E[a], E_max) / E_max (Eq. 8).

Two readings of the paper, stated here because they change the numbers:
- Hops count from 1: survival is the chance an agent runs within the next K steps (Eq. 6 has
  k >= 1), so the agent that just ran is scored by how soon it comes back, not as certain.
- With concurrent sessions the next request may come from any recently active session. Each
  session's current agent gives one survival table (a BFS from it); a block that several
  sessions share (an agent's prefix) survives unless every active session misses it,
  1 - prod_s (1 - survival_s). A block private to one session (its history) is scored from
  that session's table alone (see policies.SurvivalPolicy). With one session this is Eq. 8.

Only rows whose counts changed are re-thresholded; per-source tables are kept until the graph
changes, so a refresh is usually a few table lookups and one combination.
"""

from __future__ import annotations

from typing import Sequence

from agentcache.scout.learner import TransitionLearner

__all__ = ["SurvivalScorer"]


class SurvivalScorer:
    def __init__(
        self, learner: TransitionLearner, *, edge_threshold: float = 0.2, horizon: int = 4, active_sessions: int = 4
    ) -> None:
        if not 0 < edge_threshold <= 1:
            raise ValueError(f"edge_threshold must be in (0, 1], got {edge_threshold}")
        if horizon < 1 or active_sessions < 1:
            raise ValueError(f"horizon and active_sessions must be at least 1, got {horizon}, {active_sessions}")
        self.learner = learner
        self.edge_threshold = edge_threshold
        self.horizon = horizon
        self.active_sessions = active_sessions
        self.successors: list[list[int]] = []  # threshold graph: successors[a] = agents b with P(b|a) >= tau
        self.survival: list[float] = []  # Eq. 8 per agent index
        self._survival_at_hop = [1.0 - h / horizon for h in range(horizon + 1)]
        self._sources: tuple[int, ...] = ()
        self._from: dict[int, list[float]] = {}  # source agent -> survival table
        self.active_now: dict[str | None, int] = {}
        self.refreshes = 0

    def active(self) -> dict[str | None, int]:
        """The most recently active sessions (at most `active_sessions`) and their current agents."""
        found: dict[str | None, int] = {}
        for session in reversed(self.learner.last_session_agent):
            found[session] = self.learner.last_session_agent[session]
            if len(found) == self.active_sessions:
                break
        return found

    def maybe_refresh(self) -> bool:
        """Refresh if the current agents or the graph changed since the last refresh; True if it ran."""
        self.active_now = self.active()
        sources = tuple(dict.fromkeys(self.active_now.values()))
        if sources == self._sources and not self.learner.dirty_rows:
            return False
        self.refresh(sources)
        return True

    def refresh(self, sources: tuple[int, ...]) -> None:
        learner = self.learner
        n = learner.num_agents
        if len(self.successors) < n:  # new agents: every per-source table is one entry short
            self.successors.extend([] for _ in range(n - len(self.successors)))
            self._from.clear()
        tau = self.edge_threshold
        for a in learner.dirty_rows:
            edges = [b for b, p in enumerate(learner.row(a)) if p >= tau]
            if edges != self.successors[a]:
                self.successors[a] = edges
                self._from.clear()  # the graph changed: per-source tables are stale
        learner.dirty_rows.clear()
        self.survival = self._combined(sources, n)
        self._sources = sources
        self.refreshes += 1

    def _combined(self, sources: tuple[int, ...], n: int) -> list[float]:
        """Survival of a block any active session may reuse: 1 - prod_s (1 - survival from s's agent)."""
        if len(sources) == 1:
            return self.survival_from(sources[0])
        miss = [1.0] * n
        for source in sources:
            miss = [m * (1.0 - p) for m, p in zip(miss, self.survival_from(source))]
        return [1.0 - m for m in miss]

    def _search(self, sources: tuple[int, ...], n: int) -> list[float]:
        """Survival of every agent from a BFS over the threshold graph that starts at `sources`."""
        unreached = self.horizon + 1
        hops = [unreached] * n
        frontier: Sequence[int] = sources
        successors = self.successors
        for distance in range(1, self.horizon + 1):  # E[a] >= 1: the agent must run again (Eq. 6)
            following: list[int] = []
            for a in frontier:
                for b in successors[a]:
                    if hops[b] == unreached:
                        hops[b] = distance
                        following.append(b)
            if not following:
                break
            frontier = following
        table = self._survival_at_hop
        return [table[h] if h <= self.horizon else 0.0 for h in hops]

    def survival_from(self, agent_index: int) -> list[float]:
        """Survival of every agent seen from one session's current agent (memoized until the graph changes)."""
        table = self._from.get(agent_index)
        if table is None:
            table = self._from[agent_index] = self._search((agent_index,), self.learner.num_agents)
        return table

    @property
    def table_entries(self) -> int:
        """Values held in the memoized per-source survival tables."""
        return sum(len(t) for t in self._from.values())

    def invalidate(self) -> None:
        """Forget the per-source tables (as after an edge change); the next refresh searches again."""
        self._from.clear()

    def survival_of(self, agent_index: int) -> float:
        survival = self.survival
        return survival[agent_index] if 0 <= agent_index < len(survival) else 0.0

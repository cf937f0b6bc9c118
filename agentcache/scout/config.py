"""CacheScout's constants, chosen on the generated workloads and ablated by benchmarks/hit_rate.py.

The paper names the constants but gives no values. Ours, and why:
- smoothing eps = 0.1: an agent seen after another once already outweighs the prior (1 vs 0.1),
  yet an unseen edge keeps a small, non-zero probability.
- edge_threshold tau = 0.25: above 1/6, so six agents routed uniformly at random leave no
  edges; survival then flattens and the score falls back to recency, as the paper intends. On
  the generated traces 0.25 beat 0.15, 0.35 and 0.5 on selector and random (hit_rate.py).
- horizon E_max = 4: deep enough to rank a six-agent pipeline's next agents apart.
- decay lambda = 0.02 per dispatch: a block untouched for 50 dispatches (about four turns of
  every agent at four sessions) keeps e^-1 of its recency weight. Faster decay (0.1, 0.3) lets
  recency override survival and loses hits; 0 (survival alone) is about as good but leaves ties
  among equally surviving blocks to block ids.
- floor delta = 0.05: a block of an agent the graph cannot reach yet still ranks by recency
  (0.01-0.2 made no difference on the generated traces).
- r_min = 0.3: warm up only when the current agent removes at least 30% of the uncertainty
  about the next one (the paper's selector workload sits at 0.57, random at 0.12).
- fingerprint_blocks = 2: agents without a name are told apart by their first 2 blocks (32
  tokens). Agents whose prompts open with the same 32 tokens (a shared framework header) are
  merged into one; name them (the runtime does) or raise this.
- active_sessions = 4: survival is searched from the current agents of the 4 most recently
  dispatched sessions (the generated traces run 4 at a time; 1, 2 and 8 were worse).
- per_session = True: transitions are counted within a session and a block private to one
  session is scored from that session's agent (False: one stream, as in the paper; -5 points
  on selector traces).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["ScoutConfig"]


@dataclass(frozen=True)
class ScoutConfig:
    smoothing: float = 0.1
    edge_threshold: float = 0.25
    horizon: int = 4
    decay: float = 0.02
    floor: float = 0.05
    r_min: float = 0.3
    fingerprint_blocks: int = 2
    active_sessions: int = 4
    per_session: bool = True
    max_agents: int = 64
    warmup_min_gap: int = 1  # dispatches between two warm-ups; 1: at most one warm-up per dispatch

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "per_session":
                if not isinstance(value, bool):
                    raise ValueError(f"ScoutConfig.per_session must be True or False, got {value!r}")
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"ScoutConfig.{f.name} must be a number, got {value!r}")
        checks = {
            "smoothing": self.smoothing > 0,
            "edge_threshold": 0 < self.edge_threshold <= 1,
            "horizon": isinstance(self.horizon, int) and self.horizon >= 1,
            "decay": self.decay >= 0,
            "floor": self.floor > 0,
            "r_min": 0 <= self.r_min <= 1,
            "fingerprint_blocks": isinstance(self.fingerprint_blocks, int) and self.fingerprint_blocks >= 1,
            "active_sessions": isinstance(self.active_sessions, int) and self.active_sessions >= 1,
            "max_agents": isinstance(self.max_agents, int) and 1 <= self.max_agents <= 32767,  # int16 block map
            "warmup_min_gap": isinstance(self.warmup_min_gap, int) and self.warmup_min_gap >= 1,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"ScoutConfig: invalid {', '.join(f'{n}={getattr(self, n)!r}' for n in bad)}")

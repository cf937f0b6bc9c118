"""Warm-up coordinator: between calls, prefill the predicted next agent's prefix (CacheScout Sec. 3.4).

It decides; the caller (the runtime, or a trace replay) executes the warm-up as a request that
generates at most one token and is marked `warmup`, so it never counts as a dispatch. A warm-up
is planned only when execution is predictable enough (R >= R_min, Eq. 11), at most once every
`warmup_min_gap` dispatches, for an agent whose prefix is known and not already cached.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

from agentcache.engine.tokens import common_prefix
from agentcache.scout.config import ScoutConfig
from agentcache.scout.learner import TransitionLearner

__all__ = ["Warmup", "WarmupCoordinator"]

MAX_PREFIXES = 1024  # (namespace, agent) prefixes remembered; the least recently seen go first


@dataclass(frozen=True)
class Warmup:
    agent: str
    prefix: tuple[int, ...]  # the agent's fixed prefix: prefill it, generate at most one token
    namespace: str | None = None  # the exact-block namespace (a tenant's) the prefix was seen in


class WarmupCoordinator:
    def __init__(self, learner: TransitionLearner, config: ScoutConfig | None = None, *, min_prefix: int = 1) -> None:
        self.learner = learner
        self.config = config or ScoutConfig()
        self.min_prefix = min_prefix  # shorter prefixes are not worth a request
        # (namespace, agent) -> its prefix: a tenant's agents are learned and warmed in its own namespace
        self.prefixes: OrderedDict[tuple[str | None, str], tuple[int, ...]] = OrderedDict()
        self._confirmed: set[tuple[str | None, str]] = set()  # prefixes declared or seen twice
        self._last_dispatch = -(10**9)
        self.outcomes: Counter[str] = Counter()  # issued, unpredictable, rate_limited, unknown_prefix, cached

    def observe(self, agent: str, prompt: Sequence[int], prefix_len: int = 0, namespace: str | None = None) -> None:
        """Learn `agent`'s prefix: declared (prefix_len > 0), else the common prefix of its prompts.
        `namespace` is the exact-block namespace of the call (its tenant's); a warm-up runs there."""
        if agent not in self.learner.index:
            return  # an agent the learner does not track is never predicted: keep no prefix for it
        key = (namespace, agent)
        known = self.prefixes.get(key)
        if prefix_len > 0:
            self.prefixes[key] = tuple(prompt[:prefix_len])
            self._confirmed.add(key)
        elif known is None:
            self.prefixes[key] = tuple(prompt)
        else:
            self.prefixes[key] = known[: common_prefix(known, prompt)]
            self._confirmed.add(key)
        self.prefixes.move_to_end(key)
        while len(self.prefixes) > MAX_PREFIXES:
            self._confirmed.discard(self.prefixes.popitem(last=False)[0])

    def next_warmup(
        self, session: str | None = None, is_cached: Callable[[Sequence[int], str | None], bool] | None = None,
        namespace: str | None = None,
    ) -> Warmup | None:
        """The warm-up to run now for `session` (of the tenant whose namespace is `namespace`), or None
        (the reason is counted in `outcomes`).

        `is_cached(prefix, namespace)` says whether the cache already holds all it can of that prefix."""
        dispatches = self.learner.dispatches
        if dispatches - self._last_dispatch < self.config.warmup_min_gap:
            self.outcomes["rate_limited"] += 1
            return None
        if self.learner.predictability() < self.config.r_min:
            self.outcomes["unpredictable"] += 1
            return None
        agent = self.learner.predict(session=session)
        key = (namespace, agent)
        prefix = self.prefixes.get(key) if agent is not None else None
        if prefix is None or key not in self._confirmed or len(prefix) < self.min_prefix:
            self.outcomes["unknown_prefix"] += 1
            return None
        if is_cached is not None and is_cached(prefix, namespace):
            self.outcomes["cached"] += 1
            return None
        self._last_dispatch = dispatches
        self.outcomes["issued"] += 1
        return Warmup(agent, prefix, namespace)

"""What reusing a shared segment costs and saves on this engine and model, measured as calls run.

Two lines are fitted online (least squares over the latest calls): a call's prefill time against
the tokens it computed (`prefill`: its slope is what one token saves when reused) and the time to
plan a reused segment against its tokens (`reuse`: looking the source up, re-aligning it,
correcting it). A shared segment is worth reuse work only when what its reuse saves covers twice
what it costs on the critical path, plus what it costs the agent's next call (`Continuations`);
otherwise it runs as NonShared would, with no reuse work at all (no KV captured, nothing stored,
nothing learned). Until both lines are fitted, a segment is worth it from PRIOR_BREAK_EVEN tokens
that the next call would not have found in the prefix cache.

Reused KV is approximate, so it is never cached: an agent whose next call extends this prompt (a
conversation that grows) would find the prefix cache only up to the first reused segment, and
prefill again everything after it. `Continuations` learns, per agent, how much of a prompt its
next call in the session finds again, and that is charged to any reuse before it.

Learning (anchors, verification) runs when the engine is idle (`agentcache.idle`), so it is not
charged to a call's critical path here.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Sequence

import torch

__all__ = ["Continuations", "CostModel", "FreeReuse", "OnlineLine", "PRIOR_BREAK_EVEN", "MARGIN"]

PRIOR_BREAK_EVEN = 64  # tokens: reuse work is worth it from here until the lines are fitted
MARGIN = 2.0  # a reuse must save at least this many times what it costs
WINDOW = 64  # observations each line is fitted on
MIN_POINTS = 4
LATEST_PROMPTS = 256  # (tenant, session, agent) whose latest prompt is kept to compare the next one with


class OnlineLine:
    """y ≈ intercept + slope · x over the latest `window` points. Without spread in x the split is
    unknown: `flat` puts all of y in the intercept (a cost: overestimated for shorter x), otherwise
    all in the slope (a saving per token, its fixed part included)."""

    def __init__(self, window: int = WINDOW, *, flat: bool = False) -> None:
        self.points: deque[tuple[float, float]] = deque(maxlen=window)
        self.flat = flat
        self._fit: tuple[float, float] | None = None  # fitted once per point added: read per planned segment

    def add(self, x: float, y: float) -> None:
        if x >= 0 and y >= 0:
            self.points.append((float(x), float(y)))
            self._fit = self._least_squares()

    def fit(self) -> tuple[float, float] | None:
        """(intercept, slope), both ≥ 0; None before MIN_POINTS points."""
        return self._fit

    def _least_squares(self) -> tuple[float, float] | None:
        n = len(self.points)
        if n < MIN_POINTS:
            return None
        mean_x = sum(x for x, _ in self.points) / n
        mean_y = sum(y for _, y in self.points) / n
        var = sum((x - mean_x) ** 2 for x, _ in self.points)
        if var <= 0.01 * max(1.0, mean_x ** 2) * n:  # x within ~10% of its mean: no spread to split on
            if self.flat:
                return mean_y, 0.0
            return 0.0, mean_y / mean_x if mean_x > 0 else 0.0
        slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in self.points) / var)
        return max(0.0, mean_y - slope * mean_x), slope


class Continuations:
    """How much of an agent's prompt its next call in the same session starts with, learned per
    (tenant, agent) over its calls, apart for an agent's first call in a session and its later
    ones (a conversation's first turn is always followed; its last is not): the share of a prompt
    a dense call leaves in the prefix cache for the agent's next call."""

    def __init__(self, sessions: int = LATEST_PROMPTS) -> None:
        # (tenant, session, agent) -> (its latest prompt, whether that call was a follow-up); an LRU
        self.latest: OrderedDict[tuple, tuple[torch.Tensor, bool]] = OrderedDict()
        self.sessions = sessions
        self.calls: Counter[tuple] = Counter()  # (tenant, agent, follow-up) -> prompts seen
        self.found: Counter[tuple] = Counter()  # (tenant, agent, follow-up) -> shares the next calls started with

    def observe(self, tenant: str | None, session: str | None, agent: str, prompt: Sequence[int]) -> float:
        """A call of `agent` in `session` with this prompt: learn how much of the agent's previous
        prompt in the session it starts with, and return the share of this prompt the agent's next
        call is expected to start with (from the calls before this one)."""
        key, tokens = (tenant, session, agent), torch.tensor(prompt, dtype=torch.int64, device="cpu")  # host-side bookkeeping
        previous = self.latest.pop(key, None)
        if previous is not None and len(previous[0]):
            before, was_follow_up = previous
            n = min(len(before), len(tokens))
            differs = (before[:n] != tokens[:n]).nonzero()
            shared = int(differs[0, 0]) if len(differs) else n
            self.found[(tenant, agent, was_follow_up)] += shared / len(before)
        follow_up = previous is not None
        expected = self.share(tenant, agent, follow_up)
        self.calls[(tenant, agent, follow_up)] += 1
        self.latest[key] = (tokens, follow_up)
        while len(self.latest) > self.sessions:
            self.latest.popitem(last=False)
        return expected

    def share(self, tenant: str | None, agent: str, follow_up: bool) -> float:
        """The expected share of `agent`'s prompt its next call in the session finds cached."""
        key = (tenant, agent, follow_up)
        return self.found[key] / self.calls[key] if self.calls[key] else 0.0


class CostModel:
    def __init__(self) -> None:
        self.prefill = OnlineLine()  # seconds of a call's prefill vs tokens it computed
        self.reuse = OnlineLine(flat=True)  # seconds to plan a reused segment vs its tokens
        self.continuations = Continuations()
        self.skipped_segments = 0
        self.skipped_tokens = 0

    def observe_prefill(self, computed_tokens: int, seconds: float) -> None:
        if computed_tokens > 0:
            self.prefill.add(computed_tokens, seconds)

    def observe_reuse(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self.reuse.add(tokens, seconds)

    def worth(self, tokens: int, lost: float = 0.0) -> bool:
        """Whether reusing a shared segment of `tokens` tokens can pay for its reuse work and for
        the `lost` tokens the agent's next call is expected to prefill again because of it."""
        prefill, reuse = self.prefill.fit(), self.reuse.fit()
        if prefill is None or reuse is None:
            return tokens - lost >= PRIOR_BREAK_EVEN
        fixed, per_token = reuse
        saved = prefill[1] * (tokens - lost)
        return saved > MARGIN * (fixed + per_token * tokens)

    def skipped(self, tokens: int) -> None:
        self.skipped_segments += 1
        self.skipped_tokens += tokens

    # --- the cost gate of a strategy -------------------------------------------------------

    def worth_reusing(self, tokens: int, lost: float = 0.0) -> bool:
        """`worth`, counting a segment it turns away."""
        if self.worth(tokens, lost):
            return True
        self.skipped(tokens)
        return False

    def kept_for_next_call(self, call) -> int:
        """How many of this call's prompt tokens (a `TokenizedCall`) the agent's next call in the
        session is expected to find in the prefix cache if this call is served exactly."""
        scope = call.scope
        return int(self.continuations.observe(scope.tenant, scope.session, call.agent, call.prompt) * len(call.prompt))

    def observe_call(self, served) -> None:
        """Time a served call's prefill (a `Served`) and its reused segments' planning."""
        result = served.result
        self.observe_prefill(result.computed_tokens, max(0.0, result.ttft_s - result.queued_s))
        for decision in served.decisions.values():
            if decision.reused:
                self.observe_reuse(decision.covered, decision.plan_s)

    def break_even(self) -> int | None:
        """The fewest tokens worth reuse work now (None: none are)."""
        for tokens in (1 << k for k in range(16)):
            if self.worth(tokens):
                low = tokens // 2
                while low + 1 < tokens:  # bisect (worth is monotone in tokens)
                    mid = (low + tokens) // 2
                    low, tokens = (low, mid) if self.worth(mid) else (mid, tokens)
                return tokens
        return None

    def figures(self) -> dict:
        prefill, reuse = self.prefill.fit(), self.reuse.fit()
        return dict(
            prefill_s_per_token=prefill[1] if prefill else None,
            reuse_fixed_s=reuse[0] if reuse else None, reuse_s_per_token=reuse[1] if reuse else None,
            break_even_tokens=self.break_even(), not_worth_segments=self.skipped_segments,
            not_worth_tokens=self.skipped_tokens)


class FreeReuse:
    """The baselines' cost gate: every shared segment is worth reuse, whatever it costs."""

    def worth(self, tokens: int, lost: float = 0.0) -> bool:
        return True

    worth_reusing = worth

    def kept_for_next_call(self, call) -> int:
        return 0

    def observe_call(self, served) -> None:
        pass

    def figures(self) -> dict:
        return {}

"""Shared-context strategies: one description, switched per run.

Every strategy runs through the same corrector; they differ only in these switches.

| name               | reuse | correct | chained | ranks (base, Δ) | anchors |
| ------------------ | ----- | ------- | ------- | --------------- | ------- |
| nonshared          | no    | -       | -       | -               | -       |
| fullshared         | yes   | no      | yes     | -               | -       |
| kvcomm             | yes   | yes     | no      | full            | 20      |
| kvcmas             | yes   | yes     | yes     | 32, 32          | 10      |
| kvcmas_nonchained  | yes   | yes     | no      | 32, 32          | 10      |
| kvcmas_fullrank    | yes   | yes     | yes     | full            | 10      |

Chained: an edge's source is the latest materialization of the segment along the workflow,
and the first agent prefills densely (exact). Non-chained: the source is a context-free
reference (the segment prefilled after a short neutral lead-in, made once when first needed)
or, for an agent's output, the generating agent's cache; every consumer is corrected from it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["Strategy", "STRATEGIES", "get_strategy"]


@dataclass(frozen=True)
class Strategy:
    name: str
    reuse: bool = True  # False: prefill every shared segment (exact prefix caching still on)
    correct: bool = True  # False: inject the aligned source cache as it is
    chained: bool = True
    base_rank: int | None = 32  # None: full-dimensional
    delta_rank: int | None = 32
    max_anchors: int = 10  # V, per slot
    tau: float = 0.3  # accept a correction when the gate's normalized entropy is at most tau
    temperature: float = 1.0  # T of the gate's softmax (the token-wise weights always use T = 1)

    def __post_init__(self) -> None:
        for name in ("base_rank", "delta_rank"):
            rank = getattr(self, name)
            if rank is not None and (type(rank) is not int or rank < 1):
                raise ValueError(f"Strategy.{name} must be a positive int or None (full rank), got {rank!r}")
        if type(self.max_anchors) is not int or self.max_anchors < 1:
            raise ValueError(f"Strategy.max_anchors must be a positive int, got {self.max_anchors!r}")
        if not 0.0 <= self.tau <= 1.0:
            raise ValueError(f"Strategy.tau is a normalized entropy threshold in [0, 1], got {self.tau!r}")
        if not self.temperature > 0:
            raise ValueError(f"Strategy.temperature must be positive, got {self.temperature!r}")

    def replace(self, **changes) -> "Strategy":
        return dataclasses.replace(self, **changes)


STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("nonshared", reuse=False),
        Strategy("fullshared", correct=False),
        Strategy("kvcomm", chained=False, base_rank=None, delta_rank=None, max_anchors=20),
        Strategy("kvcmas"),
        Strategy("kvcmas_nonchained", chained=False),
        Strategy("kvcmas_fullrank", base_rank=None, delta_rank=None),
    )
}


def get_strategy(strategy: str | Strategy) -> Strategy:
    if isinstance(strategy, Strategy):
        return strategy
    try:
        return STRATEGIES[strategy]
    except KeyError:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {sorted(STRATEGIES)}") from None

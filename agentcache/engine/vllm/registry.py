"""What the engine and its hooks inside vLLM (logits processor, KV connector, scheduler) share.

With one worker (tensor_parallel_size=1) they run in one process and one thread (the engine loop
steps vLLM), but vLLM builds the hooks itself and hands them only a request's `SamplingParams` (the
logits processor) or its `Request` (connector, scheduler). So each request carries a key in
`SamplingParams.extra_args`, and the engine files what the hooks need under that key here, and the
hooks file what they produce. Keys are unique per process, so one registry serves every engine.
With worker processes the registry is the scheduler's side only: what workers need travels in the
connector's metadata, and what they produce comes back in its worker metadata (`connector`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["RequestHooks", "REGISTRY", "WORKER_LOGITS", "new_key", "key_of", "EXTRA_KEY"]

EXTRA_KEY = "agentcache_key"  # SamplingParams.extra_args entry naming the request's RequestHooks
_keys = itertools.count()


def new_key() -> str:
    return f"ac{next(_keys)}"


@dataclass(eq=False)
class RequestHooks:
    """One request's business with the hooks: what to inject, capture and record, and what came back."""

    # in: set by the engine before the request is added
    inject: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (start, K, V) runs
    capture: list[tuple[int, int]] = field(default_factory=list)  # [begin, end) position ranges to read back
    capture_generated: bool = False  # also read back the KV of the generated tokens fed to the model
    approx_from: int | None = None  # first position whose KV is approximate (hashed under `lineage_key`)
    lineage_key: str | None = None
    owner: str | None = None  # the agent, session and kind of the call: the eviction policy's dispatch
    session: str | None = None
    warmup: bool = False
    visit: Any = None  # the policy's record of the dispatch (its tag for the blocks the call releases)
    lookup_limit: int | None = None  # serve no more than this many tokens from the prefix cache
    uncounted: bool = False  # not a call's first lookup (a later phase, a warm-up): out of the hit statistics
    # out: filled by the hooks
    last_logits: torch.Tensor | None = None  # (V,) float32 at the last prompt position
    injected: int = 0  # tokens the connector claimed
    injected_from: int | None = None  # the first of them
    load_failed: bool = False  # writing them failed: vLLM recomputed those blocks
    captured: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # with worker processes (tensor parallel): the request's blocks are kept after it finished until
    # the workers sent back its captured KV and logits (`deferred`), then `done`
    deferred: bool = False
    done: bool = False
    dropped: bool = False  # its call is gone (cancelled, failed): nothing waits for what comes back


REGISTRY: dict[str, RequestHooks] = {}
# in a worker process (no registry): the logits processor's rows by key, sent back by the connector
WORKER_LOGITS: dict[str, torch.Tensor] = {}


def key_of(params: Any) -> str | None:
    """The registry key a request's SamplingParams carries, if any."""
    extra = getattr(params, "extra_args", None) or {}
    return extra.get(EXTRA_KEY)

"""The Engine contract: what the runtime asks of any engine (embedded PyTorch, vLLM).

One call = an ordered list of segments, each with a plan step:

- `PREFIX`: serve the segment from the exact prefix cache as far as the pool holds it, prefill
  the rest densely. Only a leading run of PREFIX segments is looked up.
- `DENSE`: prefill the segment under the call's real preceding context.
- `INJECT`: use the given KV for the segment (re-aligned to its position if needed); with a
  `recompute` (engines with `supports_recompute`), part of it is recomputed under the call's own
  context instead: CacheBlend's tokens (`TokenRecompute`) or DroidSpeak's layers (`LayerRecompute`).

The engine reports, per segment, how each token was materialized, and hands back the KV of
every segment and of the generated tokens with the positions they sit at.
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Callable, Protocol, Sequence, runtime_checkable

import torch

from agentcache.engine.eviction import EvictionPolicy
from agentcache.engine.grammar import OutputConstraint
from agentcache.engine.kv import KVLayout, SegmentKV
from agentcache.errors import InputError, PlanError, SegmentError

__all__ = [
    "Step",
    "TokenRecompute",
    "LayerRecompute",
    "SegmentPlan",
    "SamplingParams",
    "ExecRequest",
    "SegmentOutcome",
    "ExecResult",
    "CacheStats",
    "Engine",
]


class Step(str, Enum):
    PREFIX = "prefix"
    DENSE = "dense"
    INJECT = "inject"


@dataclass(frozen=True)
class TokenRecompute:
    """CacheBlend: recompute the `fraction` of the injected tokens whose KV deviates most.

    Layers 0..`probe_layer` first run for every token after the prefix (exact there: layer 0's KV
    depends on the token and position only); the tokens whose KV at `probe_layer` is furthest from
    the injected KV then run through every layer, attending to the injected KV of the others."""

    fraction: float
    probe_layer: int = 1

    def __post_init__(self) -> None:
        if not (_is_number(self.fraction) and 0.0 <= self.fraction <= 1.0):
            raise PlanError(f"TokenRecompute.fraction must be in [0, 1], got {self.fraction!r}")
        if type(self.probe_layer) is not int or self.probe_layer < 0:
            raise PlanError(f"TokenRecompute.probe_layer must be an int >= 0, got {self.probe_layer!r}")


@dataclass(frozen=True)
class LayerRecompute:
    """DroidSpeak: recompute layers `first`..`last` of every injected token, starting from
    `hidden`, the hidden states that entered layer `first` when the source computed these tokens
    (its "E cache"); the other layers keep the injected KV."""

    first: int
    last: int
    hidden: torch.Tensor = field(repr=False)  # (T, hidden size), T = the segment's tokens

    def __post_init__(self) -> None:
        if type(self.first) is not int or type(self.last) is not int or not 0 <= self.first <= self.last:
            raise PlanError(f"LayerRecompute needs layers 0 <= first <= last, got {self.first!r}..{self.last!r}")
        if not isinstance(self.hidden, torch.Tensor) or self.hidden.dim() != 2:
            raise PlanError("LayerRecompute.hidden must be a (tokens, hidden size) tensor")


@dataclass(frozen=True)
class SegmentPlan:
    """One segment of a call and how to materialize it."""

    name: str
    token_ids: Sequence[int]
    step: Step = Step.PREFIX
    kv: SegmentKV | None = None  # required for INJECT: KV of exactly these tokens
    capture: bool = True  # hand this segment's KV back in the result (a copy); False saves the copy
    recompute: TokenRecompute | LayerRecompute | None = None  # INJECT only: selective recomputation

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "step", Step(self.step))
        except ValueError:
            raise PlanError(
                f"segment '{self.name}': unknown plan step {self.step!r}; use one of {[s.value for s in Step]}"
            ) from None
        if len(self.token_ids) == 0:
            raise SegmentError(
                f"segment '{self.name}' is empty; a segment must have at least one token "
                "(text that tokenizes to nothing cannot be a segment)"
            )
        if self.step is Step.INJECT and self.kv is None:
            raise PlanError(f"segment '{self.name}': step 'inject' needs the segment's KV (kv=SegmentKV)")
        if self.step is not Step.INJECT and self.kv is not None:
            raise PlanError(f"segment '{self.name}': KV was given but the step is '{self.step.value}', not 'inject'")
        if self.recompute is not None:
            if self.step is not Step.INJECT:
                raise PlanError(f"segment '{self.name}': only an injected segment can be recomputed in part")
            if not isinstance(self.recompute, (TokenRecompute, LayerRecompute)):
                raise PlanError(f"segment '{self.name}': recompute must be a TokenRecompute or LayerRecompute, "
                                f"got {type(self.recompute).__name__}")
            hidden = getattr(self.recompute, "hidden", None)
            if hidden is not None and hidden.shape[0] != len(self.token_ids):
                raise PlanError(f"segment '{self.name}': LayerRecompute.hidden has {hidden.shape[0]} rows for "
                                f"{len(self.token_ids)} tokens")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 32
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    stop: tuple[str, ...] | str = ()  # a single string is one stop string
    seed: int | None = None
    ignore_eos: bool = False
    constraint: OutputConstraint | None = None  # what the output must match (constrained decoding)

    @classmethod
    def checked(cls, value: object, where: str) -> "SamplingParams":
        """`value`, or the defaults for None; anything else is an InputError naming `where`."""
        if value is None:
            return cls()
        if not isinstance(value, SamplingParams):
            raise InputError(f"{where} must be a SamplingParams, got {type(value).__name__}: "
                             "pass SamplingParams(max_tokens=..., ...)")
        return value

    def __post_init__(self) -> None:
        if type(self.max_tokens) is not int or self.max_tokens < 1:
            raise PlanError(f"SamplingParams.max_tokens must be an int of at least 1, got {self.max_tokens!r}")
        if not (_is_number(self.temperature) and self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise PlanError(f"SamplingParams.temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not (_is_number(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise PlanError(f"SamplingParams.top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and type(self.seed) is not int:
            raise PlanError(f"SamplingParams.seed must be an int or None, got {self.seed!r}")
        if not isinstance(self.stop, (str, list, tuple)):
            raise PlanError(f"SamplingParams.stop must be a string or a tuple of strings, got {self.stop!r}; "
                            "pass () for no stop strings")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise PlanError(f"SamplingParams.stop strings must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        if self.constraint is not None and not isinstance(self.constraint, OutputConstraint):
            raise PlanError(f"SamplingParams.constraint must be an OutputConstraint or None, "
                            f"got {type(self.constraint).__name__}")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class ExecRequest:
    segments: Sequence[SegmentPlan]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    lineage: str | None = None  # salt for caching approximate KV; None: approximate KV is not cached
    cache_salt: str | None = None  # namespace of the exact blocks it reads and caches (a tenant's); None: shared
    owner: str | None = None  # who runs the call (an agent name): the eviction policy's dispatch event
    session: str | None = None  # the workflow run it belongs to, for agent-aware eviction
    warmup: bool = False  # background work (a warm-up): caches the prompt like any call, but is no
    # agent dispatch and no lookup or hit in the pool's statistics; runs after real requests, in small chunks
    # the runtime's own work on a call's critical path (a context-free reference prefill): scheduled as a
    # real request, but, like a warm-up, no agent dispatch and no lookup or hit in the pool's statistics
    internal: bool = False
    capture_kv: bool = True  # hand back the KV of the segments that ask for it, and of the output
    priority: int = 0  # among waiting requests, lower runs first; warm-ups always come after real calls
    # hand back the hidden states entering this decoder layer for every segment the engine computed
    # (or was given them for) and for the generated tokens: the E cache of DroidSpeak's next consumers
    hidden_layer: int | None = None
    # called with each generated token, on the engine's loop thread: it must be quick (hand the token on)
    on_token: Callable[[int], None] | None = field(default=None, compare=False)
    # the prefix cache serves no position at or past this one (None: up to the first DENSE segment):
    # a replay that judges injected KV must compute with it, not with the exact blocks a dense call cached
    lookup_limit: int | None = None
    # set by the caller to cancel (a client that went away): the engine drops the request at its next
    # step, frees its blocks and fails its future with RequestCancelled
    cancelled: threading.Event | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not self.segments:
            raise PlanError("a call needs at least one segment")
        if not isinstance(self.sampling, SamplingParams):
            raise PlanError(f"ExecRequest.sampling must be a SamplingParams, got {type(self.sampling).__name__}")
        if type(self.priority) is not int:
            raise PlanError(f"ExecRequest.priority must be an int (lower runs first), got {self.priority!r}")
        if self.hidden_layer is not None and (type(self.hidden_layer) is not int or self.hidden_layer < 0):
            raise PlanError(f"ExecRequest.hidden_layer must be an int >= 0 or None, got {self.hidden_layer!r}")
        if (any(isinstance(seg.recompute, TokenRecompute) for seg in self.segments)
                and any(isinstance(seg.recompute, LayerRecompute) for seg in self.segments)):
            raise PlanError("a call recomputes either tokens (TokenRecompute) or layers (LayerRecompute), not both")
        if self.lookup_limit is not None and (type(self.lookup_limit) is not int or self.lookup_limit < 0):
            raise PlanError(f"ExecRequest.lookup_limit must be an int >= 0 or None, got {self.lookup_limit!r}")
        if self.cancelled is not None and not isinstance(self.cancelled, threading.Event):
            raise PlanError(f"ExecRequest.cancelled must be a threading.Event or None, got {type(self.cancelled).__name__}")
        if self.on_token is not None and not callable(self.on_token):
            raise PlanError(f"ExecRequest.on_token must be callable or None, got {type(self.on_token).__name__}")
        for name in ("lineage", "cache_salt", "owner", "session"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise PlanError(f"{name} must be a non-empty string or None, got {value!r}")

    @property
    def is_cancelled(self) -> bool:
        return self.cancelled is not None and self.cancelled.is_set()

    @property
    def token_ids(self) -> list[int]:
        return [t for seg in self.segments for t in seg.token_ids]

    @property
    def uncounted(self) -> bool:
        """No agent dispatch, no lookup or hit in the statistics (a warm-up, or the runtime's own work)."""
        return self.warmup or self.internal


@dataclass(frozen=True)
class SegmentOutcome:
    name: str
    step: Step
    start: int
    length: int
    cached_tokens: int  # served by a prefix hit: exact blocks, or the caller's own lineage
    computed_tokens: int  # prefilled densely
    injected_tokens: int  # taken from the plan's KV
    kv: SegmentKV | None  # what the segment's KV became in this call
    lineage_tokens: int = 0  # of cached_tokens, those served by the lineage's approximate blocks
    # of injected_tokens, tokens' worth of KV recomputed under this call's context (so not reused):
    # CacheBlend's picked tokens, or every token times DroidSpeak's share of the layers
    recomputed_tokens: float = 0.0
    # prefill work beyond that, in full-forward tokens: CacheBlend's probe (its first layers, every token)
    probe_tokens: float = 0.0
    hidden: torch.Tensor | None = None  # (T, hidden size) entering `hidden_layer`, when asked and known

    @property
    def prefill_tokens(self) -> float:
        """The segment's prefill work in full-forward tokens: computed, recomputed, probed."""
        return self.computed_tokens + self.recomputed_tokens + self.probe_tokens


@dataclass(frozen=True)
class ExecResult:
    token_ids: list[int]  # generated
    text: str
    finish_reason: str  # "stop" (a stop string), "eos", "length"
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float  # from submission to the first token
    total_s: float  # from submission to the result
    segments: list[SegmentOutcome]
    last_logits: torch.Tensor  # (V,) float32 logits at the last prompt position
    generated_kv: SegmentKV | None  # KV of the generated tokens fed back (all but the last)
    queued_s: float = 0.0  # of ttft_s, waiting to be admitted (behind other requests)
    generated_hidden: torch.Tensor | None = None  # (T, hidden size) of the fed-back generated tokens

    @property
    def computed_tokens(self) -> int:
        return sum(s.computed_tokens for s in self.segments)

    @property
    def injected_tokens(self) -> int:
        return sum(s.injected_tokens for s in self.segments)


@dataclass(frozen=True)
class CacheStats:
    """An engine's prefix cache, counted in blocks since the engine started."""

    capacity_blocks: int
    cached_blocks: int  # holding KV a later call may hit
    blocks_in_use: int  # referenced by requests in flight (0 when idle: a failed request leaks none)
    lookup_blocks: int  # full blocks the calls' lookups asked for
    hit_blocks: int  # of those, served from the cache
    evictions: int
    injection_failures: int = 0  # injected KV that failed to load, recomputed by the engine instead

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.lookup_blocks if self.lookup_blocks else 0.0


@runtime_checkable
class Engine(Protocol):
    """What every engine provides. `tests/test_engine_conformance.py` checks an implementation."""

    model_name: str
    block_size: int
    layout: KVLayout
    max_context: int
    bos_token_id: int | None
    eos_token_id: int | None
    vocab_size: int

    @property
    def supports_realignment(self) -> bool: ...

    @property
    def supports_recompute(self) -> bool:
        """Whether injected segments may carry a `recompute` and requests a `hidden_layer`."""
        ...

    @property
    def prefix_caching(self) -> bool:
        """Whether the engine caches and serves exact prefixes (False: the no-reuse baseline)."""
        ...

    @property
    def eviction_policy(self) -> "EvictionPolicy | None":
        """The prefix cache's eviction policy object (CacheScout learns through it); None if hidden."""
        ...

    @property
    def max_batch(self) -> int:
        """Requests the engine runs together; more wait for a place."""
        ...

    @property
    def weights(self) -> "torch.nn.Module | Path":
        """The weights that compute the engine's KV: the module it runs, or the model directory it
        loaded them from (what names them for persisted anchors: `correction.persist.model_digest`)."""
        ...

    def fresh(self) -> "Engine":
        """Another engine over the same weights and settings with an empty cache (for probes that
        must stay out of the caller's cache)."""
        ...

    def tokenize(self, text: str, *, bos: bool = False) -> list[int]:
        """Literal tokens of `text`: text spelling a control token (`<eos>`, `<|im_end|>`) stays text.
        Only `bos=True` (or token ids placed by the caller) puts a control token in a prompt."""
        ...

    def detokenize(self, token_ids: Sequence[int]) -> str: ...

    @property
    def chat_template(self) -> str | None:
        """The model's own chat template (its tokenizer's Jinja source), None when it has none."""
        ...

    def control_token_id(self, spelling: str) -> int | None:
        """The id of the control token spelled `spelling` (`<|im_start|>`), for a chat template's
        markers; None when the vocabulary has no such control token."""
        ...

    def cached_prefix_length(
        self, token_ids: Sequence[int], lineage: str | None = None, cache_salt: str | None = None
    ) -> int: ...

    def realign(self, kv: SegmentKV, start: int) -> SegmentKV: ...

    def constraint_ready(self, constraint: OutputConstraint) -> "Future[None]":
        """Compile an output constraint off the caller's thread (compiling can take seconds); done
        once `submit` will find it compiled, failed with an InputError when it cannot be."""
        ...

    def submit(self, request: ExecRequest) -> "Future[ExecResult]":
        """Queue a request to run alongside others; a malformed request raises here."""
        ...

    def execute(self, request: ExecRequest) -> ExecResult:
        """`submit(request).result()`."""
        ...

    def cache_stats(self) -> CacheStats: ...

"""The embedded engine: HF transformers causal LMs driven by our own prefill and decode loop.

Per call: look up the exact prefix cache over the leading PREFIX segments, copy the hit blocks
into the call's working cache, then walk the segments, prefilling dense runs in chunks and
appending injected KV (re-aligned when it was computed elsewhere). Logits are computed for the
last position only. After decoding, every full block of the call is cached: exact blocks
unsalted, blocks at or after the first approximate token under the call's lineage salt.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import torch

from agentcache.engine.blocks import BlockPool
from agentcache.engine.cache_manager import CacheManager
from agentcache.engine.eviction import EvictionPolicy
from agentcache.engine.kv import CallCache, KVLayout, SegmentKV, prefix_digests
from agentcache.engine.protocol import (
    ExecRequest,
    ExecResult,
    SamplingParams,
    SegmentOutcome,
    SegmentPlan,
    Step,
)
from agentcache.engine.rope import RopeAligner
from agentcache.engine.sampling import choose_token, find_stop
from agentcache.engine.tokens import LiteralTokenizer
from agentcache.errors import (
    ContextLengthError,
    InputError,
    KVShapeError,
    ModelLoadError,
    PlanError,
    RopeAlignmentError,
    SegmentError,
)
from agentcache.models import DEFAULT_MODEL, LoadedModel, load_model

__all__ = ["EmbeddedEngine", "EngineConfig"]


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    pool_bytes: int = 512 * 2**20  # KV bytes the prefix cache may hold
    pool_blocks: int | None = None  # overrides pool_bytes when set
    eviction: str | EvictionPolicy = "lru"
    prefill_chunk: int = 2048  # tokens per forward pass during prefill (bounds the mask's memory)
    prefix_caching: bool = True  # False: never look up or store blocks (the no-reuse baseline)
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("block_size", "pool_bytes", "prefill_chunk"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise InputError(f"EngineConfig.{name} must be a positive int, got {value!r}")
        if self.pool_blocks is not None and (type(self.pool_blocks) is not int or self.pool_blocks < 1):
            raise InputError(f"EngineConfig.pool_blocks must be a positive int or None, got {self.pool_blocks!r}")
        _check_device(self.device)


def _source_of(model: LoadedModel | str) -> str | None:
    """A preset name as it is, a directory as an absolute path; a model loaded by the caller is
    known only when it is a preset's."""
    from agentcache.models import PRESETS

    name = model.name if isinstance(model, LoadedModel) else str(model)
    if name in PRESETS:
        return name
    return None if isinstance(model, LoadedModel) else str(Path(name).expanduser().resolve())


def _check_device(device: object) -> None:
    """A device torch knows and this machine has; raises InputError naming what there is."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise InputError(f"EngineConfig.device {device!r} is not a torch device; use 'cpu' or e.g. 'cuda:0'") from None
    if parsed.type == "cpu":
        return
    backend = getattr(torch, parsed.type, None)
    available = getattr(backend, "is_available", None)
    count = getattr(backend, "device_count", None)
    if available is None or not available():
        raise InputError(f"EngineConfig.device {device!r}: this machine has no {parsed.type} device; use 'cpu'")
    if parsed.index is not None and count is not None and parsed.index >= count():
        raise InputError(f"EngineConfig.device {device!r}: only {count()} {parsed.type} device(s) here "
                         f"(indices 0..{count() - 1})")


def _check_pool_fits(capacity: int, block_bytes: int, device: str) -> None:
    """A CPU pool must fit this machine's memory (its storage is reserved up front, paged in lazily)."""
    if torch.device(device).type != "cpu":
        return
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if capacity * block_bytes > memory:
        raise InputError(f"EngineConfig.pool_blocks: a pool of {capacity} blocks needs "
                         f"{capacity * block_bytes / 2**30:.1f} GiB of KV, more than this machine's "
                         f"{memory / 2**30:.1f} GiB; ask for fewer blocks (or pool_bytes)")


def _layout_of(model: torch.nn.Module) -> KVLayout:
    """Probe one token through the model and read the KV shape of every layer."""
    from transformers import DynamicCache

    config = model.config
    probe = DynamicCache()
    with torch.inference_mode():
        model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=model.device), past_key_values=probe, use_cache=True)
    shapes = {tuple(layer.keys.shape[1::2]) for layer in probe.layers}  # {(H, D)}
    if len(shapes) != 1:
        raise ModelLoadError(
            f"model type '{config.model_type}' has layers with different KV shapes {sorted(shapes)}; "
            "the embedded engine supports uniform KV layouts"
        )
    (heads, dim), = shapes
    dtype = probe.layers[0].keys.dtype
    return KVLayout(num_layers=len(probe.layers), num_kv_heads=heads, head_dim=dim, dtype=dtype)


class EmbeddedEngine:
    """An in-process engine over an HF causal LM with a paged exact prefix cache."""

    def __init__(self, model: LoadedModel | str = DEFAULT_MODEL, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        loaded = model if isinstance(model, LoadedModel) else load_model(model)
        self.loaded = loaded
        # what loads these weights again (a preset name or a directory), for configs; None: unknown
        self.model_source: str | None = _source_of(model)
        self._model_key = loaded.instance_id.encode()
        self.model_name = loaded.name
        self.model = loaded.model.to(self.config.device).eval()
        self.tokenizer = loaded.tokenizer
        self._literal = LiteralTokenizer(loaded.tokenizer)
        self.requires_bos = loaded.requires_bos
        self.max_context = loaded.max_context
        self.vocab_size = int(self.model.config.vocab_size)
        self.bos_token_id = self.tokenizer.bos_token_id
        eos = self.model.config.eos_token_id
        self.eos_token_ids = frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.eos_token_id = min(self.eos_token_ids) if self.eos_token_ids else None
        self.block_size = self.config.block_size
        self.layout = _layout_of(self.model)
        capacity = self.config.pool_blocks or max(
            1, self.config.pool_bytes // (self.layout.bytes_per_token * self.block_size)
        )
        _check_pool_fits(capacity, self.layout.bytes_per_token * self.block_size, self.config.device)
        self.pool = BlockPool(capacity, self.block_size, self.config.eviction, self.layout, self.config.device)
        self.cache = CacheManager(self.pool, enabled=self.config.prefix_caching)
        try:
            self._rope: RopeAligner | None = RopeAligner.from_model(self.model)
            self._rope_error: RopeAlignmentError | None = None
        except RopeAlignmentError as exc:
            self._rope, self._rope_error = None, exc
        self._lock = threading.RLock()

    def with_config(self, config: EngineConfig) -> "EmbeddedEngine":
        """Another engine over the same weights, with its own configuration and empty pool."""
        if config.device != self.config.device:
            raise ValueError(
                f"with_config shares this engine's weights on '{self.config.device}'; "
                f"build a new EmbeddedEngine for device '{config.device}'"
            )
        if isinstance(config.eviction, EvictionPolicy) and config.eviction.attached:  # it serves a pool already
            config = replace(config, eviction=config.eviction.fresh())
        twin = EmbeddedEngine(self.loaded, config)
        twin.model_source = self.model_source
        return twin

    # --- text ------------------------------------------------------------------------------

    def tokenize(self, text: str, *, bos: bool = False) -> list[int]:
        """Literal token ids of `text` (text spelling a control token stays text); `bos=True` puts
        the BOS token first."""
        if not isinstance(text, str):
            raise InputError(f"tokenize takes a str, got {type(text).__name__}")
        ids = self._literal.encode(text)
        if bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    @property
    def chat_template(self) -> str | None:
        template = getattr(self.tokenizer, "chat_template", None)
        return template if isinstance(template, str) else None

    def control_token_id(self, spelling: str) -> int | None:
        return self._literal.control_id(spelling)

    # --- KV helpers -------------------------------------------------------------------------

    @property
    def supports_realignment(self) -> bool:
        return self._rope is not None

    def realign(self, kv: SegmentKV, start: int) -> SegmentKV:
        """The same KV moved to positions start..; no longer exact once moved."""
        if start == kv.start:
            return kv
        if self._rope is None:
            raise self._rope_error
        return SegmentKV(self._rope.realign(kv.keys, kv.start, start), kv.values, start)

    def cached_prefix_length(
        self, token_ids: Sequence[int], lineage: str | None = None, cache_salt: str | None = None
    ) -> int:
        """Tokens of `token_ids` a call would be served from the prefix cache now, if its leading
        segments (covering `token_ids`) have step PREFIX; the last token is always computed."""
        self._check_ids(token_ids, "cached_prefix_length")
        with self._lock:
            return self.cache.cached_prefix_length(token_ids, lineage=lineage, namespace=cache_salt)

    def continuation_logits(self, prompt_kv: Sequence[SegmentKV], token_ids: Sequence[int]) -> torch.Tensor:
        """Teacher-forced logits: feed `token_ids` after a prompt given as its KV (contiguous
        segments from position 0). Returns (len(token_ids), V): row i predicts the token after
        token_ids[i]. Nothing is cached."""
        with self._lock, torch.inference_mode():
            length = sum(kv.length for kv in prompt_kv)
            cache = CallCache(self.layout, length + len(token_ids), torch.device(self.config.device))
            for kv in prompt_kv:
                kv.check(self.layout, kv.length, "prompt KV")
                if kv.start != cache.length:
                    raise KVShapeError(f"prompt KV segments must be contiguous from 0; one starts at {kv.start}, "
                                       f"expected {cache.length}")
                cache.append(kv.keys, kv.values)
            ids = torch.tensor([list(token_ids)], dtype=torch.long, device=cache.key_buffer.device)  # (1, n)
            positions = torch.arange(length, length + len(token_ids), device=ids.device)[None]
            out = self.model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True)
            return out.logits[0].float()  # (n, V)

    # --- execution ------------------------------------------------------------------------------

    def execute(self, request: ExecRequest) -> ExecResult:
        started = time.perf_counter()  # TTFT counts waiting for the lock and validating the plan
        with self._lock, torch.inference_mode():
            prompt = request.token_ids
            self._validate(request, prompt)
            return self._execute(request, prompt, started)

    def _validate(self, request: ExecRequest, prompt: list[int]) -> None:
        total = len(prompt) + request.sampling.max_tokens
        if total > self.max_context:
            raise ContextLengthError(
                f"call needs {len(prompt)} prompt + {request.sampling.max_tokens} generated tokens = {total}, "
                f"more than {self.model_name}'s context of {self.max_context} tokens"
            )
        if self.requires_bos and prompt[0] != self.bos_token_id:
            raise PlanError(
                f"{self.model_name} needs its BOS token (id {self.bos_token_id}) first; the call starts with "
                f"id {prompt[0]}: tokenize the first segment with bos=True"
            )
        start = 0
        for seg in request.segments:
            self._check_ids(seg.token_ids, f"segment '{seg.name}'")
            if seg.step is Step.INJECT:
                kv = seg.kv
                kv.check(self.layout, len(seg.token_ids), f"segment '{seg.name}'")
                if not (torch.isfinite(kv.keys).all() and torch.isfinite(kv.values).all()):
                    raise KVShapeError(f"segment '{seg.name}': injected KV contains NaN or Inf")
                if kv.start != start and self._rope is None:
                    raise self._rope_error
            start += len(seg.token_ids)

    def _check_ids(self, token_ids: Sequence[int], what: str) -> None:
        bad = [t for t in token_ids if type(t) is not int or not 0 <= t < self.vocab_size]
        if bad:
            raise SegmentError(f"{what}: token ids {bad[:5]} are not ints in [0, {self.vocab_size})")

    def _execute(self, request: ExecRequest, prompt: list[int], started: float) -> ExecResult:
        sampling = request.sampling

        lead = 0  # tokens of the leading PREFIX segments, the only ones looked up
        for seg in request.segments:
            if seg.step is not Step.PREFIX:
                break
            lead += len(seg.token_ids)
        lease = self.cache.admit(prompt, lead, lineage=request.lineage, namespace=request.cache_salt,
                                 owner=request.owner, session=request.session, warmup=request.warmup)
        try:
            cache = CallCache(self.layout, len(prompt) + sampling.max_tokens, torch.device(self.config.device))
            hit, lineage_from = lease.hit.tokens, lease.hit.lineage_from
            if lease.hit.blocks:
                cache.append(*self.pool.gather(lease.hit.blocks))
            ends = [0]
            for seg in request.segments:
                ends.append(ends[-1] + len(seg.token_ids))
            # position -> digest of every token before it; what a segment ending there is exact for
            digests = prefix_digests(prompt, ends, self._model_key)

            logits, spans, first_inject_approx = self._materialize(request.segments, prompt, cache, hit, digests)
            approx_positions = ([lineage_from] if lineage_from < hit else []) + [first_inject_approx]
            first_approx = min((p for p in approx_positions if p is not None), default=None)

            generated, text, finish, ttft = self._decode(cache, logits, sampling, started, request.on_token)
            outcomes = [
                SegmentOutcome(
                    name=seg.name, step=seg.step, start=s, length=len(seg.token_ids),
                    cached_tokens=c, computed_tokens=d, injected_tokens=j,
                    kv=self._capture(cache, s, s + len(seg.token_ids), first_approx, digests)
                    if request.capture_kv
                    else None,
                    lineage_tokens=max(0, min(s + c, hit) - max(s, lineage_from)),
                )
                for seg, (s, c, d, j) in zip(request.segments, spans)
            ]
            fed = generated[:-1]  # the last generated token was never fed back, so it has no KV
            generated_kv = None
            if request.capture_kv and fed:
                end = len(prompt) + len(fed)
                digests.update(prefix_digests(prompt + fed, [end], self._model_key))
                generated_kv = self._capture(cache, len(prompt), end, first_approx, digests)
            self.cache.commit(lease, prompt + fed, cache.view, approximate_from=first_approx)
            return ExecResult(
                token_ids=generated, text=text, finish_reason=finish, prompt_tokens=len(prompt),
                cached_tokens=hit, ttft_s=ttft, total_s=time.perf_counter() - started,
                segments=outcomes, last_logits=logits, generated_kv=generated_kv,
            )
        finally:
            self.cache.free(lease)

    def _materialize(
        self,
        segments: Sequence[SegmentPlan],
        prompt: list[int],
        cache: CallCache,
        hit: int,
        digests: dict[int, bytes],
    ) -> tuple[torch.Tensor, list[tuple[int, int, int, int]], int | None]:
        """Fill the call cache past the prefix hit. Returns the last position's logits, per-segment
        (start, cached, computed, injected) counts, and the first approximate token position.

        The dense tokens before the first injected segment are prefilled as usual. All injected KV
        is then placed at its positions, and every dense token after it (the glue between injected
        segments, the tail) is computed in one scattered pass: each token attends to everything at
        lower positions, injected or dense. On a CPU a forward pass costs about as much for 5
        tokens as for 100 (reading the weights dominates), so one pass instead of one per glue
        segment is what lets reuse pay off for short shared segments."""
        spans = []
        dense: list[int] = []  # positions to compute, ascending
        placed: list[tuple[int, SegmentKV]] = []  # injected KV, re-aligned to its position
        first_approx = None
        pos = 0
        last = len(segments) - 1
        for index, seg in enumerate(segments):
            n = len(seg.token_ids)
            if seg.step is Step.INJECT:
                inject = n - 1 if index == last else n  # the final prompt token must run for its logits
                if inject:
                    exact_here = seg.kv.start == pos and seg.kv.exact_for == digests[pos + n]
                    placed.append((pos, self.realign(seg.kv.slice(0, inject), pos)))
                    if not exact_here and first_approx is None:
                        first_approx = pos
                dense.extend(range(pos + inject, pos + n))
                spans.append((pos, 0, n - inject, inject))
            else:
                cached = min(max(hit - pos, 0), n)
                dense.extend(range(pos + cached, pos + n))
                spans.append((pos, cached, n - cached, 0))
            pos += n
        split = placed[0][0] if placed else pos
        head = [p for p in dense if p < split]  # contiguous, from the end of the prefix hit
        tail = [p for p in dense if p >= split]
        logits = self._prefill(cache, prompt[head[0] : head[-1] + 1], head[0]) if head else None
        if placed:
            cache.clear(split, pos)
            for start, kv in placed:
                cache.place(start, kv.keys, kv.values)
            logits = self._prefill_scattered(cache, prompt, tail, pos)
            cache.commit(pos)
        return logits, spans, first_approx

    def _prefill_scattered(self, cache: CallCache, prompt: list[int], positions: list[int], end: int) -> torch.Tensor:
        """Compute the tokens at `positions` (ascending, the last one end - 1) over a cache that holds
        everything else below `end`, in chunks like `_prefill`. Returns the last position's logits."""
        logits = None
        chunk = self.config.prefill_chunk
        for offset in range(0, len(positions), chunk):
            part = positions[offset : offset + chunk]
            logits = self._forward_scattered(cache, [prompt[p] for p in part], part, end)
        return logits

    def _forward_scattered(self, cache: CallCache, token_ids: list[int], positions: list[int], end: int) -> torch.Tensor:
        device = cache.key_buffer.device
        ids = torch.tensor([token_ids], dtype=torch.long, device=device)  # (1, T)
        where = torch.tensor(positions, dtype=torch.long, device=device)  # (T,)
        with cache.scattered(where, end):
            out = self.model(input_ids=ids, position_ids=where[None], cache_position=where,
                             attention_mask=self._scatter_mask(where, end), past_key_values=cache, use_cache=True,
                             logits_to_keep=1)
        return out.logits[0, -1].float()

    def _scatter_mask(self, positions: torch.Tensor, end: int) -> torch.Tensor | dict[str, torch.Tensor]:
        """Additive masks (1, 1, T, end): a token sees every key at or below its position (in a
        sliding-window layer, only within the window); one per layer type for models that mix them."""
        keys = torch.arange(end, device=positions.device)[None, :]  # (1, end)
        queries = positions[:, None]  # (T, 1)
        zero = torch.zeros((), dtype=self.layout.dtype, device=positions.device)
        blocked = torch.tensor(torch.finfo(self.layout.dtype).min, dtype=self.layout.dtype, device=positions.device)
        causal = keys <= queries  # (T, end)
        config = self.loaded.config
        layer_types = getattr(config, "layer_types", None)
        if not layer_types:
            return torch.where(causal, zero, blocked)[None, None]
        masks = {}
        for kind in set(layer_types):
            allowed = causal
            if kind == "sliding_attention" and getattr(config, "sliding_window", None):
                allowed = causal & (keys > queries - config.sliding_window)  # HF's window: q - k < window
            masks[kind] = torch.where(allowed, zero, blocked)[None, None]
        return masks

    def _forward(self, cache: CallCache, token_ids: Sequence[int], start: int) -> torch.Tensor:
        """One forward pass of tokens placed at start..; returns the last position's logits (V,)."""
        device = cache.key_buffer.device
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=device)  # (1, T)
        positions = torch.arange(start, start + len(token_ids), device=device)[None]  # (1, T)
        out = self.model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache.advance(len(token_ids))
        return out.logits[0, -1].float()

    def _prefill(self, cache: CallCache, token_ids: Sequence[int], start: int) -> torch.Tensor:
        chunk = self.config.prefill_chunk
        logits = None
        for offset in range(0, len(token_ids), chunk):
            logits = self._forward(cache, token_ids[offset : offset + chunk], start + offset)
        return logits

    def _decode(
        self, cache: CallCache, logits: torch.Tensor, sampling: SamplingParams, started: float,
        on_token: Callable[[int], None] | None = None,
    ) -> tuple[list[int], str, str, float]:
        generator = None
        if sampling.temperature > 0 and sampling.seed is not None:
            generator = torch.Generator(device="cpu").manual_seed(sampling.seed)
        token = choose_token(logits.cpu(), sampling.temperature, sampling.top_p, generator)
        ttft = time.perf_counter() - started
        generated = [token]
        text, finish = "", "length"
        while True:
            if on_token is not None:
                on_token(token)
            if token in self.eos_token_ids and not sampling.ignore_eos:
                finish = "eos"
                break
            if sampling.stop:
                # Decode everything again: a character split across tokens only appears once whole.
                text = self.detokenize(generated)
                cut = find_stop(text, sampling.stop)
                if cut is not None:
                    text, finish = text[:cut], "stop"
                    break
            if len(generated) >= sampling.max_tokens:
                break
            logits = self._forward(cache, [token], cache.length)
            token = choose_token(logits.cpu(), sampling.temperature, sampling.top_p, generator)
            generated.append(token)
        if finish != "stop":
            text = self.detokenize(generated)
        return generated, text, finish, ttft

    def _capture(
        self, cache: CallCache, begin: int, end: int, first_approx: int | None, digests: dict[int, bytes]
    ) -> SegmentKV:
        keys, values = cache.view(begin, end)
        exact = first_approx is None or end <= first_approx
        return SegmentKV(keys.clone(), values.clone(), begin, digests[end] if exact else None)

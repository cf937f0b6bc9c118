"""The embedded engine: HF transformers causal LMs driven by our own scheduler and forward passes.

Requests are submitted from any thread and run on the engine's loop (`engine.loop`), batched
(`engine.scheduler`): at admission the prefix hit is found and its blocks are copied into the
request's working cache; the rest of the prompt is prefilled in chunks around injected KV
(re-aligned when it was computed elsewhere); decode steps run every decoding request in one
forward (`engine.batch`). After decoding, every full block of the call is cached: exact blocks
unsalted, blocks at or after the first approximate token under the call's lineage salt.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from agentcache.engine.attention import use_engine_attention
from agentcache.engine.blocks import BlockPool
from agentcache.engine.cache_manager import CacheManager
from agentcache.engine.cpu_linear import use_rows_first_linear
from agentcache.engine.eviction import EvictionPolicy, check_eviction
from agentcache.engine.frontend import ModelFrontend
from agentcache.engine.kv import CallCache, SegmentKV
from agentcache.engine.layers import LayerControl
from agentcache.engine.loop import EngineLoop
from agentcache.engine.precision import dtype_name, dtype_setting, parse_dtype, resolve_dtype
from agentcache.engine.protocol import (
    CacheStats,
    ExecRequest,
    ExecResult,
)
from agentcache.engine.runner import ModelRunner
from agentcache.engine.scheduler import BatchScheduler
from agentcache.engine.vllm.gate import set_threads
from agentcache.errors import (
    InputError,
    KVShapeError,
    PlanError,
)
from agentcache.models import DEFAULT_MODEL, LoadedModel, load_model

__all__ = ["EmbeddedEngine", "EngineConfig", "choose_threads"]


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    pool_bytes: int = 512 * 2**20  # KV bytes the prefix cache may hold
    pool_blocks: int | None = None  # overrides pool_bytes when set
    eviction: str | EvictionPolicy = "lru"  # "lru", "lfu" or a policy object, e.g. agentcache.make_policy("survival")
    prefill_chunk: int = 2048  # tokens per forward pass during prefill (bounds the mask's memory)
    prefix_caching: bool = True  # False: never look up or store blocks (the no-reuse baseline)
    device: str = "cpu"
    # weights and KV: "auto" (a model given loaded: its own dtype; by name: bfloat16 on CUDA, float32
    # elsewhere), "bfloat16", "float16" or "float32"
    dtype: str | torch.dtype = "auto"
    max_batch: int = 8  # requests decoded together; 1 runs one request at a time (the serialized baseline)
    warmup_chunk: int = 64  # prefill tokens per pass of a warm-up: what a real arrival may wait behind
    # prefill tokens per pass of the runtime's own requests (shadow runs, audits, reference prefills):
    # a call arriving during one waits for one such pass, not a 2048-token one (~6 s for a 0.5B model on
    # 2 cores); a 1000-token prompt took 8.8 s in passes of 256 against 8.5 s in one (Qwen 0.5B, 2 cores)
    background_chunk: int = 256
    threads: int | None = None  # torch threads for the engine's steps; None: see `choose_threads`
    cuda_graphs: bool = True  # on CUDA, decode steps replayed from captured graphs (engine.graphs)

    def __post_init__(self) -> None:
        for name in ("block_size", "pool_bytes", "prefill_chunk", "max_batch", "warmup_chunk", "background_chunk"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise InputError(f"EngineConfig.{name} must be a positive int, got {value!r}")
        if self.threads is not None and (type(self.threads) is not int or self.threads < 1):
            raise InputError(f"EngineConfig.threads must be a positive int or None, got {self.threads!r}")
        if self.pool_blocks is not None and (type(self.pool_blocks) is not int or self.pool_blocks < 1):
            raise InputError(f"EngineConfig.pool_blocks must be a positive int or None, got {self.pool_blocks!r}")
        if type(self.cuda_graphs) is not bool:
            raise InputError(f"EngineConfig.cuda_graphs must be True or False, got {self.cuda_graphs!r}")
        check_eviction(self.eviction, "EngineConfig.eviction")
        _check_device(self.device)
        object.__setattr__(self, "dtype", dtype_setting(self.dtype, "EngineConfig.dtype"))

    def model_dtype(self, loaded: torch.dtype | None) -> torch.dtype:
        """The dtype the engine runs in, for a model `loaded` in that dtype (None: loaded by name)."""
        if loaded is not None and parse_dtype(self.dtype, "EngineConfig.dtype") is None:
            return loaded
        return resolve_dtype(self.dtype, self.device, "EngineConfig.dtype")


def _source_of(model: LoadedModel | str) -> str | None:
    """A preset name as it is, a directory as an absolute path; a model loaded by the caller is
    known only when it is a preset's."""
    from agentcache.models import PRESETS

    name = model.name if isinstance(model, LoadedModel) else str(model)
    if name in PRESETS:
        return name
    return None if isinstance(model, LoadedModel) else str(Path(name).expanduser().resolve())


SMALL_MODEL_PARAMETERS = 5_000_000  # below this, one torch thread: its matrices are too small to split


def choose_threads(model: torch.nn.Module, configured: int | None) -> int | None:
    """Torch threads for an engine's steps: `configured` when given; torch's own setting when the
    environment chose one (OMP_NUM_THREADS); else 1 for a small model (on 2 shared cores a tiny
    model ran about 10x faster on 1 thread than on 2 while another process was busy: splitting
    small matrices costs more than it saves) and every core this process may use for a larger
    one. None: leave torch's setting alone."""
    if configured is not None:
        return configured
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    if sum(p.numel() for p in model.parameters()) < SMALL_MODEL_PARAMETERS:
        return 1
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


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


def _in_dtype(loaded: LoadedModel, dtype: torch.dtype) -> LoadedModel:
    """The model given, converted in place to `dtype` (as it is moved in place to the engine's device),
    under a new instance id (its KV is another model's). One that already serves an engine is refused:
    converting it would change that engine's weights."""
    if loaded.dtype == dtype:
        return loaded
    if LayerControl.installed(loaded.model):
        raise InputError(f"model {loaded.name!r} already serves an engine in {dtype_name(loaded.dtype)}; converting it to "
                         f"{dtype_name(dtype)} would change that engine's weights: load another copy "
                         f"(load_model(..., dtype=torch.{dtype_name(dtype)}))")
    loaded.model.to(dtype)
    return replace(loaded, instance_id=uuid.uuid4().hex)


def _check_pool_fits(capacity: int, block_bytes: int, device: str) -> None:
    """A CPU pool must fit this machine's memory (its storage is reserved up front, paged in lazily)."""
    if torch.device(device).type != "cpu":
        return
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if capacity * block_bytes > memory:
        raise InputError(f"EngineConfig.pool_blocks: a pool of {capacity} blocks needs "
                         f"{capacity * block_bytes / 2**30:.1f} GiB of KV, more than this machine's "
                         f"{memory / 2**30:.1f} GiB; ask for fewer blocks (or pool_bytes)")


class EmbeddedEngine(ModelFrontend):
    """An in-process engine over an HF causal LM with a paged exact prefix cache."""

    def __init__(self, model: LoadedModel | str = DEFAULT_MODEL, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        if isinstance(model, LoadedModel):
            loaded = _in_dtype(model, self.config.model_dtype(model.dtype))
        else:
            loaded = load_model(model, dtype=self.config.model_dtype(None), device=self.config.device)
        self.loaded = loaded
        # what loads these weights again (a preset name or a directory), for configs; None: unknown
        self.model_source: str | None = _source_of(model)
        self.model = loaded.model.to(self.config.device).eval()
        use_engine_attention(self.model)  # the causal mask implied, not built (engine.attention)
        use_rows_first_linear(self.model)  # a few rows' products on a CPU (engine.cpu_linear)
        self._init_frontend(loaded, self.model)
        self.block_size = self.config.block_size
        self.runner = ModelRunner(self.model, self.layout)
        self.layers = LayerControl.of(self.model)  # part-stack passes for selective recomputation
        self.threads = choose_threads(self.model, self.config.threads)
        capacity = self.config.pool_blocks or max(
            1, self.config.pool_bytes // (self.layout.bytes_per_token * self.block_size)
        )
        _check_pool_fits(capacity, self.layout.bytes_per_token * self.block_size, self.config.device)
        self.pool = BlockPool(capacity, self.block_size, self.config.eviction, self.layout, self.config.device)
        self.cache = CacheManager(self.pool, enabled=self.config.prefix_caching)
        self.scheduler = BatchScheduler(
            self.cache, self.runner, self.layers, device=self.config.device, model_key=self.model_key,
            hidden_size=self.hidden_size, realign=self.realign, eos_token_ids=self.eos_token_ids,
            detokenize=self.detokenize, max_batch=self.config.max_batch, prefill_chunk=self.config.prefill_chunk,
            warmup_chunk=self.config.warmup_chunk, background_chunk=self.config.background_chunk,
            grammars=lambda: self.grammars,
            decode_graphs=self.config.cuda_graphs and torch.device(self.config.device).type == "cuda",
        )
        self._loop = EngineLoop(self._step, self._crash, name=f"agentcache-engine-{self.model_name}")

    def with_config(self, config: EngineConfig) -> EmbeddedEngine:
        """Another engine over the same weights, with its own configuration and empty pool."""
        if config.device != self.config.device:
            raise ValueError(
                f"with_config shares this engine's weights on '{self.config.device}'; "
                f"build a new EmbeddedEngine for device '{config.device}'"
            )
        if config.model_dtype(self.layout.dtype) != self.layout.dtype:
            raise ValueError(
                f"with_config shares this engine's weights in {dtype_name(self.layout.dtype)}; build a new "
                f"EmbeddedEngine for dtype {config.dtype!r}"
            )
        config = replace(config, dtype=dtype_name(self.layout.dtype))  # the twin keeps these weights as they are
        if isinstance(config.eviction, EvictionPolicy) and config.eviction.attached:  # it serves a pool already
            config = replace(config, eviction=config.eviction.fresh())
        twin = EmbeddedEngine(self.loaded, config)
        twin.model_source = self.model_source
        return twin

    def fresh(self) -> EmbeddedEngine:
        return self.with_config(self.config)

    @property
    def prefix_caching(self) -> bool:
        return self.config.prefix_caching

    @property
    def supports_recompute(self) -> bool:
        return True

    @property
    def eviction_policy(self) -> EvictionPolicy:
        return self.pool.policy

    @property
    def max_batch(self) -> int:
        return self.config.max_batch

    @property
    def weights(self) -> torch.nn.Module:
        """The module the engine runs."""
        return self.model

    # --- KV helpers -------------------------------------------------------------------------

    def cached_prefix_length(
        self, token_ids: Sequence[int], lineage: str | None = None, cache_salt: str | None = None
    ) -> int:
        """Tokens of `token_ids` a call would be served from the prefix cache now, if its leading
        segments (covering `token_ids`) have step PREFIX; the last token is always computed."""
        self._check_ids(token_ids, "cached_prefix_length")
        return self.cache.cached_prefix_length(token_ids, lineage=lineage, namespace=cache_salt)

    def continuation_logits(self, prompt_kv: Sequence[SegmentKV], token_ids: Sequence[int]) -> torch.Tensor:
        """Teacher-forced logits: feed `token_ids` after a prompt given as its KV (contiguous
        segments from position 0). Returns (len(token_ids), V): row i predicts the token after
        token_ids[i]. Nothing is cached."""
        with torch.inference_mode():  # its own cache: it may run beside the engine's steps
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

    def submit(self, request: ExecRequest) -> Future:
        """Queue a request; the engine's loop runs it alongside the others. Returns a future of its
        ExecResult (cancel it to drop a request not yet admitted). A malformed request raises here."""
        if not isinstance(request, ExecRequest):
            raise PlanError(f"submit takes an ExecRequest, got {type(request).__name__}")
        self._validate(request, request.token_ids)
        return self._loop.submit(request).future

    def execute(self, request: ExecRequest) -> ExecResult:
        """`submit` and wait for the result."""
        return self.submit(request).result()

    def cache_stats(self) -> CacheStats:
        return self.cache.cache_stats()

    def _step(self, jobs: list) -> bool:
        if self.threads is not None:
            set_threads(self.threads)  # for this loop's thread
        with torch.inference_mode():
            return self.scheduler.step(jobs)

    def _crash(self, exc: BaseException) -> None:
        self.scheduler.crash(exc)

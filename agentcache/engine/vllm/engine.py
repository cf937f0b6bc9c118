"""The in-process vLLM engine: agentcache's Engine contract over vLLM's `LLMEngine`.

A `VLLMEngine` is a view of a `VLLMCore` (one vLLM engine per model and settings in the process,
stepped by one loop thread that every call feeds: concurrent calls are concurrent vLLM requests,
continuously batched). Each view has a salt of its own: a new engine (or `fresh()`) starts with
an empty cache, as a new embedded engine does, without loading the model or starting vLLM again;
views share the core's KV capacity. A view holds its core until `close()`: the last view of a
core to close stops it (`core.CoreTable` says when vLLM itself is shut down).

How a call maps onto vLLM:
- The prompt goes in as token ids, salted with the view and the request's `cache_salt` (the
  tenant), so exact prefixes are shared within a tenant and never across.
- vLLM's prefix cache serves every exact prefix it holds (PREFIX and DENSE segments alike: KV
  cached under the tenant's salt is exact for its tokens).
- INJECT segments enter through agentcache's KV connector (`connector.py`), in phases where
  needed (`core.py`); blocks from the first approximate token on are hashed under the call's
  lineage (`scheduler.py`), so only that lineage ever hits them.
- The hooks inside vLLM (logits processor, connector, scheduler) find what they need in the
  registry (`registry.py`) under the request's key.
- Stop strings, EOS and the token budget are judged by agentcache's own rule
  (`sampling.finish_after`), as in the embedded engine; a request that ends early is aborted.
"""

from __future__ import annotations

import uuid
from itertools import accumulate
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import torch

from agentcache.engine.eviction import AgentAwarePolicy, EvictionPolicy
from agentcache.engine.frontend import ModelFrontend
from agentcache.engine.kv import prefix_digests
from agentcache.engine.loop import EngineShutdown
from agentcache.engine.precision import dtype_setting
from agentcache.engine.protocol import CacheStats, ExecRequest, ExecResult, Step
from agentcache.engine.vllm.core import Call, VLLMCore
from agentcache.errors import InputError, PlanError
from agentcache.models import DEFAULT_MODEL, LoadedModel

__all__ = ["VLLMEngine", "VLLMConfig"]


@dataclass(frozen=True)
class VLLMConfig:
    block_size: int = 32  # vLLM's CPU kernels want multiples of 32 (its CPU default, 128, rarely hits)
    pool_blocks: int | None = None  # KV blocks of the prefix cache; None: `kv_cache_bytes` decides
    kv_cache_bytes: int = 1 << 30
    max_batch: int = 8  # vLLM's max_num_seqs: requests running together
    prefill_chunk: int = 2048  # vLLM's max_num_batched_tokens: tokens per step (chunked prefill)
    prefix_caching: bool = True  # False: vLLM caches nothing (the no-reuse baseline; injection needs the cache
    # for any segment after the first: see core.py)
    max_model_len: int | None = None  # None: the model's context, at most 16,384 tokens
    threads: int | None = None  # torch threads for the whole process (vLLM fixes them at start)
    # "lru": vLLM's own order; an AgentAwarePolicy object orders free blocks by its score (eviction.py),
    # e.g. CacheScout's: agentcache.make_policy("survival")
    eviction: str | AgentAwarePolicy = "lru"
    # Engines with equal settings share one vLLM engine (its weights, KV capacity and eviction
    # policy); a name of its own gets a separate one (e.g. to compare strategies on separate pools).
    instance: str = ""
    # vLLM's tensor parallelism: worker processes, each holding its share of the KV heads (the KV
    # cache settings are per worker); 1 runs the model in this process
    tensor_parallel_size: int = 1
    # weights and KV: "auto" (bfloat16 on CUDA, float32 on a CPU), "bfloat16", "float16" or "float32"
    dtype: str | torch.dtype = "auto"

    def __post_init__(self) -> None:
        for name in ("block_size", "kv_cache_bytes", "max_batch", "prefill_chunk", "tensor_parallel_size"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise InputError(f"VLLMConfig.{name} must be a positive int, got {value!r}")
        if self.block_size % 32:
            raise InputError(f"VLLMConfig.block_size must be a multiple of 32 (vLLM's CPU attention), got {self.block_size}")
        for name in ("pool_blocks", "max_model_len", "threads"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise InputError(f"VLLMConfig.{name} must be a positive int or None, got {value!r}")
        object.__setattr__(self, "dtype", dtype_setting(self.dtype, "VLLMConfig.dtype"))
        if not (isinstance(self.eviction, AgentAwarePolicy) or (isinstance(self.eviction, str) and self.eviction == "lru")):
            raise InputError(f"VLLMConfig.eviction: vLLM orders free blocks by its own LRU ('lru') or by an agent-aware "
                             f"policy object, e.g. eviction=agentcache.make_policy('survival'); got {self.eviction!r}")

    @property
    def core_settings(self) -> tuple:
        """What a vLLM engine is built with: views with equal settings share one."""
        eviction = self.eviction if isinstance(self.eviction, str) else id(self.eviction)
        return (self.block_size, self.pool_blocks, self.kv_cache_bytes, self.max_batch, self.prefill_chunk,
                self.prefix_caching, self.max_model_len, self.threads, eviction, self.instance, self.tensor_parallel_size,
                self.dtype)


class VLLMEngine(ModelFrontend):
    """agentcache's Engine contract on vLLM, in this process."""

    conformance_kind = "vllm"

    def __init__(self, model: LoadedModel | str = DEFAULT_MODEL, config: VLLMConfig | None = None, *,
                 _core: VLLMCore | None = None) -> None:
        self.config = config or VLLMConfig()
        core = VLLMCore.table.retain(_core) if _core is not None else VLLMCore.open(model, self.config)
        self._core = core
        self.__dict__.update(vars(core.frontend))  # the model's tokenizer, layout and RoPE aligner
        self.block_size = self.config.block_size
        self.max_context = core.max_model_len
        # Every engine object is a view with a salt of its own: like a new embedded engine it starts
        # with an empty cache, though views of one model and settings share one vLLM engine.
        self._view = uuid.uuid4().hex
        self._closed = False

    def close(self) -> None:
        """Let go of the vLLM engine (the last view of it to close stops it); calls on this view
        raise EngineShutdown from now on. Closing twice does nothing."""
        if not self._closed:
            self._closed = True
            VLLMCore.table.release(self._core)

    @property
    def _open_core(self) -> VLLMCore:
        if self._closed:
            raise EngineShutdown("this VLLMEngine is closed")
        return self._core

    # --- the contract's settings -------------------------------------------------------------

    def fresh(self) -> "VLLMEngine":
        """Another view of the same vLLM engine whose requests never hit this one's blocks."""
        return VLLMEngine(config=self.config, _core=self._open_core)

    def with_config(self, config: VLLMConfig) -> "VLLMEngine":
        """An engine over the same model with other settings (its own vLLM engine unless the settings
        are equal); its cache starts empty."""
        if config.core_settings == self.config.core_settings:
            return VLLMEngine(config=config, _core=self._open_core)
        return VLLMEngine(self._core.source, config)

    @property
    def prefix_caching(self) -> bool:
        return self.config.prefix_caching

    @property
    def eviction_policy(self) -> EvictionPolicy | None:
        """The agent-aware policy ordering vLLM's free blocks, or None for vLLM's own LRU."""
        return self._core.policy

    @property
    def max_batch(self) -> int:
        return self.config.max_batch

    @property
    def model_directory(self) -> Path:
        return self._core.directory

    @property
    def weights(self) -> Path:
        """The model directory vLLM loaded the weights from."""
        return self._core.directory

    # --- execution ---------------------------------------------------------------------------

    def cached_prefix_length(
        self, token_ids: Sequence[int], lineage: str | None = None, cache_salt: str | None = None
    ) -> int:
        """Tokens of `token_ids` vLLM would serve from its prefix cache now (block-aligned; the
        last token is always computed)."""
        self._check_ids(token_ids, "cached_prefix_length")
        core, ids, salt = self._open_core, list(token_ids), self._salt(cache_salt)
        return core.between_steps(lambda: core.lookup(ids, salt, lineage)[0]).result()

    def cache_stats(self) -> CacheStats:
        """The vLLM engine's prefix cache (shared by every view of it)."""
        core = self._open_core
        stats = core.between_steps(lambda: core.scheduler.cache_stats()).result()
        return replace(stats, injection_failures=core.injection_failures)

    def submit(self, request: ExecRequest) -> Future:
        """Queue a request for vLLM; returns a future of its ExecResult. A malformed request raises here."""
        if not isinstance(request, ExecRequest):
            raise PlanError(f"submit takes an ExecRequest, got {type(request).__name__}")
        core = self._open_core
        prompt = request.token_ids
        self._validate(request, prompt)
        inject, approx = [], []
        ends = list(accumulate(len(seg.token_ids) for seg in request.segments))
        digests = prefix_digests(prompt, ends, self.model_key)
        start = 0
        for seg, end in zip(request.segments, ends):
            if seg.step is Step.INJECT:
                kv = self.realign(seg.kv, start)  # (L, H, T, D) at the positions it takes here
                inject.append((start, kv.keys, kv.values))
                if not (seg.kv.start == start and seg.kv.exact_for == digests[end]):
                    approx.append((start, end))
            start = end
        return core.submit(Call(request, self._salt(request.cache_salt), tuple(inject), tuple(approx)))

    def execute(self, request: ExecRequest) -> ExecResult:
        return self.submit(request).result()

    def _salt(self, cache_salt: str | None) -> str:
        return f"{self._view}/{cache_salt or ''}"

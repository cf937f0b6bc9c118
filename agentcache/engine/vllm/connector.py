"""agentcache's KV connector for vLLM: injected segments go in, captured segments come back.

vLLM builds a connector beside each engine's scheduler, and one for the workers of the whole
process (a module global in vLLM: every engine in this process steps through the same worker
instance). So neither half keeps tensors of its own: the worker half writes into the layers of
the forward pass it is handed, and the scheduler half reads the paged KV tensors of its own
engine's attention layers (in-process, the scheduler and the worker share the engine's config).

- Injection: at admission vLLM asks how many tokens past its own block-aligned prefix hit the
  connector can supply. An injected run that covers that point is claimed up to its end (a
  connector can only extend the contiguous computed prefix; at least one prompt token is left
  to compute). The load is synchronous: the worker writes the KV into the request's slots right
  before the forward that reads it, through the CPU attention's own cache-write op (on this
  CPU the key cache is stored transposed; raw indexing would corrupt it).
- Capture: when a request finishes, before its blocks are freed, the KV of the ranges it asked
  for (and of the generated tokens fed back) is read out through a layout learned by writing
  known values with that same op.

With worker processes (tensor parallel, `parallel_config.world_size > 1`) the workers do not
share the engine's registry: each load carries its KV runs in the step's metadata (vLLM pickles it
to every worker; each writes its own slice of the KV heads), and a finished request's blocks are
kept (`request_finished` returns True) until the next step, when every worker reads its heads of
the captured ranges and sends them back with the logits its processor recorded (`_Outbox`, the
worker metadata vLLM aggregates over the ranks); then the blocks are freed.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm import _custom_ops as ops
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from agentcache.engine.vllm.registry import EXTRA_KEY, REGISTRY, WORKER_LOGITS, RequestHooks

__all__ = ["AgentCacheConnector"]

log = logging.getLogger(__name__)
_LAYOUTS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # learned once per cache shape and kernel
_FINISHED_KEPT = 4096  # finished request ids a worker remembers while their save may still come
_CODE_BASE = 128  # learning the KV layout: integers 1..128 are exact in float32, bf16 and fp16


Run = tuple[int, torch.Tensor, torch.Tensor]  # (first position, K, V), K and V (L, H, T, D) with every KV head


@dataclass(frozen=True)
class _Load:
    key: str
    block_ids: tuple[int, ...]  # every block of the request, in token order
    start: int  # first position written
    count: int
    runs: tuple[Run, ...] = ()  # the KV to write, within [start, start + count)


@dataclass(frozen=True)
class _Save:
    """A finished request's ranges to read back (workers only): its blocks are kept until then."""

    request_id: str
    key: str
    block_ids: tuple[int, ...]
    spans: tuple[tuple[int, int], ...]


@dataclass
class _Loads(KVConnectorMetadata):
    loads: list[_Load] = field(default_factory=list)
    saves: list[_Save] = field(default_factory=list)


@dataclass
class _Outbox(KVConnectorWorkerMetadata):
    """What the workers send back in one step, merged over the ranks by vLLM."""

    shards: dict[tuple[str, tuple[int, int]], dict[int, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    logits: dict[str, torch.Tensor] = field(default_factory=dict)  # key -> (V,) at the last prompt position
    failed: set[str] = field(default_factory=set)  # keys whose load failed (vLLM recomputes it)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, _Outbox):
            for span, shards in other.shards.items():
                self.shards.setdefault(span, {}).update(shards)  # by first head: each rank its own
            self.logits.update(other.logits)
            self.failed |= other.failed
        return self

    def __bool__(self) -> bool:
        return bool(self.shards or self.logits or self.failed)


def _layer_index(name: str) -> int:
    found = re.search(r"layers\.(\d+)\.", name)
    if found is None:
        raise RuntimeError(f"cannot tell the layer index of vLLM attention layer '{name}'")
    return int(found.group(1))


class _PagedKV:
    """One engine's paged KV tensors, per attention layer in model order, and how to read and write them."""

    def __init__(self, layers: dict[str, Any]) -> None:
        attention = {name: layer for name, layer in layers.items()
                     if isinstance(getattr(layer, "kv_cache", None), torch.Tensor)}
        self.names = sorted(attention, key=_layer_index)
        self.layers = [attention[name] for name in self.names]
        self.caches = [layer.kv_cache for layer in self.layers]  # each (blocks, H, bs, 2D)
        blocks, self.heads, self.block_size, twice = self.caches[0].shape
        self.head_dim = twice // 2
        shape = (self.heads, self.block_size, self.head_dim, self.caches[0].dtype, self.layers[0].isa)
        if shape not in _LAYOUTS:
            _LAYOUTS[shape] = self._learn_layout()
        self._key_index, self._value_index = _LAYOUTS[shape]

    def _halves(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        blocks, heads, bs, _ = cache.shape
        return cache.view(blocks, heads, 2 * bs, -1).chunk(2, dim=2)

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        """keys, values: (T, H, D); slots: (T,) int64."""
        attn = self.layers[layer]
        key_cache, value_cache = self._halves(self.caches[layer])
        ops.cpu_attn_reshape_and_cache(keys.contiguous(), values.contiguous(), key_cache, value_cache, slots,
                                       attn.isa, k_scale=attn._k_scale_float, v_scale=attn._v_scale_float)

    def _learn_layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the cache-write op puts token t, head h, channel d inside a block: write the code
        of each (t, h, d) as keys and its negative as values into a scratch block and see where they
        land. Codes go in digit by digit (base 128: every digit is exact in bf16 and fp16 too)."""
        bs, heads, dim = self.block_size, self.heads, self.head_dim
        n = bs * heads * dim
        cache = self.caches[0]
        device = cache.device
        codes = torch.arange(n, dtype=torch.int64, device=device).view(bs, heads, dim)
        slots = torch.arange(bs, dtype=torch.int64, device=device)
        attn = self.layers[0]
        found: list[torch.Tensor] = []  # per digit: (where keys landed, where values landed, their digits)
        place = 1
        while place == 1 or place < n:
            digit = (codes // place % _CODE_BASE + 1).to(cache.dtype)  # (bs, H, D), 1..128: exact
            scratch = torch.zeros((1, heads, bs, 2 * dim), dtype=cache.dtype, device=device)
            key_cache, value_cache = self._halves(scratch)
            ops.cpu_attn_reshape_and_cache(digit, -digit, key_cache, value_cache, slots, attn.isa,
                                           k_scale=1.0, v_scale=1.0)
            flat = scratch.flatten().to(torch.float32)
            if int((flat > 0).sum()) != n or int((flat < 0).sum()) != n:
                raise RuntimeError("could not learn vLLM's CPU KV layout: the cache-write op lost values")
            found.append(flat)
            place *= _CODE_BASE
        keys, values = found[0] > 0, found[0] < 0  # the same places on every pass
        key_code = torch.zeros(n, dtype=torch.int64, device=device)
        value_code = torch.zeros(n, dtype=torch.int64, device=device)
        place = 1
        for flat in found:
            key_code += (flat[keys].long() - 1) * place
            value_code += (-flat[values].long() - 1) * place
            place *= _CODE_BASE
        where = torch.arange(keys.numel(), device=device)
        key_index = torch.empty(n, dtype=torch.int64, device=device)
        value_index = torch.empty(n, dtype=torch.int64, device=device)
        key_index[key_code] = where[keys]
        value_index[value_code] = where[values]
        return key_index.view(bs, heads, dim), value_index.view(bs, heads, dim)

    def read(self, block_ids: list[int], begin: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The KV of positions [begin, end) of a request whose blocks are `block_ids`: (L, H, T, D) each."""
        bs = self.block_size
        first, last = begin // bs, (end - 1) // bs + 1
        ids = torch.tensor(block_ids[first:last], dtype=torch.int64, device=self.caches[0].device)
        lo, hi = begin - first * bs, end - first * bs
        keys, values = [], []
        for cache in self.caches:
            blocks = cache[ids].flatten(1)  # (nblk, H*bs*2D)
            k = blocks[:, self._key_index.flatten()].view(-1, self.heads, self.head_dim)[lo:hi]  # (T, H, D)
            v = blocks[:, self._value_index.flatten()].view(-1, self.heads, self.head_dim)[lo:hi]
            keys.append(k.transpose(0, 1))
            values.append(v.transpose(0, 1))
        return torch.stack(keys).clone(), torch.stack(values).clone()


def _hooks_of(request: Any) -> tuple[str | None, RequestHooks | None]:
    key = (getattr(request, "kv_transfer_params", None) or {}).get(EXTRA_KEY)
    return key, REGISTRY.get(key) if key is not None else None


def claimable(hooks: RequestHooks, computed: int, prompt_len: int) -> int:
    """Tokens past `computed` that the request's injected runs supply contiguously (leaving the
    last prompt token to compute)."""
    end = computed
    for start, keys, _ in hooks.inject:  # runs in position order
        length = keys.shape[2]
        if start <= end < start + length:
            end = start + length
    return max(0, min(end, prompt_len - 1) - computed)


class AgentCacheConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._own_layers = vllm_config.compilation_config.static_forward_context  # this engine's
        self._own_kv: _PagedKV | None = None
        self._step_kv: tuple[int, _PagedKV] | None = None
        self._pending: list[tuple[str, Any, list[int], int]] = []
        self._failed: set[int] = set()  # blocks whose injection failed in this forward pass
        self._workers = vllm_config.parallel_config.world_size > 1  # worker processes: no shared registry
        self._total_heads = vllm_config.model_config.get_total_num_kv_heads()
        self._saves: list[_Save] = []  # scheduler side: to send with the next step
        self._deferred: dict[str, str] = {}  # scheduler side: request id -> key, blocks kept for a save
        self._forget: list[str] = []  # scheduler side: keys of dropped calls, popped once their blocks are freed
        self._outbox = _Outbox()  # worker side: to send back at the end of the step
        self._saved: set[str] = set()  # worker side: request ids read back, not yet reported
        self._finished: OrderedDict[str, None] = OrderedDict()  # worker side: request ids vLLM said finished

    # --- worker side (shared by every engine in the process) ------------------------------------

    def _heads(self, paged: _PagedKV) -> tuple[int, bool]:
        """This worker's first KV head in the full set, and whether it is the first rank holding it
        (fewer KV heads than ranks: each head is held by several)."""
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        rank, size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        if self._total_heads >= size:
            return rank * paged.heads, True
        replicas = size // self._total_heads
        return rank // replicas, rank % replicas == 0

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, _Loads) or not (metadata.loads or metadata.saves):
            return
        layers = forward_context.no_compile_layers  # the engine stepping now
        if self._step_kv is None or self._step_kv[0] != id(layers):
            self._step_kv = (id(layers), _PagedKV(layers))
        paged = self._step_kv[1]
        first_head, reader = self._heads(paged)
        for load in metadata.loads:
            try:
                self._load(paged, load, first_head)
            except Exception:  # noqa: BLE001 - vLLM recomputes these blocks (kv_load_failure_policy)
                log.exception("injecting KV into request %s failed; vLLM recomputes it", load.key)
                bs = paged.block_size
                first, last = load.start // bs, (load.start + load.count - 1) // bs
                self._failed.update(load.block_ids[first : last + 1])
                hooks = REGISTRY.get(load.key)
                if hooks is not None:
                    hooks.load_failed = True
                else:
                    self._outbox.failed.add(load.key)
        for save in metadata.saves:
            if reader:
                for begin, end in save.spans:
                    self._outbox.shards.setdefault((save.key, (begin, end)), {})[first_head] = paged.read(
                        list(save.block_ids), begin, end)
            self._saved.add(save.request_id)

    def _load(self, paged: _PagedKV, load: _Load, first_head: int) -> None:
        bs = paged.block_size
        heads = slice(first_head, first_head + paged.heads)
        device = paged.caches[0].device
        positions = torch.arange(load.start, load.start + load.count, device=device)
        blocks = torch.tensor(load.block_ids, dtype=torch.int64, device=device)
        slots = blocks[positions // bs] * bs + positions % bs  # (T,)
        for start, keys, values in load.runs:  # (L, H, T, D) each
            lo, hi = max(start, load.start), min(start + keys.shape[2], load.start + load.count)
            if lo >= hi:
                continue
            part = slots[lo - load.start : hi - load.start]
            for layer in range(len(paged.caches)):
                paged.write(layer, keys[layer, heads, lo - start : hi - start].transpose(0, 1),
                            values[layer, heads, lo - start : hi - start].transpose(0, 1), part)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if not (self._saved or self._finished) and not self._workers:
            return None, None
        for request_id in finished_req_ids:  # vLLM takes only ids it named finished (they come with the save)
            self._finished[request_id] = None
        while len(self._finished) > _FINISHED_KEPT:  # other requests' ids
            self._finished.popitem(last=False)
        done = {r for r in self._saved if r in self._finished}
        for request_id in done:
            self._saved.discard(request_id)
            del self._finished[request_id]
        return (done or None), None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        self._outbox.logits.update(WORKER_LOGITS)  # what this worker's logits processor recorded
        WORKER_LOGITS.clear()
        if not self._outbox:
            return None
        out, self._outbox = self._outbox, _Outbox()
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    # --- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        _, hooks = _hooks_of(request)  # may be asked more than once: no side effects here
        if hooks is None or not hooks.inject:
            return 0, False
        return claimable(hooks, num_computed_tokens, request.num_prompt_tokens), False  # False: load before the forward

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        key, hooks = _hooks_of(request)
        if hooks is not None and num_external_tokens > 0:
            self._pending.append((key, request, list(blocks.get_block_ids()[0]), num_external_tokens))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        loads = []
        for key, request, block_ids, count in self._pending:
            start = request.num_computed_tokens - count  # num_computed now counts the local hit and the claim
            hooks = REGISTRY.get(key)
            if hooks is None:
                continue
            hooks.injected = count
            hooks.injected_from = start
            loads.append(_Load(key, tuple(block_ids), start, count, self._runs(hooks, start, start + count)))
        self._pending.clear()
        saves, self._saves = self._saves, []
        return _Loads(loads, saves)

    def _runs(self, hooks: RequestHooks, begin: int, end: int) -> tuple[Run, ...]:
        """The request's injected runs cut to [begin, end): views in-process, compact copies for
        worker processes (vLLM pickles the metadata to them)."""
        runs = []
        for start, keys, values in hooks.inject:
            lo, hi = max(start, begin), min(start + keys.shape[2], end)
            if lo < hi:
                k, v = keys[:, :, lo - start : hi - start], values[:, :, lo - start : hi - start]
                # copies of their own: a view would be pickled with its whole base tensor
                runs.append((lo, k.clone(), v.clone()) if self._workers else (lo, k, v))
        return tuple(runs)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        key, hooks = _hooks_of(request)
        if hooks is None or not (block_ids or self._workers):
            return False, None
        computed = request.num_computed_tokens
        spans = [(b, e) for b, e in hooks.capture if e <= computed]
        prompt_len = request.num_prompt_tokens
        if hooks.capture_generated and computed > prompt_len:
            spans.append((prompt_len, computed))
        if self._workers:  # the workers read it at the next step; the blocks stay until they did
            self._saves.append(_Save(request.request_id, key, tuple(block_ids), tuple(spans)))
            self._deferred[request.request_id] = key
            hooks.deferred = True
            return True, None
        if self._own_kv is None:
            self._own_kv = _PagedKV(self._own_layers)
        for begin, end in spans:
            hooks.captured[(begin, end)] = self._own_kv.read(block_ids, begin, end)
        return False, None

    def update_connector_output(self, connector_output: Any) -> None:
        for key in self._forget:  # dropped calls whose blocks the last step freed
            REGISTRY.pop(key, None)
        self._forget.clear()
        out = connector_output.kv_connector_worker_meta
        if isinstance(out, _Outbox):
            for key, row in out.logits.items():
                hooks = REGISTRY.get(key)
                if hooks is not None:
                    hooks.last_logits = row
            for (key, span), shards in out.shards.items():
                hooks = REGISTRY.get(key)
                if hooks is not None:  # each rank's heads, in head order: (L, H, T, D)
                    firsts = sorted(shards)
                    hooks.captured[span] = (torch.cat([shards[h][0] for h in firsts], dim=1),
                                            torch.cat([shards[h][1] for h in firsts], dim=1))
            for key in out.failed:
                hooks = REGISTRY.get(key)
                if hooks is not None:
                    hooks.load_failed = True
        for request_id in connector_output.finished_sending or ():  # their blocks are freed right after this
            key = self._deferred.pop(request_id, "")
            hooks = REGISTRY.get(key)
            if hooks is not None:
                hooks.done = True
                if hooks.dropped:  # freed under its tag (the eviction policy reads it), then forgotten
                    self._forget.append(key)

    def has_pending_block_frees(self) -> bool:
        return bool(self._deferred)

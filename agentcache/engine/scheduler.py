"""Continuous batching for the embedded engine: what one engine step does.

A step (1) takes newly submitted requests into the waiting queue, (2) admits waiting requests
while fewer than `max_batch` run (the prefix hit is decided here, at admission, by the cache
manager), (3) runs one prefill chunk of the first admitted request still prefilling (one whose
prefill computes at most a chunk's worth of positions may go before longer ones), and
(4) runs one batched decode step for every request past its first token. So a new arrival's
prefill interleaves with the others' decoding instead of waiting for them to finish.

Order: real requests before warm-ups, then `priority` (lower first), then arrival. A warm-up is
admitted only when no real request waits, prefills in small chunks and only while no real
request is prefilling, and is preempted when a real request needs its place.

What a request's prefill computes, and in which passes, is planned at admission without the model
(`prefill.prefill_layout`); the scheduler runs that layout one pass per step.

Only the engine loop's thread calls into a scheduler, in inference mode; the cache manager locks
its own bookkeeping, so other threads' lookups never wait for a step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch

from agentcache.engine.batch import DecodeRows
from agentcache.engine.cache_manager import CacheManager
from agentcache.engine.kv import CallCache, SegmentKV, prefix_digests
from agentcache.engine.grammar import Grammars, mask_rows
from agentcache.engine.graphs import DecodeGraphs
from agentcache.engine.layers import LayerControl
from agentcache.engine.loop import Job
from agentcache.engine.prefill import prefill_layout
from agentcache.engine.live_request import LiveRequest, job_order
from agentcache.engine.prefill_passes import PrefillPasses
from agentcache.engine.protocol import (
    ExecRequest,
    ExecResult,
    SegmentOutcome,
    Step,
)
from agentcache.engine.recompute import HiddenRecord
from agentcache.engine.runner import ModelRunner
from agentcache.engine.sampling import choose_token, finish_after
from agentcache.errors import Preempted, RequestCancelled

__all__ = ["BatchScheduler", "next_prefill"]


class BatchScheduler:
    """Runs requests on a model: `runner` computes, `layers` runs part of the stack, `cache` holds the
    prefix blocks, `model_key` names the weights (KV digests), `realign` moves KV to other positions;
    `eos_token_ids` and `detokenize` judge when a request is done."""

    def __init__(
        self, cache: CacheManager, runner: ModelRunner, layers: LayerControl, *, device: torch.device | str,
        model_key: bytes, hidden_size: int, realign: Callable[[SegmentKV, int], SegmentKV],
        eos_token_ids: frozenset[int], detokenize: Callable[[Sequence[int]], str],
        max_batch: int, prefill_chunk: int, warmup_chunk: int, grammars: Callable[[], Grammars],
        background_chunk: int | None = None,
        decode_graphs: bool = False,
    ) -> None:
        self.cache = cache
        self.runner = runner
        self.layers = layers
        self.kv_layout = runner.layout
        self.passes = PrefillPasses(runner, layers, realign)
        self.device = torch.device(device)
        self.model_key = model_key
        self.hidden_size = hidden_size
        self.realign = realign
        self.eos_token_ids = eos_token_ids
        self.detokenize = detokenize
        self.grammars = grammars  # built on first use: most engines never see a constraint
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.warmup_chunk, self.background_chunk = warmup_chunk, background_chunk
        self.waiting: list[Job] = []
        self.live: list[LiveRequest] = []
        self.rows = DecodeRows(self.kv_layout, max_batch, self.device)
        # decode steps replayed from CUDA graphs (graphs.py); None: every step runs eagerly
        self.graphs = DecodeGraphs(runner.step, self.rows, capture=True) if decode_graphs else None
        self.batched_tokens = 0  # tokens decoded in steps of more than one request
        # decode steps with a constrained row: their count, time, and the grammar's share (masks, matchers)
        self.constrained_steps, self.constrained_step_s, self.grammar_s = 0, 0.0, 0.0
        self.preempted = 0
        self.cancelled = 0  # requests dropped because their callers cancelled them

    # --- one step --------------------------------------------------------------------------

    def step(self, new_jobs: list[Job]) -> bool:
        """Run one engine step; returns whether work remains."""
        for job in new_jobs:
            if job.future.set_running_or_notify_cancel():  # a cancelled request is dropped here
                self.waiting.append(job)
        self._drop_cancelled()
        self.waiting.sort(key=job_order)
        self._admit()
        self._prefill_one()
        self._decode()
        return bool(self.waiting or self.live)

    def _drop_cancelled(self) -> None:
        """Requests their callers cancelled leave now: blocks freed, nothing cached."""
        for live in [live for live in self.live if live.request.is_cancelled]:
            self.cancelled += 1
            self._drop(live, RequestCancelled("the caller cancelled the request"))
        for job in [job for job in self.waiting if job.request.is_cancelled]:
            self.cancelled += 1
            self.waiting.remove(job)
            _fail(job.future, RequestCancelled("the caller cancelled the request before it was admitted"))

    def crash(self, exc: BaseException) -> None:
        """`step` raised outside any one request: fail every request and start clean."""
        for live in list(self.live):
            self._drop(live, exc)
        for job in self.waiting:
            _fail(job.future, exc)
        self.waiting.clear()

    # --- admission ---------------------------------------------------------------------------

    def _admit(self) -> None:
        """Admit from the head of the sorted queue: a warm-up reaches the head only when no real
        request waits."""
        while self.waiting:
            job = self.waiting[0]
            if len(self.live) >= self.max_batch and not self._preempt_for(job):
                break
            self.waiting.pop(0)
            try:
                self.live.append(self._start(job))
            except Exception as exc:  # noqa: BLE001 - this request fails, the engine goes on
                _fail(job.future, exc)

    def _preempt_for(self, job: Job) -> bool:
        """Free a place for a real request by preempting the newest warm-up, if one runs."""
        if job.request.warmup:
            return False
        warmups = [live for live in self.live if live.request.warmup]
        if not warmups:
            return False
        victim = max(warmups, key=lambda live: live.job.seq)
        self.preempted += 1
        self._drop(victim, Preempted("a real request needed this warm-up's place in the batch"))
        return True

    def _start(self, job: Job) -> LiveRequest:
        request = job.request
        prompt = request.token_ids
        lease = self.cache.admit(prompt, _lookup_length(request), lineage=request.lineage, namespace=request.cache_salt,
                                 owner=request.owner, session=request.session, warmup=request.uncounted)
        try:
            cache = CallCache(self.kv_layout, len(prompt) + request.sampling.max_tokens, self.device)
            if lease.hit.blocks:
                cache.append(*self.cache.gather(lease))
            digests = prefix_digests(prompt, _segment_ends(request), self.model_key)
            layout = prefill_layout(request, lease.hit.tokens, digests, prefill_chunk=self.prefill_chunk,
                                    warmup_chunk=self.warmup_chunk, background_chunk=self.background_chunk)
            live = LiveRequest(job, prompt, lease, cache, digests, layout)
            if request.hidden_layer is not None:
                live.hidden = HiddenRecord(request.hidden_layer, cache.capacity, self.hidden_size, self.device)
            sampling = request.sampling
            if sampling.temperature > 0 and sampling.seed is not None:
                live.generator = torch.Generator(device="cpu").manual_seed(sampling.seed)
            if sampling.constraint is not None:
                live.grammar = self.grammars().start(sampling.constraint)
            live.prefill = self.passes.steps(live)
            return live
        except BaseException:
            self.cache.free(lease)
            raise

    # --- prefill -------------------------------------------------------------------------------

    def _prefill_one(self) -> None:
        prefilling = [live for live in self.live if live.prefill is not None]
        if not prefilling:
            return
        live = next_prefill(prefilling, self.max_batch)
        try:
            next(live.prefill)
            return
        except StopIteration:
            live.prefill = None
        except Exception as exc:  # noqa: BLE001
            self._drop(live, exc)
            return
        try:
            self._first_token(live)
        except _CallbackError as exc:
            self._drop(live, exc)

    # --- decoding --------------------------------------------------------------------------------

    def _first_token(self, live: LiveRequest) -> None:
        sampling = live.request.sampling
        logits = live.logits.cpu()[None]  # (1, V); the kept logits stay as the model gave them
        if live.grammar is not None:
            logits = mask_rows(logits.clone(), [live.grammar])
        token = choose_token(logits[0], sampling.temperature, sampling.top_p, live.generator)
        live.ttft = time.perf_counter() - live.job.submitted
        if self._emit(live, token):
            self._finish(live)
        else:
            self.rows.join(live.cache)
            live.decoding = True

    def _decode(self) -> None:
        members = [live for live in self.live if live.decoding]
        if not members:
            return
        by_cache = {id(live.cache): live for live in members}
        ordered = [by_cache[id(cache)] for cache in self.rows.members]  # row order
        grammars = [live.grammar for live in ordered]
        began = time.perf_counter()
        try:
            logits = self._decode_step(ordered)  # (n, V)
        except Exception as exc:  # noqa: BLE001 - the batch's requests fail, the engine goes on
            for live in ordered:
                self._drop(live, exc)
            return
        if len(ordered) > 1:
            self.batched_tokens += len(ordered)
        masking = time.perf_counter()
        logits = mask_rows(logits.cpu(), grammars)  # (n, V); unconstrained rows untouched
        grammar_s = time.perf_counter() - masking
        done = []
        for live, row_logits in zip(ordered, logits):
            sampling = live.request.sampling
            token = choose_token(row_logits, sampling.temperature, sampling.top_p, live.generator)
            try:
                if self._emit(live, token):
                    done.append(live)
            except _CallbackError as exc:
                self._drop(live, exc)
        if any(g is not None for g in grammars):
            self.constrained_steps += 1
            self.constrained_step_s += time.perf_counter() - began
            self.grammar_s += grammar_s + sum(live.grammar_s for live in ordered)
            for live in ordered:
                live.grammar_s = 0.0
        for live in done:
            self._finish(live)

    def _decode_step(self, ordered: list[LiveRequest]) -> torch.Tensor:
        """One batched decode step over the rows (in row order), recording the hidden states of the
        rows that ask for them. Rows asking for different layers: only the first layer asked is
        recorded (the others' output then has no hidden states, and their consumers prefill)."""
        tokens = [live.generated[-1] for live in ordered]
        asking = [(row, live) for row, live in enumerate(ordered) if live.hidden is not None]
        if not asking:
            if self.graphs is not None:
                return self.graphs.decode(tokens)
            return self.runner.decode(self.rows, tokens)
        layer = asking[0][1].hidden.layer
        positions = [live.cache.length for live in ordered]  # where each row's token goes
        with self.layers.running(capture=layer) as setting:
            logits = self.runner.decode(self.rows, tokens)
        hidden = setting.captured[0]  # (n, 1, hidden size)
        for row, live in asking:
            if live.hidden.layer == layer:
                live.hidden.put([positions[row]], hidden[row])
        return logits

    def _emit(self, live: LiveRequest, token: int) -> bool:
        """Record a generated token; returns whether the request is finished."""
        sampling = live.request.sampling
        live.generated.append(token)
        on_token = live.request.on_token
        try:
            if live.grammar is not None:
                began = time.perf_counter()
                live.grammar.accept(token)
                live.grammar_s += time.perf_counter() - began
            if on_token is not None:
                on_token(token)
        except Exception as exc:
            raise _CallbackError(exc) from exc
        ended = finish_after(live.generated, sampling.max_tokens, sampling.stop, sampling.ignore_eos,
                             self.eos_token_ids, self.detokenize)
        if ended is None:
            return False
        live.finish, text = ended
        if text is not None:
            live.text = text
        return True

    # --- finishing ---------------------------------------------------------------------------------

    def _finish(self, live: LiveRequest) -> None:
        """Hand back the result: capture KV, cache the call's blocks, free its row and lease."""
        request, cache = live.request, live.cache
        try:
            prompt = live.prompt
            if live.finish != "stop":
                live.text = self.detokenize(live.generated)
            hit, lineage_from = live.lease.hit.tokens, live.lease.hit.lineage_from
            outcomes = [self._outcome(live, index, hit, lineage_from) for index in range(len(request.segments))]
            fed = live.generated[:-1]  # the last generated token was never fed back, so it has no KV
            generated_kv = generated_hidden = None
            if request.capture_kv and fed:
                end = len(prompt) + len(fed)
                live.digests.update(prefix_digests(prompt + fed, [end], self.model_key))
                generated_kv = self._capture(live, len(prompt), end)
                if live.hidden is not None:
                    generated_hidden = live.hidden.get(len(prompt), end)
            self.cache.commit(live.lease, prompt + fed, cache.view, approximate_from=live.first_approx)
            result = ExecResult(
                token_ids=list(live.generated), text=live.text, finish_reason=live.finish, prompt_tokens=len(prompt),
                cached_tokens=hit, ttft_s=live.ttft, total_s=time.perf_counter() - live.job.submitted,
                segments=outcomes, last_logits=live.logits, generated_kv=generated_kv, generated_hidden=generated_hidden,
                queued_s=live.admitted - live.job.submitted,
            )
        except Exception as exc:  # noqa: BLE001
            self._drop(live, exc)
            return
        self._release(live)
        live.job.future.set_result(result)

    def _outcome(self, live: LiveRequest, index: int, hit: int, lineage_from: int) -> SegmentOutcome:
        seg, span = live.request.segments[index], live.layout.spans[index]
        begin, end = span.start, span.start + len(seg.token_ids)
        return SegmentOutcome(
            name=seg.name, step=seg.step, start=begin, length=end - begin,
            cached_tokens=span.cached, computed_tokens=span.computed, injected_tokens=span.injected,
            kv=self._capture(live, begin, end) if live.request.capture_kv and seg.capture else None,
            lineage_tokens=max(0, min(begin + span.cached, hit) - max(begin, lineage_from)),
            recomputed_tokens=live.recomputed.get(index, 0.0), probe_tokens=live.probed.get(index, 0.0),
            hidden=live.hidden.get(begin, end) if live.hidden is not None else None,
        )

    def _capture(self, live: LiveRequest, begin: int, end: int) -> SegmentKV:
        keys, values = live.cache.view(begin, end)
        exact = live.first_approx is None or end <= live.first_approx
        return SegmentKV(keys.clone(), values.clone(), begin, live.digests[end] if exact else None)

    def _drop(self, live: LiveRequest, exc: BaseException) -> None:
        """End a request with an error; nothing it computed is cached."""
        self._release(live)
        _fail(live.job.future, exc.error if isinstance(exc, _CallbackError) else exc)

    def _release(self, live: LiveRequest) -> None:
        if live in self.live:
            self.live.remove(live)
        if live.decoding:
            self.rows.leave(live.cache)
            live.decoding = False
        self.cache.free(live.lease)


def next_prefill(prefilling: list[LiveRequest], max_batch: int) -> LiveRequest:
    """Whose prefill pass runs this step: the first in queue order, except that a request whose
    prefill computes at most one chunk's worth of positions (its own chunk: a warm-up's is small)
    goes before longer ones of its class, so that a call reusing its shared context (a few tokens
    of its own) does not wait behind a sibling's dense prefill. The first is overtaken at most
    `max_batch` times in a row, so it is never starved."""
    first = min(prefilling, key=lambda x: x.order)
    short = [live for live in prefilling
             if live.order[:2] == first.order[:2] and live.layout.dense_positions <= live.layout.chunk]
    if not short or first in short or first.overtaken >= max_batch:
        first.overtaken = 0
        return first
    first.overtaken += 1
    return min(short, key=lambda x: x.order)


class _CallbackError(Exception):
    """The request's own `on_token` or grammar raised: that request fails with its error."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _fail(future: Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


def _lookup_length(request: ExecRequest) -> int:
    """How much of the prompt is looked up in the prefix cache: the leading PREFIX and INJECT
    segments (DENSE ones are computed), within the request's lookup limit."""
    lookup = 0
    for seg in request.segments:
        if seg.step is Step.DENSE:
            break
        lookup += len(seg.token_ids)
    return lookup if request.lookup_limit is None else min(lookup, request.lookup_limit)


def _segment_ends(request: ExecRequest) -> list[int]:
    """0 and each segment's end position in the prompt."""
    ends = [0]
    for seg in request.segments:
        ends.append(ends[-1] + len(seg.token_ids))
    return ends

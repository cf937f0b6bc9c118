"""Continuous batching for the embedded engine: what one engine step does.

A step (1) takes newly submitted requests into the waiting queue, (2) admits waiting requests
while fewer than `max_batch` run (the prefix hit is decided here, at admission, by the cache
manager), (3) runs one prefill chunk of the first admitted request still prefilling, and
(4) runs one batched decode step for every request past its first token. So a new arrival's
prefill interleaves with the others' decoding instead of waiting for them to finish.

Order: real requests before warm-ups, then `priority` (lower first), then arrival. A warm-up is
admitted only when no real request waits, prefills in small chunks and only while no real
request is prefilling, and is preempted when a real request needs its place.

Only the engine loop's thread calls into a scheduler, in inference mode; the cache manager locks
its own bookkeeping, so other threads' lookups never wait for a step.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from functools import partial
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

import torch

from agentcache.engine.batch import DecodeRows
from agentcache.engine.cache_manager import Lease
from agentcache.engine.kv import CallCache, SegmentKV, prefix_digests
from agentcache.engine.loop import Job
from agentcache.engine.protocol import ExecRequest, ExecResult, SegmentOutcome, Step
from agentcache.engine.sampling import choose_token, finish_after
from agentcache.errors import Preempted

if TYPE_CHECKING:
    from agentcache.engine.embedded import EmbeddedEngine

__all__ = ["BatchScheduler"]


@dataclass(eq=False)
class _Live:
    """An admitted request, from admission to its result."""

    job: Job
    prompt: list[int]  # the request's tokens, joined once
    lease: Lease
    cache: CallCache
    digests: dict[int, bytes]  # position -> digest of the tokens before it (what KV ending there is exact for)
    prefill: Iterator[None] | None = None  # one prefill chunk per next(); None once the prompt is in
    logits: torch.Tensor | None = None  # (V,) at the last prompt position
    spans: list[tuple[int, int, int, int]] = field(default_factory=list)  # per segment (start, cached, computed, injected)
    first_approx: int | None = None  # first position whose KV is not exact for this prompt
    generator: torch.Generator | None = None
    generated: list[int] = field(default_factory=list)
    ttft: float = 0.0
    text: str = ""
    finish: str = "length"
    decoding: bool = False  # in the decode rows
    admitted: float = field(default_factory=time.perf_counter)

    @property
    def request(self) -> ExecRequest:
        return self.job.request

    @property
    def order(self) -> tuple:
        return _order(self.job)


def _order(job: Job) -> tuple:
    return (job.request.warmup, job.request.priority, job.seq)


class BatchScheduler:
    def __init__(self, engine: "EmbeddedEngine", max_batch: int, warmup_chunk: int) -> None:
        self.engine = engine
        self.max_batch = max_batch
        self.warmup_chunk = warmup_chunk
        self.waiting: list[Job] = []
        self.live: list[_Live] = []
        self.rows = DecodeRows(engine.layout, max_batch, torch.device(engine.config.device))
        self.batched_tokens = 0  # tokens decoded in steps of more than one request
        self.preempted = 0

    # --- one step --------------------------------------------------------------------------

    def step(self, new_jobs: list[Job]) -> bool:
        """Run one engine step; returns whether work remains."""
        for job in new_jobs:
            if job.future.set_running_or_notify_cancel():  # a cancelled request is dropped here
                self.waiting.append(job)
        self.waiting.sort(key=_order)
        self._admit()
        self._prefill_one()
        self._decode()
        return bool(self.waiting or self.live)

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

    def _start(self, job: Job) -> _Live:
        engine, request = self.engine, job.request
        prompt = request.token_ids
        lookup = 0  # the leading PREFIX and INJECT segments are looked up; DENSE ones are computed
        for seg in request.segments:
            if seg.step is Step.DENSE:
                break
            lookup += len(seg.token_ids)
        lease = engine.cache.admit(prompt, lookup, lineage=request.lineage, namespace=request.cache_salt,
                                   owner=request.owner, session=request.session, warmup=request.warmup)
        try:
            cache = CallCache(engine.layout, len(prompt) + request.sampling.max_tokens, torch.device(engine.config.device))
            if lease.hit.blocks:
                cache.append(*engine.cache.gather(lease))
            ends = [0]
            for seg in request.segments:
                ends.append(ends[-1] + len(seg.token_ids))
            live = _Live(job, prompt, lease, cache, prefix_digests(prompt, ends, engine.model_key))
            sampling = request.sampling
            if sampling.temperature > 0 and sampling.seed is not None:
                live.generator = torch.Generator(device="cpu").manual_seed(sampling.seed)
            live.prefill = self._prefill_steps(live)
            return live
        except BaseException:
            engine.cache.free(lease)
            raise

    # --- prefill -------------------------------------------------------------------------------

    def _prefill_one(self) -> None:
        prefilling = [live for live in self.live if live.prefill is not None]
        if not prefilling:
            return
        live = min(prefilling, key=lambda x: x.order)
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

    def _prefill_steps(self, live: _Live) -> Iterator[None]:
        """Fill the call cache past the prefix hit, one forward pass per `next`; sets the last
        position's logits, per-segment counts, and the first approximate position.

        The dense tokens before the first injected segment are prefilled as usual. All injected KV
        is then placed at its positions, and every dense token after it (the glue between injected
        segments, the tail) is computed in one scattered pass: each token attends to everything at
        lower positions, injected or dense. On a CPU a forward pass costs about as much for 5
        tokens as for 100 (reading the weights dominates), so one pass instead of one per glue
        segment is what lets reuse pay off for short shared segments."""
        engine, request, cache = self.engine, live.request, live.cache
        runner = engine.runner
        prompt = live.prompt
        hit, lineage_from = live.lease.hit.tokens, live.lease.hit.lineage_from
        chunk = self.warmup_chunk if request.warmup else engine.config.prefill_chunk
        dense: list[int] = []  # positions to compute, ascending
        placed: list[tuple[int, SegmentKV]] = []  # injected KV, re-aligned to its position
        first_inject_approx = None
        pos = 0
        last = len(request.segments) - 1
        for index, seg in enumerate(request.segments):
            n = len(seg.token_ids)
            cached = min(max(hit - pos, 0), n)  # served by the prefix hit found at admission
            if seg.step is Step.INJECT:
                inject = (n - 1 if index == last else n) - cached  # the final prompt token runs for its logits
                if inject > 0:
                    exact_here = seg.kv.start == pos and seg.kv.exact_for == live.digests[pos + n]
                    placed.append((pos + cached, engine.realign(seg.kv.slice(cached, cached + inject), pos + cached)))
                    if not exact_here and first_inject_approx is None:
                        first_inject_approx = pos + cached
                inject = max(inject, 0)
                dense.extend(range(pos + cached + inject, pos + n))
                live.spans.append((pos, cached, n - cached - inject, inject))
            else:
                dense.extend(range(pos + cached, pos + n))
                live.spans.append((pos, cached, n - cached, 0))
            pos += n
        split = placed[0][0] if placed else pos
        head = [p for p in dense if p < split]  # contiguous, from the end of the prefix hit
        tail = [p for p in dense if p >= split]
        passes = []  # one forward pass each, returning the logits of its last position
        if head:
            first, tokens = head[0], prompt[head[0] : head[-1] + 1]
            for offset in range(0, len(tokens), chunk):
                passes.append(partial(runner.forward, cache, tokens[offset : offset + chunk], first + offset))
        if placed:
            def scattered(part: list[int], first_pass: bool) -> torch.Tensor:
                if first_pass:  # the injected KV goes in right before the first pass that reads it
                    cache.clear(split, pos)
                    for start, kv in placed:
                        cache.place(start, kv.keys, kv.values)
                return runner.forward_scattered(cache, [prompt[p] for p in part], part, pos)

            for offset in range(0, len(tail), chunk):
                passes.append(partial(scattered, tail[offset : offset + chunk], offset == 0))
        for index, forward in enumerate(passes):
            live.logits = forward()
            if index < len(passes) - 1:
                yield
        if placed:
            cache.commit(pos)
        approx = ([lineage_from] if lineage_from < hit else []) + [first_inject_approx]
        live.first_approx = min((p for p in approx if p is not None), default=None)

    # --- decoding --------------------------------------------------------------------------------

    def _first_token(self, live: _Live) -> None:
        sampling = live.request.sampling
        token = choose_token(live.logits.cpu(), sampling.temperature, sampling.top_p, live.generator)
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
        try:
            logits = self.engine.runner.decode(self.rows, [live.generated[-1] for live in ordered])  # (n, V)
        except Exception as exc:  # noqa: BLE001 - the batch's requests fail, the engine goes on
            for live in ordered:
                self._drop(live, exc)
            return
        if len(ordered) > 1:
            self.batched_tokens += len(ordered)
        logits = logits.cpu()
        done = []
        for live, row_logits in zip(ordered, logits):
            sampling = live.request.sampling
            token = choose_token(row_logits, sampling.temperature, sampling.top_p, live.generator)
            try:
                if self._emit(live, token):
                    done.append(live)
            except _CallbackError as exc:
                self._drop(live, exc)
        for live in done:
            self._finish(live)

    def _emit(self, live: _Live, token: int) -> bool:
        """Record a generated token; returns whether the request is finished."""
        engine, sampling = self.engine, live.request.sampling
        live.generated.append(token)
        on_token = live.request.on_token
        if on_token is not None:
            try:
                on_token(token)
            except Exception as exc:  # noqa: BLE001 - the caller's callback fails its own request only
                raise _CallbackError(exc) from exc
        ended = finish_after(live.generated, sampling.max_tokens, sampling.stop, sampling.ignore_eos,
                             engine.eos_token_ids, engine.detokenize)
        if ended is None:
            return False
        live.finish, text = ended
        if text is not None:
            live.text = text
        return True

    # --- finishing ---------------------------------------------------------------------------------

    def _finish(self, live: _Live) -> None:
        """Hand back the result: capture KV, cache the call's blocks, free its row and lease."""
        engine, request, cache = self.engine, live.request, live.cache
        try:
            prompt = live.prompt
            if live.finish != "stop":
                live.text = engine.detokenize(live.generated)
            hit, lineage_from = live.lease.hit.tokens, live.lease.hit.lineage_from
            outcomes = [
                SegmentOutcome(
                    name=seg.name, step=seg.step, start=s, length=len(seg.token_ids),
                    cached_tokens=c, computed_tokens=d, injected_tokens=j,
                    kv=self._capture(live, s, s + len(seg.token_ids)) if request.capture_kv and seg.capture else None,
                    lineage_tokens=max(0, min(s + c, hit) - max(s, lineage_from)),
                )
                for seg, (s, c, d, j) in zip(request.segments, live.spans)
            ]
            fed = live.generated[:-1]  # the last generated token was never fed back, so it has no KV
            generated_kv = None
            if request.capture_kv and fed:
                end = len(prompt) + len(fed)
                live.digests.update(prefix_digests(prompt + fed, [end], engine.model_key))
                generated_kv = self._capture(live, len(prompt), end)
            engine.cache.commit(live.lease, prompt + fed, cache.view, approximate_from=live.first_approx)
            result = ExecResult(
                token_ids=list(live.generated), text=live.text, finish_reason=live.finish, prompt_tokens=len(prompt),
                cached_tokens=hit, ttft_s=live.ttft, total_s=time.perf_counter() - live.job.submitted,
                segments=outcomes, last_logits=live.logits, generated_kv=generated_kv,
                queued_s=live.admitted - live.job.submitted,
            )
        except Exception as exc:  # noqa: BLE001
            self._drop(live, exc)
            return
        self._release(live)
        live.job.future.set_result(result)

    def _capture(self, live: _Live, begin: int, end: int) -> SegmentKV:
        keys, values = live.cache.view(begin, end)
        exact = live.first_approx is None or end <= live.first_approx
        return SegmentKV(keys.clone(), values.clone(), begin, live.digests[end] if exact else None)

    def _drop(self, live: _Live, exc: BaseException) -> None:
        """End a request with an error; nothing it computed is cached."""
        self._release(live)
        _fail(live.job.future, exc.error if isinstance(exc, _CallbackError) else exc)

    def _release(self, live: _Live) -> None:
        if live in self.live:
            self.live.remove(live)
        if live.decoding:
            self.rows.leave(live.cache)
            live.decoding = False
        self.engine.cache.free(live.lease)


class _CallbackError(Exception):
    """The request's own `on_token` raised: that request fails with the callback's error."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _fail(future: Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)

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
from bisect import bisect_right
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import torch

from agentcache.engine.batch import DecodeRows
from agentcache.engine.cache_manager import Lease
from agentcache.engine.kv import CallCache, SegmentKV, prefix_digests
from agentcache.engine.loop import Job
from agentcache.engine.protocol import (
    ExecRequest,
    ExecResult,
    LayerRecompute,
    SegmentOutcome,
    Step,
    TokenRecompute,
)
from agentcache.engine.recompute import (
    Blend,
    HiddenRecord,
    Layered,
    chunks,
    known_from,
    pick_deviating,
    stages,
)
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
    recomputed: dict[int, float] = field(default_factory=dict)  # segment -> tokens' worth recomputed
    probed: dict[int, float] = field(default_factory=dict)  # segment -> CacheBlend probe work, in tokens
    hidden: HiddenRecord | None = None  # the hidden states entering `request.hidden_layer`, when asked
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
    def __init__(self, engine: EmbeddedEngine, max_batch: int, warmup_chunk: int) -> None:
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
                                   owner=request.owner, session=request.session, warmup=request.uncounted)
        try:
            cache = CallCache(engine.layout, len(prompt) + request.sampling.max_tokens, torch.device(engine.config.device))
            if lease.hit.blocks:
                cache.append(*engine.cache.gather(lease))
            ends = [0]
            for seg in request.segments:
                ends.append(ends[-1] + len(seg.token_ids))
            live = _Live(job, prompt, lease, cache, prefix_digests(prompt, ends, engine.model_key))
            if request.hidden_layer is not None:
                live.hidden = HiddenRecord(request.hidden_layer, cache.capacity, engine.hidden_size)
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
        segment is what lets reuse pay off for short shared segments. Selective recomputation
        (`engine.recompute`) adds CacheBlend's probe and picked tokens, or DroidSpeak's layer groups."""
        engine, request, cache = self.engine, live.request, live.cache
        runner = engine.runner
        prompt = live.prompt
        hit, lineage_from = live.lease.hit.tokens, live.lease.hit.lineage_from
        chunk = self.warmup_chunk if request.warmup else engine.config.prefill_chunk
        dense: list[int] = []  # positions to compute, ascending
        placed: list[tuple[int, SegmentKV]] = []  # injected KV, re-aligned to its position
        blends: list[Blend] = []
        layered: list[Layered] = []
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
                    kv = engine.realign(seg.kv.slice(cached, cached + inject), pos + cached)
                    placed.append((pos + cached, kv))
                    if not exact_here and first_inject_approx is None:
                        first_inject_approx = pos + cached
                    span = list(range(pos + cached, pos + cached + inject))
                    if isinstance(seg.recompute, TokenRecompute):
                        blends.append(Blend(index, span, kv, seg.recompute))
                    elif isinstance(seg.recompute, LayerRecompute):
                        hidden = seg.recompute.hidden[cached : cached + inject]  # (inject, hidden size)
                        unknown = known_from(hidden)  # leading tokens without hidden states: prefilled
                        dense.extend(span[:unknown])
                        live.recomputed[index] = float(unknown)
                        if unknown < len(span):
                            layered.append(Layered(index, span[unknown:], hidden[unknown:], seg.recompute))
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
        ran = False  # a pass has run: yield before the next one
        for part in chunks(head, chunk):
            if ran:
                yield
            live.logits = self._pass(live, part, partial(runner.forward, cache, [prompt[p] for p in part], part[0]))
            ran = True
        if placed:
            cache.clear(split, pos)
            for start, kv in placed:
                cache.place(start, kv.keys, kv.values)
            if blends:
                probe = max(b.spec.probe_layer for b in blends)
                probed = sorted(set(tail).union(*(b.positions for b in blends)))
                for part in chunks(probed, chunk):
                    if ran:
                        yield
                    self._scattered(live, part, pos, last=probe)
                    ran = True
                self._count(live, probed, live.probed, (probe + 1) / engine.layout.num_layers)
                for blend in blends:
                    picked = pick_deviating(cache, blend, probe)
                    live.recomputed[blend.segment] = float(len(picked))
                    tail.extend(picked)
                tail.sort()
            for stage in stages(tail, layered):
                if isinstance(stage, Layered):
                    for i in range(0, len(stage.positions), chunk):
                        if ran:
                            yield
                        self._scattered(live, stage.positions[i : i + chunk], pos, first=stage.spec.first,
                                        last=stage.spec.last, hidden=stage.hidden[i : i + chunk])
                        ran = True
                    share = len(stage.positions) * stage.layers / engine.layout.num_layers
                    live.recomputed[stage.segment] = live.recomputed.get(stage.segment, 0.0) + share
                    continue
                for part in chunks(stage, chunk):
                    if ran:
                        yield
                    live.logits = self._scattered(live, part, pos)
                    ran = True
            cache.commit(pos)
        approx = ([lineage_from] if lineage_from < hit else []) + [first_inject_approx]
        live.first_approx = min((p for p in approx if p is not None), default=None)

    def _scattered(self, live: _Live, positions: list[int], end: int, first: int = 0, last: int | None = None,
                   hidden: torch.Tensor | None = None) -> torch.Tensor:
        """One scattered pass over `positions` (below `end`), through layers first..last, layer
        `first` taking `hidden` (T, hidden size) as its input when given."""
        forward = partial(self.engine.runner.forward_scattered, live.cache, [live.prompt[p] for p in positions],
                          positions, end)
        return self._pass(live, positions, forward, first, last, None if hidden is None else hidden[None])

    def _pass(self, live: _Live, positions: list[int], forward, first: int = 0, last: int | None = None,
              hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Run one forward pass over `positions`, within the layer range, recording the hidden
        states the request asked for (the input of its `hidden_layer`, when the range runs it)."""
        record = live.hidden
        top = self.engine.layout.num_layers - 1 if last is None else last
        capture = record.layer if record is not None and first <= record.layer <= top else None
        if capture is None and first == 0 and last is None:
            return forward()
        with self.engine.layers.running(first, last, hidden, capture) as setting:
            logits = forward()
        if capture is not None:
            record.put(positions, setting.captured[0][0])  # (T, hidden size)
        return logits

    def _count(self, live: _Live, positions: list[int], into: dict[int, float], weight: float) -> None:
        """Add `weight` per position to the segment holding it."""
        starts = [start for start, *_ in live.spans]
        for p in positions:
            segment = bisect_right(starts, p) - 1
            into[segment] = into.get(segment, 0.0) + weight

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
            logits = self._decode_step(ordered)  # (n, V)
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

    def _decode_step(self, ordered: list[_Live]) -> torch.Tensor:
        """One batched decode step over the rows (in row order), recording the hidden states of the
        rows that ask for them. Rows asking for different layers: only the first layer asked is
        recorded (the others' output then has no hidden states, and their consumers prefill)."""
        tokens = [live.generated[-1] for live in ordered]
        asking = [(row, live) for row, live in enumerate(ordered) if live.hidden is not None]
        if not asking:
            return self.engine.runner.decode(self.rows, tokens)
        layer = asking[0][1].hidden.layer
        positions = [live.cache.length for live in ordered]  # where each row's token goes
        with self.engine.layers.running(capture=layer) as setting:
            logits = self.engine.runner.decode(self.rows, tokens)
        hidden = setting.captured[0]  # (n, 1, hidden size)
        for row, live in asking:
            if live.hidden.layer == layer:
                live.hidden.put([positions[row]], hidden[row])
        return logits

    def _emit(self, live: _Live, token: int) -> bool:
        """Record a generated token; returns whether the request is finished."""
        engine, sampling = self.engine, live.request.sampling
        live.generated.append(token)
        on_token = live.request.on_token
        if on_token is not None:
            try:
                on_token(token)
            except Exception as exc:
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
                    recomputed_tokens=live.recomputed.get(index, 0.0), probe_tokens=live.probed.get(index, 0.0),
                    hidden=live.hidden.get(s, s + len(seg.token_ids)) if live.hidden is not None else None,
                )
                for index, (seg, (s, c, d, j)) in enumerate(zip(request.segments, live.spans))
            ]
            fed = live.generated[:-1]  # the last generated token was never fed back, so it has no KV
            generated_kv = generated_hidden = None
            if request.capture_kv and fed:
                end = len(prompt) + len(fed)
                live.digests.update(prefix_digests(prompt + fed, [end], engine.model_key))
                generated_kv = self._capture(live, len(prompt), end)
                if live.hidden is not None:
                    generated_hidden = live.hidden.get(len(prompt), end)
            engine.cache.commit(live.lease, prompt + fed, cache.view, approximate_from=live.first_approx)
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

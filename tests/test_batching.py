"""Continuous batching in the embedded engine: batched greedy decoding equals one request at a time,
token for token (requests joining and leaving mid-batch, injected segments, prefix hits), and the
scheduler's rules: warm-ups after real calls and preempted for them, priorities, cancellation, a
failing request or callback failing only itself."""

from __future__ import annotations

import threading
import time

import pytest

from agentcache.engine import EngineConfig, ExecRequest, SamplingParams, SegmentPlan, Step
from agentcache.errors import Preempted

from conftest import TINY_PRESETS, make_engine, text_of_length


def mixed_requests(engine, count: int, seed: int = 0) -> list[ExecRequest]:
    """Requests of different prompt and output lengths, some sharing a system prompt (prefix hits),
    one injecting the KV of its shared segment computed in another context (approximate KV)."""
    system = engine.tokenize("System: you are a careful agent. " + text_of_length(engine, 30, seed=seed), bos=True)
    requests = []
    for i in range(count):
        query = engine.tokenize(f" Task {i}: " + text_of_length(engine, 5 + 9 * (i % 4), seed=seed + i))
        sampling = SamplingParams(max_tokens=3 + 5 * (i % 3), ignore_eos=True)
        requests.append(ExecRequest([SegmentPlan("sys", system), SegmentPlan("task", query)], sampling,
                                    owner=f"agent{i % 3}"))
    return requests


def with_injected(engine, requests: list[ExecRequest]) -> list[ExecRequest]:
    """Add a request whose shared note is injected from a call where it sat at another position."""
    note = engine.tokenize(" Shared note: " + text_of_length(engine, 20, seed=99))
    header = engine.tokenize("Elsewhere first. ", bos=True)
    source = make_engine(engine.model_name, pool_blocks=64, max_batch=1).execute(
        ExecRequest([SegmentPlan("h", header), SegmentPlan("note", note)], SamplingParams(max_tokens=1)))
    system = engine.tokenize("System: a reader. ", bos=True)
    ask = engine.tokenize(" Answer:")
    injected = ExecRequest([SegmentPlan("sys", system), SegmentPlan("note", note, Step.INJECT, source.segments[1].kv),
                            SegmentPlan("ask", ask, Step.DENSE)], SamplingParams(max_tokens=9, ignore_eos=True),
                           lineage="reader-lineage", owner="reader")
    return requests[:2] + [injected] + requests[2:]


def run_serial(preset: str, requests: list[ExecRequest]) -> list:
    engine = make_engine(preset, pool_blocks=256, max_batch=1)
    return [engine.execute(r) for r in requests]


def run_staggered(preset: str, requests: list[ExecRequest], max_batch: int) -> tuple[list, object]:
    """Submit the first half at once, the rest while those decode: requests join and leave mid-batch."""
    engine = make_engine(preset, pool_blocks=256, max_batch=max_batch)
    half = len(requests) // 2
    futures = [engine.submit(r) for r in requests[:half]]
    time.sleep(0.05)
    futures += [engine.submit(r) for r in requests[half:]]
    return [f.result(timeout=120) for f in futures], engine


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_batched_greedy_equals_one_at_a_time(preset):
    engine = make_engine(preset, pool_blocks=256)
    requests = with_injected(engine, mixed_requests(engine, 7))
    serial = run_serial(preset, requests)
    batched, batched_engine = run_staggered(preset, requests, max_batch=4)
    assert [r.token_ids for r in batched] == [r.token_ids for r in serial]
    assert batched_engine.scheduler.batched_tokens > 0, "no decode step ran more than one request"
    injected = batched[2].segments[1]
    # the whole note: no other request shares the reader's system prompt, so none of it was a prefix hit
    assert injected.injected_tokens == len(requests[2].segments[1].token_ids) and not injected.kv.exact
    assert batched_engine.pool.num_evictable == batched_engine.pool.num_used  # every lease was freed
    assert len(batched_engine.scheduler.rows) == 0 and not batched_engine.scheduler.live


def test_batched_greedy_equals_one_at_a_time_on_gemma(gemma_engine):
    requests = mixed_requests(gemma_engine, 5, seed=4)
    serial = [gemma_engine.with_config(EngineConfig(pool_blocks=256, max_batch=1)).execute(r) for r in requests]
    engine = gemma_engine.with_config(EngineConfig(pool_blocks=256, max_batch=4))
    batched = [f.result(timeout=300) for f in [engine.submit(r) for r in requests]]
    assert [r.token_ids for r in batched] == [r.token_ids for r in serial]
    assert engine.scheduler.batched_tokens > 0


def test_decode_rows_grow_and_stay_packed():
    """More requests than rows, prompts longer than the first buffer: rows grow and repack."""
    engine = make_engine("tiny-gemma3", pool_blocks=512, max_batch=2)
    long = engine.tokenize("Long: " + text_of_length(engine, 120, seed=5), bos=True)
    requests = [ExecRequest([SegmentPlan("p", engine.tokenize(f"Short {i}. ", bos=True))],
                            SamplingParams(max_tokens=4 + i, ignore_eos=True)) for i in range(3)]
    requests.append(ExecRequest([SegmentPlan("p", long)], SamplingParams(max_tokens=6, ignore_eos=True)))
    serial = run_serial("tiny-gemma3", requests)
    batched = [f.result(timeout=120) for f in [engine.submit(r) for r in requests]]
    assert [r.token_ids for r in batched] == [r.token_ids for r in serial]
    assert engine.scheduler.rows.tokens >= len(long) + 6


def test_warmups_wait_for_real_calls_and_give_way():
    engine = make_engine("tiny-llama", pool_blocks=256, max_batch=1)
    order = []
    gate = threading.Event()

    def blocker(token):  # holds the only slot until released
        gate.wait(10)

    first = engine.submit(ExecRequest([SegmentPlan("p", engine.tokenize("first call", bos=True))],
                                      SamplingParams(max_tokens=2, ignore_eos=True), on_token=blocker))
    warm = engine.submit(ExecRequest([SegmentPlan("w", engine.tokenize("warm me " * 20, bos=True))],
                                     SamplingParams(max_tokens=1), warmup=True, on_token=lambda t: order.append("warm")))
    real = engine.submit(ExecRequest([SegmentPlan("p", engine.tokenize("a real call", bos=True))],
                                     SamplingParams(max_tokens=1), on_token=lambda t: order.append("real")))
    gate.set()
    first.result(timeout=30), real.result(timeout=30), warm.result(timeout=30)
    assert order == ["real", "warm"]  # submitted after the warm-up, served before it

    # a running warm-up is preempted when a real call needs its place
    engine = make_engine("tiny-llama", pool_blocks=256, max_batch=1, warmup_chunk=1)
    warm = engine.submit(ExecRequest([SegmentPlan("w", engine.tokenize("warm me " * 40, bos=True))],
                                     SamplingParams(max_tokens=1), warmup=True))
    while not engine.scheduler.live:
        time.sleep(0.001)
    real = engine.submit(ExecRequest([SegmentPlan("p", engine.tokenize("urgent", bos=True))], SamplingParams(max_tokens=1)))
    real.result(timeout=30)
    with pytest.raises(Preempted):
        warm.result(timeout=30)
    assert engine.scheduler.preempted == 1 and engine.pool.num_evictable == engine.pool.num_used


def test_priority_orders_waiting_requests():
    engine = make_engine("tiny-llama", pool_blocks=256, max_batch=1)
    order = []
    gate = threading.Event()
    engine.submit(ExecRequest([SegmentPlan("p", engine.tokenize("hold", bos=True))],
                              SamplingParams(max_tokens=2, ignore_eos=True), on_token=lambda t: gate.wait(10)))
    futures = [engine.submit(ExecRequest([SegmentPlan("p", engine.tokenize(f"call {p}", bos=True))],
                                         SamplingParams(max_tokens=1), priority=p,
                                         on_token=lambda t, p=p: order.append(p))) for p in (5, 1, 3)]
    gate.set()
    for f in futures:
        f.result(timeout=30)
    assert order == [1, 3, 5]


def test_a_prefill_that_fits_one_pass_goes_before_a_longer_one():
    """A call with few tokens of its own (its shared context reused) is not held behind a sibling's
    dense prefill admitted just before it; both keep their greedy outputs."""
    engine = make_engine("tiny-llama", pool_blocks=256, max_batch=4, prefill_chunk=16)
    order, gate = [], threading.Event()
    hold = engine.submit(ExecRequest([SegmentPlan("p", engine.tokenize("hold", bos=True))],
                                     SamplingParams(max_tokens=2, ignore_eos=True), on_token=lambda t: gate.wait(10)))
    deadline = time.monotonic() + 30
    while not engine.scheduler.live and time.monotonic() < deadline:
        time.sleep(0.001)
    long_ids = engine.tokenize(text_of_length(engine, 60, seed=3), bos=True)  # many 16-token passes
    short_ids = engine.tokenize("a call", bos=True)  # 7 tokens (a byte tokenizer): one pass
    sampling = SamplingParams(max_tokens=3, ignore_eos=True)
    long = engine.submit(ExecRequest([SegmentPlan("p", long_ids)], sampling, on_token=lambda t: order.append("long")))
    short = engine.submit(ExecRequest([SegmentPlan("p", short_ids)], sampling, on_token=lambda t: order.append("short")))
    gate.set()  # both were queued while the held call's callback blocked the engine's loop
    results = [f.result(timeout=60) for f in (hold, long, short)]
    assert order[0] == "short" and order.count("long") == 3
    serial = make_engine("tiny-llama", pool_blocks=256, max_batch=1)
    assert results[1].token_ids == serial.execute(ExecRequest([SegmentPlan("p", long_ids)], sampling)).token_ids
    assert results[2].token_ids == serial.execute(ExecRequest([SegmentPlan("p", short_ids)], sampling)).token_ids


def test_short_prefills_overtake_the_first_at_most_max_batch_times_in_a_row():
    from types import SimpleNamespace

    from agentcache.engine.scheduler import next_prefill

    def live(seq: int, positions: int, warmup: bool = False):
        layout = SimpleNamespace(dense_positions=positions, chunk=4 if warmup else 8)  # a warm-up's chunk is smaller
        return SimpleNamespace(order=(warmup, 0, seq), layout=layout, overtaken=0)

    long, short, later_short = live(0, 40), live(1, 5), live(2, 3)
    warm_short = live(3, 2, warmup=True)
    picks = [next_prefill([long, short, later_short, warm_short], max_batch=2) for _ in range(3)]
    assert picks == [short, short, long]  # overtaken twice (max_batch), then served
    assert long.overtaken == 0 and next_prefill([long, later_short], max_batch=2) is later_short
    assert next_prefill([live(0, 40, warmup=True), warm_short], max_batch=2) is warm_short
    assert next_prefill([live(0, 40, warmup=True), live(1, 6, warmup=True)], max_batch=2).order[2] == 0
    assert next_prefill([live(5, 4), live(6, 2)], max_batch=2).order[2] == 5  # both short: queue order
    assert next_prefill([long, live(9, 30)], max_batch=2) is long  # neither fits one pass


def test_cancel_failures_and_callbacks_fail_only_their_request():
    engine = make_engine("tiny-qwen2", pool_blocks=256, max_batch=4)
    gate = threading.Event()
    hold = engine.submit(ExecRequest([SegmentPlan("p", engine.tokenize("hold the loop"))],
                                     SamplingParams(max_tokens=2, ignore_eos=True), on_token=lambda t: gate.wait(10)))
    queued = [engine.submit(ExecRequest([SegmentPlan("p", engine.tokenize(f"queued {i}"))], SamplingParams(max_tokens=3)))
              for i in range(2)]
    assert queued[0].cancel()  # not admitted yet: cancelled before it runs

    def broken(token):
        raise RuntimeError("callback broke")

    bad = engine.submit(ExecRequest([SegmentPlan("p", engine.tokenize("bad callback"))], SamplingParams(max_tokens=3),
                                    on_token=broken))
    good = engine.submit(ExecRequest([SegmentPlan("p", engine.tokenize("good call"))],
                                     SamplingParams(max_tokens=5, ignore_eos=True)))
    gate.set()
    with pytest.raises(RuntimeError, match="callback broke"):
        bad.result(timeout=30)
    assert len(good.result(timeout=30).token_ids) == 5
    assert hold.result(timeout=30) and queued[1].result(timeout=30)
    assert engine.pool.num_evictable == engine.pool.num_used and not engine.scheduler.live


def test_a_crashing_step_fails_its_requests_and_the_engine_recovers(monkeypatch):
    engine = make_engine("tiny-llama", pool_blocks=256, max_batch=2)
    calls = {"n": 0}
    original = engine.scheduler._decode

    def crash_once():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("scheduler bug")
        original()

    monkeypatch.setattr(engine.scheduler, "_decode", crash_once)
    request = ExecRequest([SegmentPlan("p", engine.tokenize("crash test", bos=True))],
                          SamplingParams(max_tokens=4, ignore_eos=True))
    with pytest.raises(RuntimeError, match="scheduler bug"):
        engine.execute(request)
    assert len(engine.execute(request).token_ids) == 4
    assert engine.pool.num_evictable == engine.pool.num_used


def test_exiting_with_a_request_in_flight_does_not_abort_the_process():
    """At interpreter exit the engine loop stops after its step: a daemon thread caught inside a
    torch op by the shutdown used to abort the process ("terminate called without an active
    exception", exit status 134)."""
    import subprocess
    import sys

    code = ("import time\n"
            "from agentcache.engine import EmbeddedEngine, ExecRequest, SamplingParams, SegmentPlan\n"
            "engine = EmbeddedEngine('mid-llama')\n"
            "future = engine.submit(ExecRequest([SegmentPlan('a', [1] + list(range(3, 300)) * 3)],\n"
            "                                   SamplingParams(max_tokens=400, ignore_eos=True)))\n"
            "time.sleep(1.0)\n"
            "assert not future.done()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]

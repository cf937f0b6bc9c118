"""Decode steps in static buckets (what CUDA graphs replay), checked on a CPU: the same tokens as eager
steps, padding rows that touch no member, and a step that reads nothing back to the host."""

from __future__ import annotations

import pytest
import torch

from agentcache.device_audit import HostReadAudit
from agentcache.engine import EmbeddedEngine, EngineConfig, ExecRequest, SamplingParams, SegmentPlan
from agentcache.engine.graphs import MIN_KEYS, DecodeGraphs, batch_bucket, keys_bucket

from conftest import text_of_length


def _engine(preset: str, static: bool) -> EmbeddedEngine:
    engine = EmbeddedEngine(preset, EngineConfig(pool_blocks=256, max_batch=8))
    if static:  # the CUDA path without the capture: every step in its (rows, keys) bucket
        engine.scheduler.graphs = DecodeGraphs(engine.runner.step, engine.scheduler.rows, capture=False)
    return engine


def _together(engine: EmbeddedEngine, prompts: list[list[int]], tokens: list[int]) -> list[list[int]]:
    """Every request submitted at once (decoded in one batch), greedy; their tokens."""
    futures = [engine.submit(ExecRequest([SegmentPlan("p", p)], SamplingParams(max_tokens=n, ignore_eos=True)))
               for p, n in zip(prompts, tokens)]
    return [f.result().token_ids for f in futures]


def test_buckets_pad_rows_to_powers_of_two_and_keys_to_the_buffer():
    assert [batch_bucket(n, 8) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert batch_bucket(3, 3) == 3  # never more rows than the buffer has
    assert keys_bucket(37, 4096) == MIN_KEYS and keys_bucket(257, 4096) == 512 and keys_bucket(513, 600) == 600


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gemma3"])  # tiny-gemma3: sliding-window layers (window 8)
def test_static_steps_decode_the_tokens_eager_steps_do(preset):
    eager, static = _engine(preset, False), _engine(preset, True)
    prompts = [eager.tokenize(text_of_length(eager, words, seed=words), bos=True) for words in (5, 17, 40)]
    lengths = [30, 12, 24]  # rows leave at different steps: buckets of 4, then 2, then 1 rows
    assert _together(static, prompts, lengths) == _together(eager, prompts, lengths)
    graphs = static.scheduler.graphs
    assert {rows for rows, _ in graphs._buckets} == {1, 2, 4}
    # a long request grows the decode buffer: the buckets over the old one are dropped, and steps go on
    long_prompt = static.tokenize(text_of_length(static, 120, seed=3), bos=True)
    assert len(long_prompt) + 8 > static.scheduler.rows.tokens
    before = static.scheduler.rows.keys
    assert _together(static, [prompts[0], long_prompt], [8, 8]) == _together(eager, [prompts[0], long_prompt], [8, 8])
    assert static.scheduler.rows.keys is not before and graphs._buffers is static.scheduler.rows.keys


def test_a_decode_step_reads_nothing_back_to_the_host():
    """Inside a step (what a graph captures) no tensor is read on the host and no host data is copied
    in: the one read per step is the sampled tokens', after it."""
    engine = _engine("tiny-gemma3", True)
    graphs = engine.scheduler.graphs
    audits: list[HostReadAudit] = []
    step = graphs.step

    def audited(*args):
        with HostReadAudit() as audit:
            logits = step(*args)
        audits.append(audit)
        return logits

    graphs.step = audited
    prompts = [engine.tokenize(text_of_length(engine, w, seed=w), bos=True) for w in (6, 30)]
    _together(engine, prompts, [10, 10])
    assert len(audits) >= 9
    reads = sum((a.reads for a in audits), start=type(audits[0].reads)())
    assert not reads, dict(reads)


def test_padding_rows_write_only_where_no_member_reads():
    """A padding row decodes at its bucket's last key position of a free row: the members' KV is
    what an eager engine holds."""
    eager, static = _engine("tiny-llama", False), _engine("tiny-llama", True)
    prompts = [eager.tokenize(text_of_length(eager, w, seed=w), bos=True) for w in (9, 21, 33)]
    captured = []
    for engine in (eager, static):
        futures = [engine.submit(ExecRequest([SegmentPlan("p", p, capture=True)],
                                             SamplingParams(max_tokens=6, ignore_eos=True), capture_kv=True))
                   for p in prompts]
        captured.append([f.result().generated_kv for f in futures])
    for got, want in zip(captured[1], captured[0]):
        assert torch.allclose(got.keys, want.keys, atol=1e-5) and torch.allclose(got.values, want.values, atol=1e-5)

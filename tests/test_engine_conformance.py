"""The Engine contract. Every engine implementation must pass this suite: the `engine` fixture runs
each kind in `conftest.ENGINE_KINDS` on each tiny preset, and `engine_variant` builds another
engine of the same kind with other settings."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from agentcache.engine import Engine, ExecRequest, SamplingParams, SegmentKV, SegmentPlan, Step
from agentcache.errors import ContextLengthError, KVShapeError, PlanError, RequestCancelled, SegmentError

from conftest import ENGINE_KINDS, ENGINE_MARKS, TINY_PRESETS, engine_variant, text_of_length

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(params=[pytest.param((kind, preset), marks=ENGINE_MARKS.get(kind, []), id=f"{kind}-{preset}")
                        for kind in ENGINE_KINDS for preset in TINY_PRESETS])
def engine(request):
    kind, preset = request.param
    built = ENGINE_KINDS[kind](preset, pool_blocks=64)
    built.conformance_kind = kind
    return built


def three_segments(engine, seed=0):
    return [
        SegmentPlan("sys", engine.tokenize("System: you are the planner. " + text_of_length(engine, 6, seed), bos=True)),
        SegmentPlan("query", engine.tokenize(" Query: " + text_of_length(engine, 12, seed + 1))),
        SegmentPlan("glue", engine.tokenize(" Answer:")),
    ]


def as_one(segments, step=Step.PREFIX):
    return [SegmentPlan("all", [t for s in segments for t in s.token_ids], step)]


def with_steps(segments, step):
    return [SegmentPlan(s.name, s.token_ids, step) for s in segments]


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, atol=1e-4, rtol=1e-4)


def test_engine_satisfies_protocol(engine):
    assert isinstance(engine, Engine)


def test_segment_by_segment_prefill_equals_one_shot(engine):
    segments = three_segments(engine)
    one = engine.execute(ExecRequest(as_one(segments, Step.DENSE), GREEDY))
    split = engine.execute(ExecRequest(with_steps(segments, Step.DENSE), GREEDY))
    assert close(one.last_logits, split.last_logits)
    assert one.token_ids == split.token_ids
    for outcome in split.segments:
        ref_keys = one.segments[0].kv.keys[:, :, outcome.start : outcome.start + outcome.length]
        assert close(outcome.kv.keys, ref_keys)
        assert outcome.kv.exact


def test_chunked_prefill_equals_unchunked(engine):
    chunked = engine_variant(engine, pool_blocks=64, prefill_chunk=7)
    segments = three_segments(engine)
    a = engine.execute(ExecRequest(with_steps(segments, Step.DENSE), GREEDY))
    b = chunked.execute(ExecRequest(with_steps(segments, Step.DENSE), GREEDY))
    assert close(a.last_logits, b.last_logits) and a.token_ids == b.token_ids


def test_repeated_prefix_reports_cached_tokens_and_same_logits(engine):
    segments = three_segments(engine)
    cold = engine.execute(ExecRequest(segments, GREEDY))
    assert cold.cached_tokens == 0
    total = sum(len(s.token_ids) for s in segments)
    expected = (total - 1) // engine.block_size * engine.block_size
    assert engine.cached_prefix_length([t for s in segments for t in s.token_ids]) >= expected
    warm = engine.execute(ExecRequest(segments, GREEDY))
    assert warm.cached_tokens == expected > 0
    assert sum(o.cached_tokens for o in warm.segments) == expected
    assert warm.computed_tokens == total - expected
    assert close(cold.last_logits, warm.last_logits)
    assert cold.token_ids == warm.token_ids
    # DENSE steps never use the cache.
    dense = engine.execute(ExecRequest(with_steps(segments, Step.DENSE), GREEDY))
    assert dense.cached_tokens == 0 and close(dense.last_logits, cold.last_logits)


def test_generated_tokens_extend_the_cached_prefix(engine):
    segments = three_segments(engine, seed=3)
    first = engine.execute(ExecRequest(segments, SamplingParams(max_tokens=40, ignore_eos=True)))
    follow_up = [t for s in segments for t in s.token_ids] + first.token_ids
    assert engine.cached_prefix_length(follow_up) >= (len(follow_up) - 1) // engine.block_size * engine.block_size
    assert first.generated_kv.start == first.prompt_tokens
    assert first.generated_kv.length == len(first.token_ids) - 1


def test_injecting_own_exact_kv_equals_dense(engine):
    segments = three_segments(engine)
    dense = engine.execute(ExecRequest(with_steps(segments, Step.DENSE), GREEDY))
    query_kv = dense.segments[1].kv
    glue_kv = dense.segments[2].kv
    plan = [
        SegmentPlan("sys", segments[0].token_ids, Step.DENSE),
        SegmentPlan("query", segments[1].token_ids, Step.INJECT, query_kv),
        SegmentPlan("glue", segments[2].token_ids, Step.INJECT, glue_kv),  # last: its final token is recomputed
    ]
    injected = engine.execute(ExecRequest(plan, GREEDY))
    assert injected.segments[1].injected_tokens == len(segments[1].token_ids)
    assert injected.segments[2].injected_tokens == len(segments[2].token_ids) - 1
    assert injected.segments[2].computed_tokens == 1
    assert close(dense.last_logits, injected.last_logits)
    assert dense.token_ids == injected.token_ids
    assert all(o.kv.exact for o in injected.segments)


def test_inject_is_trimmed_at_the_prefix_hit_found_at_admission(engine):
    """A plan injects the whole shared segment; the cache holds exact blocks of part of it (another
    call computed them): those tokens are served exactly, only the rest is injected."""
    segments = three_segments(engine, seed=3)
    sys_ids, query_ids, glue_ids = (s.token_ids for s in segments)
    warm = engine.block_size + 4  # query tokens cached: the hit ends inside the query
    engine.execute(ExecRequest([SegmentPlan("warm", list(sys_ids) + list(query_ids[:warm]))], GREEDY))
    dense = engine_variant(engine, pool_blocks=64, prefix_caching=False).execute(
        ExecRequest(with_steps(segments, Step.DENSE), GREEDY))
    plan = [SegmentPlan("sys", sys_ids, Step.PREFIX), SegmentPlan("query", query_ids, Step.INJECT, dense.segments[1].kv),
            SegmentPlan("glue", glue_ids, Step.DENSE)]
    result = engine.execute(ExecRequest(plan, GREEDY))
    hit = (len(sys_ids) + warm) // engine.block_size * engine.block_size
    query = result.segments[1]
    assert result.cached_tokens == hit > len(sys_ids)
    assert query.cached_tokens == hit - len(sys_ids) and query.injected_tokens == len(query_ids) - query.cached_tokens
    assert query.kv.exact and query.lineage_tokens == 0  # exact blocks, then exact KV of the same context
    assert close(dense.last_logits, result.last_logits) and dense.token_ids == result.token_ids


def test_a_lookup_limit_makes_injected_kv_count_where_the_cache_holds_exact_blocks(engine):
    """A prompt whose exact blocks are all cached, replayed with its query injected as KV of
    another context: without a limit the cache serves the query exactly (the injected KV is
    unused); with `lookup_limit` at the query's start the injected KV is what the call computes with."""
    segments = three_segments(engine, seed=5)
    sys_ids, query_ids, glue_ids = (s.token_ids for s in segments)
    exact = engine.execute(ExecRequest(with_steps(segments, Step.PREFIX), GREEDY))  # caches every full block
    other = engine_variant(engine, pool_blocks=64).execute(ExecRequest(  # the query after another system prompt
        [SegmentPlan("sys", engine.tokenize("Another prompt entirely. " * 3, bos=True)),
         SegmentPlan("query", query_ids), SegmentPlan("glue", glue_ids)], GREEDY))
    plan = [SegmentPlan("sys", sys_ids, Step.PREFIX), SegmentPlan("query", query_ids, Step.INJECT, other.segments[1].kv),
            SegmentPlan("glue", glue_ids, Step.PREFIX)]
    served = engine.execute(ExecRequest(plan, GREEDY))
    assert served.segments[1].cached_tokens >= len(query_ids) - engine.block_size  # all but a partial block
    limited = engine.execute(ExecRequest(plan, GREEDY, lookup_limit=len(sys_ids)))
    assert limited.cached_tokens <= len(sys_ids) and limited.segments[1].injected_tokens == len(query_ids)

    def deviation(result) -> float:
        return float((result.last_logits - exact.last_logits).abs().max())

    assert deviation(limited) > 3 * deviation(served)  # computed with the other context's KV
    with pytest.raises(PlanError, match="lookup_limit"):
        ExecRequest(plan, GREEDY, lookup_limit=-1)


@pytest.mark.parametrize("chunk", [512, 3])
def test_glue_between_injected_segments_equals_dense(engine, chunk):
    """[sys][A inject][glue][B inject][glue][C inject][ask]: the glue and the ask are computed in one
    scattered pass over the placed KV (in chunks of 3 too); with exact KV that equals dense prefill,
    also past tiny-gemma3's sliding window of 8."""
    engine = engine_variant(engine, pool_blocks=64, prefill_chunk=chunk)
    # the dense reference runs elsewhere: its blocks here would serve the injected segments at admission
    reference = engine_variant(engine, pool_blocks=64, prefill_chunk=chunk, prefix_caching=False)
    parts = [engine.tokenize("System: you are the judge. ", bos=True)]
    for i in range(3):
        parts.append(engine.tokenize(f" Note {i}: " + text_of_length(engine, 10, seed=i)))
        parts.append(engine.tokenize(f" then{i}"))
    names = ["sys"] + [n for i in range(3) for n in (f"note{i}", f"glue{i}")]
    dense = reference.execute(ExecRequest([SegmentPlan(n, t, Step.DENSE) for n, t in zip(names, parts)], GREEDY))
    plan = [SegmentPlan("sys", parts[0], Step.PREFIX)]
    for index in range(1, len(parts)):
        kv = dense.segments[index].kv if names[index].startswith("note") else None
        plan.append(SegmentPlan(names[index], parts[index], Step.INJECT if kv else Step.DENSE, kv))
    injected = engine.execute(ExecRequest(plan, GREEDY))
    assert [o.injected_tokens for o in injected.segments] == [0, len(parts[1]), 0, len(parts[3]), 0, len(parts[5]), 0]
    assert close(dense.last_logits, injected.last_logits)
    assert dense.token_ids == injected.token_ids
    for a, b in zip(dense.segments, injected.segments):  # the glue's KV too, computed in the scattered pass
        assert close(a.kv.keys, b.kv.keys) and close(a.kv.values, b.kv.values)
    assert all(o.kv.exact for o in injected.segments)
    again = engine.execute(ExecRequest(plan, GREEDY))  # cached blocks from the scattered call serve a rerun
    # the lookup covers the leading PREFIX and INJECT segments (up to the first glue): all their full blocks hit
    looked_up = len(parts[0]) + len(parts[1])
    assert again.cached_tokens == looked_up // engine.block_size * engine.block_size
    assert again.token_ids == dense.token_ids


def _foreign_query_kv(engine, query_ids):
    """The query's KV computed under another agent's prefix (approximate for ours)."""
    other = engine.tokenize("System: you are the critic, terse. ", bos=True)
    result = engine.execute(ExecRequest([SegmentPlan("sys", other), SegmentPlan("query", query_ids)], GREEDY))
    return result.segments[1].kv


def test_approximate_kv_serves_only_its_own_lineage(engine):
    segments = three_segments(engine, seed=5)
    foreign = _foreign_query_kv(engine, segments[1].token_ids)
    assert foreign.start != len(segments[0].token_ids)
    plan = [segments[0], SegmentPlan("query", segments[1].token_ids, Step.INJECT, foreign), segments[2]]
    approx = engine.execute(ExecRequest(plan, GREEDY, lineage="planner"))
    assert not approx.segments[1].kv.exact and not approx.segments[2].kv.exact
    assert approx.segments[0].kv.exact
    prompt = [t for s in segments for t in s.token_ids]
    sys_blocks = len(segments[0].token_ids) // engine.block_size
    # Another request sees only the exact system-prompt blocks; the planner's lineage sees more.
    assert engine.cached_prefix_length(prompt) == sys_blocks * engine.block_size
    assert engine.cached_prefix_length(prompt, lineage="critic") == sys_blocks * engine.block_size
    assert engine.cached_prefix_length(prompt, lineage="planner") > sys_blocks * engine.block_size
    again = engine.execute(ExecRequest(segments, GREEDY, lineage="planner"))
    assert again.cached_tokens > sys_blocks * engine.block_size
    # Its own (approximate) context is what got reused: the hit part of the query is the injected KV.
    reused = again.segments[1].cached_tokens
    assert reused == min(len(segments[1].token_ids), again.cached_tokens - len(segments[0].token_ids)) > 0
    assert torch.equal(again.segments[1].kv.keys[:, :, :reused], approx.segments[1].kv.keys[:, :, :reused])
    assert not again.segments[1].kv.exact
    # Without a lineage, approximate KV is not cached at all.
    fresh = engine_variant(engine, pool_blocks=64)
    fresh.execute(ExecRequest(plan, GREEDY))
    assert fresh.cached_prefix_length(prompt, lineage="anything") <= sys_blocks * fresh.block_size


def test_stop_strings_eos_and_max_tokens(engine):
    segments = three_segments(engine)
    free = engine.execute(ExecRequest(segments, SamplingParams(max_tokens=12, ignore_eos=True)))
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    if len(free.text) >= 3:
        stop = free.text[1:3]
        stopped = engine.execute(ExecRequest(segments, SamplingParams(max_tokens=12, stop=(stop,), ignore_eos=True)))
        assert stopped.finish_reason == "stop"
        assert stop not in stopped.text and free.text.startswith(stopped.text)


def test_sampling_is_reproducible_with_a_seed(engine):
    segments = three_segments(engine)
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True)
    a = engine.execute(ExecRequest(segments, params))
    b = engine.execute(ExecRequest(segments, params))
    assert a.token_ids == b.token_ids


def test_bad_input_raises_clear_errors_and_engine_stays_usable(engine):
    segments = three_segments(engine)
    baseline = engine.execute(ExecRequest(segments, GREEDY))
    good_kv = baseline.segments[1].kv
    n = len(segments[1].token_ids)
    with pytest.raises(SegmentError, match="'query' is empty"):
        SegmentPlan("query", engine.tokenize(""))
    with pytest.raises(PlanError, match="unknown plan step 'recompute'"):
        SegmentPlan("query", segments[1].token_ids, "recompute")
    with pytest.raises(PlanError, match="needs the segment's KV"):
        SegmentPlan("query", segments[1].token_ids, Step.INJECT)
    bad_calls = {
        "context": (ContextLengthError, [segments[0]], SamplingParams(max_tokens=engine.max_context)),
        "short kv": (KVShapeError, [segments[0], SegmentPlan("query", segments[1].token_ids, Step.INJECT, good_kv.slice(0, n - 1))], GREEDY),
        "wrong heads": (KVShapeError, [segments[0], SegmentPlan("query", segments[1].token_ids, Step.INJECT, SegmentKV(good_kv.keys[:, :1].repeat(1, 3, 1, 1), good_kv.values[:, :1].repeat(1, 3, 1, 1), good_kv.start))], GREEDY),
        "nan": (KVShapeError, [segments[0], SegmentPlan("query", segments[1].token_ids, Step.INJECT, SegmentKV(good_kv.keys * float("nan"), good_kv.values, good_kv.start))], GREEDY),
        "vocab": (SegmentError, [segments[0], SegmentPlan("query", [10**7])], GREEDY),
    }
    if engine.requires_bos:
        bad_calls["bos"] = (PlanError, segments[1:], GREEDY)
    for label, (error, plan, params) in bad_calls.items():
        with pytest.raises(error):
            engine.execute(ExecRequest(plan, params))
        after = engine.execute(ExecRequest(segments, GREEDY))
        assert after.token_ids == baseline.token_ids, f"engine changed after bad input '{label}'"
        assert close(after.last_logits, baseline.last_logits)
    assert engine.cache_stats().blocks_in_use == 0


def test_random_workload_never_serves_stale_kv(engine):
    small = engine_variant(engine, pool_blocks=6)
    rng = random.Random(3)
    heads = [small.tokenize(f"Agent {i}: " + text_of_length(small, 10, seed=i), bos=True) for i in range(4)]
    for step in range(12):
        plan = [SegmentPlan("sys", rng.choice(heads)), SegmentPlan("q", small.tokenize(" " + text_of_length(small, rng.randint(1, 8), seed=step)))]
        cached = small.execute(ExecRequest(plan, SamplingParams(max_tokens=2, ignore_eos=True)))
        dense = small.execute(ExecRequest(with_steps(plan, Step.DENSE), SamplingParams(max_tokens=2, ignore_eos=True)))
        assert close(cached.last_logits, dense.last_logits), f"step {step}: cached prefix differs from dense"
        stats = small.cache_stats()
        assert stats.cached_blocks <= stats.capacity_blocks
    assert stats.evictions > 0 and stats.hit_blocks > 0


def test_concurrent_calls_match_serial_results(engine):
    calls = [three_segments(engine, seed=s) for s in range(4)]
    serial = [engine.execute(ExecRequest(c, GREEDY)).token_ids for c in calls]
    results: dict[int, list[int]] = {}

    def worker(i):
        results[i] = engine.execute(ExecRequest(calls[i], GREEDY)).token_ids

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(4)] == serial


def test_prefix_caching_can_be_turned_off(engine):
    off = engine_variant(engine, prefix_caching=False)
    segments = three_segments(engine)
    first = off.execute(ExecRequest(segments, GREEDY))
    second = off.execute(ExecRequest(segments, GREEDY))
    assert first.cached_tokens == second.cached_tokens == 0
    assert off.cache_stats().cached_blocks == 0 and close(first.last_logits, second.last_logits)


def test_exact_kv_from_another_context_counts_as_approximate(engine):
    """KV captured exact under agent A's prefix is approximate under agent B's, even at the same position."""
    query = engine.tokenize(" Query: " + text_of_length(engine, 20, seed=8))
    sys_a = engine.tokenize("System: you are agent A, the planner." + " plan" * 8, bos=True)
    sys_b = [engine.bos_token_id] * (engine.bos_token_id is not None) + engine.tokenize("Zz" * 40)
    sys_b = sys_b[: len(sys_a)] + engine.tokenize("q") * (len(sys_a) - len(sys_b[: len(sys_a)]))
    assert len(sys_a) == len(sys_b) and sys_a != sys_b
    from_a = engine.execute(ExecRequest([SegmentPlan("sys", sys_a), SegmentPlan("query", query)], GREEDY))
    kv_a = from_a.segments[1].kv
    assert kv_a.exact and kv_a.start == len(sys_b)
    into_b = engine.execute(ExecRequest(
        [SegmentPlan("sys", sys_b), SegmentPlan("query", query, Step.INJECT, kv_a), SegmentPlan("ask", engine.tokenize(" A:"))],
        GREEDY,
    ))
    assert not into_b.segments[1].kv.exact and not into_b.segments[2].kv.exact
    prompt_b = sys_b + query + engine.tokenize(" A:")
    assert engine.cached_prefix_length(prompt_b) == len(sys_b) // engine.block_size * engine.block_size


def test_exact_kv_of_other_tokens_is_never_cached_as_exact(engine):
    """KV of segment X injected for a different segment Y of the same length is approximate for Y."""
    sys_ids = engine.tokenize("System: planner. ", bos=True)
    x = engine.tokenize(" alpha " * 6)
    y = engine.tokenize(" omega " * 6)
    assert len(x) == len(y) and x != y
    kv_x = engine.execute(ExecRequest([SegmentPlan("sys", sys_ids), SegmentPlan("x", x)], GREEDY)).segments[1].kv
    assert kv_x.exact
    into_y = engine.execute(ExecRequest(
        [SegmentPlan("sys", sys_ids), SegmentPlan("y", y, Step.INJECT, kv_x), SegmentPlan("ask", engine.tokenize(" ok"))],
        GREEDY,
    ))
    assert not into_y.segments[1].kv.exact
    assert engine.cached_prefix_length(sys_ids + y + engine.tokenize(" ok")) <= len(sys_ids)


def test_cached_prefix_length_matches_what_execute_serves(engine):
    bs = engine.block_size
    prompt = engine.tokenize(text_of_length(engine, 40), bos=True)[: 2 * bs]
    assert len(prompt) == 2 * bs
    engine.execute(ExecRequest([SegmentPlan("p", prompt)], GREEDY))
    predicted = engine.cached_prefix_length(prompt)
    assert predicted == bs  # the last token is always computed, so the last full block is not served
    assert engine.execute(ExecRequest([SegmentPlan("p", prompt)], GREEDY)).cached_tokens == predicted


def test_bool_token_ids_are_refused(engine):
    with pytest.raises(SegmentError, match="not ints"):
        engine.execute(ExecRequest([SegmentPlan("a", three_segments(engine)[0].token_ids + [True])], GREEDY))


def test_kv_is_captured_only_for_the_segments_that_ask(engine):
    sys_plan, query_plan, glue_plan = three_segments(engine)
    result = engine.execute(ExecRequest([SegmentPlan("sys", sys_plan.token_ids, capture=False), query_plan,
                                         SegmentPlan("glue", glue_plan.token_ids, capture=False)], GREEDY))
    assert [o.kv is not None for o in result.segments] == [False, True, False]
    assert result.segments[1].kv.exact and result.generated_kv is not None


def test_a_cancelled_request_is_dropped_frees_its_blocks_and_caches_nothing(engine):
    """Cancel mid-decode (after the first token) and before admission: the future fails with
    RequestCancelled, no block stays in use, and the engine goes on (exact blocks vLLM filled before
    the cancel may stay cached: they are exact)."""
    segments = three_segments(engine, seed=7)
    cancel = threading.Event()
    first = threading.Event()

    def on_token(_token: int) -> None:
        first.set()
        cancel.set()  # the caller goes away once the first token is out

    long = SamplingParams(max_tokens=200, ignore_eos=True)
    future = engine.submit(ExecRequest(as_one(segments), long, capture_kv=False, on_token=on_token, cancelled=cancel))
    with pytest.raises(RequestCancelled):
        future.result(timeout=120)
    assert first.is_set()
    assert engine.cache_stats().blocks_in_use == 0

    gone = threading.Event()
    gone.set()
    with pytest.raises(RequestCancelled):
        engine.submit(ExecRequest(as_one(segments), GREEDY, cancelled=gone)).result(timeout=120)
    assert engine.cache_stats().blocks_in_use == 0
    served = engine.execute(ExecRequest(as_one(segments), GREEDY))  # the engine goes on
    assert len(served.token_ids) == GREEDY.max_tokens
    assert engine.cache_stats().blocks_in_use == 0

"""The embedded engine's prefill layout, without a model: where each prompt token comes from (the
prefix hit, the plan's injected KV, a forward pass) and in which passes the rest is computed."""

from __future__ import annotations

import random

import pytest
import torch

from agentcache.engine.kv import SegmentKV, prefix_digests
from agentcache.engine.prefill import Injection, SegmentSpan, prefill_layout
from agentcache.engine.protocol import ExecRequest, LayerRecompute, SegmentPlan, Step, TokenRecompute

MODEL = b"weights"
BIG = 2048  # a prefill chunk that never splits these small prompts


class Prompt:
    """Builds a request segment by segment, token ids counting up, with the digests the engine makes."""

    def __init__(self) -> None:
        self.segments: list[SegmentPlan] = []
        self.end = 0

    def text(self, n: int, step: Step = Step.PREFIX) -> "Prompt":
        self.segments.append(SegmentPlan(f"s{len(self.segments)}", self._tokens(n), step))
        self.end += n
        return self

    def inject(self, n: int, *, exact: bool = False, recompute=None) -> "Prompt":
        """An injected segment whose KV was computed here (exact: after exactly this prompt's prefix)."""
        tokens = self._tokens(n)
        exact_for = prefix_digests(self.tokens() + list(tokens), [self.end + n], MODEL)[self.end + n] if exact else None
        kv = SegmentKV(torch.zeros(1, 1, n, 2), torch.zeros(1, 1, n, 2), self.end, exact_for)
        self.segments.append(SegmentPlan(f"s{len(self.segments)}", tokens, Step.INJECT, kv, recompute=recompute))
        self.end += n
        return self

    def tokens(self) -> list[int]:
        return [t for seg in self.segments for t in seg.token_ids]

    def _tokens(self, n: int) -> tuple[int, ...]:
        return tuple(range(100 + self.end, 100 + self.end + n))

    def layout(self, hit: int = 0, *, prefill_chunk: int = BIG, warmup_chunk: int = 64, warmup: bool = False,
               background_chunk: int | None = None, internal: bool = False):
        request = ExecRequest(self.segments, warmup=warmup, internal=internal)
        ends, at = [], 0
        for seg in self.segments:
            at += len(seg.token_ids)
            ends.append(at)
        digests = prefix_digests(request.token_ids, ends, MODEL)
        return prefill_layout(request, hit, digests, prefill_chunk=prefill_chunk, warmup_chunk=warmup_chunk,
                              background_chunk=background_chunk)


def passes(layout, picked=()) -> list[tuple[int, ...]]:
    """Every forward pass in order: the head's, then each stage's (the probe apart)."""
    return list(layout.head) + [part for stage in layout.stages(picked) for part in stage.chunks]


def test_a_prefix_hit_mid_segment_serves_its_head_and_computes_the_rest():
    layout = Prompt().text(10).text(10).layout(hit=16)
    assert layout.spans == (SegmentSpan(0, 10, 0, 0), SegmentSpan(10, 6, 4, 0))
    assert layout.head == ((16, 17, 18, 19),) and layout.injections == () and layout.tail == ()
    assert layout.split == layout.end == 20


def test_an_injected_segment_is_split_at_the_hit():
    """The hit covers 4 of the injected segment's 12 tokens: the other 8 are placed from the plan's
    KV (taken from its 5th token on), and the tail after it is computed over them."""
    prompt = Prompt().text(8).inject(12).text(4)
    layout = prompt.layout(hit=12)
    assert layout.spans == (SegmentSpan(0, 8, 0, 0), SegmentSpan(8, 4, 0, 8), SegmentSpan(20, 0, 4, 0))
    (injection,) = layout.injections
    assert injection == Injection(segment=1, start=12, offset=4, length=8, exact=False)
    assert layout.head == () and layout.split == 12 and layout.tail == (20, 21, 22, 23)
    assert passes(layout) == [(20, 21, 22, 23)]
    assert layout.first_inexact == 12


def test_the_head_runs_up_to_the_first_injected_token_and_exact_kv_stays_exact():
    layout = Prompt().text(5).inject(6, exact=True).text(3).inject(4).text(2).layout(hit=0)
    assert layout.head == ((0, 1, 2, 3, 4),)
    assert [(i.start, i.length, i.exact) for i in layout.injections] == [(5, 6, True), (14, 4, False)]
    assert layout.tail == (11, 12, 13, 18, 19)  # the glue and the question, in one scattered pass
    assert layout.first_inexact == 14  # the exact segment keeps the KV before 14 exact
    assert layout.split == 5


def test_passes_are_cut_at_the_prefill_chunk():
    layout = Prompt().text(10).inject(4).text(5).inject(2).text(3).layout(prefill_chunk=4)
    assert layout.head == ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9))
    assert layout.tail == (14, 15, 16, 17, 18, 21, 22, 23)
    assert passes(layout)[3:] == [(14, 15, 16, 17), (18, 21, 22, 23)]
    assert all(len(part) <= 4 for part in passes(layout))


def test_a_warmup_prefills_in_its_own_small_chunks():
    prompt = Prompt().text(10)
    assert prompt.layout(prefill_chunk=8, warmup_chunk=3, warmup=True).head == ((0, 1, 2), (3, 4, 5), (6, 7, 8), (9,))
    assert prompt.layout(prefill_chunk=8, warmup_chunk=3).head == ((0, 1, 2, 3, 4, 5, 6, 7), (8, 9))


def test_the_runtimes_own_requests_prefill_in_background_chunks():
    prompt = Prompt().text(10)
    shadow = prompt.layout(prefill_chunk=8, background_chunk=4, internal=True)
    assert shadow.head == ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9)) and shadow.chunk == 4
    assert prompt.layout(prefill_chunk=8, background_chunk=4).head == ((0, 1, 2, 3, 4, 5, 6, 7), (8, 9))  # a call's
    assert prompt.layout(prefill_chunk=8, internal=True).head == ((0, 1, 2, 3, 4, 5, 6, 7), (8, 9))  # none set


def test_the_last_prompt_token_is_always_computed():
    """Its logits choose the first generated token: an injected last segment leaves it out, a hit
    never covers it, and it is the last position of the last pass."""
    layout = Prompt().text(4).inject(6).layout()
    assert layout.spans[-1] == SegmentSpan(4, 0, 1, 5)
    assert layout.injections[0].length == 5 and passes(layout)[-1] == (9,)
    one = Prompt().text(4).inject(1).layout()  # nothing left to inject
    assert one.injections == () and one.spans[-1] == SegmentSpan(4, 0, 1, 0) and passes(one)[-1][-1] == 4
    assert passes(Prompt().text(8).text(4).layout(hit=11)) == [(11,)]
    with pytest.raises(ValueError, match="all but the last prompt token"):
        Prompt().text(8).layout(hit=8)


@pytest.mark.parametrize("seed", range(20))
def test_every_prompt_token_comes_from_exactly_one_place(seed):
    """Random prompts, hits and chunks: the hit, the injections and the passes cover the prompt
    once each; passes ascend within a chunk, keep to the chunk size, and the last ends the prompt."""
    rng = random.Random(seed)
    prompt = Prompt()
    for _ in range(rng.randint(1, 6)):
        if rng.random() < 0.4:
            prompt.inject(rng.randint(1, 9), exact=rng.random() < 0.5)
        else:
            prompt.text(rng.randint(1, 9), rng.choice([Step.PREFIX, Step.DENSE]))
    hit, chunk = rng.randrange(prompt.end), rng.randint(1, 6)
    layout = prompt.layout(hit=hit, prefill_chunk=chunk)
    injected = [p for inj in layout.injections for p in inj.positions]
    computed = [p for part in passes(layout) for p in part]
    assert sorted([*range(hit), *injected, *computed]) == list(range(prompt.end))
    assert all(list(part) == sorted(part) and 0 < len(part) <= chunk for part in passes(layout))
    assert computed[-1] == prompt.end - 1
    assert [s.cached + s.computed + s.injected for s in layout.spans] == [len(s.token_ids) for s in prompt.segments]
    assert sum(s.cached for s in layout.spans) == hit
    assert sum(s.injected for s in layout.spans) == len(injected) and sum(s.computed for s in layout.spans) == len(computed)


def test_cacheblend_probes_the_tail_and_the_blended_tokens_then_adds_its_picks():
    layout = Prompt().text(3).inject(5, recompute=TokenRecompute(0.4, probe_layer=2)).text(2).layout(prefill_chunk=4)
    assert layout.probe_layer == 2 and [i.segment for i in layout.blends] == [1]
    assert layout.probed == (3, 4, 5, 6, 7, 8, 9) and layout.probe == ((3, 4, 5, 6), (7, 8, 9))
    assert passes(layout, picked=[4, 6]) == [(0, 1, 2), (4, 6, 8, 9)]


def test_droidspeak_prefills_tokens_without_hidden_states_and_runs_the_rest_in_their_own_stage():
    hidden = torch.randn(6, 8)
    hidden[:2] = float("nan")  # the source served these from its prefix cache: no hidden states
    layout = Prompt().text(4).inject(6, recompute=LayerRecompute(1, 2, hidden)).text(3).layout()
    (injection,) = layout.injections
    assert (injection.start, injection.length, injection.prefilled) == (4, 6, 2)
    assert layout.tail == (4, 5, 10, 11, 12)
    stages = layout.stages()
    assert [stage.chunks for stage in stages] == [((4, 5),), ((6, 7, 8, 9),), ((10, 11, 12),)]
    assert stages[1].layered.segment == 1 and torch.equal(stages[1].layered.hidden, hidden[2:])

"""The layout of a request's prefill in the embedded engine: which tokens come from where, and the
forward passes that compute the rest. Planned without a model; the scheduler runs it.

Past the prefix hit found at admission, the dense tokens before the first injected segment are
prefilled as usual (`head`, contiguous). All injected KV is then placed at its positions, and every
dense token after it (the glue between injected segments, the tail) is computed in scattered
passes: each token attends to everything at lower positions, injected or dense. On a CPU a forward
pass costs about as much for 5 tokens as for 100 (reading the weights dominates), so one pass
instead of one per glue segment is what lets reuse pay off for short shared segments.

Selective recomputation adds passes: CacheBlend's probe over the tail and the blended tokens
(layers 0..probe), after which the tokens it picks join the tail; DroidSpeak's layer groups, run
from the source's hidden states, with the dense tokens before each computed first (`stages`).

The last prompt token is always computed (its logits choose the first generated token): a prefix
hit never covers it and an injected last segment leaves it out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from agentcache.engine.protocol import ExecRequest, LayerRecompute, Step, TokenRecompute
from agentcache.engine.recompute import Layered, chunks, known_from, stages

__all__ = ["Injection", "PrefillLayout", "SegmentSpan", "Stage", "prefill_layout"]


@dataclass(frozen=True)
class SegmentSpan:
    """Where one segment's tokens come from, in order: `cached` from the prefix hit, then `injected`
    from the plan's KV, then `computed` (a segment is one of these, or cached then the rest)."""

    start: int
    cached: int
    computed: int
    injected: int


@dataclass(frozen=True)
class Injection:
    """The part of an injected segment's KV that is placed: tokens offset..offset+length of the
    segment, at positions start..start+length."""

    segment: int  # index in the request
    start: int
    offset: int  # tokens of the segment before it, served by the prefix hit
    length: int
    exact: bool  # the KV was computed at these positions after exactly this prompt's prefix
    recompute: TokenRecompute | LayerRecompute | None = None
    prefilled: int = 0  # DroidSpeak: leading tokens without source hidden states, prefilled instead

    @property
    def positions(self) -> range:
        return range(self.start, self.start + self.length)


@dataclass(frozen=True)
class Stage:
    """Scattered passes after the placed KV, one per chunk; a layered stage runs its segment's layer
    group from the source's hidden states (the chunks split `layered.hidden` in the same way)."""

    chunks: tuple[tuple[int, ...], ...]
    layered: Layered | None = None


@dataclass(frozen=True)
class PrefillLayout:
    spans: tuple[SegmentSpan, ...]  # one per segment
    end: int  # the prompt's length
    chunk: int  # positions per forward pass
    head: tuple[tuple[int, ...], ...]  # contiguous passes from the prefix hit up to the first injected token
    injections: tuple[Injection, ...]  # placed after the head, ascending
    tail: tuple[int, ...]  # dense positions after the first injected token, ascending
    layered: tuple[Layered, ...]  # DroidSpeak: the injected tokens that have source hidden states

    @property
    def dense_positions(self) -> int:
        """Positions its passes compute: the head and the tail (CacheBlend's picks come later)."""
        return sum(len(part) for part in self.head) + len(self.tail)

    @property
    def split(self) -> int:
        """Where the placed region starts: the first injected position (the prompt's end if none)."""
        return self.injections[0].start if self.injections else self.end

    @property
    def first_inexact(self) -> int | None:
        """The first position whose placed KV is not exact for this prompt."""
        return next((inj.start for inj in self.injections if not inj.exact), None)

    @property
    def blends(self) -> tuple[Injection, ...]:
        """CacheBlend's injections: the probe ranks their tokens, the most deviating are recomputed."""
        return tuple(inj for inj in self.injections if isinstance(inj.recompute, TokenRecompute))

    @property
    def probe_layer(self) -> int | None:
        blends = self.blends
        return max(inj.recompute.probe_layer for inj in blends) if blends else None

    @property
    def probed(self) -> tuple[int, ...]:
        """The positions CacheBlend's probe runs (through layers 0..probe_layer): the tail and every
        blended token."""
        if not self.blends:
            return ()
        return tuple(sorted(set(self.tail).union(*(inj.positions for inj in self.blends))))

    @property
    def probe(self) -> tuple[tuple[int, ...], ...]:
        return _chunked(self.probed, self.chunk)

    def stages(self, picked: Iterable[int] = ()) -> list[Stage]:
        """The passes after the placed KV (and the probe): the tail with the tokens CacheBlend
        `picked`, cut at every layered segment, each part in chunks."""
        dense = sorted([*self.tail, *picked])
        out = []
        for stage in stages(dense, list(self.layered)):
            if isinstance(stage, Layered):
                out.append(Stage(_chunked(stage.positions, self.chunk), stage))
            else:
                out.append(Stage(_chunked(stage, self.chunk)))
        return out


def prefill_layout(request: ExecRequest, hit: int, digests: Mapping[int, bytes], *, prefill_chunk: int,
                   warmup_chunk: int, background_chunk: int | None = None) -> PrefillLayout:
    """The layout of `request`'s prefill after a prefix hit of `hit` tokens. `digests` maps each
    segment's end to the digest of the prompt up to there (what exact KV ending there was computed
    after). A warm-up prefills in chunks of `warmup_chunk`, the runtime's own work (shadow runs,
    audits) in chunks of `background_chunk` (None: `prefill_chunk`): what a real arrival may wait behind."""
    segments = request.segments
    end = sum(len(seg.token_ids) for seg in segments)
    if not 0 <= hit < end:
        raise ValueError(f"a prefix hit covers at most all but the last prompt token: {hit} of {end}")
    chunk = (warmup_chunk if request.warmup else background_chunk if request.internal and background_chunk
             else prefill_chunk)
    dense: list[int] = []  # positions to compute, ascending
    spans: list[SegmentSpan] = []
    injections: list[Injection] = []
    layered: list[Layered] = []
    pos = 0
    last = len(segments) - 1
    for index, seg in enumerate(segments):
        n = len(seg.token_ids)
        cached = min(max(hit - pos, 0), n)  # served by the prefix hit found at admission
        if seg.step is Step.INJECT:
            inject = (n - 1 if index == last else n) - cached  # the final prompt token runs for its logits
            if inject > 0:
                exact = seg.kv.start == pos and seg.kv.exact_for == digests[pos + n]
                span = list(range(pos + cached, pos + cached + inject))
                prefilled = 0
                if isinstance(seg.recompute, LayerRecompute):
                    hidden = seg.recompute.hidden[cached : cached + inject]  # (inject, hidden size)
                    prefilled = known_from(hidden)  # leading tokens without hidden states: prefilled
                    dense.extend(span[:prefilled])
                    if prefilled < len(span):
                        layered.append(Layered(index, span[prefilled:], hidden[prefilled:], seg.recompute))
                injections.append(Injection(index, pos + cached, cached, inject, exact, seg.recompute, prefilled))
            inject = max(inject, 0)
            dense.extend(range(pos + cached + inject, pos + n))
            spans.append(SegmentSpan(pos, cached, n - cached - inject, inject))
        else:
            dense.extend(range(pos + cached, pos + n))
            spans.append(SegmentSpan(pos, cached, n - cached, 0))
        pos += n
    split = injections[0].start if injections else end
    head = [p for p in dense if p < split]  # contiguous, from the end of the prefix hit
    tail = tuple(p for p in dense if p >= split)
    return PrefillLayout(tuple(spans), end, chunk, _chunked(head, chunk), tuple(injections), tail, tuple(layered))


def _chunked(positions: Iterable[int], size: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(part) for part in chunks(list(positions), size))

"""Running a request's prefill layout (`prefill.prefill_layout`) on the model, one forward pass
per step: the head of the prompt, then injected KV placed where the call reads it, CacheBlend's
probe and the tokens it picks, DroidSpeak's layer groups, and the rest; recording the hidden
states a request asked for and how much of each segment was recomputed."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from functools import partial

import torch

from agentcache.engine.kv import SegmentKV
from agentcache.engine.layers import LayerControl
from agentcache.engine.live_request import LiveRequest
from agentcache.engine.protocol import LayerRecompute, TokenRecompute
from agentcache.engine.recompute import Blend, pick_deviating
from agentcache.engine.runner import ModelRunner

__all__ = ["PrefillPasses"]


class PrefillPasses:
    """`runner` computes, `layers` runs part of the stack, `realign` moves KV to other positions."""

    def __init__(self, runner: ModelRunner, layers: LayerControl, realign: Callable[[SegmentKV, int], SegmentKV]) -> None:
        self.runner = runner
        self.layers = layers
        self.realign = realign
        self.num_layers = runner.layout.num_layers

    def steps(self, live: LiveRequest) -> Iterator[None]:
        """Run the request's prefill layout, one forward pass per `next`: fill the call cache past
        the prefix hit; set the last position's logits, the recomputation counts and the first
        approximate position."""
        request, cache, layout = live.request, live.cache, live.layout
        prompt, end = live.prompt, layout.end
        placed = []  # (injection, its KV re-aligned to its positions)
        for inj in layout.injections:
            kv = request.segments[inj.segment].kv
            placed.append((inj, self.realign(kv.slice(inj.offset, inj.offset + inj.length), inj.start)))
            if isinstance(inj.recompute, LayerRecompute):
                live.recomputed[inj.segment] = float(inj.prefilled)
        ran = False  # a pass has run: yield before the next one
        for part in layout.head:
            if ran:
                yield
            forward = partial(self.runner.forward, cache, [prompt[p] for p in part], part[0])
            live.logits = self._pass(live, part, forward)
            ran = True
        if placed:
            cache.clear(layout.split, end)
            for inj, kv in placed:
                cache.place(inj.start, kv.keys, kv.values)
            picked: list[int] = []
            if layout.blends:
                probe = layout.probe_layer
                for part in layout.probe:
                    if ran:
                        yield
                    self._scattered(live, part, end, last=probe)
                    ran = True
                self._count(live, layout.probed, live.probed, (probe + 1) / self.num_layers)
                for inj, kv in placed:
                    if isinstance(inj.recompute, TokenRecompute):
                        blend = Blend(inj.segment, list(inj.positions), kv, inj.recompute)
                        deviating = pick_deviating(cache, blend, probe)
                        live.recomputed[inj.segment] = float(len(deviating))
                        picked.extend(deviating)
            for stage in layout.stages(picked):
                layered = stage.layered
                if layered is None:
                    for part in stage.chunks:
                        if ran:
                            yield
                        live.logits = self._scattered(live, part, end)
                        ran = True
                    continue
                done = 0
                for part in stage.chunks:
                    if ran:
                        yield
                    self._scattered(live, part, end, first=layered.spec.first, last=layered.spec.last,
                                    hidden=layered.hidden[done : done + len(part)])
                    done += len(part)
                    ran = True
                share = len(layered.positions) * layered.layers / self.num_layers
                live.recomputed[layered.segment] = live.recomputed.get(layered.segment, 0.0) + share
            cache.commit(end)
        hit, lineage_from = live.lease.hit.tokens, live.lease.hit.lineage_from
        approx = ([lineage_from] if lineage_from < hit else []) + [layout.first_inexact]
        live.first_approx = min((p for p in approx if p is not None), default=None)

    def _scattered(self, live: LiveRequest, positions: Sequence[int], end: int, first: int = 0, last: int | None = None,
                   hidden: torch.Tensor | None = None) -> torch.Tensor:
        """One scattered pass over `positions` (below `end`), through layers first..last, layer
        `first` taking `hidden` (T, hidden size) as its input when given."""
        forward = partial(self.runner.forward_scattered, live.cache, [live.prompt[p] for p in positions],
                          positions, end)
        return self._pass(live, positions, forward, first, last, None if hidden is None else hidden[None])

    def _pass(self, live: LiveRequest, positions: Sequence[int], forward, first: int = 0, last: int | None = None,
              hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Run one forward pass over `positions`, within the layer range, recording the hidden
        states the request asked for (the input of its `hidden_layer`, when the range runs it)."""
        record = live.hidden
        top = self.num_layers - 1 if last is None else last
        capture = record.layer if record is not None and first <= record.layer <= top else None
        if capture is None and first == 0 and last is None:
            return forward()
        with self.layers.running(first, last, hidden, capture) as setting:
            logits = forward()
        if capture is not None:
            record.put(positions, setting.captured[0][0])  # (T, hidden size)
        return logits

    def _count(self, live: LiveRequest, positions: Sequence[int], into: dict[int, float], weight: float) -> None:
        """Add `weight` per position to the segment holding it."""
        starts = [span.start for span in live.layout.spans]
        for p in positions:
            segment = bisect_right(starts, p) - 1
            into[segment] = into.get(segment, 0.0) + weight

"""Decode steps replayed from CUDA graphs, so that a step costs the GPU's time, not the host's.

An eager decode step of an HF model issues hundreds of kernels from Python (on an H200 a 1.1B
model's step took 21 ms of host time for 2 ms of GPU work). A CUDA graph records one step's
kernels once and replays them with one launch. It needs every shape and every buffer address
fixed, so steps are grouped into buckets:
- rows: the decoding requests padded up to 1, 2, 4, 8, ... rows (at most the engine's batch); a
  padding row decodes token 0 at the bucket's last key position of a free row, which no member
  reads;
- keys: the length every row attends over, `end` rounded up to a power of two (at least
  MIN_KEYS, at most the decode buffer's capacity); the step's mask hides each row's keys past its
  own position, as in an eager step.
The inputs (token ids and positions) live in one static tensor per bucket, filled from the host
before each replay: the step itself reads nothing back (`device_audit.HostReadAudit` checks that
on any device). When the decode buffer grows (a longer request joins), its address changes and
the graphs over the old one are dropped; they are captured again on first use.

Off CUDA (or with `capture=False`) a bucket runs the same static step eagerly: what a test on a
CPU checks of this path. A capture that fails turns graphs off for the engine, counted and logged,
and every later step runs eagerly.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from agentcache.engine.batch import DecodeRows

__all__ = ["DecodeGraphs", "MIN_KEYS", "batch_bucket", "keys_bucket"]

log = logging.getLogger(__name__)

MIN_KEYS = 256  # the shortest key bucket: short contexts share one graph
WARMUP_RUNS = 2  # eager runs on a side stream before capture (lazy library initialization)

Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def batch_bucket(rows: int, most: int) -> int:
    """The padded row count for `rows` decoding requests: the next power of two, at most `most`."""
    return min(most, 1 << max(0, rows - 1).bit_length())


def keys_bucket(end: int, capacity: int) -> int:
    """The key length a step over keys 0..end-1 attends over: a power of two of at least MIN_KEYS,
    at most `capacity` (the decode buffer's)."""
    return min(capacity, max(MIN_KEYS, 1 << max(0, end - 1).bit_length()))


class _Bucket:
    """One (rows, keys) bucket: its static inputs and, when captured, its graph and output."""

    def __init__(self, rows: int, keys: int, device: torch.device) -> None:
        self.rows, self.keys = rows, keys
        self.inputs = torch.zeros((2, rows), dtype=torch.long, device=device)  # token ids, positions
        self.inputs[1].fill_(keys - 1)  # padding rows (and warm-up runs) write at the last key position
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # the graph's output, (rows, V) float32

    def run(self, step: Callable[[], torch.Tensor]) -> torch.Tensor:
        if self.graph is None:
            return step()
        self.graph.replay()
        return self.logits


class DecodeGraphs:
    """Static-shape decode steps over `rows`, computed by `step` (the runner's), one graph per bucket."""

    def __init__(self, step: Step, rows: DecodeRows, *, capture: bool) -> None:
        self.step = step
        self.rows = rows
        self.capture = capture
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._buffers: torch.Tensor | None = None  # the decode buffer the buckets were built over
        self._pool = None  # one CUDA memory pool for every graph (they never run at once)
        self.captured = 0
        self.replays = 0
        self.failure: str | None = None  # why graphs were turned off, when they were

    def decode(self, token_ids: list[int]) -> torch.Tensor:
        """One decode step of every member (row b decodes token_ids[b]); logits (n, V) float32."""
        rows = self.rows
        positions = rows.positions
        n = len(positions)
        batch = batch_bucket(n, rows.rows)
        keys = keys_bucket(max(positions) + 1, rows.tokens)
        if rows.keys is not self._buffers:  # the buffer grew: the graphs over the old one are stale
            self._buckets.clear()
            self._buffers = rows.keys
        rows.prepare(batch, keys)
        bucket = self._buckets.get((batch, keys))
        if bucket is None:
            bucket = self._buckets[batch, keys] = self._build(batch, keys)
        staged = torch.tensor([token_ids, positions], dtype=torch.long, device="cpu")  # (2, n), from the host
        bucket.inputs[:, :n].copy_(staged, non_blocking=True)
        bucket.inputs[0, n:] = 0
        bucket.inputs[1, n:] = keys - 1
        logits = bucket.run(lambda: self._forward(bucket))
        if bucket.graph is not None:
            self.replays += 1
        rows.advance()
        return logits[:n]

    def _forward(self, bucket: _Bucket) -> torch.Tensor:
        return self.step(self.rows.keys, self.rows.values, bucket.inputs[0], bucket.inputs[1], bucket.keys)

    def _build(self, batch: int, keys: int) -> _Bucket:
        bucket = _Bucket(batch, keys, self.rows.device)
        if self.capture and self.failure is None:
            try:
                self._capture(bucket)
            except Exception as exc:  # noqa: BLE001 - decoding goes on eagerly
                self.failure = f"{type(exc).__name__}: {exc}"
                bucket.graph = bucket.logits = None
                log.warning("capturing a decode step in a CUDA graph failed (%s); decoding eagerly from now on",
                            self.failure)
        return bucket

    def _capture(self, bucket: _Bucket) -> None:
        device = self.rows.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up runs write only at the bucket's last key position
            for _ in range(WARMUP_RUNS):
                self._forward(bucket)
        torch.cuda.current_stream(device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the runtime's threads may use the device meanwhile (re-alignment, anchors)
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            bucket.logits = self._forward(bucket)
        bucket.graph = graph
        self.captured += 1

    def figures(self) -> dict:
        return {"decode_graphs": self.captured, "decode_graph_replays": self.replays,
                "decode_graph_failure": self.failure}

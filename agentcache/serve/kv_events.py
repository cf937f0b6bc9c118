"""The embedded engine's prefix-cache changes published as vLLM KV events, for routers that place
requests by cached blocks (vllm-router's `kv_aware` policy).

The wire format is vLLM's (`vllm.distributed.kv_events`): a ZeroMQ PUB socket sends multipart
messages `[topic, sequence (8 bytes, big-endian), payload]`, the payload a msgpack array
`[timestamp, events, data_parallel_rank]`, each event a map tagged by "type": `BlockStored`
(block hashes, parent hash, token ids, block size, ...), `BlockRemoved` (block hashes) or
`AllBlocksCleared` (sent when the cache's event buffer overflowed: what a subscriber holds is
stale). At most 4096 events go in one message (vllm-router refuses larger batches). A subscriber
that sees a gap in the sequence asks the replay socket (ROUTER) for the batches from a sequence
number on (`[b"", start (8 bytes)]`); the answer ends with sequence -1.

Only exact blocks are published: approximate KV is cached under its lineage and never serves
another request, so it is no reason to route one here. A router hashes the token ids itself
(vllm-router: each block's ids, whatever our block hashes are), so the hashes only link
`BlockRemoved` to `BlockStored`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

from agentcache.engine.embedded import EmbeddedEngine
from agentcache.errors import InputError

__all__ = ["KVEventPublisher", "REPLAY_BATCHES"]

log = logging.getLogger(__name__)

REPLAY_BATCHES = 10_000  # batches kept for subscribers that missed some
MAX_BATCH_EVENTS = 4096  # events per message: vllm-router refuses a larger batch whole
END_SEQUENCE = (-1).to_bytes(8, "big", signed=True)  # ends a replay
MEDIUM = "GPU"  # vLLM's name for the engine's own KV pool (the tier a hit needs no transfer from)


class KVEventPublisher:
    """Publishes `engine`'s cache events every `interval_s` from a thread of its own; `close()` stops it."""

    def __init__(self, engine: Any, endpoint: str, replay_endpoint: str | None = None, *,
                 interval_s: float = 0.05, topic: str = "") -> None:
        if not isinstance(engine, EmbeddedEngine):
            raise InputError(f"KV events are published from the embedded engine's prefix cache; "
                             f"{type(engine).__name__} has none (vLLM publishes its own: its kv_events_config)")
        try:
            import msgpack
            import zmq
        except ImportError as exc:
            raise InputError(f"publishing KV events needs {exc.name}: install agentcache's `cluster` extra "
                             f"(pip install -e '.[cluster]'; scripts/setup.sh does)") from None
        self._cache, self._block_size = engine.cache, engine.block_size
        self._pack = msgpack.packb
        self._zmq = zmq
        self._context = zmq.Context.instance()
        self._publisher = self._bind(zmq.PUB, endpoint)
        self._replay = self._bind(zmq.ROUTER, replay_endpoint) if replay_endpoint else None
        self._topic = topic.encode()
        self._sent: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BATCHES)
        self._sequence = 0
        self._dropped = engine.cache.events_dropped
        self.published = 0  # events
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agentcache-kv-events", daemon=True)
        self._thread.start()

    def _bind(self, kind: int, endpoint: str) -> Any:
        socket = self._context.socket(kind)
        socket.setsockopt(self._zmq.LINGER, 0)
        try:
            socket.bind(endpoint)
        except self._zmq.ZMQError as exc:
            socket.close()
            raise InputError(f"cannot bind the KV event socket {endpoint!r}: {exc}") from None
        return socket

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.publish_now()
                self._answer_replays()
            except Exception:  # noqa: BLE001 - routing hints only: the server goes on without them
                log.exception("publishing KV events failed")

    def publish_now(self) -> None:
        events = [self._event(e) for e in self._cache.drain_events() if e.exact]
        dropped = self._cache.events_dropped
        if dropped != self._dropped:  # the cache's buffer overflowed: what subscribers hold is stale
            self._dropped = dropped
            events = [{"type": "AllBlocksCleared"}] + events
        for first in range(0, len(events), MAX_BATCH_EVENTS):
            batch = events[first:first + MAX_BATCH_EVENTS]
            payload = self._pack([time.time(), batch, None], use_bin_type=True)
            self._publisher.send_multipart([self._topic, self._sequence.to_bytes(8, "big", signed=True), payload])
            self._sent.append((self._sequence, payload))
            self._sequence += 1
            self.published += len(batch)

    def _event(self, event: Any) -> dict[str, Any]:
        if event.kind == "stored":
            return {"type": "BlockStored", "block_hashes": [event.block_hash], "parent_block_hash": event.parent_hash,
                    "token_ids": list(event.token_ids), "block_size": self._block_size, "lora_id": None,
                    "medium": MEDIUM, "lora_name": None}
        return {"type": "BlockRemoved", "block_hashes": [event.block_hash], "medium": MEDIUM}

    def _answer_replays(self) -> None:
        """vLLM's replay protocol: a request [identity, b"", start] gets [identity, b"", topic,
        sequence, payload] for every kept batch from `start` on, then [identity, b"", b"", -1, b""]."""
        if self._replay is None:
            return
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3:
                log.warning("ignoring a KV event replay request of %d frames (3 expected)", len(frames))
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
            for sequence, payload in list(self._sent):
                if sequence >= start:
                    self._replay.send_multipart([identity, b"", self._topic, sequence.to_bytes(8, "big", signed=True),
                                                 payload])
            self._replay.send_multipart([identity, b"", b"", END_SEQUENCE, b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self._publisher.close()
        if self._replay is not None:
            self._replay.close()

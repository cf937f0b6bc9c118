"""The embedded engine's prefix cache published as vLLM KV events (agentcache.serve.kv_events),
read back the way vllm-router's kv_aware reads them: a ZeroMQ SUB socket, frames [topic,
sequence, msgpack payload], and a replay socket for missed batches; and the server's `/tokenize`,
which that policy asks for the tokens a request would prefill."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from agentcache.engine import ExecRequest, SamplingParams, SegmentPlan
from agentcache.errors import InputError
from tests.conftest import make_engine, text_of_length

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")

from agentcache.serve.kv_events import KVEventPublisher  # noqa: E402 - after the extra is known present


def free_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def receive(sub, until: float) -> list[tuple[int, list]]:
    batches = []
    while time.monotonic() < until:
        if sub.poll(100):
            topic, sequence, payload = sub.recv_multipart()
            stamp, events, rank = msgpack.unpackb(payload, raw=False)
            assert topic == b"" and isinstance(stamp, float) and rank is None
            batches.append((int.from_bytes(sequence, "big", signed=True), events))
        elif batches:
            break
    return batches


def test_exact_blocks_are_published_as_vllm_kv_events_and_can_be_replayed():
    engine = make_engine("tiny-llama", pool_blocks=8)  # small: later prompts evict earlier blocks
    endpoint, replay_endpoint = free_endpoint(), free_endpoint()
    publisher = KVEventPublisher(engine, endpoint, replay_endpoint, interval_s=0.02)
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    time.sleep(0.3)  # a PUB socket drops what it sends before the subscriber joined
    try:
        prompts = []
        for seed in range(3):
            tokens = engine.tokenize(text_of_length(engine, 60, seed=seed), bos=True)
            prompts.append(tokens)
            engine.execute(ExecRequest([SegmentPlan("all", tokens)], SamplingParams(max_tokens=2, ignore_eos=True)))
        batches = receive(sub, time.monotonic() + 5)
        assert [s for s, _ in batches] == list(range(len(batches))) and batches
        events = [e for _, batch in batches for e in batch]
        stored = [e for e in events if e["type"] == "BlockStored"]
        removed = [e for e in events if e["type"] == "BlockRemoved"]
        assert stored and removed  # the small pool evicted the first prompts' blocks
        blocks = {tuple(p[i:i + 16]) for p in prompts for i in range(0, len(p) - 15, 16)}
        for event in stored:  # what the router hashes: each block's own token ids
            assert event["block_size"] == 16 and len(event["token_ids"]) == 16 and tuple(event["token_ids"]) in blocks
            assert event["medium"] == "GPU" and len(event["block_hashes"]) == 1
        stored_hashes = {e["block_hashes"][0] for e in stored}
        assert all(e["block_hashes"][0] in stored_hashes for e in removed)  # removals name stored blocks
        # a subscriber that missed batches asks for them from a sequence number on
        dealer = context.socket(zmq.DEALER)
        dealer.connect(replay_endpoint)
        dealer.send_multipart([b"", (1).to_bytes(8, "big", signed=True)])
        replayed = []
        while True:
            assert dealer.poll(5000)
            empty, topic, sequence, payload = dealer.recv_multipart()  # vLLM's frames, the topic included
            assert empty == b"" and topic == b""
            sequence = int.from_bytes(sequence, "big", signed=True)
            if sequence == -1:
                assert payload == b""
                break
            replayed.append(sequence)
        assert replayed == [s for s, _ in batches if s >= 1]
        dealer.close()
    finally:
        sub.close()
        publisher.close()


def test_large_batches_are_split_and_an_overflow_clears_the_subscribers_index():
    from agentcache.engine.blocks import CacheEvent
    from agentcache.serve import kv_events

    engine = make_engine("tiny-llama", pool_blocks=8)
    endpoint = free_endpoint()
    publisher = KVEventPublisher(engine, endpoint, interval_s=3600)  # published by hand below
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    time.sleep(0.3)
    try:
        for i in range(kv_events.MAX_BATCH_EVENTS + 10):
            engine.cache._record(CacheEvent("stored", i.to_bytes(16, "big"), None, tuple(range(16)), True))
        engine.cache.events_dropped += 1  # as when its buffer overflowed
        publisher.publish_now()
        batches = receive(sub, time.monotonic() + 5)
        assert [len(events) for _, events in batches] == [kv_events.MAX_BATCH_EVENTS, 11]
        assert batches[0][1][0] == {"type": "AllBlocksCleared"}
    finally:
        sub.close()
        publisher.close()


def test_an_engine_without_a_prefix_cache_and_a_taken_endpoint_are_refused():
    with pytest.raises(InputError, match="embedded engine"):
        KVEventPublisher(object(), free_endpoint())
    engine = make_engine("tiny-llama", pool_blocks=8)
    endpoint = free_endpoint()
    first = KVEventPublisher(engine, endpoint)
    try:
        with pytest.raises(InputError, match="cannot bind"):
            KVEventPublisher(engine, endpoint)
    finally:
        first.close()


def test_tokenize_gives_the_tokens_a_chat_call_prefills():
    from agentcache.runtime import Runtime, RuntimeConfig
    from agentcache.serve import ServeConfig, ServerThread, create_app

    rt = Runtime(make_engine("tiny-qwen2-chat", pool_blocks=256), strategy="kvcmas",
                 config=RuntimeConfig(self_check=False))
    messages = [{"role": "system", "content": "You are the planner."},
                {"role": "user", "content": "Plan a week of meals for four people, no fish."}]
    with ServerThread(create_app(rt, ServeConfig())) as server:
        base = server.url.removesuffix("/v1")
        tokens = httpx.post(f"{base}/tokenize", json={"model": rt.engine.model_name, "messages": messages,
                                                      "continue_final_message": False}, timeout=30).json()
        reply = httpx.post(f"{server.url}/chat/completions", json={"model": rt.engine.model_name, "messages": messages,
                                                                   "max_tokens": 2, "temperature": 0}, timeout=60).json()
        assert tokens["count"] == len(tokens["tokens"]) == reply["usage"]["prompt_tokens"] > 0
        assert tokens["max_model_len"] == rt.engine.max_context
        assert rt.results[-1].prompt_tokens == tokens["count"]
        assert httpx.post(f"{base}/tokenize", json={"model": "other", "messages": messages}).status_code == 404
        for bad, field in (({"prompt": "hi"}, "prompt"), ({"messages": messages, "add_generation_prompt": False},
                                                          "add_generation_prompt"), ({"model": "x"}, "messages"),
                           ({"model": [], "messages": messages}, "model"), ({"model": {}, "messages": messages}, "model")):
            refused = httpx.post(f"{base}/tokenize", json=bad, timeout=30)
            assert refused.status_code == 400 and field in refused.json()["error"]["message"]
    rt.close()

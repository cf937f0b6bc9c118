"""Streaming a runtime call: text chunks as the engine generates them, then the call's result.

The engine reports each token; `TextStream.push` returns the text that is now final. It holds
back what may still change: a character split across tokens (decoded as U+FFFD until whole),
a tail that could be the start of a stop string, and anything when decoding rewrote earlier
text, so a streamed chunk never shows text the final result does not have.

`stream_call` (a generator; the call runs on a worker thread) and `astream_call` (an async
generator over `Runtime.arun`, never blocking the event loop) bridge a call's tokens to the
consumer; both adapters use them.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterator, Sequence

if TYPE_CHECKING:
    from agentcache.correction.plan import TokenizedCall
    from agentcache.metrics import CallResult
    from agentcache.runtime import Runtime
    from agentcache.segments import AgentCall, DispatchEvent
    from agentcache.engine.protocol import SamplingParams

__all__ = ["TextStream", "stream_call", "astream_call"]

_DONE = object()


class TextStream:
    def __init__(self, detokenize: Callable[[Sequence[int]], str], stop: Sequence[str] = ()) -> None:
        self._detokenize = detokenize
        self._stop = tuple(stop)
        self._tokens: list[int] = []
        self.sent = ""  # the text returned so far
        self.stopped = False  # a stop string appeared: nothing more is sent

    def push(self, token_id: int) -> str:
        """Add one generated token; the new final text (possibly empty)."""
        if self.stopped:
            return ""
        self._tokens.append(token_id)
        text = self._detokenize(self._tokens)
        cut = min((i for i in (text.find(s) for s in self._stop) if i != -1), default=None)
        if cut is not None:
            self.stopped = True
            return self._take(text[:cut])
        safe = len(text)
        if text.endswith("\ufffd"):
            safe = len(text.rstrip("\ufffd"))
        for stop in self._stop:  # the longest tail that begins a stop string waits for more tokens
            for n in range(min(len(stop) - 1, safe), 0, -1):
                if text[safe - n : safe] == stop[:n]:
                    safe -= n
                    break
        return self._take(text[:safe])

    def finish(self, final_text: str) -> str:
        """What is left to send of the call's final text. It extends what was sent, since only
        final text is sent; the whole text also comes in the adapter's final result."""
        self.stopped = True
        rest = final_text[len(self.sent) :] if final_text.startswith(self.sent) else ""
        self.sent = final_text
        return rest

    def _take(self, text: str) -> str:
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""  # nothing new, or decoding changed what was sent: wait for the final text
        chunk = text[len(self.sent) :]
        self.sent = text
        return chunk


def stream_call(
    runtime: "Runtime", call: "AgentCall", sampling: "SamplingParams", event: "DispatchEvent | None" = None
) -> Iterator["str | CallResult"]:
    """Text chunks of `call` as they are generated, then its `CallResult`. The call runs on a worker
    thread; if the consumer stops early it still finishes there (a place in the engine's batch meanwhile)."""
    text = TextStream(runtime.engine.detokenize, sampling.stop)
    chunks: queue.SimpleQueue[Any] = queue.SimpleQueue()
    outcome: dict[str, Any] = {}

    def on_token(token_id: int) -> None:
        piece = text.push(token_id)
        if piece:
            chunks.put(piece)

    def work() -> None:
        try:
            outcome["result"] = runtime.run(call, sampling, event=event, on_token=on_token)
        except BaseException as exc:  # raised in the consumer below
            outcome["error"] = exc
        finally:
            chunks.put(_DONE)

    threading.Thread(target=work, name="agentcache-stream", daemon=True).start()
    while (piece := chunks.get()) is not _DONE:
        yield piece
    if "error" in outcome:
        raise outcome["error"]
    result = outcome["result"]
    rest = text.finish(result.text)
    if rest:
        yield rest
    yield result


async def astream_call(
    runtime: "Runtime", call: "AgentCall", sampling: "SamplingParams", event: "DispatchEvent | None" = None,
    cancelled: "threading.Event | None" = None, tokenized: "TokenizedCall | None" = None,
) -> AsyncIterator["str | CallResult"]:
    """`stream_call` for an event loop: the engine's thread posts chunks to the loop, which keeps running.
    Setting `cancelled` drops the call from the engine; `tokenized`: its tokens, when known (`Runtime.arun`)."""
    text = TextStream(runtime.engine.detokenize, sampling.stop)
    loop = asyncio.get_running_loop()
    chunks: asyncio.Queue[Any] = asyncio.Queue()

    def on_token(token_id: int) -> None:  # on the engine's loop thread: hand the piece over, never block
        piece = text.push(token_id)
        if piece:
            try:
                loop.call_soon_threadsafe(chunks.put_nowait, piece)
            except RuntimeError:  # the loop closed under an abandoned stream: nobody is listening
                pass

    async def produce() -> "CallResult":
        try:
            return await runtime.arun(call, sampling, event=event, on_token=on_token, cancelled=cancelled,
                                      tokenized=tokenized)
        finally:
            # The engine's posts reach the loop in order, before the call's completion resumes us.
            chunks.put_nowait(_DONE)

    task = asyncio.ensure_future(produce())
    try:
        while (piece := await chunks.get()) is not _DONE:
            yield piece
        result = await task
    finally:
        if not task.done():  # abandoned: let the call finish, and never report its error unread
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
    rest = text.finish(result.text)
    if rest:
        yield rest
    yield result

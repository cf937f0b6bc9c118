"""The server's drain, as replies see it: on SIGTERM (or a `ServerThread`'s exit) uvicorn lets the
requests in flight run for `drain_s`, then cancels them. A stream cut that way would end with no
error and no `[DONE]`, and a whole reply with no response at all, so replies watch the drain's
deadline themselves and, a little before it, end cleanly: a stream with an error event and
`[DONE]`, a whole reply with a 503 (and their engine request is cancelled)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

__all__ = ["Drain", "DrainCut", "until_drained", "within_drain"]

POLL_S = 0.1  # how often a waiting reply looks at the deadline
_Item = TypeVar("_Item")


class DrainCut(Exception):
    """A reply reached the drain's deadline before it was whole."""

    def __init__(self) -> None:
        super().__init__("the server is shutting down and the reply was not whole by its drain timeout")


class Drain:
    """When the drain began, and so when replies must end; `begin` may be called from any thread."""

    def __init__(self) -> None:
        self.deadline: float | None = None  # time.monotonic() by which replies end; None: not draining

    def begin(self, drain_s: float) -> None:
        margin = min(0.5, drain_s / 4)  # the error goes out before uvicorn cancels the task
        if self.deadline is None:
            self.deadline = time.monotonic() + max(0.0, drain_s - margin)

    def passed(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline


async def _next_before_deadline(pending: asyncio.Future, drain: Drain):
    """`pending`'s result, or `DrainCut` once the deadline passes first."""
    while not drain.passed():
        done, _ = await asyncio.wait({pending}, timeout=POLL_S)
        if done:
            return pending.result()
    raise DrainCut()


async def within_drain(work: Awaitable[_Item], drain: Drain) -> _Item:
    """`work`'s result, unless the drain's deadline passes first (`DrainCut`; `work` is cancelled)."""
    pending = asyncio.ensure_future(work)
    try:
        return await _next_before_deadline(pending, drain)
    finally:
        pending.cancel()


async def until_drained(items: AsyncIterator[_Item], drain: Drain) -> AsyncIterator[_Item]:
    """`items`, until they end or the drain's deadline passes first (`DrainCut`)."""
    while True:
        pending = asyncio.ensure_future(items.__anext__())
        try:
            item = await _next_before_deadline(pending, drain)
        except StopAsyncIteration:
            return
        finally:
            pending.cancel()  # a no-op once it is done
        yield item

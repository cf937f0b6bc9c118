"""One call's story told once, run two ways: on the caller's thread, or on an event loop.

The runtime writes a call's story as a generator that yields its steps: `Do` (a function to
run: on the caller's thread by `drive`; on the runtime thread it names by `drive_async`, so the
event loop never blocks) and `Await` (engine futures: waited for by `drive`, awaited by
`drive_async`, so a call in flight holds no thread). Each step's result is sent back into the
story, and its exception thrown there, so the story reads like straight-line code.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator, Mapping
from concurrent.futures import Executor, Future
from concurrent.futures import wait as wait_for_all
from dataclasses import dataclass
from typing import Any

__all__ = ["Do", "Await", "Story", "drive", "drive_async"]


@dataclass(frozen=True)
class Do:
    """Run `fn(*args)`; `thread` names the runtime thread it runs on under `drive_async`."""

    thread: str
    fn: Callable[..., Any]
    args: tuple = ()


@dataclass(frozen=True)
class Await:
    """Wait for engine futures: the result of the one future (`one`), or for all of them (None)."""

    futures: tuple[Future, ...]
    one: bool = False

    @classmethod
    def result(cls, future: Future) -> Await:
        return cls((future,), one=True)


Story = Generator[Do | Await, Any, Any]


def drive(story: Story) -> Any:
    """Run every step of `story` on this thread; its return value."""
    sent: Any = None
    thrown: BaseException | None = None
    while True:
        try:
            step = story.throw(thrown) if thrown is not None else story.send(sent)
        except StopIteration as done:
            return done.value
        try:
            sent, thrown = _run(step), None
        except BaseException as exc:  # noqa: BLE001 - thrown into the story, which decides
            sent, thrown = None, exc


async def drive_async(story: Story, threads: Mapping[str, Executor]) -> Any:
    """Run `story` on the event loop: each `Do` on its thread in `threads`, each `Await` awaited."""
    loop = asyncio.get_running_loop()
    sent: Any = None
    thrown: BaseException | None = None
    while True:
        try:
            step = story.throw(thrown) if thrown is not None else story.send(sent)
        except StopIteration as done:
            return done.value
        try:
            if isinstance(step, Do):
                sent = await loop.run_in_executor(threads[step.thread], step.fn, *step.args)
            elif step.one:
                sent = await asyncio.wrap_future(step.futures[0])
            else:
                sent = await asyncio.wait([asyncio.wrap_future(f) for f in step.futures]) if step.futures else None
            thrown = None
        except BaseException as exc:  # noqa: BLE001 - thrown into the story, which decides
            sent, thrown = None, exc


def _run(step: Do | Await) -> Any:
    if isinstance(step, Do):
        return step.fn(*step.args)
    if step.one:
        return step.futures[0].result()
    wait_for_all(step.futures)
    return None

"""Turning generated token ids into text chunks as they come, for adapters that stream.

The engine reports each token; `TextStream.push` returns the text that is now final. It holds
back what may still change: a character split across tokens (decoded as U+FFFD until whole)
and a tail that could be the start of a stop string, so a streamed chunk never shows text the
final result cuts off.
"""

from __future__ import annotations

from typing import Callable, Sequence

__all__ = ["TextStream"]


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
        if len(text) <= len(self.sent):
            return ""
        chunk = text[len(self.sent) :]
        self.sent = text
        return chunk

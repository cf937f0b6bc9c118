"""A message's content as one text: the part flattening the framework adapters share.

A framework's message content is a string, or a list of parts: strings, typed dict parts
(`{"type": "text", "text": ...}`, LangChain's and OpenAI's content blocks) or the framework's own
objects (AutoGen's `FunctionCall`, `Image`). Core reads the strings; the adapter says what any other
part is (its text, nothing, or an error naming the message): core never imports a framework.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

__all__ = ["flatten_content", "text_block"]


def flatten_content(content: str | Iterable[Any], read_part: Callable[[Any], str | None], *,
                    separator: str = "") -> str:
    """`content` as text: a string as it is; a list's string parts as they are, every other part read
    by `read_part` (its text, None to leave it out, or an exception to refuse it), joined by `separator`.
    Parts are read in order, so the first part refused is the one an error names."""
    if isinstance(content, str):
        return content
    texts = (part if isinstance(part, str) else read_part(part) for part in content)
    return separator.join(text for text in texts if text is not None)


def text_block(part: Any) -> str | None:
    """The text of a typed text part (`{"type": "text", "text": ...}`; no "text" reads as ""), else None."""
    if isinstance(part, dict) and part.get("type") == "text":
        return str(part.get("text", ""))
    return None

"""Literal tokenization: text becomes text tokens, never control tokens.

A query, a tool result or another agent's output may spell `<eos>`, `<end_of_turn>` or
`<|im_end|>`. A tokenizer's default call turns such text into the control token itself, which
would let untrusted text end a turn or forge a role. Here every token the tokenizer declares
special is split into ordinary pieces; only the runtime places BOS (and, through token ids,
template tokens). Added tokens the tokenizer does not declare special (Gemma's newline runs and
HTML tags) are ordinary text tokens and stay as they are.

Also `common_prefix`, the shared-prefix length of two token sequences.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from agentcache.errors import InputError

__all__ = ["LiteralTokenizer", "common_prefix"]


class LiteralTokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        special = {i: t.content for i, t in tokenizer.added_tokens_decoder.items() if t.special and t.content}
        self.control_ids = frozenset(special)
        self._control_by_spelling = {content: i for i, content in special.items()}
        contents = sorted(set(special.values()), key=len, reverse=True)
        self._control_text = re.compile("|".join(map(re.escape, contents))) if contents else None

    def control_id(self, spelling: str) -> int | None:
        """The id of the control token spelled exactly `spelling`, or None."""
        return self._control_by_spelling.get(spelling)

    def encode(self, text: str) -> list[int]:
        ids = self._encode(text)
        if self.control_ids.isdisjoint(ids):
            return ids
        return self._encode_split(text)  # this tokenizer ignored split_special_tokens

    def _encode(self, text: str) -> list[int]:
        return list(self._tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def _encode_split(self, text: str) -> list[int]:
        """Cut the text just after the first character of every control-token spelling, so no piece
        holds one whole; the pieces' tokens still decode to exactly the text."""
        ids: list[int] = []
        while text:
            found = self._control_text.search(text) if self._control_text is not None else None
            if found is None:
                ids.extend(self._encode(text))
                break
            ids.extend(self._encode(text[: found.start() + 1]))
            text = text[found.start() + 1 :]
        leaked = self.control_ids.intersection(ids)
        if leaked:  # a one-character control token cannot be split: refuse rather than forge it
            raise InputError(f"text contains control token ids {sorted(leaked)} that cannot be tokenized as text")
        return ids


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n

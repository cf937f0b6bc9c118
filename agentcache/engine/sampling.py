"""Next-token choice (greedy, temperature, top-p) and stop-string detection."""

from __future__ import annotations

from typing import Callable, Collection, Sequence

import torch

__all__ = ["choose_token", "find_stop", "finish_after", "stop_window", "GREEDY_BELOW"]

GREEDY_BELOW = 1e-5  # temperatures below this sample like greedy decoding (softmax is one-hot there)


def choose_token(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> int:
    """Pick the next token from logits (V,). Computed in float64 after subtracting the maximum, so
    no temperature overflows; NaN logits are never chosen."""
    logits = torch.nan_to_num(logits.double(), nan=float("-inf"))  # (V,)
    if temperature < GREEDY_BELOW:
        return int(torch.argmax(logits))
    scaled = (logits - logits.max()) / temperature  # (V,) <= 0, the best token at 0
    probs = torch.softmax(scaled, dim=-1)  # (V,) finite: exp(0) = 1 keeps the sum positive
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        keep = cumulative - sorted_probs < top_p  # always keeps the most likely token
        sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
        choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))


def find_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index in `text` where the earliest stop string begins, or None."""
    found = [i for i in (text.find(stop) for stop in stops) if i != -1]
    return min(found, default=None)


def stop_window(stop: Sequence[str]) -> int:
    """Tokens at the end of the generated ones whose text holds any stop string that ends within
    the last token: a token holds at least one byte and a character at most 4, so 4 tokens per
    character of the longest stop string, and a margin for the last token and a character cut at
    the window's start. Checking only these keeps a token's cost independent of the reply's length."""
    return 4 * max(len(s) for s in stop) + 8


def finish_after(
    generated: Sequence[int], max_tokens: int, stop: Sequence[str], ignore_eos: bool,
    eos_token_ids: Collection[int], detokenize: Callable[[Sequence[int]], str],
) -> tuple[str, str | None] | None:
    """Whether a request ends with its last generated token: (finish reason, text cut before the
    stop string, or None to decode it all), or None to go on. Every engine ends requests by this
    one rule, so they agree token for token."""
    if generated[-1] in eos_token_ids and not ignore_eos:
        return "eos", None
    if stop and find_stop(detokenize(generated[-stop_window(stop):]), stop) is not None:
        # A stop string new in the text ends within the last token's characters, so a tail of tokens
        # long enough to spell the longest stop string finds it; the cut is placed in the whole text
        # (decoded once, here), where the earliest stop string begins.
        text = detokenize(generated)
        cut = find_stop(text, stop)
        if cut is not None:
            return "stop", text[:cut]
    if len(generated) >= max_tokens:
        return "length", None
    return None

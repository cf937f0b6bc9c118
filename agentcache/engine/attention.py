"""Attention for the embedded engine's forward passes: SDPA with the causal mask implied, not built.

The engine's contiguous passes put T new tokens after S − T cached ones: each new token attends
to every position up to its own (the causal mask aligned to the lower right). HF's SDPA path
builds that mask as a (T, S) tensor on every pass that follows a prefix hit, and an explicit mask
keeps SDPA off its fused causal kernels: on a 2-core CPU a 4K-token prefill after a 32-token hit
took 2.5x as long as the same prefill from position 0.

Registered as the attention implementation `agentcache_sdpa`, with a mask function that builds no
mask unless a caller's padding mask or a model's own mask pattern asks for one (then HF's SDPA mask:
a caller's padded batch on a model an engine took is computed as before). The attention then attends:
- with the mask a pass gives (the engine's scattered and decode passes, a padded batch): as given,
  each key head read once by its group of query heads (`masked_attention`; HF's path copies it per head);
- in a sliding-window layer whose keys reach past the window: a window mask built here;
- otherwise causally, lower-right aligned: `is_causal` when the queries are all the keys; with
  the queries placed after as many zero rows as there are cached keys when those are at most
  PAD_LIMIT times as many as the queries (SDPA's upper-left causal mask is then exactly right for
  the real rows: S²/2 scores on the fused kernel cost less than T·S behind a mask, which ran 2.7x
  slower per score on a CPU); else a (T, S) mask (few new tokens after many cached).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

__all__ = ["ATTENTION", "causal_attention", "implied_mask", "use_engine_attention"]

ATTENTION = "agentcache_sdpa"
PAD_LIMIT = 4  # pad the queries while cached keys are at most this many times the new ones


def causal_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, *, sliding_window: int | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query (B, Hq, T, D); key, value (B, Hkv, S, D). Returns (B, T, Hq, D) as HF's attention functions do."""
    kwargs.pop("is_causal", None)
    new, seen = query.shape[2], key.shape[2]
    if attention_mask is not None:
        return masked_attention(module, query, key, value, attention_mask, **kwargs)
    cached = seen - new
    if cached < 0:
        raise ValueError(f"{new} queries over {seen} keys: an unmasked pass puts its tokens after the cached ones")
    if sliding_window is not None and seen > sliding_window:
        return masked_attention(module, query, key, value, _lower_right(new, seen, query.device, sliding_window),
                                **kwargs)
    if new == 1 or cached == 0:
        return sdpa_attention_forward(module, query, key, value, None, is_causal=new > 1, **kwargs)
    if cached <= PAD_LIMIT * new:
        padded = torch.cat([query.new_zeros(query.shape[0], query.shape[1], cached, query.shape[3]), query], dim=2)
        out, _ = sdpa_attention_forward(module, padded, key, value, None, is_causal=True, **kwargs)  # (B, S, Hq, D)
        return out[:, cached:], None
    return masked_attention(module, query, key, value, _lower_right(new, seen, query.device), **kwargs)


def masked_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     mask: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query (B, Hq, T, D) over key, value (B, Hkv, S, D) behind `mask` (B or 1, 1, T, S), additive or
    bool. Returns (B, T, Hq, D). With a mask, HF's SDPA path repeats every key and value head for
    its group of query heads: a copy of the cache read, per layer and pass (7 of Qwen2.5's; after
    2,513 prompt tokens, 27% of a Qwen 0.5B decode step on a CPU, 43% of three sequences'). Here a
    group's query heads are stacked along the query axis of their key head instead, which scores
    the same pairs."""
    batch, heads, new, dim = query.shape
    kv_heads, seen = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    stacked_mask_bytes = groups * new * seen * mask.element_size()  # per mask row
    repeated_heads_bytes = 2 * heads * seen * dim * key.element_size()  # per batch row
    if (groups == 1 or heads != groups * kv_heads or mask.dim() != 4 or mask.shape[1] != 1
            or stacked_mask_bytes > repeated_heads_bytes):  # many queries: repeating the heads copies less
        return sdpa_attention_forward(module, query, key, value, mask, is_causal=False, **kwargs)
    stacked = query.reshape(batch, kv_heads, groups * new, dim)  # query head k*g + j, token t: row j*T + t of head k
    rows = mask.shape[0]
    mask = mask[:, :, None, :, :seen].expand(rows, 1, groups, new, seen).reshape(rows, 1, groups * new, seen)
    out = torch.nn.functional.scaled_dot_product_attention(
        stacked, key, value, attn_mask=mask, dropout_p=kwargs.get("dropout", 0.0), scale=kwargs.get("scaling"))
    return out.view(batch, heads, new, dim).transpose(1, 2).contiguous(), None  # (B, Hkv, g*T, D) -> (B, T, Hq, D)


def _lower_right(new: int, seen: int, device: torch.device, window: int | None = None) -> torch.Tensor:
    """(1, 1, new, seen) bool: query i (at position seen − new + i) sees keys at or below it (and, in a
    window, the last `window` of them: HF's q − k < window)."""
    query_at = torch.arange(seen - new, seen, device=device)[:, None]  # (T, 1)
    key_at = torch.arange(seen, device=device)[None, :]  # (1, S)
    allowed = key_at <= query_at
    if window is not None:
        allowed &= key_at > query_at - window
    return allowed[None, None]


def implied_mask(*args: Any, attention_mask: torch.Tensor | None = None, allow_is_causal_skip: bool = True,
                 **kwargs: Any) -> torch.Tensor | None:
    """The mask HF hands `causal_attention`: none for a plain causal pass (the attention implies it);
    HF's SDPA mask when the caller padded the batch or the model overlays a pattern of its own (HF
    then forbids the causal shortcut)."""
    if attention_mask is None and allow_is_causal_skip:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, allow_is_causal_skip=allow_is_causal_skip, **kwargs)


AttentionInterface.register(ATTENTION, causal_attention)
AttentionMaskInterface.register(ATTENTION, implied_mask)


def use_engine_attention(model: torch.nn.Module) -> None:
    """Run `model`'s attention through `causal_attention` (its config is changed in place; every
    module of an HF decoder reads the implementation from it at each call)."""
    config = model.config
    for part in {id(c): c for c in (config, getattr(config, "get_text_config", lambda: config)())}.values():
        part._attn_implementation = ATTENTION

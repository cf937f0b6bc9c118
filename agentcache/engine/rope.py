"""RoPE re-alignment: move cached keys from start position p to q.

Keys are cached after the rotary embedding, k_p = R(p)·k. Rotations compose, so the key the
model would have produced at q is R(q − p)·k_p. The angle per frequency is linear in the
position only for static rotary schemes (default, linear, llama3): there `inv_freq` does not
depend on the sequence length and the attention scaling factor cancels. Dynamic NTK and
longrope change `inv_freq` with the length and are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentcache.engine.precision import compute_dtype, exactness_tolerance
from agentcache.errors import RopeAlignmentError

__all__ = ["RopeAligner", "rotate_keys", "SUPPORTED_ROPE_TYPES", "REALIGNABLE_MODEL_TYPES"]

SUPPORTED_ROPE_TYPES = frozenset({"default", "linear", "llama3"})
# HF decoders whose every layer applies rotate-half RoPE to the full head (others, such as
# Cohere's interleaved layout or models with RoPE-free layers, would be rotated wrongly).
REALIGNABLE_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text"})


def rotate_keys(keys: torch.Tensor, delta: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate post-RoPE keys by `delta` positions (HF rotate-half layout).

    keys: (L, H, T, D); inv_freq: (L, D/2) float64, one row per layer, on the keys' device. Returns
    a new tensor in the keys' dtype, rotated in float32 (float64 for float64 keys): bf16 and fp16 keys
    are rounded once, at the end.
    """
    if delta == 0:
        return keys.clone()
    work = keys.to(compute_dtype(keys.dtype))  # (L, H, T, D): a copy only when converted
    half = keys.shape[-1] // 2
    angle = float(delta) * inv_freq  # (L, D/2), float64 so large deltas keep their precision
    cos = angle.cos().to(work.dtype)[:, None, None, :]  # (L, 1, 1, D/2)
    sin = angle.sin().to(work.dtype)[:, None, None, :]
    first, second = work[..., :half], work[..., half:]  # (L, H, T, D/2) each
    out = torch.empty_like(work)
    torch.mul(first, cos, out=out[..., :half]).addcmul_(second, sin, value=-1)  # x₁cos − x₂sin
    torch.mul(second, cos, out=out[..., half:]).addcmul_(first, sin)  # x₂cos + x₁sin
    return out.to(keys.dtype)


@dataclass(frozen=True)
class RopeAligner:
    """Per-layer inverse frequencies of a model's rotary embedding, for exact re-alignment."""

    inv_freq: torch.Tensor  # (L, D/2) float64

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> "RopeAligner":
        """Read the model's own rotary settings, per layer; raise RopeAlignmentError if not exact."""
        config = model.config
        family = getattr(config, "model_type", "?")
        if family not in REALIGNABLE_MODEL_TYPES:
            raise RopeAlignmentError(
                f"model type '{family}' is not known to use rotate-half RoPE on every layer; exact "
                f"re-alignment supports {sorted(REALIGNABLE_MODEL_TYPES)}"
            )
        rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
        if rotary is None:
            raise RopeAlignmentError(
                f"model type '{family}' has no `model.rotary_emb` module; agentcache re-aligns only "
                "HF rotary (RoPE) decoders such as Llama, Qwen2 and Gemma 3"
            )
        num_layers = int(config.num_hidden_layers)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * num_layers
        rows = []
        for layer_type in layer_types:
            if hasattr(rotary, f"{layer_type}_inv_freq"):  # per-type rotary (Gemma 3)
                inv_freq = getattr(rotary, f"{layer_type}_original_inv_freq", getattr(rotary, f"{layer_type}_inv_freq"))
                rope_type = rotary.rope_type.get(layer_type, "default")
            elif hasattr(rotary, "inv_freq"):
                inv_freq = getattr(rotary, "original_inv_freq", rotary.inv_freq)
                rope_type = getattr(rotary, "rope_type", "default")
            else:
                raise RopeAlignmentError(
                    f"model type '{family}': cannot find the inverse frequencies of layer type '{layer_type}'"
                )
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise RopeAlignmentError(
                    f"model type '{family}' uses rope type '{rope_type}', whose frequencies depend on the "
                    f"sequence length; exact re-alignment supports {sorted(SUPPORTED_ROPE_TYPES)}"
                )
            if 2 * inv_freq.numel() != head_dim:
                raise RopeAlignmentError(
                    f"model type '{family}' rotates {2 * inv_freq.numel()} of {head_dim} head dims "
                    "(partial rotary); exact re-alignment supports full-dimension rotary only"
                )
            rows.append(inv_freq.detach().to(torch.float64).cpu())
        aligner = cls(torch.stack(rows))
        aligner._probe(model)
        return aligner

    def _probe(self, model: torch.nn.Module, shift: int = 37) -> None:
        """Layer-0 keys depend only on token and position: computed at q they must equal the keys
        computed at p and re-aligned to q, as exactly as the model's dtype rounds. Catches rotary
        layouts the model list lets through."""
        from transformers import DynamicCache

        tokens = torch.arange(3, 11, device=model.device)[None] % model.config.vocab_size  # (1, 8)
        layer0 = []
        with torch.inference_mode():
            for start in (0, shift):
                cache = DynamicCache()
                positions = torch.arange(start, start + tokens.shape[1], device=model.device)[None]
                model(input_ids=tokens, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=1)
                layer0.append(cache.layers[0].keys[0])  # (H, 8, D)
        at_p, at_q = layer0
        moved = rotate_keys(at_p[None], shift, self.inv_freq[:1].to(at_p.device))[0]  # layer 0 only
        error = float((moved.float() - at_q.float()).norm() / at_q.float().norm())
        tolerance = exactness_tolerance(at_q.dtype)
        if not error < tolerance:
            raise RopeAlignmentError(
                f"model type '{model.config.model_type}': re-aligned layer-0 keys differ from keys computed "
                f"in place by {error:.1e} (relative; {at_q.dtype} allows {tolerance:.1e}); its rotary layout "
                "cannot be re-aligned exactly"
            )

    def realign(self, keys: torch.Tensor, from_start: int, to_start: int) -> torch.Tensor:
        """Keys (L, H, T, D) cached at positions from_start.. moved to to_start..; a new tensor."""
        if keys.shape[0] != self.inv_freq.shape[0]:
            raise RopeAlignmentError(
                f"keys have {keys.shape[0]} layers, the model has {self.inv_freq.shape[0]}"
            )
        return rotate_keys(keys, to_start - from_start, self.inv_freq.to(keys.device))

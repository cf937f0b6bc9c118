"""The engine's number format: which dtype a model runs in, and how exact "exact" can be in it.

An engine's weights and KV share one dtype: float32, bfloat16 or float16. The default follows
the device: bfloat16 on CUDA (what every GPU deployment runs), float32 elsewhere (the most exact,
and the fastest on a CPU without bfloat16 instructions; `agentcache demo` picks bfloat16 on one
with them, `cpu_computes_bfloat16`). Accuracy-sensitive math on the KV (re-alignment,
factorizing anchors, matching, correcting) runs in float32 whatever the KV's dtype and is stored
back in it.

Checks that something is exact (re-aligned keys against keys computed in place) compare two
results that were each rounded to the KV's dtype, so they cannot agree more closely than that
dtype rounds: `exactness_tolerance` is derived from its machine epsilon.
"""

from __future__ import annotations

import torch

from agentcache.errors import InputError

__all__ = ["DTYPES", "parse_dtype", "dtype_setting", "resolve_dtype", "dtype_name", "exactness_tolerance", "compute_dtype",
           "cpu_computes_bfloat16"]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

# Relative error below which two results count as equal in float32 (re-aligned keys match keys computed
# in place to about 1e-5 on real models there: the rotary angles are computed in float32 by the model).
FLOAT32_EXACTNESS = 1e-3
# Two independently rounded results of a few ops each: their relative difference stays within about one
# epsilon (measured on an H200 and on CPU: 0.4-0.5 eps for bf16 and fp16); twice that is the bar.
EPSILONS_OF_EXACTNESS = 2.0


def parse_dtype(spec: object, what: str) -> torch.dtype | None:
    """`spec` as a dtype: None or "auto" (the default for the device), a name ("bfloat16", "bf16",
    "float16", "fp16", "float32", "fp32") or a torch dtype of those; anything else is an InputError."""
    if spec is None or spec == "auto":
        return None
    if isinstance(spec, torch.dtype) and spec in _NAMES:
        return spec
    if isinstance(spec, str) and spec.lower() in DTYPES:
        return DTYPES[spec.lower()]
    raise InputError(f"{what} {spec!r} is not a dtype an engine runs in; use 'auto', 'bfloat16', 'float16' "
                     "or 'float32'")


def dtype_setting(spec: object, what: str) -> str:
    """`spec` checked and named as a setting: "auto" or a dtype's name (JSON-friendly, unlike a torch.dtype)."""
    parsed = parse_dtype(spec, what)
    return "auto" if parsed is None else dtype_name(parsed)


def resolve_dtype(spec: object, device: torch.device | str, what: str = "dtype") -> torch.dtype:
    """The dtype to run in: `spec` when given, else bfloat16 on CUDA and float32 elsewhere."""
    chosen = parse_dtype(spec, what)
    if chosen is not None:
        return chosen
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    return _NAMES.get(dtype, str(dtype).removeprefix("torch."))


def exactness_tolerance(dtype: torch.dtype) -> float:
    """The relative Frobenius error under which two computations of the same KV in `dtype` agree
    as exactly as that dtype allows: 1e-3 in float32, 2 epsilons in bf16 (1.6e-2) and fp16 (2e-3).
    A wrong rotary layout is off by order 1, far above any of these."""
    if not dtype.is_floating_point:
        raise InputError(f"exactness is judged for floating-point KV, not {dtype}")
    return max(FLOAT32_EXACTNESS, EPSILONS_OF_EXACTNESS * torch.finfo(dtype).eps)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype accuracy-sensitive math on KV of `dtype` runs in: float32, or float64 for float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def cpu_computes_bfloat16() -> bool:
    """Whether this CPU has bfloat16 matrix instructions (AVX512-BF16 or AMX), where bf16 kernels
    are faster than float32 ones (a 0.5B model's 900-token prefill 2.4x on a 2-core AMD EPYC)
    instead of emulated and slower."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch.cpu's (private, since torch 2.1)
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)

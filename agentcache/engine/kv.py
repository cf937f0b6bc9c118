"""KV tensors as the engine hands them out and takes them in, and the working cache of one call.

Layout everywhere: keys and values stacked over layers, `(L, H, T, D)` = (layers, KV heads,
tokens, head dim). Keys are stored after RoPE, so a segment's KV is tied to its start position.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from contextlib import contextmanager
from typing import Iterable, Iterator, Sequence

import torch
from transformers.cache_utils import Cache, DynamicLayer

from agentcache.errors import KVShapeError

__all__ = ["KVLayout", "SegmentKV", "all_finite", "same_device", "CallCache", "prefix_digests", "joined", "joined_hidden"]


def prefix_digests(token_ids: Sequence[int], cut_points: Iterable[int], model_key: bytes) -> dict[int, bytes]:
    """Digest of `token_ids[:cut]` for each cut point, under one model's weights (`model_key`)."""
    digest = hashlib.blake2b(model_key, digest_size=16)
    out: dict[int, bytes] = {}
    done = 0
    for cut in sorted(set(cut_points)):
        digest.update(array("q", token_ids[done:cut]).tobytes())
        done = cut
        out[cut] = digest.copy().digest()
    return out


@dataclass(frozen=True)
class KVLayout:
    """The per-token KV shape of a model: every layer has `num_kv_heads` heads of `head_dim`."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device = torch.device("cpu")  # where the engine's KV lives

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize


def all_finite(*tensors: torch.Tensor) -> bool:
    """Whether every number in `tensors` (on one device) is finite, in one pass each and one read on the
    host: NaN and ±Inf survive a sum, and finite KV sums far below the range of float32 and bf16 (an
    fp16 tensor is summed in float32; a sum that overflowed would only count as not finite: a
    fallback, never a wrong cache). A sum in the tensor's own dtype is the fast one on a CPU."""
    if not tensors:
        return True
    sums = torch.stack([t.sum(dtype=torch.float32 if t.dtype == torch.float16 else None).float() for t in tensors])
    return bool(torch.isfinite(sums).all())


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are one (`cuda` is the current CUDA device, taken as index 0)."""
    return a.type == b.type and (a.index or 0) == (b.index or 0)


@dataclass(frozen=True)
class SegmentKV:
    """The KV of a contiguous run of tokens placed at `start`.

    `exact_for` names what this KV is exact for: the digest (`prefix_digests`) of every token
    from position 0 through the segment's last token, under the model's weights. It is None for
    approximate KV (corrected, or reused from another context). Injected anywhere else, for
    other tokens, or into another model, the KV counts as approximate.
    """

    keys: torch.Tensor  # (L, H, T, D), after RoPE at positions start..start+T-1
    values: torch.Tensor  # (L, H, T, D)
    start: int
    exact_for: bytes | None = None

    @property
    def exact(self) -> bool:
        return self.exact_for is not None

    @property
    def length(self) -> int:
        return int(self.keys.shape[2])

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def check(self, layout: KVLayout, length: int, what: str) -> None:
        """Raise KVShapeError unless this KV fits `layout` and covers exactly `length` tokens."""
        expected = (layout.num_layers, layout.num_kv_heads, length, layout.head_dim)
        for name, tensor in (("keys", self.keys), ("values", self.values)):
            if not isinstance(tensor, torch.Tensor):
                raise KVShapeError(f"{what}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
            if tuple(tensor.shape) != expected:
                raise KVShapeError(
                    f"{what}: {name} have shape {tuple(tensor.shape)}, expected {expected} "
                    f"(layers, kv heads, tokens, head dim) for a {length}-token segment"
                )
            if tensor.dtype != layout.dtype:
                raise KVShapeError(f"{what}: {name} have dtype {tensor.dtype}, the model uses {layout.dtype}")
            if not same_device(tensor.device, layout.device):
                raise KVShapeError(f"{what}: {name} are on {tensor.device}, the engine's KV is on {layout.device}")
        if self.start < 0:
            raise KVShapeError(f"{what}: start position {self.start} is negative")

    def slice(self, begin: int, end: int) -> "SegmentKV":
        """Tokens [begin, end) of this segment (relative indices), keeping their positions.

        A slice no longer knows what it is exact for, unless it is the whole segment.
        """
        whole = begin == 0 and end >= self.length
        return SegmentKV(
            self.keys[:, :, begin:end], self.values[:, :, begin:end], self.start + begin,
            self.exact_for if whole else None,
        )


def joined(parts: Sequence[SegmentKV | None]) -> SegmentKV | None:
    """One segment's KV from the contiguous parts it was split into (None unless every part has KV).
    It is exact when every part is: then the last part's digest names the whole prefix through its end."""
    if not parts or any(p is None for p in parts):
        return None
    if len(parts) == 1:
        return parts[0]
    keys = torch.cat([p.keys for p in parts], dim=2)  # (L, H, T, D)
    values = torch.cat([p.values for p in parts], dim=2)
    exact_for = parts[-1].exact_for if all(p.exact for p in parts) else None
    return SegmentKV(keys, values, parts[0].start, exact_for)


def joined_hidden(parts: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """One segment's hidden states from its parts' (None unless every part has them)."""
    if not parts or any(p is None for p in parts):
        return None
    return parts[0] if len(parts) == 1 else torch.cat(list(parts))  # (T, hidden size)


class _BufferLayer(DynamicLayer):
    """One layer of a CallCache: a view into preallocated buffers instead of concatenation."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, owner: "CallCache") -> None:
        super().__init__()
        self._key_buffer = keys  # (1, H, capacity, D)
        self._value_buffer = values
        self._owner = owner
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self._sync()

    def _sync(self) -> None:
        n = self._owner.length
        self.keys = self._key_buffer[:, :, :n]
        self.values = self._value_buffer[:, :, :n]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states: (1, H, q, D) for the tokens being prefilled at positions length..length+q-1,
        # or, in a scattered pass, at the positions the owner names
        scatter = self._owner.scatter_positions
        if scatter is not None:
            positions, end = scatter
            self._key_buffer[:, :, positions] = key_states
            self._value_buffer[:, :, positions] = value_states
            return self._key_buffer[:, :, :end], self._value_buffer[:, :, :end]
        start = self._owner.length
        end = start + key_states.shape[-2]
        if end > self._owner.capacity:
            raise KVShapeError(f"call cache overflow: {end} tokens, capacity {self._owner.capacity}")
        self._key_buffer[:, :, start:end] = key_states
        self._value_buffer[:, :, start:end] = value_states
        return self._key_buffer[:, :, :end], self._value_buffer[:, :, :end]

    def get_seq_length(self) -> int:
        return self._owner.length


class CallCache(Cache):
    """The KV of one call, contiguous from position 0, in buffers sized for prompt plus generation.

    The HF model writes into it through `update` (per layer); the engine then calls `advance`
    once per forward pass. Injected and prefix-hit KV enter through `append`.
    """

    def __init__(
        self, layout: KVLayout, capacity: int, device: torch.device,
        buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """`buffers`: (keys, values) views of shape (L, 1, H, >= capacity, D) to work in, e.g. a row of
        a batching engine's shared buffer; None allocates the call's own."""
        self.length = 0
        self.capacity = capacity
        self.scatter_positions: tuple[torch.Tensor, int] | None = None  # set during a scattered pass
        if buffers is None:
            shape = (layout.num_layers, 1, layout.num_kv_heads, capacity, layout.head_dim)
            buffers = (torch.empty(shape, dtype=layout.dtype, device=device),
                       torch.empty(shape, dtype=layout.dtype, device=device))
        self.key_buffer, self.value_buffer = buffers  # (L, 1, H, C, D)
        layers = [_BufferLayer(self.key_buffer[i], self.value_buffer[i], self) for i in range(layout.num_layers)]
        super().__init__(layers=layers)

    def rebind(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Work in other buffers from now on (the caller copied what these held)."""
        self.key_buffer, self.value_buffer = keys, values
        for i, layer in enumerate(self.layers):
            layer._key_buffer, layer._value_buffer = keys[i], values[i]
            layer._sync()

    def advance(self, num_tokens: int, *, views: bool = True) -> None:
        """Commit `num_tokens` written by the model's last forward pass. `views=False` moves the length
        only: for a decode row's cache, which the model reads through the rows, and we through `view`
        (the layers' views are brought up to date by the next `rebind` or `advance`)."""
        self.length += num_tokens
        if views:
            for layer in self.layers:
                layer._sync()

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append KV for the next tokens: keys/values (L, H, T, D), already at the right positions."""
        n = keys.shape[2]
        if self.length + n > self.capacity:
            raise KVShapeError(f"call cache overflow: {self.length + n} tokens, capacity {self.capacity}")
        self.key_buffer[:, 0, :, self.length : self.length + n] = keys
        self.value_buffer[:, 0, :, self.length : self.length + n] = values
        self.advance(n)

    def place(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write KV (L, H, T, D) for positions start..start+T-1 past the committed length, ahead of
        the tokens between: a scattered pass (`scattered`) computes those, then `commit` them all."""
        n = keys.shape[2]
        if start < self.length or start + n > self.capacity:
            raise KVShapeError(f"cannot place {n} tokens at {start}: committed {self.length}, capacity {self.capacity}")
        self.key_buffer[:, 0, :, start : start + n] = keys
        self.value_buffer[:, 0, :, start : start + n] = values

    def clear(self, begin: int, end: int) -> None:
        """Zero positions [begin, end): a masked-out slot must not hold NaN (0 * NaN poisons attention)."""
        self.key_buffer[:, :, :, begin:end] = 0
        self.value_buffer[:, :, :, begin:end] = 0

    @contextmanager
    def scattered(self, positions: torch.Tensor, end: int) -> Iterator[None]:
        """During the forward passes inside, the model writes its tokens' KV at `positions` (any
        order-preserving subset of [length, end)) and attends over the buffer up to `end`."""
        self.scatter_positions = (positions, end)
        try:
            yield
        finally:
            self.scatter_positions = None

    def commit(self, end: int) -> None:
        """Every position below `end` now holds its KV (placed or computed)."""
        self.length = end
        for layer in self.layers:
            layer._sync()

    def view(self, begin: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of tokens [begin, end), each (L, H, T, D); views, not copies."""
        return self.key_buffer[:, 0, :, begin:end], self.value_buffer[:, 0, :, begin:end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

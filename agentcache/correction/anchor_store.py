"""Where persisted anchor pools live: a store of named, versioned blobs shared by every instance.

Instances of one deployment share a tenant's anchor pools (statistical corrections, never KV)
through one store. Writers never overwrite what they have not read: `write` replaces a blob only
if it is still the version the writer read (compare-and-swap), and a writer that lost the race
reads again, merges, and retries (`correction.persist`). A reader sees either the old blob or the
new one whole.

`DirectoryStore` is a directory (local, or shared between machines on a file system with POSIX
record locks, such as NFS with its lock manager): a blob is a file, replaced by rename, its
version a hash of its bytes (no file-system timestamp or inode number to go stale or repeat),
and writers serialize on an exclusive `lockf` of a lock file beside it (`.lock`). An object
store takes its place by implementing the same two methods with its conditional writes (S3's
`If-Match` on the ETag, GCS's generation preconditions).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
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
        data = _contents(self.path(name))
        return None if data is None else Stored(data, _version(data))

    def write(self, name: str, data: bytes, *, expected: str | None) -> str | None:
        path = self.path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path.parent / LOCK_FILE):
            current = _contents(path)
            if (None if current is None else _version(current)) != expected:
                return None
            _replace(path, data)
            return _version(data)


LOCK_FILE = ".lock"


def _version(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _contents(path: Path) -> bytes | None:
    try:
        with open(path, "rb") as f:  # a rename replaces the file whole: this one stays readable
            return f.read()
    except FileNotFoundError:
        return None


@contextlib.contextmanager
def _locked(lock_file: Path):
    """An exclusive POSIX record lock on `lock_file` (NFS carries these; flock it may not)."""
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _replace(path: Path, data: bytes) -> None:
    """Write to a temporary file beside `path`, fsync it, then rename it over `path`; on any failure
    the temporary file goes and `path` stays as it was."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would keep other instances' users from reading it
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

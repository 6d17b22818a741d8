"""Where published weights are stored: a local directory, or any fsspec filesystem (memory://, s3://).

Two implementations of one small interface (`Store`), because durability differs: a local file is written
under a temporary name, fsynced and renamed, then its directory fsynced, so a name never refers to
partial content and a crash loses nothing acknowledged; an object store makes an object visible whole
when its writer closes, so no rename (a copy there) is needed. `rlfabric.weights.versions` builds the
version/manifest/marker protocol on top and relies only on this: once `write_bytes` returns or an
`open_write` block exits, the content is durable under its final name; the name itself is durable once
`sync_dir` of its directory returns (a no-op on object stores). Listing and `exists` are consistent with
completed writes (s3fs's listing cache is invalidated before each listing).

Imports without fsspec for plain local paths (fsspec is imported only for URLs).
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, BinaryIO, Protocol


class Writer(Protocol):
    """What `Store.open_write` yields: writes all of `data` (no short writes)."""

    def write(self, data: memoryview | bytes) -> Any: ...


class Store(Protocol):
    """The few storage operations the format needs. Paths are '/'-joined strings native to the store."""

    root: str

    def url(self, path: str) -> str: ...
    def list_names(self, path: str) -> list[str]: ...
    def exists(self, path: str) -> bool: ...
    def read_bytes(self, path: str) -> bytes: ...
    def open_read(self, path: str) -> AbstractContextManager[BinaryIO]: ...
    def open_write(self, path: str) -> AbstractContextManager[Writer]: ...  # durable once exited
    def write_bytes(self, path: str, data: bytes) -> None: ...  # durable like a closed open_write
    def makedirs(self, path: str) -> None: ...
    def sync_dir(self, path: str) -> None: ...
    def remove(self, path: str) -> None: ...
    def remove_tree(self, path: str) -> None: ...


class LocalStore:
    """A local directory: files are written as `.<name>.tmp`, fsynced, renamed, and the directory fsynced."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)

    def url(self, path: str) -> str:
        return path

    def list_names(self, path: str) -> list[str]:
        try:
            return os.listdir(path)
        except FileNotFoundError:
            return []

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def read_bytes(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def open_read(self, path: str) -> AbstractContextManager[BinaryIO]:
        return open(path, "rb")

    @contextmanager
    def open_write(self, path: str) -> Iterator[Writer]:
        tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
        with open(tmp, "wb", buffering=0) as f:
            yield FullWriter(f)
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def write_bytes(self, path: str, data: bytes) -> None:
        with self.open_write(path) as out:
            out.write(data)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def sync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def remove(self, path: str) -> None:
        os.remove(path)

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(path)


class FullWriter:
    """Writes all of each buffer to an unbuffered local file (a raw `write` may write less than asked), and
    starts the kernel's write-back of every `WRITEBACK_BYTES` written, so that the final fsync has little
    left to wait for (on Linux: `sync_file_range(SYNC_FILE_RANGE_WRITE)`, which does not wait)."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self._written = 0
        self._kicked = 0

    def write(self, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            n = self._f.write(view)
            view = view[n:]
            self._written += n
        if self._written - self._kicked >= WRITEBACK_BYTES:
            start_writeback(self._f.fileno(), self._kicked, self._written - self._kicked)
            self._kicked = self._written


WRITEBACK_BYTES = 8 << 20
_SYNC_FILE_RANGE_WRITE = 2


@functools.cache
def _sync_file_range() -> Any:
    """libc's `sync_file_range` through ctypes, or None where there is none (not Linux, no libc)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return function


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Asks the kernel to start writing a file range to disk without waiting. Advisory: a failure (or no
    such call on this platform) only means the later fsync does all the work, so it is ignored."""
    function = _sync_file_range()
    if function is not None:
        function(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


class FsspecStore:
    """Any fsspec filesystem (memory://, s3://, ...): objects appear whole when closed; no rename needed."""

    def __init__(self, fs: Any, root: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/") or "/"

    def url(self, path: str) -> str:
        return str(self.fs.unstrip_protocol(path))

    def list_names(self, path: str) -> list[str]:
        self.fs.invalidate_cache(path)  # listings may be cached (s3fs); other processes write here
        try:
            return [entry.rstrip("/").rsplit("/", 1)[-1] for entry in self.fs.ls(path, detail=False)]
        except FileNotFoundError:
            return []

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(path))

    def read_bytes(self, path: str) -> bytes:
        return bytes(self.fs.cat_file(path))

    def open_read(self, path: str) -> AbstractContextManager[BinaryIO]:
        return self.fs.open(path, "rb")  # type: ignore[no-any-return]

    @contextmanager
    def open_write(self, path: str) -> Iterator[Writer]:
        with self.fs.open(path, "wb") as f:
            yield f

    def write_bytes(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(path, data)

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    def sync_dir(self, path: str) -> None:
        return None

    def remove(self, path: str) -> None:
        self.fs.rm_file(path)

    def remove_tree(self, path: str) -> None:
        self.fs.rm(path, recursive=True)


def open_store(root: str | os.PathLike[str]) -> Store:
    """A local store for plain paths and file:// URLs (without importing fsspec for plain paths)."""
    root = os.fspath(root)
    if "://" not in root:
        return LocalStore(root)
    from fsspec.core import url_to_fs
    from fsspec.implementations.local import LocalFileSystem

    fs, path = url_to_fs(root)
    return LocalStore(path) if isinstance(fs, LocalFileSystem) else FsspecStore(fs, path)


def join(*parts: str) -> str:
    return "/".join(p.rstrip("/") for p in parts)

"""Host memory other processes map by name: the first level of a manager whose engine copies
KV in and out of its pages from other processes (the vLLM connector's workers)."""

from __future__ import annotations

import contextlib
import errno
import mmap
import os

import numpy as np

from kvpool.errors import StorageError
from kvpool.storage.memory import Bytes, HostMemory


def shared_pool_file(pool_group: int, pool: int) -> str:
    """The name of a shared level's file for one pool, inside its `shared_dir`."""
    return f"pool-{pool_group}-{pool}"


class SharedHostMemory(HostMemory):
    """Host RAM that other processes map by name: a file `path` (in a RAM file system such as
    /dev/shm) of `max_size` bytes, mapped shared. An engine's worker processes read and write
    pages through it while the manager's process decides where they live. It never grows past
    `max_size` (other processes' mappings would not follow); shrinking frees the file's pages
    past the cut (MADV_REMOVE). The used range has its memory allocated up front, on creation
    and on growth (posix_fallocate): a file system too small is a `StorageError` then, never a
    SIGBUS in whichever process touches the page later. `close()` deletes the file."""

    kind = "shared host"

    def __init__(self, path: str | os.PathLike[str], size: int, max_size: int | None = None):
        self.path = os.fspath(path)
        self._fd = -1
        super().__init__(size, max_size)

    def _reserve(self, size: int) -> mmap.mmap:
        if getattr(self, "_map", None) is not None:
            raise StorageError(
                errno.EFBIG,
                f"shared memory {self.path} cannot grow past its {self._max_size} bytes",
            )
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as error:
            raise StorageError(
                error.errno or errno.EIO, f"cannot create shared memory file {self.path}"
            ) from error
        try:
            os.ftruncate(self._fd, max(size, 1))
            self._allocate(0, self._size)
            return mmap.mmap(self._fd, max(size, 1), flags=mmap.MAP_SHARED)
        except BaseException as error:
            os.close(self._fd)
            self._fd = -1
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            if isinstance(error, OSError) and not isinstance(error, StorageError):
                raise StorageError(
                    error.errno or errno.EIO,
                    f"cannot map {size} bytes of shared memory at {self.path}: {error.strerror}",
                ) from error
            raise

    def _allocate(self, start: int, nbytes: int) -> None:
        """Give [start, start + nbytes) of the file its memory now: a RAM file system that
        runs out later would kill the process touching the page (SIGBUS), not raise."""
        if nbytes <= 0:
            return
        try:
            os.posix_fallocate(self._fd, start, nbytes)
        except OSError as error:
            free = os.statvfs(os.path.dirname(self.path) or ".")
            room = free.f_bavail * free.f_frsize
            raise StorageError(
                error.errno or errno.ENOSPC,
                f"cannot give {nbytes} bytes of shared memory to {self.path} "
                f"({os.strerror(error.errno or errno.ENOSPC)}); its file system has {room} "
                "bytes free",
            ) from error

    def resize(self, new_size: int) -> None:
        """As `HostMemory.resize`, the file's memory allocated for a larger size first (a
        `StorageError` naming the room left, with nothing changed, when it does not fit)."""
        if self._map is not None and self._size < new_size <= self._max_size:
            self._allocate(self._size, new_size - self._size)
        super().resize(new_size)

    def _release(self, start: int, nbytes: int) -> None:
        assert self._map is not None
        self._map.madvise(getattr(mmap, "MADV_REMOVE", mmap.MADV_DONTNEED), start, nbytes)

    def close(self) -> None:
        if self._map is None:
            return
        super().close()
        os.close(self._fd)
        self._fd = -1
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def map_shared(path: str | os.PathLike[str]) -> Bytes:
    """The whole of a `SharedHostMemory` file, mapped shared, as a writable uint8 array (from
    another process). The mapping lives as long as the array (and views of it)."""
    with open(path, "r+b") as file:
        mapped = mmap.mmap(file.fileno(), 0, flags=mmap.MAP_SHARED)
    return np.frombuffer(mapped, dtype=np.uint8)

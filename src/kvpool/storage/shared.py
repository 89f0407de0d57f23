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
    past the cut (MADV_REMOVE). `close()` unmaps and deletes the file."""

    kind = "shared host"

    def __init__(self, path: str | os.PathLike[str], size: int, max_size: int | None = None):
        self.path = os.fspath(path)
        super().__init__(size, max_size)

    def _reserve(self, size: int) -> mmap.mmap:
        if getattr(self, "_map", None) is not None:
            raise StorageError(
                errno.EFBIG,
                f"shared memory {self.path} cannot grow past its {self._max_size} bytes",
            )
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as error:
            raise StorageError(
                error.errno or errno.EIO, f"cannot create shared memory file {self.path}"
            ) from error
        try:
            os.ftruncate(fd, max(size, 1))
            return mmap.mmap(fd, max(size, 1), flags=mmap.MAP_SHARED)
        except OSError as error:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            raise StorageError(
                error.errno or errno.EIO,
                f"cannot map {size} bytes of shared memory at {self.path}: {error.strerror}",
            ) from error
        finally:
            os.close(fd)

    def _release(self, start: int, nbytes: int) -> None:
        assert self._map is not None
        self._map.madvise(getattr(mmap, "MADV_REMOVE", mmap.MADV_DONTNEED), start, nbytes)

    def close(self) -> None:
        if self._map is None:
            return
        super().close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def map_shared(path: str | os.PathLike[str]) -> Bytes:
    """The whole of a `SharedHostMemory` file, mapped shared, as a writable uint8 array (from
    another process). The mapping lives as long as the array (and views of it)."""
    with open(path, "r+b") as file:
        mapped = mmap.mmap(file.fileno(), 0, flags=mmap.MAP_SHARED)
    return np.frombuffer(mapped, dtype=np.uint8)

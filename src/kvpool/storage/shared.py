"""Host memory other processes map: the first level of a manager whose engine copies KV in and
out of its pages from other processes (the vLLM connector's workers). Either a named file in a
RAM file system, or anonymous shared memory (memfd) that other processes open through
`/proc/<pid>/fd/<fd>`: no file anywhere, and the kernel frees it when the last process holding
it (open or mapped) ends, however it ends (SIGKILL and the OOM killer included)."""

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
    """Host RAM that other processes map: a file `path` (in a RAM file system such as /dev/shm)
    of `max_size` bytes, mapped shared, or with `path=None` an anonymous memfd named `name`
    (other processes open `handle_path`). An engine's worker processes read and write
    pages through it while the manager's process decides where they live. It never grows past
    `max_size` (other processes' mappings would not follow); shrinking frees the file's pages
    past the cut (MADV_REMOVE). The used range has its memory allocated up front, on creation
    and on growth (posix_fallocate): a file system too small is a `StorageError` then, never a
    SIGBUS in whichever process touches the page later. `close()` deletes the file."""

    kind = "shared host"

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        size: int,
        max_size: int | None = None,
        name: str = "kvpool",
    ):
        self.path = None if path is None else os.fspath(path)
        self._name = name
        self._fd = -1
        super().__init__(size, max_size)

    @property
    def handle_path(self) -> str:
        """What another process opens to map this memory (`map_shared`)."""
        if self.path is not None:
            return self.path
        return f"/proc/{os.getpid()}/fd/{self._fd}"

    def _open(self) -> int:
        if self.path is None:
            return os.memfd_create(self._name, os.MFD_CLOEXEC)
        return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)

    def _reserve(self, size: int) -> mmap.mmap:
        if getattr(self, "_map", None) is not None:
            raise StorageError(
                errno.EFBIG,
                f"shared memory {self.path} cannot grow past its {self._max_size} bytes",
            )
        try:
            self._fd = self._open()
        except OSError as error:
            raise StorageError(
                error.errno or errno.EIO, f"cannot create shared memory {self._describe()}"
            ) from error
        try:
            os.ftruncate(self._fd, max(size, 1))
            self._allocate(0, self._size)
            return mmap.mmap(self._fd, max(size, 1), flags=mmap.MAP_SHARED)
        except BaseException as error:
            os.close(self._fd)
            self._fd = -1
            if self.path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
            if isinstance(error, OSError) and not isinstance(error, StorageError):
                raise StorageError(
                    error.errno or errno.EIO,
                    f"cannot map {size} bytes of shared memory {self._describe()}: "
                    f"{error.strerror}",
                ) from error
            raise

    def _describe(self) -> str:
        return f"file {self.path}" if self.path is not None else f"(memfd {self._name!r})"

    def _allocate(self, start: int, nbytes: int) -> None:
        """Give [start, start + nbytes) of the file its memory now: a RAM file system that
        runs out later would kill the process touching the page (SIGBUS), not raise."""
        if nbytes <= 0:
            return
        try:
            os.posix_fallocate(self._fd, start, nbytes)
        except OSError as error:
            if self.path is None:
                room = "the memory left to this process's cgroup"
            else:
                free = os.statvfs(os.path.dirname(self.path) or ".")
                room = f"{free.f_bavail * free.f_frsize} bytes free on its file system"
            raise StorageError(
                error.errno or errno.ENOSPC,
                f"cannot give {nbytes} bytes of shared memory {self._describe()} "
                f"({os.strerror(error.errno or errno.ENOSPC)}); room: {room}",
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
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


def map_shared(path: str | os.PathLike[str]) -> Bytes:
    """The whole of a `SharedHostMemory` (its `handle_path`), mapped shared, as a writable
    uint8 array (from another process). The mapping lives as long as the array (and views of
    it)."""
    with open(path, "r+b") as file:
        mapped = mmap.mmap(file.fileno(), 0, flags=mmap.MAP_SHARED)
    return np.frombuffer(mapped, dtype=np.uint8)

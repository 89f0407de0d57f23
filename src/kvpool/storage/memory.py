"""The memory behind each cache level: host RAM, a disk file, or accelerator memory.

Each pool of each level owns one `Memory` of `size` bytes that can be resized at run time:
- `HostMemory` reserves address space once (anonymous private mmap), so growing only moves the
  logical end and views stay valid; shrinking hands the resident pages past the cut back to the
  OS with madvise(MADV_DONTNEED). The reservation asks for transparent huge pages
  (MADV_HUGEPAGE, where the kernel offers them): a pool is touched and copied in large runs, and
  2 MiB pages make first touch, copies and that hand-back several times cheaper than 4 KiB ones.
- `DiskMemory` is an unlinked temporary file; growing reserves the disk blocks up front
  (posix_fallocate), so "disk full" surfaces at resize time, not in the middle of an eviction.
- `DeviceMemory` is torch CUDA memory when a GPU is present, else host memory with the same
  interface. CUDA memory is reallocated on resize, so its addresses move (re-fetch views), and
  a resize briefly needs the old and the new size at once, plus a device copy of what is kept
  (at the device's memory bandwidth: about a millisecond per GiB on an H200).

Where a GPU level exists, host levels are pinned (`HostMemory.pin`: the used range registered
with the CUDA driver), so copies to and from the GPU are asynchronous DMA.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import mmap
import os
import sys
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvpool.errors import ArgumentError, StorageError
from kvpool.validation import check_int, is_int

PAGE_SIZE = mmap.PAGESIZE
# Not exported by Python 3.11's mmap module; the value is the same on every Linux architecture.
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
HUGE_PAGE_SIZE = 2 << 20  # a transparent huge page on x86-64 and (4 KiB-page) arm64

Bytes = npt.NDArray[np.uint8]


class Memory(ABC):
    """A resizable byte range of one storage kind."""

    kind: str

    @property
    @abstractmethod
    def size(self) -> int:
        """Current size in bytes."""

    @abstractmethod
    def resize(self, new_size: int) -> None:
        """Change the size; bytes below min(old, new) keep their contents."""

    @abstractmethod
    def read(self, offset: int, nbytes: int) -> Bytes:
        """A copy of `nbytes` bytes at `offset`."""

    @abstractmethod
    def write(self, offset: int, data: Bytes | bytes) -> None:
        """Write `data` at `offset`."""

    @abstractmethod
    def close(self) -> None:
        """Release the memory (idempotent)."""

    def _check_range(self, offset: int, nbytes: int) -> None:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ArgumentError(
                f"offset={offset}, nbytes={nbytes} is invalid: the range must lie in "
                f"[0, {self.size}) of this {self.kind} memory"
            )


def _check_size(name: str, value: int, maximum: int | None = None) -> None:
    if maximum is not None and is_int(value) and value > maximum:
        raise ArgumentError(f"{name}={value!r} is invalid: must be <= the reserved {maximum} bytes")
    check_int(name, value, 0)


def available_host_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _reserve(size: int) -> mmap.mmap:
    """Anonymous private address space; MAP_NORESERVE: memory is committed only on touch.
    Reservations of a huge page or more ask for transparent huge pages (best effort: a kernel
    without them, or with them off, keeps 4 KiB pages)."""
    try:
        reserved = mmap.mmap(
            -1,
            max(size, 1),
            flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE,
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
        )
    except (OSError, OverflowError) as error:
        available = available_host_memory()
        shown = (
            "unknown" if available is None else f"{available} bytes ({available / 2**30:.1f} GiB)"
        )
        raise StorageError(
            errno.ENOMEM,
            f"cannot reserve {size} bytes ({size / 2**30:.1f} GiB) of host memory "
            f"({os.strerror(errno.ENOMEM)}); available: {shown}",
        ) from error
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None and size >= HUGE_PAGE_SIZE:
        with contextlib.suppress(OSError):  # EINVAL: a kernel built without them
            reserved.madvise(advice)
    return reserved


class HostMemory(Memory):
    """Host RAM: one anonymous mapping reserved at `max_size`; pages become resident on touch."""

    kind = "host"

    def __init__(self, size: int, max_size: int | None = None) -> None:
        _check_size("size", size)
        max_size = size if max_size is None else max_size
        _check_size("max_size", max_size)
        _check_size("size", size, max_size)
        self._max_size = max_size
        self._size = size
        self._map: mmap.mmap | None = self._reserve(max_size)
        self.array: Bytes = np.frombuffer(self._map, dtype=np.uint8, count=max_size)
        """The whole reservation as a writable array; only [0, size) is in use."""
        self._wants_pin = False
        self.pinned = 0  # bytes registered with the CUDA driver, from the start

    def _reserve(self, size: int) -> mmap.mmap:
        return _reserve(size)

    def _release(self, start: int, nbytes: int) -> None:
        """Hand the resident pages of [start, start + nbytes) back to the OS."""
        assert self._map is not None
        self._map.madvise(mmap.MADV_DONTNEED, start, nbytes)

    def pin(self) -> bool:
        """Page-lock the used range for the GPU (and keep it so across resizes). False, with
        one log line, where the driver refuses: the memory works, pageable."""
        self._wants_pin = True
        return self._pin()

    def _pin(self) -> bool:
        from kvpool.storage import device

        if self.pinned or not self._wants_pin or self._map is None:
            return bool(self.pinned)
        # (A whole page at least: the driver registers pages.)
        nbytes = min(max(-(-self._size // PAGE_SIZE) * PAGE_SIZE, PAGE_SIZE), self._max_size)
        if device.pin(self.array.ctypes.data, nbytes):
            self.pinned = nbytes
        return bool(self.pinned)

    def _unpin(self) -> None:
        from kvpool.storage import device

        if self.pinned:
            device.unpin(self.array.ctypes.data)
            self.pinned = 0

    @property
    def size(self) -> int:
        return self._size

    @property
    def max_size(self) -> int:
        return self._max_size

    def resize(self, new_size: int) -> None:
        """Move the logical end. Within the reservation addresses stay; growing past it maps a
        larger reservation and copies the contents (addresses change: re-fetch views)."""
        _check_size("new_size", new_size)
        if self._map is None:
            raise StorageError(errno.EBADF, "the host memory is closed")
        self._unpin()  # (a pinned range changes with the size; locked pages cannot go back)
        try:
            if new_size > self._max_size:
                self._remap(new_size)
            elif new_size < self._size:
                start = -(-new_size // PAGE_SIZE) * PAGE_SIZE
                end = min(-(-self._size // PAGE_SIZE) * PAGE_SIZE, self._max_size)
                if start < end:
                    self._release(start, end - start)
            self._size = new_size
        finally:
            self._pin()

    def _remap(self, new_max: int) -> None:
        old_map, old_array = self._map, self.array
        self._map = self._reserve(new_max)
        self.array = np.frombuffer(self._map, dtype=np.uint8, count=new_max)
        self.array[: self._size] = old_array[: self._size]
        self._max_size = new_max
        del old_array
        with contextlib.suppress(BufferError):
            assert old_map is not None
            old_map.close()

    def read(self, offset: int, nbytes: int) -> Bytes:
        self._check_range(offset, nbytes)
        return self.array[offset : offset + nbytes].copy()

    def write(self, offset: int, data: Bytes | bytes) -> None:
        source = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data
        self._check_range(offset, source.size)
        self.array[offset : offset + source.size] = source

    def close(self) -> None:
        if self._map is None:
            return
        self._unpin()
        self.array = np.empty(0, dtype=np.uint8)
        self._size = 0
        # A caller may still hold a view: then the mapping goes when the last view is dropped.
        with contextlib.suppress(BufferError):
            self._map.close()
        self._map = None


class DiskMemory(Memory):
    """An unlinked file in `directory`, read and written with pread/pwrite at slot offsets."""

    kind = "disk"

    def __init__(self, directory: str | os.PathLike[str], size: int) -> None:
        _check_size("size", size)
        self.directory = os.fspath(directory)
        if not os.path.isdir(self.directory):
            raise ArgumentError(
                f"directory={self.directory!r} is invalid: must be an existing directory"
            )
        self._fd = self._create_file()
        self._size = 0
        try:
            self.resize(size)
        except BaseException:
            os.close(self._fd)
            raise

    @property
    def size(self) -> int:
        return self._size

    @property
    def fileno(self) -> int:
        return self._fd

    def file_offset(self, offset: int) -> int:
        """Where byte `offset` of this memory lies in its file (`fileno`)."""
        return offset

    def _create_file(self) -> int:
        """An unlinked file in the directory (`StorageError` naming it when that fails)."""
        try:
            return os.open(self.directory, os.O_TMPFILE | os.O_RDWR, 0o600)
        except OSError:
            pass
        # Filesystems without O_TMPFILE: create a named file and unlink it at once.
        try:
            fd, path = tempfile.mkstemp(dir=self.directory, prefix="kvpool-")
        except OSError as error:
            code = error.errno or errno.EIO
            raise StorageError(
                code,
                f"cannot create the disk level's file in {self.directory}: {os.strerror(code)}",
            ) from error
        try:
            os.unlink(path)
        except OSError as error:
            os.close(fd)
            raise StorageError(
                error.errno or errno.EIO, f"cannot unlink {path}: {os.strerror(error.errno or 5)}"
            ) from error
        return fd

    def resize(self, new_size: int) -> None:
        _check_size("new_size", new_size)
        self._require_open()
        if new_size > self._size:
            try:
                os.posix_fallocate(self._fd, self._size, new_size - self._size)
            except (OSError, OverflowError) as error:
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, self._size)
                code = getattr(error, "errno", None) or errno.EFBIG
                raise StorageError(
                    code,
                    f"cannot grow the disk level in {self.directory} from {self._size} to "
                    f"{new_size} bytes: {os.strerror(code)}",
                ) from error
        else:
            try:
                os.ftruncate(self._fd, new_size)
            except OSError as error:
                raise StorageError(
                    error.errno,
                    f"cannot shrink the disk level in {self.directory} to {new_size} bytes: "
                    f"{os.strerror(error.errno or errno.EIO)}",
                ) from error
        self._size = new_size

    def read(self, offset: int, nbytes: int) -> Bytes:
        out = np.empty(nbytes, dtype=np.uint8)
        self.readinto(offset, out)
        return out

    def readinto(self, offset: int, out: Bytes) -> None:
        """Fill the contiguous array `out` from the file at `offset`."""
        self.readv(offset, [out])

    def write(self, offset: int, data: Bytes | bytes) -> None:
        self.writev(
            offset, [np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data]
        )

    def readv(self, offset: int, buffers: Sequence[Bytes]) -> None:
        """Scatter the file range at `offset` into contiguous `buffers` (preadv)."""
        self._vector_io("read", offset, buffers)

    def writev(self, offset: int, buffers: Sequence[Bytes]) -> None:
        """Gather contiguous `buffers` into the file range at `offset` (pwritev)."""
        self._vector_io("write", offset, buffers)

    def _vector_io(self, op: str, offset: int, buffers: Sequence[Bytes]) -> None:
        self._require_open()
        views = [buffer.data.cast("B") for buffer in buffers]
        total = sum(len(view) for view in views)
        self._check_range(offset, total)
        call = os.preadv if op == "read" else os.pwritev
        done = 0
        while views:
            try:
                n = call(self._fd, views, offset + done)
            except OSError as error:
                raise self._io_error(op, offset, total, error) from error
            if n == 0:
                raise StorageError(
                    errno.EIO, f"unexpected end of the disk level file at {offset + done}"
                )
            done += n
            while views and n >= len(views[0]):  # drop what was transferred in full
                n -= len(views[0])
                views.pop(0)
            if n:
                views[0] = views[0][n:]

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self._size = 0

    def _require_open(self) -> None:
        if self._fd < 0:
            raise StorageError(errno.EBADF, "the disk level memory is closed")

    def _io_error(self, op: str, offset: int, nbytes: int, error: OSError) -> StorageError:
        code = error.errno or errno.EIO
        return StorageError(
            code,
            f"disk level {op} of {nbytes} bytes at offset {offset} in {self.directory} failed: "
            f"{os.strerror(code)}",
        )


CUDA_DEVICE_FILES = ("/dev/nvidiactl", "/dev/kfd")  # NVIDIA's driver, AMD's (ROCm)


def cuda_available() -> bool:
    """True when torch is installed and sees a CUDA (or ROCm) device. Torch is imported only
    when it is imported already or a GPU driver's device file exists: importing it costs
    seconds and hundreds of MiB, which a machine without a GPU should not pay."""
    if "torch" not in sys.modules:
        if importlib.util.find_spec("torch") is None:
            return False
        if not any(os.path.exists(path) for path in CUDA_DEVICE_FILES):
            return False
    import torch

    return bool(torch.cuda.is_available())


def _cuda_bytes(size: int) -> Any:
    """An uninitialized CUDA byte tensor; `StorageError` (ENOMEM) when the device is full."""
    import torch

    try:
        return torch.empty(size, dtype=torch.uint8, device="cuda")
    except RuntimeError as error:  # torch.OutOfMemoryError is one
        free, total = torch.cuda.mem_get_info()
        raise StorageError(
            errno.ENOMEM,
            f"cannot allocate {size} bytes ({size / 2**30:.1f} GiB) of CUDA memory: "
            f"{free} bytes free of {total}",
        ) from error


class DeviceMemory(Memory):
    """Accelerator memory: a torch CUDA byte tensor, or `HostMemory` when there is no GPU."""

    def __init__(self, size: int, max_size: int | None = None) -> None:
        _check_size("size", size)
        self._host: HostMemory | None = None
        self._tensor: Any = None
        if cuda_available():
            self.kind = "cuda"
            self._tensor = _cuda_bytes(size)
        else:
            self.kind = "host (no CUDA device)"
            self._host = HostMemory(size, max_size)

    @property
    def is_cuda(self) -> bool:
        return self._host is None

    @property
    def host(self) -> HostMemory:
        """The host memory standing in for the device (only when there is no GPU)."""
        if self._host is None:
            raise StorageError(errno.EINVAL, "device memory is CUDA memory, not host memory")
        return self._host

    @property
    def tensor(self) -> Any:
        """The CUDA byte tensor (only with a GPU; its address changes on resize)."""
        if self._host is not None:
            raise StorageError(errno.EINVAL, "device memory is host memory (no CUDA device)")
        return self._tensor

    @property
    def size(self) -> int:
        if self._host is not None:
            return self._host.size
        return 0 if self._tensor is None else int(self._tensor.numel())

    def resize(self, new_size: int) -> None:
        _check_size("new_size", new_size)
        if self._host is not None:
            self._host.resize(new_size)
            return

        old = self._tensor
        keep = min(new_size, int(old.numel()))
        fresh = _cuda_bytes(new_size)
        fresh[:keep].copy_(old[:keep])
        self._tensor = fresh

    def read(self, offset: int, nbytes: int) -> Bytes:
        if self._host is not None:
            return self._host.read(offset, nbytes)
        self._check_range(offset, nbytes)
        result: Bytes = self._tensor[offset : offset + nbytes].cpu().numpy()
        return result

    def write(self, offset: int, data: Bytes | bytes) -> None:
        if self._host is not None:
            self._host.write(offset, data)
            return
        import torch

        source = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data
        self._check_range(offset, source.size)
        self._tensor[offset : offset + source.size].copy_(torch.from_numpy(source.copy()))

    def close(self) -> None:
        if self._host is not None:
            self._host.close()
        self._tensor = None

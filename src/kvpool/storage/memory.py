"""The memory behind each cache level: host RAM or a disk file (`device_memory.DeviceMemory`
is the GPU level's).

Each pool of each level owns one `Memory` of `size` bytes that can be resized at run time:
- `HostMemory` reserves address space once (anonymous private mmap), so growing only moves the
  logical end and views stay valid; shrinking hands the resident pages past the cut back to the
  OS with madvise(MADV_DONTNEED). The reservation asks for transparent huge pages
  (MADV_HUGEPAGE, where the kernel offers them): a pool is touched and copied in large runs, and
  2 MiB pages make first touch, copies and that hand-back several times cheaper than 4 KiB ones.
- `DiskMemory` is an unlinked temporary file; growing reserves the disk blocks up front
  (posix_fallocate), so "disk full" surfaces at resize time, not in the middle of an eviction.

Where a GPU level exists, host levels are pinned (`HostMemory.pin`): registered with the CUDA
driver so copies to and from the GPU are asynchronous DMA. Registering page-locks, so a pinned
level is resident (committed, zero-filled) from the start rather than on touch. It is
registered in pieces of whole slots (`PIN_CHUNK`), so a resize registers or unregisters only the
pieces past the cut (after `drain`: no copy still uses them), and a copy never spans two.
"""

from __future__ import annotations

import contextlib
import errno
import math
import mmap
import os
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from kvpool.errors import ArgumentError, StorageError
from kvpool.validation import check_int, is_int

PAGE_SIZE = mmap.PAGESIZE
# Not exported by Python 3.11's mmap module; the value is the same on every Linux architecture.
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
HUGE_PAGE_SIZE = 2 << 20  # a transparent huge page on x86-64 and (4 KiB-page) arm64
PIN_CHUNK = 64 << 20  # host memory is registered with the CUDA driver in pieces about this big

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

    def readinto(self, offset: int, out: Bytes) -> None:
        """Fill the contiguous array `out` with the bytes at `offset`."""
        out[:] = self.read(offset, out.size)

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


def _no_copies() -> None:
    """A memory no GPU copy uses: nothing to wait for."""


class HostMemory(Memory):
    """Host RAM: one anonymous mapping reserved at `max_size`; pages become resident on touch
    (all registered ones at once, where it is pinned)."""

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
        self._pin_refused = False
        self._pieces = 0  # registered pieces, from the start
        self._pin_unit = 1
        self.drain: Callable[[], None] = _no_copies
        """Waits for the GPU copies that may still use this memory (set by the copier):
        called before a registered piece is unregistered, or the memory remapped or closed."""

    def _reserve(self, size: int) -> mmap.mmap:
        return _reserve(size)

    def _release(self, start: int, nbytes: int) -> None:
        """Hand the resident pages of [start, start + nbytes) back to the OS."""
        assert self._map is not None
        self._map.madvise(mmap.MADV_DONTNEED, start, nbytes)

    @property
    def pin_unit(self) -> int:
        """What a registered piece holds whole (a pool's slot size): no slot, and so no copy of
        whole slots, spans two registrations (a copy that did would be a pageable one)."""
        return self._pin_unit

    @pin_unit.setter
    def pin_unit(self, unit: int) -> None:
        if self._pieces:
            raise StorageError(errno.EBUSY, "the pin unit of registered memory cannot change")
        self._pin_unit = max(int(unit), 1)

    @property
    def pin_piece(self) -> int:
        """Bytes of one registered piece: whole pages and whole `pin_unit`s, about
        `PIN_CHUNK` (one unit where that is larger)."""
        unit = math.lcm(self._pin_unit, PAGE_SIZE)
        return max(1, PIN_CHUNK // unit) * unit

    @property
    def pinned(self) -> int:
        """Bytes registered with the CUDA driver, from the start: the pieces that cover the
        used range (the last one may reach past it), 0 where not pinned or refused."""
        return min(self._pieces * self.pin_piece, self._max_size)

    def pin(self) -> bool:
        """Page-lock the used range for the GPU (and keep it so across resizes, piece by
        piece). False, with one log line, where the driver refuses: the memory works, pageable."""
        self._wants_pin = True
        self._pin_to(self._size)
        return self.pinned >= self._size

    def _pin_to(self, size: int) -> None:
        """Register pieces until [0, size) is covered (where pinning is wanted and works)."""
        from kvpool.storage import device

        if not self._wants_pin or self._pin_refused or self._map is None:
            return
        piece, base = self.pin_piece, self.array.ctypes.data
        while self._pieces * piece < size:
            start = self._pieces * piece
            if not device.pin(base + start, min(piece, self._max_size - start)):
                self._pin_refused = True  # (no retry per resize: the driver said why once)
                return
            self._pieces += 1

    def _unpin_past(self, size: int) -> None:
        """Unregister the pieces wholly past `size`, once no copy uses them."""
        from kvpool.storage import device

        piece = self.pin_piece
        keep = -(-size // piece)
        if self._pieces <= keep:
            return
        self.drain()
        base = self.array.ctypes.data
        while self._pieces > keep:
            self._pieces -= 1
            device.unpin(base + self._pieces * piece)

    @property
    def size(self) -> int:
        return self._size

    @property
    def max_size(self) -> int:
        return self._max_size

    def resize(self, new_size: int) -> None:
        """Move the logical end. Within the reservation addresses stay; growing past it maps a
        larger reservation and copies the contents (addresses change: re-fetch views). Pinned,
        only the pieces past the cut are unregistered (a shrink) or registered (a growth)."""
        _check_size("new_size", new_size)
        if self._map is None:
            raise StorageError(errno.EBADF, "the host memory is closed")
        try:
            if new_size > self._max_size:
                self._unpin_past(0)  # (after the copies: the contents move)
                self._remap(new_size)
            elif new_size < self._size:
                self._unpin_past(new_size)
                # Registered pages stay resident: handing them back would leave the GPU's
                # mapping on the old pages while the CPU faults in new ones.
                start = max(-(-new_size // PAGE_SIZE) * PAGE_SIZE, self.pinned)
                end = min(-(-self._size // PAGE_SIZE) * PAGE_SIZE, self._max_size)
                if start < end:
                    self._release(start, end - start)
            self._size = new_size
        finally:
            self._pin_to(self._size)

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

    def readinto(self, offset: int, out: Bytes) -> None:
        self._check_range(offset, out.size)
        out[:] = self.array[offset : offset + out.size]

    def write(self, offset: int, data: Bytes | bytes) -> None:
        source = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data
        self._check_range(offset, source.size)
        self.array[offset : offset + source.size] = source

    def close(self) -> None:
        if self._map is None:
            return
        self._unpin_past(0)
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
        """Fill the contiguous array `out` from the file at `offset` (one `preadv` where the
        range is one extent of the file: a page read where it lies)."""
        nbytes = out.size
        if not self._one_extent(offset, nbytes):
            self.readv(offset, [out])
            return
        self._require_open()
        self._check_range(offset, nbytes)
        try:
            got = os.preadv(self._fd, [out.data], self.file_offset(offset))
        except OSError as error:
            raise self._io_error("read", offset, nbytes, error) from error
        if got < nbytes:  # (a short read: the general path goes on from there)
            self.readv(offset + got, [out[got:]])

    def _one_extent(self, offset: int, nbytes: int) -> bool:
        """Whether bytes [offset, offset + nbytes) lie side by side in the file."""
        return True

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

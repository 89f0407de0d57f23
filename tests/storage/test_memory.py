"""Memories: host (mmap), disk (unlinked file), device (CUDA or host fallback)."""

import ctypes
import ctypes.util
import errno
import mmap
import os
import subprocess
import sys

import numpy as np
import pytest

from kvpool.errors import ArgumentError, StorageError
from kvpool.storage import DeviceMemory, DiskMemory, HostMemory
from kvpool.storage.device_memory import cuda_available
from kvpool.storage.memory import HUGE_PAGE_SIZE

MiB = 1 << 20


def smaps_fields(array):
    """The /proc/self/smaps fields of the mapping holding `array`'s first byte (an entry can
    hold neighbouring mappings with the same flags too)."""
    start = array.ctypes.data
    fields = {}
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            first, *rest = line.split()
            if "-" in first and ":" not in first:
                if fields:
                    break
                low, high = (int(bound, 16) for bound in first.split("-"))
                inside = low <= start < high
            elif inside:
                fields[first.rstrip(":")] = rest
    assert fields, "mapping not found in /proc/self/smaps"
    return fields


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def resident_bytes(array):
    """Resident bytes of the memory under `array` (page-aligned), page by page (mincore): the
    mapping's smaps total would count a neighbouring mapping merged into the same entry."""
    pages = -(-array.nbytes // mmap.PAGESIZE)
    residency = ctypes.create_string_buffer(pages)
    if _libc.mincore(ctypes.c_void_p(array.ctypes.data), array.nbytes, residency) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return int((np.frombuffer(residency.raw, dtype=np.uint8) & 1).sum()) * mmap.PAGESIZE


def transparent_huge_pages():
    """The kernel's THP mode ('always', 'madvise', 'never'), None without THP."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as mode:
            return mode.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def test_host_memory_keeps_data_below_the_cut_and_views_stay_valid():
    memory = HostMemory(8 * MiB, max_size=32 * MiB)
    view = memory.array
    address = view.ctypes.data
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, 8 * MiB, dtype=np.uint8)
    view[: 8 * MiB] = data
    memory.resize(3 * MiB + 123)
    assert memory.size == 3 * MiB + 123
    assert np.array_equal(memory.read(0, 3 * MiB + 123), data[: 3 * MiB + 123])
    memory.resize(32 * MiB)
    assert memory.array is view and memory.array.ctypes.data == address
    assert np.array_equal(view[: 3 * MiB + 123], data[: 3 * MiB + 123])
    # Whole pages past the cut were handed back: they read as zeros now.
    assert not view[4 * MiB : 8 * MiB].any()
    memory.close()


def test_host_memory_grows_past_its_reservation_keeping_data():
    memory = HostMemory(MiB, max_size=2 * MiB)
    memory.write(MiB - 5, b"kept!")
    memory.resize(8 * MiB)
    assert memory.max_size == 8 * MiB and memory.size == 8 * MiB
    assert memory.read(MiB - 5, 5).tobytes() == b"kept!"
    memory.write(8 * MiB - 3, b"end")
    memory.close()


def test_host_memory_shrink_returns_resident_memory():
    memory = HostMemory(64 * MiB)
    assert resident_bytes(memory.array) < MiB  # reserved, not touched
    memory.array[:] = 7
    assert resident_bytes(memory.array) >= 63 * MiB
    memory.resize(16 * MiB)
    resident = resident_bytes(memory.array)
    assert 15 * MiB <= resident <= 17 * MiB
    assert (memory.array[: 16 * MiB] == 7).all()
    memory.resize(0)
    assert resident_bytes(memory.array) < MiB
    memory.close()


@pytest.mark.skipif(
    transparent_huge_pages() not in ("always", "madvise"), reason="no transparent huge pages"
)
def test_host_memory_asks_for_huge_pages_and_still_hands_memory_back():
    memory = HostMemory(32 * MiB)
    assert "hg" in smaps_fields(memory.array)["VmFlags"]  # MADV_HUGEPAGE on the reservation
    memory.array[:] = 3
    memory.resize(9 * MiB + 5)  # a cut inside a huge page: the kernel splits it (or may not)
    assert 9 * MiB <= resident_bytes(memory.array) <= 9 * MiB + HUGE_PAGE_SIZE + mmap.PAGESIZE
    assert (memory.array[: 9 * MiB + 5] == 3).all()
    memory.resize(32 * MiB)
    assert not memory.array[11 * MiB :].any()  # handed back, reads as zeros
    small = HostMemory(MiB)  # under one huge page: left to the kernel's default
    assert "hg" not in smaps_fields(small.array)["VmFlags"]
    small.close()
    memory.close()


@pytest.mark.parametrize("kernel", ["refuses the advice", "python without it"])
def test_host_memory_works_where_huge_pages_cannot_be_asked_for(monkeypatch, kernel):
    if kernel == "refuses the advice":  # madvise fails with EINVAL, as a kernel without THP does
        monkeypatch.setattr(mmap, "MADV_HUGEPAGE", 0x7FFF, raising=False)
    else:
        monkeypatch.delattr(mmap, "MADV_HUGEPAGE", raising=False)
    memory = HostMemory(4 * MiB)
    assert "hg" not in smaps_fields(memory.array)["VmFlags"]
    memory.write(3 * MiB, b"still here")
    memory.resize(3 * MiB + 10)
    assert memory.read(3 * MiB, 10).tobytes() == b"still here"
    memory.close()


def test_host_memory_rejects_bad_sizes_and_ranges():
    with pytest.raises(ArgumentError, match="size=-1 is invalid"):
        HostMemory(-1)
    memory = HostMemory(MiB, max_size=2 * MiB)
    with pytest.raises(ArgumentError, match="new_size=-1 is invalid"):
        memory.resize(-1)
    assert memory.size == MiB
    with pytest.raises(ArgumentError, match=r"offset=1048570, nbytes=10 is invalid"):
        memory.write(MiB - 6, bytes(10))
    memory.close()
    memory.close()  # idempotent


def test_disk_memory_round_trip_and_the_file_is_unlinked(tmp_path):
    memory = DiskMemory(tmp_path, 4 * MiB)
    assert list(tmp_path.iterdir()) == []  # O_TMPFILE (or mkstemp + unlink): no name on disk
    assert os.fstat(memory.fileno).st_size == 4 * MiB
    rng = np.random.default_rng(2)
    blocks = {
        offset: rng.integers(0, 256, 4096, dtype=np.uint8) for offset in (0, 8192, 4 * MiB - 4096)
    }
    for offset, data in blocks.items():
        memory.write(offset, data)
    for offset, data in blocks.items():
        assert np.array_equal(memory.read(offset, 4096), data)
    memory.resize(MiB)
    assert os.fstat(memory.fileno).st_size == MiB
    memory.resize(2 * MiB)
    stat = os.fstat(memory.fileno)  # grown by exactly the difference, reserved (not sparse)
    assert stat.st_size == 2 * MiB and stat.st_blocks * 512 >= 2 * MiB
    assert np.array_equal(memory.read(8192, 4096), blocks[8192])
    assert not memory.read(MiB, 4096).any()
    with pytest.raises(ArgumentError, match="must lie in"):
        memory.read(2 * MiB - 10, 4096)
    memory.close()
    with pytest.raises(StorageError, match="closed"):
        memory.read(0, 16)


def test_disk_memory_falls_back_to_mkstemp_without_o_tmpfile(tmp_path, monkeypatch):
    real_open = os.open

    def no_tmpfile(path, flags, *args):
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            raise OSError(errno.EOPNOTSUPP, "not supported")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_tmpfile)
    memory = DiskMemory(tmp_path, MiB)
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []
    memory.write(100, b"kvpool")
    assert memory.read(100, 6).tobytes() == b"kvpool"
    memory.close()


def test_disk_write_error_is_clear_and_keeps_previous_contents(tmp_path, monkeypatch):
    memory = DiskMemory(tmp_path, MiB)
    memory.write(0, b"A" * 4096)
    memory.write(4096, b"B" * 4096)

    def failing_pwritev(fd, buffers, offset):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "pwritev", failing_pwritev)
    with pytest.raises(
        StorageError, match=r"disk level write of 4096 bytes at offset 8192 .* Input/output error"
    ) as caught:
        memory.write(8192, b"C" * 4096)
    assert caught.value.errno == errno.EIO
    monkeypatch.undo()
    assert memory.read(0, 4096).tobytes() == b"A" * 4096
    assert memory.read(4096, 4096).tobytes() == b"B" * 4096
    memory.write(8192, b"C" * 4096)  # still usable
    assert memory.read(8192, 4096).tobytes() == b"C" * 4096
    memory.close()


def test_disk_vector_io_retries_short_transfers(tmp_path, monkeypatch):
    memory = DiskMemory(tmp_path, MiB)
    real_pwritev, real_preadv = os.pwritev, os.preadv
    calls = []

    def short(real):
        def call(fd, buffers, offset):  # transfers at most 1000 bytes, of the first buffer only
            calls.append(sum(len(b) for b in buffers))
            return real(fd, [buffers[0][:1000]], offset)

        return call

    monkeypatch.setattr(os, "pwritev", short(real_pwritev))
    parts = [np.full(1500, 1, np.uint8), np.full(2596, 2, np.uint8)]
    memory.writev(0, parts)
    assert calls == [4096, 3096, 2596, 1596, 596]
    calls.clear()
    monkeypatch.setattr(os, "preadv", short(real_preadv))
    out = [np.empty(2000, np.uint8), np.empty(2096, np.uint8)]
    memory.readv(0, out)
    monkeypatch.undo()
    assert calls == [4096, 3096, 2096, 1096, 96]
    assert np.array_equal(np.concatenate(out), np.concatenate(parts))
    calls.clear()
    monkeypatch.setattr(os, "preadv", short(real_preadv))
    whole = np.empty(4096, np.uint8)
    memory.readinto(0, whole)  # (one extent: one call, then the rest as readv does it)
    monkeypatch.undo()
    assert calls == [4096, 3096, 2096, 1096, 96]
    assert np.array_equal(whole, np.concatenate(parts))
    memory.close()


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 256 KiB tmpfs, when this machine lets us mount one (root)."""
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount_point)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=True)


def test_disk_full_is_a_clear_error_and_nothing_changes(tiny_tmpfs):
    memory = DiskMemory(tiny_tmpfs, 128 * 1024)
    memory.write(0, b"K" * 128 * 1024)
    with pytest.raises(
        StorageError, match=r"cannot grow the disk level .* No space left on device"
    ) as caught:
        memory.resize(4 * MiB)
    assert caught.value.errno == errno.ENOSPC
    assert memory.size == 128 * 1024
    assert os.fstat(memory.fileno).st_size == 128 * 1024
    assert memory.read(0, 128 * 1024).tobytes() == b"K" * 128 * 1024
    with pytest.raises(StorageError, match="No space left on device"):
        DiskMemory(tiny_tmpfs, MiB)
    memory.close()


@pytest.mark.skipif(cuda_available(), reason="checks the host fallback")
def test_device_memory_without_cuda_is_host_memory():
    memory = DeviceMemory(MiB, max_size=4 * MiB)
    assert not memory.is_cuda
    assert "no CUDA" in memory.kind
    assert isinstance(memory.host, HostMemory)
    with pytest.raises(StorageError, match="host memory"):
        memory.tensor  # noqa: B018
    memory.write(10, b"device")
    memory.resize(4 * MiB)
    assert memory.read(10, 6).tobytes() == b"device"
    memory.close()


@pytest.mark.skipif(not cuda_available(), reason="needs torch with a CUDA device")
def test_device_memory_on_cuda():
    memory = DeviceMemory(MiB)
    assert memory.is_cuda and memory.tensor.is_cuda
    memory.write(10, b"device")
    memory.resize(4 * MiB)
    assert memory.size == 4 * MiB
    assert memory.read(10, 6).tobytes() == b"device"
    memory.resize(16)
    assert memory.read(10, 6).tobytes() == b"device"
    memory.close()


# -- shared host memory (a level other processes map: the vLLM connector's workers) -----------


def test_shared_memory_is_seen_and_written_by_another_process(tmp_path):
    from kvpool.storage.shared import SharedHostMemory

    memory = SharedHostMemory(tmp_path / "pool", 2 * MiB, 4 * MiB)
    memory.write(MiB, bytes(range(256)) * 4)
    script = (
        "import sys; from kvpool.storage.shared import map_shared\n"
        "a = map_shared(sys.argv[1])\n"
        "assert a.size == 4 << 20, a.size\n"
        "assert bytes(a[(1 << 20) : (1 << 20) + 4]) == bytes([0, 1, 2, 3])\n"
        "a[5] = 77\n"
    )
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "pool")], check=True)
    assert memory.read(5, 1)[0] == 77  # the other process's write, through the mapping
    memory.resize(4 * MiB)  # within the reservation: addresses stay
    assert memory.read(MiB, 4).tolist() == [0, 1, 2, 3]
    memory.resize(MiB // 2)  # the file's pages past the cut go back (MADV_REMOVE)
    assert memory.read(5, 1)[0] == 77
    memory.close()
    assert not (tmp_path / "pool").exists()


def test_shared_memory_refuses_to_grow_past_its_file_and_keeps_its_data(tmp_path):
    from kvpool.storage.shared import SharedHostMemory

    memory = SharedHostMemory(tmp_path / "pool", MiB, MiB)
    memory.write(0, b"kept")
    with pytest.raises(StorageError, match="cannot grow past") as error:
        memory.resize(2 * MiB)
    assert error.value.errno == errno.EFBIG
    assert memory.size == MiB and bytes(memory.read(0, 4)) == b"kept"
    memory.close()


def test_shared_memory_in_a_missing_directory_is_a_clear_error(tmp_path):
    from kvpool.storage.shared import SharedHostMemory

    with pytest.raises(StorageError, match="cannot create shared memory file"):
        SharedHostMemory(tmp_path / "missing" / "pool", MiB)


def test_shared_memory_without_room_is_a_clear_error_up_front_not_a_crash_later(
    tmp_path, monkeypatch
):
    from kvpool.storage import shared
    from kvpool.storage.shared import SharedHostMemory

    def full(fd, offset, length):  # a RAM file system with no room left
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    real = os.posix_fallocate
    monkeypatch.setattr(shared.os, "posix_fallocate", full)
    with pytest.raises(StorageError, match=r"cannot give 2097152 bytes .* bytes free") as error:
        SharedHostMemory(tmp_path / "pool", 2 * MiB)
    assert error.value.errno == errno.ENOSPC
    assert not (tmp_path / "pool").exists()  # nothing left behind

    monkeypatch.setattr(shared.os, "posix_fallocate", real)
    memory = SharedHostMemory(tmp_path / "pool", MiB, 4 * MiB)
    memory.write(0, b"kept")
    monkeypatch.setattr(shared.os, "posix_fallocate", full)
    with pytest.raises(StorageError, match="cannot give 1048576 bytes"):
        memory.resize(2 * MiB)  # growing needs the file's memory first: refused, unchanged
    assert memory.size == MiB and bytes(memory.read(0, 4)) == b"kept"
    monkeypatch.setattr(shared.os, "posix_fallocate", real)
    memory.resize(2 * MiB)
    assert os.stat(tmp_path / "pool").st_blocks * 512 >= 2 * MiB  # allocated, not sparse
    memory.close()

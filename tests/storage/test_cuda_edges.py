"""What surrounds the CUDA event protocol (issue 44), on the CPU under `tests/fake_cuda.py`:
slots larger than a staging buffer, a refused pin's pending error, host resizes and remaps
while copies run, the GPU level's own resizes, reads and writes, shutdown, index tensors, the
GPU temporaries of a large copy, and the route of disk pages onto the GPU. Each test names the
finding it covers."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvpool import (  # noqa: E402
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManager,
)
from kvpool.storage import (  # noqa: E402
    DeviceMemory,
    DiskMemory,
    HostMemory,
    PoolGroup,
    cuda_copies,
    device,
)
from kvpool.storage import memory as memory_module  # noqa: E402
from kvpool.storage.copier import Copier  # noqa: E402
from tests import fake_cuda  # noqa: E402
from tests.engine_check import CheckingEngine  # noqa: E402
from tests.helpers import MiB, make_config, record_layer, shutdown  # noqa: E402
from tests.storage.test_device_order import LAYERS, TPB, round_trip  # noqa: E402

KiB = 1 << 10
SLOT = 64 * KiB  # LAYERS' slot: 2 layers x K, V x 16 KiB


@pytest.fixture
def cuda(monkeypatch):
    monkeypatch.setattr(device, "_pin_refused", [])
    return fake_cuda.install(monkeypatch)


def first(log, test):
    return next((i for i, entry in enumerate(log) if test(entry)), None)


def gpu_host(host=4 * MiB, disk=0, tmp_path=None, layers=LAYERS, gpu=2 * MiB):
    tiers = [GpuCacheTierConfig(gpu)]
    if host:
        tiers.append(HostCacheTierConfig(host))
    if disk:
        tiers.append(DiskCacheTierConfig(disk, str(tmp_path)))
    return KVCacheManager(make_config(layers, tiers, TPB))


# -- 1. slots larger than a staging buffer ------------------------------------------------------


def test_1_a_slot_larger_than_a_staging_buffer_round_trips_through_the_disk(
    cuda, monkeypatch, tmp_path
):
    monkeypatch.setattr(cuda_copies, "STAGING_BYTES", 1 * MiB)
    layers = [record_layer(i, TPB, repeats=1536) for i in range(2)]  # 384 KiB buffers
    m = gpu_host(host=0, disk=48 * MiB, tmp_path=tmp_path, layers=layers, gpu=12 * MiB)
    assert m._storage.state.levels[0].pool_groups[0].slot_sizes == (3 * 512 * KiB,)  # 1.5 MiB
    round_trip(m, CheckingEngine(m), blocks=4, pushers=3)  # to the disk and back, checked
    assert m.num_moved_pages[1] >= 4 and m.num_moved_pages[0] >= 4
    staging = m._storage.state.copier._staging
    assert staging.nbytes >= 3 * 512 * KiB  # made again at the slot's size
    shutdown(m)


SIZES = [
    64 * KiB - 4096,
    64 * KiB - 16,
    64 * KiB,
    64 * KiB + 16,
    64 * KiB + 4096,
    2 * 64 * KiB + 48,
    3 * 64 * KiB - 16,
    5000,
]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("other", ["disk", "pageable host"])
def test_1_staged_copies_of_slots_around_the_buffer_size_keep_every_byte(
    cuda, monkeypatch, tmp_path, size, other
):
    """A fuzz of slot sizes around a 64 KiB staging buffer, both directions."""
    monkeypatch.setattr(cuda_copies, "STAGING_BYTES", 64 * KiB)
    rng = random.Random(size)
    count = 12

    def group(kind):
        make = {
            "gpu": lambda pool, nbytes: DeviceMemory(nbytes),
            "disk": lambda pool, nbytes: DiskMemory(tmp_path, nbytes),
            "pageable host": lambda pool, nbytes: HostMemory(nbytes),
        }[kind]
        return PoolGroup([size], count, make)

    gpu, middle, back = group("gpu"), group(other), group("gpu")
    gpu.memories[0].tensor.copy_(torch.randint(0, 256, (count * size,), dtype=torch.uint8))
    copier = Copier()
    out = list(zip(rng.sample(range(count), 9), rng.sample(range(count), 9), strict=True))
    copier.copy(gpu, middle, out).check()
    home = list(zip([d for _, d in out], rng.sample(range(count), 9), strict=True))
    event = copier.copy(middle, back, home)
    event.check()
    event.wait()
    source = gpu.memories[0].tensor.view(count, size)
    landed = back.memories[0].tensor.view(count, size)
    through = {d: s for s, d in out}
    for m_slot, b_slot in home:
        assert torch.equal(landed[b_slot], source[through[m_slot]]), (size, m_slot, b_slot)
    assert cuda.ops("transfer") and {entry[3] for entry in cuda.ops("transfer")} == {"pinned"}
    copier.close()
    for g in (gpu, middle, back):
        g.close()


# -- 2. a refused pin leaves a pending CUDA error -----------------------------------------------


def test_2_a_refused_pin_clears_its_pending_error_and_the_memory_works(cuda, caplog):
    cuda.refuse_pinning = True
    with caplog.at_level(logging.WARNING, logger="kvpool.storage"):
        m = gpu_host()
        second = gpu_host()
    assert caplog.text.count("could not be pinned") == 1
    assert cuda.ops("register") and not cuda.pending  # (cleared in the thread that met it)
    assert cuda.ops("get last error")
    round_trip(m, CheckingEngine(m))  # the first copy's launch does not report a stale error
    assert m.num_moved_pages[1] > 0
    shutdown(m)
    shutdown(second)


def test_2_a_failed_unregister_is_logged_and_its_error_cleared(cuda, caplog):
    m = gpu_host()
    round_trip(m, CheckingEngine(m))
    cuda.refuse_unregistering = True
    with caplog.at_level(logging.WARNING, logger="kvpool.storage"):
        shutdown(m)
    assert "cudaHostUnregister" in caplog.text and "returned 1" in caplog.text
    assert not cuda.pending


def test_2_the_cuda_runtime_is_found_among_the_loaded_libraries(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f10 r-xp 00000000 08:01 12 /usr/lib/libc.so.6\n"
        "7f20-7f30 r-xp 00000000 08:01 13 /opt/nvidia/cu13/lib/libcudart.so.13\n"
        "7f40-7f50 rw-p 00000000 00:00 0 \n"
    )
    assert device.loaded_library("libcudart.so", str(maps)) == (
        "/opt/nvidia/cu13/lib/libcudart.so.13"
    )
    assert device.loaded_library("libcuda.so.1", str(maps)) is None
    assert device.loaded_library("libcudart.so", str(tmp_path / "none")) is None


# -- 3. host resizes and remaps while copies run ------------------------------------------------


def test_3_a_host_shrink_drains_the_copies_then_unregisters_only_the_pieces_past_the_cut(
    cuda, monkeypatch
):
    monkeypatch.setattr(memory_module, "PIN_CHUNK", 256 * KiB)  # 4 slots a piece: 16 pieces
    m = gpu_host(host=4 * MiB)
    (host,) = m._storage.state.levels[1].pool_groups[0].memories
    assert host.pin_piece == 256 * KiB and len(cuda.registered) == 16
    round_trip(m, CheckingEngine(m))  # copies into and out of the host level
    cuda.log.clear()
    assert m.resize(1, 2 * MiB)
    unregistered = [i for i, e in enumerate(cuda.log) if e[0] == "unregister"]
    drained = first(cuda.log, lambda e: e[0] == "stream synchronize" and e[1].startswith("copy"))
    assert len(unregistered) == 8 and not cuda.ops("register")  # not the whole level again
    assert drained is not None and drained < unregistered[0]
    assert host.pinned == host.size == 2 * MiB
    cuda.log.clear()
    assert m.resize(1, 4 * MiB)  # growing registers the new pieces only, with nothing to wait for
    assert len(cuda.ops("register")) == 8 and not cuda.ops("unregister", "stream synchronize")
    round_trip(m, CheckingEngine(m))
    shutdown(m)
    assert cuda.registered == {}


def test_3_a_pinned_host_memory_waits_for_the_copies_before_it_moves_or_goes(cuda):
    memory = HostMemory(MiB)
    memory.drain = lambda: cuda.log.append(("drain",))
    assert memory.pin() and memory.pinned >= memory.size
    data = np.arange(MiB, dtype=np.uint64).astype(np.uint8)
    memory.write(0, data)
    cuda.log.clear()
    memory.resize(3 * MiB)  # past the reservation: remapped, its bytes copied
    kinds = [entry[0] for entry in cuda.log]
    assert kinds.index("drain") < kinds.index("unregister") < kinds.index("register")
    assert np.array_equal(memory.read(0, MiB), data) and memory.pinned >= 3 * MiB
    cuda.log.clear()
    memory.close()
    kinds = [entry[0] for entry in cuda.log]
    assert kinds.index("drain") < kinds.index("unregister") and cuda.registered == {}


def test_3_a_shrink_hands_back_only_pages_no_longer_registered(cuda, monkeypatch):
    monkeypatch.setattr(memory_module, "PIN_CHUNK", 256 * KiB)
    memory = HostMemory(4 * MiB)
    memory.pin_unit = SLOT
    assert memory.pin()
    released = []
    real = memory._release
    monkeypatch.setattr(memory, "_release", lambda a, n: (released.append(a), real(a, n)))
    memory.resize(MiB + 100 * KiB)
    assert released == [memory.pinned] == [5 * 256 * KiB]  # past the registered pieces only
    base = memory.array.ctypes.data
    assert sorted((a - base, n) for a, n in cuda.registered.items()) == [
        (i * 256 * KiB, 256 * KiB) for i in range(5)
    ]
    memory.close()


# -- 4. the GPU level's resize, read and write ---------------------------------------------------


def test_4_the_gpu_levels_resize_read_and_write_run_on_the_copy_stream(cuda):
    m = gpu_host(gpu=4 * MiB)
    order = m._storage.state.copier.order
    (gpu,) = m._storage.state.levels[0].pool_groups[0].memories
    assert gpu.order is order
    round_trip(m, CheckingEngine(m), blocks=20, pushers=4)
    copy = order.copy_stream.name

    def issued(entries):
        """The entries of one copy: the copy stream waits for an event recorded on the
        engine's stream, launches on the copy stream, and the engine waits for it."""
        records = {e[2]: e[1] for e in entries if e[0] == "record"}
        waits = [e for e in entries if e[0] == "wait"]
        assert waits[0][1] == copy and records[waits[0][2]] == "engine", entries
        assert waits[-1][1] == "engine" and records[waits[-1][2]] == copy, entries
        assert any(e[:2] == ("launch", copy) for e in entries), entries

    cuda.log.clear()
    old = gpu.tensor
    assert m.resize(0, 2 * MiB)  # the GPU level shrinks: a reallocation and a device copy
    issued(cuda.log)
    assert ("launch", copy, "copy_", 2 * MiB) in cuda.log  # (what is kept, on the copy stream)
    assert ("record_stream", copy, old.numel()) in cuda.log
    assert ("record_stream", "engine", old.numel()) in cuda.log
    cuda.log.clear()
    gpu.write(SLOT, np.full(100, 7, np.uint8))
    issued(cuda.log)
    assert cuda.ops("pin_memory")
    cuda.log.clear()
    assert (gpu.read(SLOT, 100) == 7).all()
    issued(cuda.log)
    shutdown(m)


# -- 5. shutdown drains the copy stream ----------------------------------------------------------


def test_5_shutdown_drains_the_copy_stream_before_freeing_anything(cuda, tmp_path):
    m = gpu_host(host=2 * MiB, disk=8 * MiB, tmp_path=tmp_path)
    round_trip(m, CheckingEngine(m), blocks=20, pushers=4)  # host and disk, staging buffers
    assert m.num_moved_pages[2] > 0 and m._storage.state.copier._staging.buffers
    cuda.log.clear()
    shutdown(m)
    drained = first(cuda.log, lambda e: e[0] == "stream synchronize" and e[1].startswith("copy"))
    freed = first(cuda.log, lambda e: e[0] in ("unregister", "record_stream"))
    assert drained is not None and freed is not None and drained < freed
    assert cuda.registered == {}


# -- 6. index tensors from pinned memory, without blocking ---------------------------------------


SCATTERED = [2 * i + 1 for i in range(40)]
HOST_RUNS = list(range(20)) + list(range(50, 70))


def scattered_copy(direction, size=256):
    gpu, other_gpu = DeviceMemory(96 * size), DeviceMemory(96 * size)
    host = HostMemory(96 * size)
    host.pin()
    source, destination, pairs = {
        "to-gpu": (host, gpu, list(zip(HOST_RUNS, SCATTERED, strict=True))),
        "from-gpu": (gpu, host, list(zip(SCATTERED, HOST_RUNS, strict=True))),
        "within-gpu": (gpu, other_gpu, list(zip(SCATTERED, HOST_RUNS, strict=True))),
    }[direction]
    src = cuda_copies._tensor(source).view(-1, size)
    src.copy_(torch.randint(0, 256, src.shape, dtype=torch.uint8))  # (on the "engine" stream)
    order = device.DeviceOrder()
    order.issue(order.mark(), cuda_copies.batch(source, destination, size, pairs))
    dst = cuda_copies._tensor(destination).view(-1, size)
    for s, d in pairs:
        assert torch.equal(dst[d], src[s]), (s, d)


@pytest.mark.parametrize("direction", ["to-gpu", "from-gpu", "within-gpu"])
def test_6_index_tensors_go_from_pinned_memory_without_blocking(cuda, direction):
    scattered_copy(direction)
    sent = cuda.ops("to")
    assert sent and all(entry[2:] == ("non-blocking", "pinned") for entry in sent), sent


# -- 7. bounded GPU temporaries -------------------------------------------------------------------


@pytest.mark.parametrize("direction", ["to-gpu", "from-gpu", "within-gpu"])
def test_7_a_large_scattered_copy_keeps_its_gpu_temporaries_bounded(cuda, monkeypatch, direction):
    monkeypatch.setattr(cuda_copies, "GATHER_BYTES", 4 * 256)  # 4 rows a temporary
    scattered_copy(direction)
    gathers = [e for e in cuda.ops("launch") if e[2] in ("index_select", "index_copy_")]
    assert len(gathers) >= 40 // 4  # in chunks ...
    assert max(e[3] for e in gathers) <= 4 * 256  # ... of at most GATHER_BYTES each


# -- 8. disk pages reach the GPU through the pinned buffers -------------------------------------


@pytest.mark.parametrize("host", [0, 2 * MiB])
def test_8_disk_pages_reach_the_gpu_through_the_pinned_buffers(cuda, tmp_path, host):
    m = gpu_host(host=host, disk=8 * MiB, tmp_path=tmp_path)
    round_trip(m, CheckingEngine(m), blocks=20, pushers=4)
    assert m.num_moved_pages[len(m.num_moved_pages) - 1] > 0  # pages went to the disk
    transfers = cuda.ops("transfer")
    assert {"to-gpu", "to-host"} <= {entry[2] for entry in transfers}
    pageable = [entry for entry in transfers if entry[3] != "pinned"]
    assert not pageable, f"{len(pageable)} of {len(transfers)} transfers from pageable memory"
    staging = m._storage.state.copier._staging
    assert staging.pinnable and staging.buffers
    shutdown(m)

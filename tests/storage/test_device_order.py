"""The CUDA paths on the CPU (issue 34), under a recording torch.cuda (`tests/fake_cuda.py`): the
GPU level is a CPU tensor, so every copy's bytes are real and checked, while the streams and
events record the order kvpool uses them in. Checked: a copy waits for the engine's work queued
before the call and the engine's stream waits for the copy, with no device-wide or per-call
synchronization; the host waits on a copy's own event only before the CPU touches its bytes;
scattered slots go in few launches; host levels are pinned (and follow resizes) or fall back with
one log line; a disk and the GPU exchange pages through two pinned buffers in turn (the fuzzer
also with buffers smaller than a slot). `test_cuda_edges.py` has what surrounds this protocol."""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")

from kvpool import (  # noqa: E402
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManager,
    LogicError,
)
from kvpool.storage import cuda_copies, device  # noqa: E402
from tests import fake_cuda  # noqa: E402
from tests.engine_check import CheckingEngine  # noqa: E402
from tests.fuzz.fuzzer import fuzz  # noqa: E402
from tests.helpers import MiB, make_config, record_layer, shutdown  # noqa: E402

TPB = 16
LAYERS = [record_layer(i, TPB, repeats=64) for i in range(2)]  # 64 KiB pages: 32 per 2 MiB


@pytest.fixture
def cuda(monkeypatch):
    monkeypatch.setattr(device, "_pin_refused", [])
    return fake_cuda.install(monkeypatch)


def prompt(n, blocks):
    return [n * 10_000 + i for i in range(blocks * TPB)]


def run(m, engine, tokens, keep=False):
    cache = m.create_kv_cache(None, tokens[:-1])
    assert cache.resume()
    assert engine.step(cache, tokens, tokens[cache.num_committed_tokens :])
    engine.check(cache, tokens)
    if keep:
        return cache
    cache.close()
    return None


def round_trip(m, engine, blocks=10, pushers=4):
    """A held request's pages pushed off the GPU by other requests, then resumed; its bytes are
    checked where they came back."""
    tokens = prompt(1, blocks)
    held = run(m, engine, tokens, keep=True)
    held.suspend()
    for n in range(2, 2 + pushers):
        run(m, engine, prompt(n, blocks))
    assert held.resume()
    engine.check(held, tokens)
    held.close()


def copies(log):
    """Each copy's entries, from the copy stream's wait to the engine's wait for it."""
    found, current = [], None
    for entry in log:
        if entry[0] == "wait" and entry[1].startswith("copy"):
            current = [entry]
        elif current is not None:
            current.append(entry)
            if entry[0] == "wait" and entry[1] == "engine":
                found.append(current)
                current = None
    return found


def test_copies_wait_for_the_engines_work_and_the_engine_waits_for_them(cuda):
    m = KVCacheManager(
        make_config(LAYERS, [GpuCacheTierConfig(2 * MiB), HostCacheTierConfig(4 * MiB)], TPB)
    )
    assert m.on_device
    round_trip(m, CheckingEngine(m))  # to the host and back
    assert m.num_moved_pages[1] > 0 and m.num_moved_pages[0] > 0
    log = cuda.log
    issued = copies(log)
    assert issued, "no copy went through the copy stream"
    records = {entry[2]: entry[1] for entry in log if entry[0] == "record"}
    for entries in issued:
        waited_for = entries[0][2]
        # The copy stream waits for an event the engine's stream recorded at the call ...
        assert records[waited_for] == "engine", entries
        # ... the copies are launched on the copy stream ...
        assert ("enter", entries[0][1]) in entries
        assert any(e[:2] == ("launch", entries[0][1]) for e in entries), entries
        done = entries[-1][2]
        # ... and the engine's stream waits for the event the copy stream recorded after it.
        assert records[done] == entries[0][1] and entries[-1][:2] == ("wait", "engine")
    assert not cuda.ops("device synchronize", "stream synchronize")
    shutdown(m)


def test_the_host_waits_for_a_copy_only_before_the_cpu_touches_its_bytes(cuda):
    tiers = [
        GpuCacheTierConfig(2 * MiB),
        HostCacheTierConfig(2 * MiB),
        DiskCacheTierConfig(8 * MiB, "."),
    ]
    m = KVCacheManager(make_config(LAYERS, tiers, TPB))
    engine = CheckingEngine(m)
    requests = [prompt(n, 10) for n in range(12)]  # GPU -> host -> disk
    for tokens in requests:
        run(m, engine, tokens)
    assert m.num_moved_pages[2] > 0
    # Pages copied GPU -> host were then copied host -> disk by the CPU: it waited for those
    # copies' events (never the device). GPU slots a copy read were handed to requests without
    # a wait (the engine's stream waits for the copy).
    waited = {entry[1] for entry in cuda.ops("event synchronize")}
    out_of_gpu = [entries[-1][2] for entries in copies(cuda.log)]
    assert waited and waited <= set(out_of_gpu)
    assert len(waited) < len(out_of_gpu)  # not every copy: only those the CPU read after
    # Reading a page's bytes on the CPU waits for the copy that wrote them.
    cache = m.create_kv_cache(None, requests[-1][:-1])
    assert cache.resume()
    engine.check(cache, requests[-1])
    cache.close()
    assert not cuda.ops("device synchronize", "stream synchronize")
    shutdown(m)


@pytest.mark.parametrize("direction", ["to-gpu", "from-gpu", "within-gpu"])
def test_scattered_slots_move_in_few_launches(cuda, direction):
    from kvpool.storage import DeviceMemory, HostMemory

    size = 256
    gpu, other_gpu, host = DeviceMemory(96 * size), DeviceMemory(96 * size), HostMemory(96 * size)
    # 40 pages between every other slot of the GPU and two runs of the host: 40 pieces.
    scattered = [2 * i + 1 for i in range(40)]
    host_runs = list(range(20)) + list(range(50, 70))
    source, destination, pairs = {
        "to-gpu": (host, gpu, list(zip(host_runs, scattered, strict=True))),
        "from-gpu": (gpu, host, list(zip(scattered, host_runs, strict=True))),
        "within-gpu": (gpu, other_gpu, list(zip(scattered, host_runs, strict=True))),
    }[direction]
    src = cuda_copies._tensor(source).view(-1, size)
    src.copy_(torch.randint(0, 256, src.shape, dtype=torch.uint8))  # (on the "engine" stream)
    order = device.DeviceOrder()
    order.issue(order.mark(), cuda_copies.batch(source, destination, size, pairs))
    dst = cuda_copies._tensor(destination).view(-1, size)
    for s, d in pairs:
        assert torch.equal(dst[d], src[s]), (s, d)
    launches = [entry[2] for entry in cuda.ops("launch")]
    # One gather/scatter on the device and one transfer per run consecutive on the host side
    # (two runs), not one per page.
    assert {"index_select", "index_copy_"} & set(launches), launches
    assert len(launches) <= 3, launches


def test_host_levels_are_pinned_and_stay_pinned_across_resizes(cuda):
    tiers = [GpuCacheTierConfig(2 * MiB), HostCacheTierConfig(4 * MiB)]
    m = KVCacheManager(make_config(LAYERS, tiers, TPB))
    host_memories = [
        mem for group in m._storage.state.levels[1].pool_groups for mem in group.memories
    ]

    def pinned_pieces():
        """Every used byte registered, in whole pieces of whole slots, the last one at most
        reaching a piece past the used range; the driver's record the same."""
        for mem in host_memories:
            assert mem.size <= mem.pinned < mem.size + mem.pin_piece
            assert mem.pin_piece % (64 * 1024) == 0
        assert sum(cuda.registered.values()) == sum(mem.pinned for mem in host_memories)

    pinned_pieces()
    assert m.resize(1, 2 * MiB)  # a smaller host level: still pinned at its new size
    pinned_pieces()
    shutdown(m)
    assert cuda.registered == {}  # unpinned before the memory went


def test_a_driver_that_refuses_pinning_is_logged_once_and_the_memory_works(cuda, caplog):
    cuda.refuse_pinning = True
    tiers = [GpuCacheTierConfig(2 * MiB), HostCacheTierConfig(4 * MiB)]
    with caplog.at_level(logging.WARNING, logger="kvpool.storage"):
        m = KVCacheManager(make_config(LAYERS, tiers, TPB))
        second = KVCacheManager(make_config(LAYERS, tiers, TPB))
    assert caplog.text.count("could not be pinned") == 1
    round_trip(m, CheckingEngine(m))  # (pageable memory: the same bytes)
    shutdown(m)
    shutdown(second)


def test_a_disk_and_the_gpu_exchange_pages_through_two_pinned_buffers_in_turn(
    cuda, monkeypatch, tmp_path
):
    monkeypatch.setattr(cuda_copies, "STAGING_BYTES", 4 * 64 * 1024)  # 4 pages a buffer
    tiers = [GpuCacheTierConfig(2 * MiB), DiskCacheTierConfig(8 * MiB, str(tmp_path))]
    m = KVCacheManager(make_config(LAYERS, tiers, TPB))
    round_trip(m, CheckingEngine(m), blocks=20, pushers=3)  # to the disk and back
    assert m.num_moved_pages[1] >= 20 and m.num_moved_pages[0] >= 20
    staging = m._storage.state.copier._staging
    assert len(staging.buffers) == 2 and all(buffer.pinned for buffer in staging.buffers)
    issued = copies(cuda.log)
    assert len(issued) >= 2 * (20 // 4)  # chunks of 4 pages each way
    # Each buffer's previous transfer was waited for (on its event) before the buffer's reuse.
    assert len(cuda.ops("event synchronize")) >= 20 // 4
    shutdown(m)


def test_the_engine_may_name_its_stream(cuda):
    m = KVCacheManager(
        make_config(LAYERS, [GpuCacheTierConfig(2 * MiB), HostCacheTierConfig(4 * MiB)], TPB)
    )
    mine = fake_cuda.FakeStream(cuda, "mine")
    m.set_engine_stream(mine)
    round_trip(m, CheckingEngine(m))
    waits = [entry for entry in cuda.log if entry[0] == "wait" and not entry[1].startswith("copy")]
    assert waits and all(entry[1] == "mine" for entry in waits)
    shutdown(m)


def test_naming_a_stream_without_a_cuda_level_is_refused():
    m = KVCacheManager(make_config(LAYERS, [GpuCacheTierConfig(2 * MiB)], TPB))
    assert not m.on_device
    with pytest.raises(LogicError, match="no CUDA device"):
        m.set_engine_stream(object())
    shutdown(m)


SMALL_STAGING = {"gpu-host-disk": 48 * 1024, "hybrid": 24 * 1024, "tight": 48 * 1024}
"""Staging buffers smaller than every slot of the layout (64 KiB; 32 and 64 KiB in hybrid)."""


@pytest.mark.parametrize(
    ("layout", "small_staging"),
    [
        ("gpu-host", False),
        ("gpu-host-disk", False),
        ("gpu-host-disk", True),
        ("hybrid", True),
        ("tight", False),
        ("tight", True),
    ],
)
def test_the_fuzzer_passes_through_the_device_paths(cuda, monkeypatch, layout, small_staging):
    if small_staging:
        monkeypatch.setattr(cuda_copies, "STAGING_BYTES", SMALL_STAGING[layout])
    drains, fits = [], []
    real_drain, real_fit = device.DeviceOrder.drain, cuda_copies.StagingBuffers.fit
    monkeypatch.setattr(
        device.DeviceOrder, "drain", lambda order: (drains.append(1), real_drain(order))[1]
    )
    monkeypatch.setattr(
        cuda_copies.StagingBuffers,
        "fit",
        lambda buffers, size: (fits.append((buffers.nbytes, size)), real_fit(buffers, size))[1],
    )
    stats = fuzz(layout, 2, 1000)
    assert stats["pages moved between levels"] > 0 and stats["records checked"] > 50_000
    assert len(cuda.ops("launch")) > 0
    # The host waits for the whole copy stream only where memory goes (a resize, the close).
    assert not cuda.ops("device synchronize")
    assert len(cuda.ops("stream synchronize")) == len(drains) > 0
    transfers = cuda.ops("transfer")  # (never from pageable memory)
    assert transfers and all(entry[3] == "pinned" for entry in transfers)
    if layout != "gpu-host":  # disk pages went through the staging buffers ...
        assert fits
    if small_staging:  # ... made again at a slot's size when it was larger
        assert any(size > nbytes for nbytes, size in fits)

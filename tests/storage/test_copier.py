"""Batched slot copies: coalescing, every route between host and disk, errors."""

import errno
import os
import threading

import numpy as np
import pytest

from kvpool.config import CacheTier
from kvpool.errors import StorageError
from kvpool.storage import copier as copier_module
from kvpool.storage.copier import Copier, contiguous, runs
from kvpool.storage.pools import LevelStorage

SLOTS = [(256, 64)]  # one pool group with two pools


def level(tier, tmp_path=None):
    return LevelStorage(tier, 1 << 20, SLOTS, [1.0], [1], granularity=4096, disk_path=tmp_path)


def fill(group, slot_ids, seed):
    for pool, memory in enumerate(group.memories):
        size = group.slot_sizes[pool]
        for slot in slot_ids:
            memory.write(slot * size, np.full(size, (seed + slot * 3 + pool) % 251, np.uint8))


def check(source, destination, pairs, seed):
    for pool, memory in enumerate(destination.memories):
        size = destination.slot_sizes[pool]
        for src, dst in pairs:
            expected = np.full(size, (seed + src * 3 + pool) % 251, np.uint8)
            assert np.array_equal(memory.read(dst * size, size), expected), (pool, src, dst)


def test_runs_and_contiguous_pieces():
    pairs = [(7, 20), (0, 10), (1, 11), (2, 12), (5, 13), (6, 14)]
    assert runs(pairs) == [[(0, 10), (1, 11), (2, 12)], [(5, 13), (6, 14), (7, 20)]]
    by_destination = runs(pairs, by_destination=True)
    assert by_destination == [[(0, 10), (1, 11), (2, 12), (5, 13), (6, 14)], [(7, 20)]]
    assert contiguous(by_destination[0], 0) == [(0, 10, 3), (5, 13, 2)]


PAIRS = [(7, 20), (0, 10), (1, 11), (2, 12), (5, 13), (6, 14)]


@pytest.mark.parametrize("inline_bytes", [0, 1 << 20])  # in worker threads; in the caller's
@pytest.mark.parametrize(
    ("src_tier", "dst_tier"),
    [("host", "host"), ("host", "disk"), ("disk", "host"), ("disk", "disk")],
)
def test_every_route_copies_the_bytes(tmp_path, src_tier, dst_tier, inline_bytes):
    tiers = {"host": CacheTier.HOST, "disk": CacheTier.DISK}
    source, destination = level(tiers[src_tier], tmp_path), level(tiers[dst_tier], tmp_path)
    fill(source.pool_groups[0], range(8), seed=5)
    copier = Copier(inline_bytes=inline_bytes)
    event = copier.copy(source.pool_groups[0], destination.pool_groups[0], PAIRS)
    assert event.wait() and event.is_set()
    event.check()
    check(source.pool_groups[0], destination.pool_groups[0], PAIRS, seed=5)
    copier.close()
    source.close()
    destination.close()


def test_host_to_disk_is_one_pwritev_per_destination_run(tmp_path, monkeypatch):
    source, destination = level(CacheTier.HOST), level(CacheTier.DISK, tmp_path)
    fill(source.pool_groups[0], range(8), seed=1)
    calls = []
    real = os.pwritev

    def counting(fd, buffers, offset):
        calls.append(len(buffers))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", counting)
    Copier().copy(source.pool_groups[0], destination.pool_groups[0], PAIRS).check()
    # Per pool: destination run 10..14 gathers 2 source pieces; run 20 is one piece.
    assert sorted(calls) == [1, 1, 2, 2]
    monkeypatch.undo()
    check(source.pool_groups[0], destination.pool_groups[0], PAIRS, seed=1)


def test_disk_to_host_is_one_preadv_per_source_run(tmp_path, monkeypatch):
    source, destination = level(CacheTier.DISK, tmp_path), level(CacheTier.HOST)
    fill(source.pool_groups[0], range(8), seed=2)
    calls = []
    real = os.preadv

    def counting(fd, buffers, offset):
        calls.append(len(buffers))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", counting)
    Copier().copy(source.pool_groups[0], destination.pool_groups[0], PAIRS).check()
    # Per pool: source runs 0..2 (one piece) and 5..7 (destinations 13, 14 then 20: 2 pieces).
    assert sorted(calls) == [1, 1, 2, 2]
    monkeypatch.undo()
    check(source.pool_groups[0], destination.pool_groups[0], PAIRS, seed=2)


@pytest.mark.parametrize("inline_bytes", [0, 1 << 20])
def test_a_failed_copy_raises_on_check(tmp_path, monkeypatch, inline_bytes):
    source, destination = level(CacheTier.HOST), level(CacheTier.DISK, tmp_path)

    def failing(fd, buffers, offset):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "pwritev", failing)
    copier = Copier(inline_bytes=inline_bytes)
    event = copier.copy(source.pool_groups[0], destination.pool_groups[0], PAIRS)
    assert event.wait()  # waiting never raises
    with pytest.raises(StorageError, match="Input/output error") as caught:
        event.check()
    assert caught.value.errno == errno.EIO


def test_small_copies_run_in_the_callers_thread_large_ones_in_workers(monkeypatch):
    source, destination = level(CacheTier.HOST), level(CacheTier.HOST)
    threads = []
    real = copier_module._copy_pool

    def recording(*args):
        threads.append(threading.current_thread())
        real(*args)

    monkeypatch.setattr(copier_module, "_copy_pool", recording)
    copier = Copier(inline_bytes=len(PAIRS) * sum(SLOTS[0]))  # exactly this batch
    copier.copy(source.pool_groups[0], destination.pool_groups[0], PAIRS).check()
    assert threads == [threading.current_thread()] * 2  # both pools, here
    threads.clear()
    copier.copy(source.pool_groups[0], destination.pool_groups[0], [*PAIRS, (3, 30)]).check()
    assert len(threads) == 2 and threading.current_thread() not in threads
    copier.close()


def test_a_large_host_copy_is_split_among_the_threads(monkeypatch):
    source, destination = level(CacheTier.HOST), level(CacheTier.HOST)
    monkeypatch.setattr(copier_module.os, "cpu_count", lambda: 4)
    pairs = [(slot, 200 - slot) for slot in range(40)]  # destinations descending
    fill(source.pool_groups[0], range(40), seed=7)
    parts = []
    real = copier_module._copy_pool

    def recording(source_memory, destination_memory, size, part):
        parts.append((size, list(part)))
        real(source_memory, destination_memory, size, part)

    monkeypatch.setattr(copier_module, "_copy_pool", recording)
    # Pool 0 (256-byte slots) moves 10,240 bytes: 5 parts' worth, as many as 4 threads take;
    # pool 1 (64-byte slots) moves 2,560: one part.
    copier = Copier(inline_bytes=0, split_bytes=2048)
    copier.copy(source.pool_groups[0], destination.pool_groups[0], pairs).check()
    assert sorted((size, part[0][0], len(part)) for size, part in parts) == [
        (64, 0, 40),
        (256, 0, 10),
        (256, 10, 10),
        (256, 20, 10),
        (256, 30, 10),
    ]
    check(source.pool_groups[0], destination.pool_groups[0], pairs, seed=7)

    def failing_part(source_memory, destination_memory, size, part):
        if part[0][0] == 20:
            raise OSError(errno.EIO, "injected")
        real(source_memory, destination_memory, size, part)

    monkeypatch.setattr(copier_module, "_copy_pool", failing_part)
    with pytest.raises(StorageError, match="injected"):
        copier.copy(source.pool_groups[0], destination.pool_groups[0], pairs).check()
    copier.close()
    source.close()
    destination.close()

"""Regression tests for the defects of issue 12: KV survives every failed operation, priority
changes go through the eviction queue, and a failure leaves the state as before (or as
documented)."""

import errno
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import kvpool
from kvpool import (
    AttentionLayerConfig,
    BufferConfig,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    KVCacheStatus,
    LogicError,
    StorageError,
)
from kvpool.errors import ArgumentError, CorruptedError
from tests.engine_check import CheckingEngine
from tests.faults import DiskFaults, state_of
from tests.helpers import MiB, make_config, record_layer, shutdown

TPB = 16
# One pool group of 64 KiB slots: 32 per 2 MiB.
LAYERS = [record_layer(i, TPB, repeats=64) for i in range(2)]


def three_levels(tmp_path, gpu=2, host=2, disk=4):
    return [
        GpuCacheTierConfig(gpu * MiB),
        HostCacheTierConfig(host * MiB),
        DiskCacheTierConfig(disk * MiB, str(tmp_path)),
    ]


@pytest.fixture
def make(tmp_path):
    managers = []

    def build(tiers=None, layers=LAYERS, **kwargs):
        m = KVCacheManager(
            make_config(
                layers=layers,
                tokens_per_block=TPB,
                tiers=tiers if tiers is not None else three_levels(tmp_path),
                **kwargs,
            )
        )
        managers.append(m)
        return m, CheckingEngine(m)

    yield build
    for m in managers:
        shutdown(m)


def suspended_request(m, engine, tokens):
    cache = m.create_kv_cache()
    assert cache.resume() and engine.step(cache, tokens, tokens)
    cache.suspend()
    return cache


def fill_with_held(m, engine, start=100_000):
    """Suspended requests until every slot of every level holds a held page; returns them."""
    held = []
    for blocks in (8, 1):  # big requests first, then one block at a time to fill every slot
        while True:
            tokens = [start + len(held) * 1000 + t for t in range(blocks * TPB)]
            cache = m.create_kv_cache()
            if not cache.resume() or not engine.step(cache, tokens, tokens):
                cache.close()
                break
            cache.suspend()
            held.append((cache, tokens))
    return held


def check_all(m, engine, requests):
    m.check_invariants()
    for cache, tokens in requests:
        if cache.status is not KVCacheStatus.CLOSED:
            engine.check_anywhere(cache, tokens)


# -- 1. priority changes of queued pages -------------------------------------------------------


@pytest.mark.parametrize("finish", ["close", "stop_committing"])
def test_priority_of_a_queued_page_changes_through_its_queue(finish):
    m = KVCacheManager(
        KVCacheManagerConfig(
            4,
            [GpuCacheTierConfig(2 << 20), HostCacheTierConfig(2 << 20)],
            [AttentionLayerConfig(0, [BufferConfig("k", 16384), BufferConfig("v", 16384)])],
        )
    )
    c = m.create_kv_cache(priority_callback=lambda ordinal, group: 50)
    c.resume()
    c.resize(6)
    c.commit([1, 2, 3, 4, 5, 6])
    c.suspend()  # held pages on the GPU level of two: queued (they may move down)
    getattr(c, finish)()
    m.check_invariants()  # the queue's buckets match the pages' priorities
    priorities = sorted(page.priority for page in m._storage.state.queues[0][0])
    assert priorities == [50, 50]
    c.close()
    m.clear_reusable_blocks()  # KeyError: 50 before the fix
    assert m.get_storage_statistics(0)[0].free == m.get_storage_statistics(0)[0].total
    m.shutdown()


def test_priority_set_on_a_queued_page_keeps_eviction_order_under_pressure(make, tmp_path):
    m, engine = make(tiers=three_levels(tmp_path)[:2])
    tokens = list(range(1, 5 * TPB + 7))
    cache = m.create_kv_cache(priority_callback=lambda ordinal, group: 90)
    assert cache.resume() and engine.step(cache, tokens, tokens)
    cache.suspend()
    cache.close()  # the partial tail gets priority 90 while queued
    for i in range(6):  # pressure: every page cycles through the queues
        filler = [10_000 * (i + 1) + t for t in range(20 * TPB)]
        c = m.create_kv_cache()
        assert c.resume() and engine.step(c, filler, filler)
        c.close()
        m.check_invariants()
    assert m.num_dropped_pages > 0


# -- 2. a failed write while putting staged pages back -----------------------------------------


def test_resume_survives_a_write_error_in_the_staging_path(make, monkeypatch):
    m, engine = make()
    base = list(range(1, 41))  # ends mid-block: resuming needs a private copy of the tail
    c = m.create_kv_cache()
    assert c.resume() and engine.step(c, base, base)
    c.close()
    request = m.create_kv_cache(None, base + [99])
    assert request.num_committed_tokens == 40
    held = fill_with_held(m, engine)
    assert {p.level for p in request.pages(0) if p is not None} == {2}
    faults = DiskFaults(m).install(monkeypatch)
    faults.fail("pwritev", errno.EIO)
    try:
        resumed = request.resume()
    except StorageError:
        resumed = False
    faults.disarm()
    assert request.status is (KVCacheStatus.ACTIVE if resumed else KVCacheStatus.SUSPENDED)
    check_all(m, engine, [(request, base), *held])
    # Whatever the first attempt did, the request resumes once there is room and its KV is intact.
    held[0][0].close()
    held[1][0].close()
    assert request.resume()
    engine.check(request, base)
    check_all(m, engine, held)


def test_resume_that_cannot_fit_does_no_io(make, monkeypatch):
    m, engine = make()
    base = list(range(1, 41))
    c = m.create_kv_cache()
    assert c.resume() and engine.step(c, base, base)
    c.close()
    request = m.create_kv_cache(None, base + [99])
    held = fill_with_held(m, engine)
    faults = DiskFaults(m).install(monkeypatch)
    before = state_of(m)
    assert not request.resume()  # no room for the private copy anywhere
    assert state_of(m) == before
    assert faults.calls["pwritev"] == faults.calls["preadv"] == 0
    check_all(m, engine, [(request, base), *held])


# -- 3. a failed relocation cancels the shrink --------------------------------------------------


def test_failed_relocation_read_cancels_the_shrink(make, tmp_path, monkeypatch):
    m, engine = make(
        tiers=[GpuCacheTierConfig(2 * MiB), DiskCacheTierConfig(4 * MiB, str(tmp_path))]
    )
    requests = []
    for i in range(6):  # 72 held pages: 32 on the GPU, 40 on the disk (slots 0-39)
        tokens = [i * 10_000 + t for t in range(12 * TPB)]
        requests.append((suspended_request(m, engine, tokens), tokens))
    requests.pop(0)[0].close()  # the oldest pages, lowest on disk: cached, droppable
    on_disk = [p.slot_id for c, _ in requests for p in c.pages(0) if p.level == 1]
    assert max(on_disk) >= 32  # a shrink to 32 slots must relocate these
    faults = DiskFaults(m).install(monkeypatch)
    faults.fail("preadv", errno.EIO)
    with pytest.raises(StorageError, match="Input/output error"):
        m.resize(1, 2 * MiB)
    assert faults.injected["preadv"] == 1
    faults.disarm()
    assert not m._storage.state.allocators[1][0].shrink_in_progress
    assert m.get_slot_counts(1) == [64] and m.get_quota(1) == 4 * MiB
    check_all(m, engine, requests)
    # The manager stays usable: the same shrink now works, every request resumes intact.
    assert m.resize(1, 2 * MiB)
    assert m.get_slot_counts(1) == [32]
    assert m._storage.state.num_relocated > 0
    check_all(m, engine, requests)
    for cache, tokens in requests:
        assert cache.resume()
        engine.check(cache, tokens)
        cache.suspend()


# -- 4. prefetch is best effort --------------------------------------------------------------


def test_prefetch_with_no_room_returns_false_instead_of_raising(make):
    m, engine = make()
    tokens = list(range(1, 6 * TPB + 1))
    request = suspended_request(m, engine, tokens)
    held = fill_with_held(m, engine)
    assert {p.level for p in request.pages(0)} == {2}
    before = state_of(m)
    assert request.prefetch(1) is False  # OutOfPagesError("cannot free 0 slots") before
    assert state_of(m) == before
    held[0][0].close()  # room on the GPU for a resume (it pushes held pages down)
    assert request.resume()
    engine.check(request, tokens)


def test_prefetch_moves_what_fits(make):
    m, engine = make()
    tokens = list(range(1, 6 * TPB + 1))
    request = suspended_request(m, engine, tokens)
    held = fill_with_held(m, engine)
    # Free a few host slots: close a held request with some pages there (they become cached,
    # and the full disk below makes them droppable).
    closing = next(
        (c, t) for c, t in held if 0 < sum(p.level == 1 for p in c.pages(0)) < len(tokens) // TPB
    )
    freed = sum(p.level == 1 for p in closing[0].pages(0))
    closing[0].close()
    held.remove(closing)
    assert request.prefetch(1) is False  # only `freed` of its six pages fit
    levels = [p.level for p in request.pages(0)]
    assert levels.count(1) == freed and levels.count(2) == 6 - freed
    check_all(m, engine, [(request, tokens), *held])


# -- 5. a failed grow keeps the quota -------------------------------------------------------------


def test_failed_disk_grow_keeps_quota_and_slots(make, monkeypatch):
    m, _ = make()
    faults = DiskFaults(m).install(monkeypatch)
    faults.fail("posix_fallocate", errno.ENOSPC)
    before = state_of(m)
    with pytest.raises(StorageError, match="No space left on device"):
        m.resize(2, 8 * MiB)
    assert faults.injected["posix_fallocate"] == 1
    assert state_of(m) == before
    assert m.get_quota(2) == 4 * MiB
    faults.disarm()
    assert m.resize(2, 8 * MiB) and m.get_slot_counts(2) == [128]


# -- 6. a bad priority callback changes nothing --------------------------------------------------


@pytest.mark.parametrize("result", [500, -1, "x", True, 2.5, "raise"])
def test_bad_priority_callback_fails_before_the_commit_changes_anything(make, result):
    m, engine = make()

    def callback(ordinal, group):
        if result == "raise":
            raise RuntimeError("callback failed")
        return result

    tokens = list(range(1, 2 * TPB + 1))
    cache = m.create_kv_cache(priority_callback=callback)
    assert cache.resume() and cache.resize(len(tokens))
    engine.write(cache, tokens, 0)
    before = state_of(m)
    expected = RuntimeError if result == "raise" else ArgumentError
    with pytest.raises(expected):
        cache.commit(tokens)
    assert state_of(m) == before
    assert cache.num_committed_tokens == 0
    cache._priority_callback = None
    cache.commit(tokens)  # LogicError before: committed 8, history 0
    assert cache.num_committed_tokens == 2 * TPB
    engine.check(cache, tokens)
    cache.close()


def test_bad_priority_callback_in_stop_committing_changes_nothing(make):
    m, engine = make()
    results = iter([10, 500])
    cache = m.create_kv_cache(priority_callback=lambda ordinal, group: next(results))
    tokens = list(range(1, TPB + 6))
    assert cache.resume() and engine.step(cache, tokens, tokens)
    before = state_of(m)
    with pytest.raises(ArgumentError, match=r"priority_callback\(1, 0\)=500"):
        cache.stop_committing()
    assert state_of(m) == before
    cache._priority_callback = None
    cache.close()
    assert m.probe_reuse(None, tokens) == len(tokens)


# -- 7. failed reads change nothing ----------------------------------------------------------


def test_failed_read_in_resume_changes_nothing(make, monkeypatch):
    m, engine = make()
    tokens = list(range(1, 6 * TPB + 1))
    request = suspended_request(m, engine, tokens)
    for i in range(4):  # cached traffic pushes the request's pages to disk, fills every level
        filler = [(i + 1) * 10_000 + t for t in range(30 * TPB)]
        c = m.create_kv_cache()
        assert c.resume() and engine.step(c, filler, filler)
        c.close()
    assert {p.level for p in request.pages(0)} == {2}
    assert m.get_storage_statistics(0)[0].free == 0
    faults = DiskFaults(m).install(monkeypatch)
    faults.fail("preadv", errno.EIO)
    before = state_of(m)
    with pytest.raises(StorageError, match=r"read .* Input/output error"):
        request.resume()
    assert faults.injected["preadv"] == 1
    assert state_of(m) == before  # no cached page moved down or dropped to make room
    faults.disarm()
    assert request.resume()
    engine.check(request, tokens)


def test_failed_read_in_prefetch_changes_nothing(make, monkeypatch):
    m, engine = make()
    tokens = list(range(1, 6 * TPB + 1))
    request = suspended_request(m, engine, tokens)
    for i in range(4):
        filler = [(i + 1) * 10_000 + t for t in range(30 * TPB)]
        c = m.create_kv_cache()
        assert c.resume() and engine.step(c, filler, filler)
        c.close()
    assert {p.level for p in request.pages(0)} == {2}
    faults = DiskFaults(m).install(monkeypatch)
    faults.fail("preadv", errno.EIO)
    before = state_of(m)
    with pytest.raises(StorageError):
        request.prefetch(1)
    assert faults.injected["preadv"] == 1
    assert state_of(m) == before
    faults.disarm()
    assert request.prefetch(1)
    check_all(m, engine, [(request, tokens)])


# -- 9. one validation rule per kind of argument ----------------------------------------------


def test_tokens_are_validated_in_an_empty_scope(make):
    m, _ = make()
    before = state_of(m)
    for bad in ([-1] * 8, [True] * 3, [1, 2, 2**31]):
        with pytest.raises(ArgumentError, match="token"):
            m.create_kv_cache(None, bad)
        with pytest.raises(ArgumentError, match="token"):
            m.probe_reuse(None, bad)
    assert state_of(m) == before


def test_bool_tokens_are_refused_in_commit(make):
    m, _ = make()
    cache = m.create_kv_cache()
    assert cache.resume() and cache.resize(20)
    for bad in ([True], [1, False, 3], [True] * 16):
        with pytest.raises(ArgumentError, match="token"):
            cache.commit(bad)
    assert cache.num_committed_tokens == 0
    cache.close()


def test_enable_partial_reuse_must_be_a_bool():
    with pytest.raises(ArgumentError, match="enable_partial_reuse='no' is invalid"):
        make_config(enable_partial_reuse="no").validate()


# -- 10. one thread at a time --------------------------------------------------------------------


def test_a_call_from_a_second_thread_is_refused_in_debug_mode(make):
    m, _ = make()
    cache = m.create_kv_cache()
    errors = []

    def other():
        try:
            m.create_kv_cache()
        except LogicError as error:
            errors.append(error)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert errors and "thread" in str(errors[0])
    assert m.num_open_kv_caches == 1
    m.transfer_to_current_thread()  # the same thread may take the manager over explicitly
    cache.close()


def test_debug_mode_checks_the_manager_after_a_requests_call(make):
    """With KVPOOL_DEBUG the checker runs after each call of a request too (each request reads
    the flag when made)."""
    m, _ = make()
    cache = m.create_kv_cache(None, [])
    assert cache.resume() and cache.resize(32)
    cache.commit(list(range(20)))
    page = cache.pages(0)[0]
    page.locks += 1  # a lock nobody holds
    with pytest.raises(CorruptedError):
        cache.resize(33)
    page.locks -= 1
    cache.close()


# -- 11. no torch at import or without a GPU -----------------------------------------------------


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="a GPU machine imports torch")
def test_import_and_a_gpu_level_without_cuda_do_not_import_torch():
    code = (
        "import sys, kvpool\n"
        "from kvpool import *\n"
        "m = KVCacheManager(KVCacheManagerConfig(16, [GpuCacheTierConfig(4 << 20)],"
        " [AttentionLayerConfig(0, [BufferConfig('k', 4096)])]))\n"
        "c = m.create_kv_cache(); c.resume(); c.resize(40); c.commit(list(range(40))); c.close()\n"
        "print('torch' in sys.modules)\n"
    )
    source = str(Path(kvpool.__file__).parents[1])  # this kvpool, installed or not
    env = {**os.environ, "PYTHONPATH": source}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.strip() == "False"

"""The fault matrix: an I/O error (EIO, ENOSPC) or an interrupt (Ctrl-C) injected at each disk
I/O point (write on eviction, read on resume and prefetch, relocation read and write on shrink,
fallocate on grow) during each operation that reaches it.

Every case asserts that the fault was injected (the path was reached), then that:
- the operation either raised `StorageError` naming the failed I/O (or the interrupt), or
  recovered by design (a state snapshot skipped), as the case says;
- the invariants hold, and every held or active request verifies byte for byte wherever its
  pages are; a request whose call failed is in the state it was in before the call;
- the manager stays usable: the same operation succeeds once the disk works again;
- no slot leaks: after closing everything and clearing the cache every slot is free.
"""

import errno
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from kvpool import (
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManager,
    KVCacheStatus,
    StorageError,
)
from tests.engine_check import CheckingEngine
from tests.faults import DiskFaults, state_of
from tests.helpers import MiB, make_config, record_layer, shutdown, ssm_layer

TPB = 16
LAYERS = [record_layer(i, TPB, repeats=64) for i in range(2)]  # 64 KiB slots: 32 per 2 MiB


@dataclass
class Scenario:
    """A manager in a state where `action` reaches the I/O point under test."""

    manager: KVCacheManager
    engine: CheckingEngine
    requests: list  # (cache, tokens) that must survive
    action: Callable[[], object]
    target: object = None  # the request the action is about (its state must not change)
    recovers: bool = False  # an I/O error is absorbed by design: the action succeeds


def build(tmp_path, gpu=2, host=2, disk=4, layers=LAYERS, **kwargs):
    tiers = [GpuCacheTierConfig(gpu * MiB)]
    if host:
        tiers.append(HostCacheTierConfig(host * MiB))
    tiers.append(DiskCacheTierConfig(disk * MiB, str(tmp_path)))
    m = KVCacheManager(make_config(layers=layers, tokens_per_block=TPB, tiers=tiers, **kwargs))
    return m, CheckingEngine(m)


def run_request(m, engine, tokens, close=True):
    cache = m.create_kv_cache(None, tokens)
    assert cache.resume()
    engine.check(cache, tokens)
    done = cache.history_length
    if done < len(tokens):
        assert engine.step(cache, tokens, tokens[done:])
    if close:
        cache.close()
        return None
    cache.suspend()
    return cache


def traffic(m, engine, start, blocks):
    run_request(m, engine, [start + t for t in range(blocks * TPB)])


def held_on_disk(m, engine):
    """A suspended request pushed to the disk by cached traffic that fills every level."""
    tokens = list(range(1, 6 * TPB + 1))
    cache = run_request(m, engine, tokens, close=False)
    for i in range(4):
        traffic(m, engine, (i + 1) * 100_000, 30)
    assert {p.level for p in cache.pages(0)} == {2}
    return cache, tokens


# -- scenarios: (name, the I/O call that fails, builder) -------------------------------------------


def resume_reads(tmp_path):
    m, engine = build(tmp_path)
    cache, tokens = held_on_disk(m, engine)
    return Scenario(m, engine, [(cache, tokens)], cache.resume, cache)


def resume_evicts(tmp_path):
    """Resuming pushes cached GPU pages to the host and the host's to the disk (writes)."""
    m, engine = build(tmp_path)
    cache, tokens = held_on_disk(m, engine)
    return Scenario(m, engine, [(cache, tokens)], cache.resume, cache)


def resume_swaps(tmp_path):
    """Every level full of held pages: resuming swaps pages with those it pushes down."""
    m, engine = build(tmp_path, gpu=2, host=2, disk=2)
    requests = []
    for i in range(4):  # 4 x 24 held pages: all 96 slots
        tokens = [i * 10_000 + t for t in range(24 * TPB)]
        requests.append((run_request(m, engine, tokens, close=False), tokens))
    cache, tokens = requests[0]
    assert {p.level for p in cache.pages(0)} == {2}
    return Scenario(m, engine, requests, cache.resume, cache)


def prefetch_reads(tmp_path):
    m, engine = build(tmp_path)
    cache, tokens = held_on_disk(m, engine)
    return Scenario(m, engine, [(cache, tokens)], lambda: cache.prefetch(1), cache)


def prefetch_evicts(tmp_path):
    """Prefetching to the host pushes the host's cached pages to the disk (writes)."""
    m, engine = build(tmp_path, disk=8)
    cache, tokens = held_on_disk(m, engine)
    traffic(m, engine, 900_000, 20)  # fresh cached pages on the host, free slots on the disk
    return Scenario(m, engine, [(cache, tokens)], lambda: cache.prefetch(1), cache)


def grow_evicts(tmp_path):
    """A request grows into a GPU full of cached pages: the cascade writes to the disk."""
    m, engine = build(tmp_path)
    for i in range(3):
        traffic(m, engine, (i + 1) * 100_000, 30)
    tokens = list(range(7, 7 + 20 * TPB))
    cache = m.create_kv_cache()
    assert cache.resume()
    return Scenario(m, engine, [], lambda: engine.step(cache, tokens, tokens), cache)


def shrink_relocates(tmp_path):
    """A disk shrink moves held pages out of the removed slot range (read, then write)."""
    m, engine = build(tmp_path, host=0)
    requests = []
    for i in range(6):  # 72 held pages: 32 on the GPU, 40 on the disk
        tokens = [i * 10_000 + t for t in range(12 * TPB)]
        requests.append((run_request(m, engine, tokens, close=False), tokens))
    requests.pop(0)[0].close()  # the lowest disk slots become cached (droppable) pages
    return Scenario(m, engine, requests, lambda: m.resize(1, 2 * MiB))


def shrink_evicts(tmp_path):
    """A host shrink pushes its held pages to the disk (writes)."""
    m, engine = build(tmp_path, host=4)
    requests = []
    for i in range(6):  # 72 held pages: 32 on the GPU, 40 on the host
        tokens = [i * 10_000 + t for t in range(12 * TPB)]
        requests.append((run_request(m, engine, tokens, close=False), tokens))
    assert sum(p.level == 1 for c, _ in requests for p in c.pages(0)) == 40
    return Scenario(m, engine, requests, lambda: m.resize(1, 2 * MiB))


def grow_disk(tmp_path):
    m, engine = build(tmp_path)
    cache, tokens = held_on_disk(m, engine)
    return Scenario(m, engine, [(cache, tokens)], lambda: m.resize(2, 8 * MiB))


def rebalance_disk(tmp_path):
    """Re-splitting the disk between two pool groups (attention, SSM): the attention group
    shrinks, relocating held pages (read, then write), and the SSM group grows (fallocate)."""
    layers = [record_layer(0, TPB, repeats=256), ssm_layer(1, size=256 * 1024)]
    m, engine = build(
        tmp_path, gpu=4, host=0, disk=16, layers=layers, initial_pool_ratio=[0.5, 0.5]
    )
    assert m.get_slot_counts(1) == [64, 32]  # 128 KiB and 256 KiB slots
    requests = []
    for i in range(9):  # 72 held attention pages: 16 on the GPU, 56 on the disk
        tokens = [i * 10_000 + t for t in range(8 * TPB)]
        requests.append((run_request(m, engine, tokens, close=False), tokens))
    for cache, _ in requests[:3]:  # the lowest disk slots become cached (droppable) pages
        cache.close()
    requests = requests[3:]
    return Scenario(m, engine, requests, lambda: m.adjust_cache_level(1, [0.4, 0.6]))


def snapshot_evicts(tmp_path):
    """An SSM layer's state snapshot at a block boundary needs a slot: making room writes to
    the disk. The snapshot is best effort: the commit succeeds without it."""
    layers = [record_layer(0, TPB, repeats=64), ssm_layer(1, size=256 * 1024)]
    m, engine = build(tmp_path, gpu=4, host=4, disk=8, layers=layers, initial_pool_ratio=[0.5, 0.5])
    assert [m.get_slot_counts(level)[1] for level in range(3)] == [8, 8, 16]
    for i in range(20):  # cached snapshots fill the SSM pool group on the GPU and the host
        traffic(m, engine, (i + 1) * 100_000, 2)
    tokens = list(range(5, 5 + 2 * TPB))
    cache = m.create_kv_cache()
    assert cache.resume() and cache.resize(len(tokens))
    engine.write(cache, tokens, 0)
    return Scenario(m, engine, [], lambda: cache.commit(tokens), cache, recovers=True)


CASES = [
    ("resume", "preadv", resume_reads),
    ("resume", "pwritev", resume_evicts),
    ("resume-swap", "pwritev", resume_swaps),
    ("resume-swap", "preadv", resume_swaps),
    ("prefetch", "preadv", prefetch_reads),
    ("prefetch", "pwritev", prefetch_evicts),
    ("resize-request", "pwritev", grow_evicts),
    ("shrink-disk", "preadv", shrink_relocates),
    ("shrink-disk", "pwritev", shrink_relocates),
    ("shrink-host", "pwritev", shrink_evicts),
    ("grow-disk", "posix_fallocate", grow_disk),
    ("rebalance-disk", "preadv", rebalance_disk),
    ("rebalance-disk", "posix_fallocate", rebalance_disk),
    ("commit-snapshot", "pwritev", snapshot_evicts),
]
CODES = {"EIO": errno.EIO, "ENOSPC": errno.ENOSPC, "interrupt": None}


@pytest.mark.parametrize("code", list(CODES))
@pytest.mark.parametrize(
    ("operation", "call", "scenario"), CASES, ids=[f"{o}-{c}" for o, c, _ in CASES]
)
def test_fault(tmp_path, monkeypatch, operation, call, scenario, code):
    s = scenario(tmp_path)
    m, engine = s.manager, s.engine
    try:
        faults = DiskFaults(m).install(monkeypatch)
        if code == "interrupt":  # Ctrl-C reaches the main thread: copy there
            monkeypatch.setattr(m._storage.state.copier, "_inline_bytes", 1 << 62)
        before = state_of(m)
        target = s.target
        target_before = before["caches"].get(target.id) if target is not None else None
        faults.fail(call, CODES[code])
        failed = None
        try:
            s.action()
        except (StorageError, KeyboardInterrupt) as error:
            failed = error
        assert faults.injected[call] == 1, f"{operation} never reached {call}"
        faults.disarm()
        if s.recovers and code != "interrupt":
            assert failed is None, f"{operation} should absorb the fault, raised {failed!r}"
        else:
            assert failed is not None, f"{operation} hid a failed {call}"
            if code == "interrupt":
                assert isinstance(failed, KeyboardInterrupt)
            else:
                message = str(failed)
                assert "Input/output error" in message or "No space left" in message, message
                assert "disk level" in message or "level" in message, message
        m.check_invariants()
        if target is not None and failed is not None:
            assert state_of(m)["caches"][target.id] == target_before  # the request as it was
        if call == "preadv" and failed is not None and operation in ("resume", "prefetch"):
            assert state_of(m) == before  # a failed read changes nothing at all
        for cache, tokens in s.requests:
            engine.check_anywhere(cache, tokens)
        # Usable: the operation works with a healthy disk, and every request resumes intact.
        if failed is not None:
            s.action()
            m.check_invariants()
        for cache, tokens in s.requests:
            if cache.status is KVCacheStatus.SUSPENDED:
                for other, _ in s.requests:
                    if other is not cache and other.status is KVCacheStatus.ACTIVE:
                        other.suspend()
                assert cache.resume()
            engine.check(cache, tokens)
        # No slot leaked.
        for cache in list(m._living.values()):
            cache.close()
        m.clear_reusable_blocks()
        for level in range(m.num_levels):
            for stats in m.get_storage_statistics(level):
                assert stats.free == stats.total, (level, stats)
    finally:
        shutdown(m)

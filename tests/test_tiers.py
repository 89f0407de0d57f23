"""Host and disk levels: cascading eviction, reuse from colder levels, suspend/resume under
pressure, the resume gate, quota resize, prefetch and I/O faults, all verified byte for byte."""

import errno
import os
import random

import numpy as np
import pytest

from kvpool import (
    ArgumentError,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManager,
    KVCacheStatus,
    LogicError,
    StorageError,
)
from kvpool.records import PageStatus
from tests.engine_check import CheckingEngine
from tests.helpers import MiB, close_open_caches, hybrid_layers, make_config, record_layer, shutdown

TPB = 16
# One pool group of 64 KiB slots (2 layers x K, V x 16 KiB): 32 slots per 2 MiB.
LAYERS = [record_layer(i, TPB, repeats=64) for i in range(2)]


def tiers(tmp_path, gpu=2, host=2, disk=4):
    result = [GpuCacheTierConfig(gpu * MiB)]
    if host:
        result.append(HostCacheTierConfig(host * MiB))
    if disk:
        result.append(DiskCacheTierConfig(disk * MiB, str(tmp_path)))
    return result


@pytest.fixture
def make(tmp_path):
    managers = []

    def build(layers=LAYERS, **kwargs):
        kwargs.setdefault("tiers", tiers(tmp_path))
        m = KVCacheManager(make_config(layers=layers, tokens_per_block=TPB, **kwargs))
        managers.append(m)
        return m, CheckingEngine(m)

    yield build
    for m in managers:
        shutdown(m)


def levels_of(m, tokens):
    """Level of each cached block page along the chain of `tokens` (full blocks)."""
    match = m._tree.match(
        __import__("kvpool.tokens", fromlist=["root_key"]).root_key(None), tokens, False
    )
    return [page.level for block in match.blocks for page in block if page is not None]


def write_and_close(m, engine, tokens):
    cache = m.create_kv_cache(None, tokens)
    reused = cache.num_committed_tokens
    assert cache.resume()
    engine.check(cache, tokens)
    if reused < len(tokens):
        assert engine.step(cache, tokens, tokens[reused:])
    engine.check(cache, tokens)
    cache.close()
    return reused


def fill(m, engine, seed, blocks):
    """Other traffic: a request of `blocks` blocks, written and closed (cached)."""
    tokens = [seed + i for i in range(blocks * TPB)]
    write_and_close(m, engine, tokens)


@pytest.mark.parametrize("with_host", [True, False], ids=["gpu-host-disk", "gpu-disk"])
def test_pages_travel_down_and_come_back_byte_for_byte(make, tmp_path, with_host):
    m, engine = make(tiers=tiers(tmp_path, host=2 if with_host else 0))
    prompt = list(range(1, 4 * TPB + 1))
    write_and_close(m, engine, prompt)
    assert levels_of(m, prompt) == [0] * 4
    fill(m, engine, 10_000, 32)  # GPU full: the prompt's pages move one level down
    assert levels_of(m, prompt) == [1] * 4
    if with_host:
        fill(m, engine, 20_000, 32)  # and again: host full, they reach the disk
        assert levels_of(m, prompt) == [2] * 4
    disk = m.num_levels - 1
    assert m._storage.state.num_moved[disk] >= 4
    assert m._storage.state.bytes_moved == [
        n * 64 * 1024 for n in m.num_moved_pages
    ]  # 64 KiB slots
    checked = engine.records_checked
    assert write_and_close(m, engine, prompt + [7]) == 4 * TPB  # reused from disk, verified
    assert engine.records_checked > checked
    assert m.num_dropped_pages == 0


@pytest.mark.parametrize("cold_copy_held", [False, True], ids=["droppable", "held"])
def test_committing_a_block_whose_tree_copy_is_cold(make, tmp_path, cold_copy_held):
    """Two requests with the same prompt, created before either committed, compute it both.
    When the second commits, the tree's copy is on the host: an unused copy is replaced by the
    second request's GPU page (and its host slot freed); one a suspended request holds stays."""
    m, engine = make()
    prompt = list(range(1, 4 * TPB + 1))
    first, second = m.create_kv_cache(None, prompt), m.create_kv_cache(None, prompt)
    assert second.num_committed_tokens == 0
    assert first.resume() and engine.step(first, prompt, prompt)
    first.close()
    fill(m, engine, 10_000, 32)  # the prompt's pages move down to the host
    assert levels_of(m, prompt) == [1] * 4
    holder = None
    if cold_copy_held:
        holder = m.create_kv_cache(None, prompt + [5])  # reuses (holds) the host copies
        assert holder.num_committed_tokens == 4 * TPB
    host_used = sum(s.total - s.free for s in m.get_storage_statistics(1))
    moved_to_host = m.num_moved_pages[1]
    assert second.resume() and engine.step(second, prompt, prompt)
    engine.check(second, prompt)
    host_used += m.num_moved_pages[1] - moved_to_host  # the filler's pages it pushed down
    host_after = sum(s.total - s.free for s in m.get_storage_statistics(1))
    if cold_copy_held:
        assert levels_of(m, prompt) == [1] * 4 and host_after == host_used
        engine.check_anywhere(holder, prompt)
        holder.close()
    else:
        assert levels_of(m, prompt) == [0] * 4 and host_after == host_used - 4
        assert [p.level for p in second.pages(0)] == [0] * 4
    second.close()
    assert write_and_close(m, engine, prompt + [9]) == 4 * TPB  # reused and verified
    m.check_invariants()


def test_last_level_drops_and_held_pages_are_never_dropped(make, tmp_path):
    m, engine = make(tiers=tiers(tmp_path, gpu=2, host=2, disk=0))  # 32 + 32 slots
    held_tokens = list(range(1, 10 * TPB + 1))
    held = m.create_kv_cache(None, held_tokens)
    assert held.resume() and engine.step(held, held_tokens, held_tokens)
    held.suspend()  # 10 held pages, evictable down to host but never dropped
    for i in range(6):
        fill(m, engine, 100_000 * (i + 1), 20)
    assert m.num_dropped_pages > 0
    assert {p.level for p in held.pages(0)} == {1}  # pushed to host, kept
    assert {p.status for p in held.pages(0)} == {PageStatus.HELD}
    assert held.resume()
    assert {p.status for p in held.pages(0)} == {PageStatus.LOCKED}
    engine.check(held, held_tokens)
    held.close()


def test_allocation_that_would_drop_a_held_page_fails_and_changes_nothing(make, tmp_path):
    m, engine = make(tiers=tiers(tmp_path, gpu=2, host=2, disk=0))
    requests = []
    for i in range(3):  # 3 x 20 held pages = 60 of the 64 slots
        tokens = [i * 1000 + t for t in range(20 * TPB)]
        cache = m.create_kv_cache()
        assert cache.resume() and engine.step(cache, tokens, tokens)
        cache.suspend()
        requests.append((cache, tokens))
    greedy = m.create_kv_cache()
    assert greedy.resume()
    before = [(s.free, s.evictable) for level in range(2) for s in m.get_storage_statistics(level)]
    assert not greedy.resize(10 * TPB)  # would need to drop held pages
    assert [
        (s.free, s.evictable) for level in range(2) for s in m.get_storage_statistics(level)
    ] == before
    assert greedy.resize(4 * TPB)
    greedy.close()
    for cache, tokens in requests:
        # Every level is nearly full of held pages: resuming swaps pages with those it pushes down.
        assert cache.resume()
        engine.check(cache, tokens)
        cache.suspend()
    assert m._storage.state.num_swapped > 0
    for cache, tokens in reversed(requests):
        assert cache.resume()
        engine.check(cache, tokens)
        cache.close()


def test_oldest_held_pages_move_where_room_below_and_cached_pages_go_instead(make, tmp_path):
    """The GPU's oldest evictable pages are a suspended request's (held); the host, the last
    level, is full of held pages but two slots. A request needing four GPU slots moves two held
    pages down and drops the two oldest cached pages behind them instead of failing."""
    m, engine = make(tiers=tiers(tmp_path, gpu=2, host=2, disk=0))  # 32 + 32 slots

    def written(first, blocks, suspend):
        tokens = [first + t for t in range(blocks * TPB)]
        cache = m.create_kv_cache()
        assert cache.resume() and engine.step(cache, tokens, tokens)
        if suspend:
            cache.suspend()
        return cache, tokens

    deep = written(0, 30, suspend=True)
    cached, cached_tokens = written(100_000, 28, suspend=False)  # pushes 26 of deep's down
    held = written(200_000, 4, suspend=True)  # and the other 4: the host has 2 free slots
    cached.close()  # 28 cached pages queue behind held's 4
    assert [p.level for p in deep[0].pages(0)] == [1] * 30
    dropped = m.num_dropped_pages
    newcomer = m.create_kv_cache()
    assert newcomer.resume() and newcomer.resize(4 * TPB)
    assert [p.level for p in held[0].pages(0)] == [1, 1, 0, 0]  # the oldest two moved down
    assert m.num_dropped_pages == dropped + 2
    assert m.probe_reuse(None, cached_tokens) == 26 * TPB  # its last two blocks (queued first)
    newcomer.close()
    for cache, tokens in (held, deep):
        engine.check_anywhere(cache, tokens)
        assert cache.resume()
        engine.check(cache, tokens)
        cache.close()


def test_suspend_resume_in_random_order_under_pressure(make, tmp_path):
    m, engine = make(tiers=tiers(tmp_path, gpu=2, host=2, disk=4))  # 32 + 32 + 64 slots
    rng = random.Random(7)
    requests = []
    for _ in range(24):
        tokens = [rng.randrange(1 << 30) for _ in range(rng.randrange(2, 7) * TPB)]
        requests.append({"tokens": tokens, "cache": m.create_kv_cache()})
    resumed = suspended = failed = 0
    for _ in range(1500):
        request = rng.choice(requests)
        cache, tokens = request["cache"], request["tokens"]
        if cache.status is KVCacheStatus.CLOSED:
            continue
        if cache.status is KVCacheStatus.SUSPENDED:
            if cache.resume():
                resumed += 1
                engine.check(cache, tokens)
            else:
                failed += 1
            continue
        if rng.random() < 0.3:
            cache.suspend()
            suspended += 1
            continue
        done = cache.history_length
        if done == len(tokens):
            engine.check(cache, tokens)
            cache.close()
            continue
        if not engine.step(cache, tokens, tokens[done : done + rng.randrange(1, 20)]):
            cache.suspend()
            suspended += 1
    assert resumed > 100 and suspended > 100, (resumed, suspended, failed)
    assert max(m._storage.state.num_moved) > 50
    for request in requests:
        cache = request["cache"]
        if cache.status is KVCacheStatus.SUSPENDED and cache.resume():
            engine.check(cache, request["tokens"])
        cache.close()


def test_resume_gate_is_per_pool_group_not_byte_weighted(make, tmp_path):
    # Group 0: window layers with 64 KiB slots (32 per 2 MiB); group 1: full attention with
    # 4 KiB slots. The GPU holds 2 MiB of each: the small group is mostly empty.
    layers = [record_layer(0, TPB, window=32, repeats=128), record_layer(1, TPB, repeats=8)]
    m, _ = make(
        layers=layers,
        tiers=tiers(tmp_path, gpu=4, host=4, disk=0),
        max_util_for_resume=0.9,
        initial_pool_ratio=[0.5, 0.5],
    )
    stats = m.get_storage_statistics(0)
    assert [s.total for s in stats] == [32, 512]
    waiting = m.create_kv_cache()
    runner = m.create_kv_cache()
    assert runner.resume()
    assert runner.resize(30 * TPB)  # 30 of 32 big slots locked: 94%
    stats = m.get_storage_statistics(0)
    used_bytes = sum(s.unavailable * sum(s.slot_sizes) for s in stats)
    total_bytes = sum(s.total * sum(s.slot_sizes) for s in stats)
    assert stats[0].unavailable / stats[0].total > 0.9 > used_bytes / total_bytes
    assert not waiting.resume()
    assert waiting.status is KVCacheStatus.SUSPENDED
    runner.close()
    assert waiting.resume()
    waiting.close()


def test_quota_resize_shrinks_and_expands_every_level_with_data(make, tmp_path):
    m, engine = make(tiers=tiers(tmp_path, gpu=4, host=4, disk=8))  # 64 + 64 + 128 slots
    rng = random.Random(3)
    caches = []
    for _ in range(6):
        tokens = [rng.randrange(1 << 30) for _ in range(8 * TPB)]
        cache = m.create_kv_cache()
        assert cache.resume() and engine.step(cache, tokens, tokens)
        cache.suspend()
        caches.append((cache, tokens))
    cached = [i * 7 for i in range(40 * TPB)]
    write_and_close(m, engine, cached)  # 40 cached blocks
    with pytest.raises(
        LogicError, match="resize\\(\\) needs every KV cache suspended; 1 are active"
    ):
        caches[0][0].resume()
        m.resize(0, 2 * MiB)
    caches[0][0].suspend()
    for level, small in ((0, 2 * MiB), (1, 2 * MiB), (2, 4 * MiB)):
        assert m.resize(level, small)
        assert m.get_quota(level) == small
        assert m.get_storage_statistics(level)[0].total == small // (64 * 1024)
    for level, big in ((0, 4 * MiB), (1, 4 * MiB), (2, 8 * MiB)):
        assert m.resize(level, big)
    for cache, tokens in caches:
        assert cache.resume()
        engine.check(cache, tokens)
        cache.suspend()
    # Prefetch: newer traffic pushes the suspended requests' pages to disk; prefetch brings
    # every disk page of one of them back to the host.
    fill(m, engine, 50_000, 60)
    fill(m, engine, 60_000, 60)
    for cache, tokens in caches:
        if any(p.level == 2 for p in cache.pages(0)):
            assert cache.prefetch(1)
            assert all(p.level <= 1 for p in cache.pages(0))
            assert cache.resume()
            engine.check(cache, tokens)
            cache.suspend()
            break
    else:
        pytest.fail("no request had pages on disk")
    reused = write_and_close(m, engine, cached + [1])
    assert reused >= 0


def test_quota_resize_that_cannot_hold_the_held_pages_changes_nothing(make, tmp_path):
    m, engine = make(tiers=tiers(tmp_path, gpu=2, host=4, disk=0))  # 32 + 64 slots
    for i in range(3):  # 72 held pages: at least 40 on the host, the last level
        tokens = [i * 10_000 + t for t in range(24 * TPB)]
        cache = m.create_kv_cache()
        assert cache.resume() and engine.step(cache, tokens, tokens)
        cache.suspend()
    before = [
        (s.total, s.free, s.evictable)
        for level in range(2)
        for s in m.get_storage_statistics(level)
    ]
    assert not m.resize(1, 2 * MiB)
    assert [
        (s.total, s.free, s.evictable)
        for level in range(2)
        for s in m.get_storage_statistics(level)
    ] == before
    assert m.get_quota(1) == 4 * MiB
    m.check_invariants()


def test_prefetch_only_for_suspended_requests(make):
    m, _ = make()
    cache = m.create_kv_cache()
    cache.resume()
    with pytest.raises(LogicError, match="prefetch\\(\\) on KV cache 0, which is active"):
        cache.prefetch(1)
    cache.suspend()
    with pytest.raises(Exception, match="level=5 is invalid"):
        cache.prefetch(5)
    assert cache.prefetch(0)


def disk_fd(m):
    return m._storage.state.levels[-1].pool_groups[0].memories[0].fileno


def fail_disk_reads(monkeypatch, m):
    """Every read of `m`'s disk level fails with EIO (a bad sector) until `monkeypatch.undo()`."""
    fd, real = disk_fd(m), os.preadv

    def bad_sector(file, buffers, offset):
        if file == fd:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(file, buffers, offset)

    monkeypatch.setattr(os, "preadv", bad_sector)


def test_failed_disk_write_leaves_the_page_on_host_and_reusable(make, tmp_path, monkeypatch):
    m, engine = make()
    prompt = list(range(1, 4 * TPB + 1))
    write_and_close(m, engine, prompt)
    fill(m, engine, 10_000, 32)
    assert levels_of(m, prompt) == [1] * 4  # on host
    fd, real = disk_fd(m), os.pwritev

    def full_disk(file, buffers, offset):
        if file == fd:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(file, buffers, offset)

    monkeypatch.setattr(os, "pwritev", full_disk)
    with pytest.raises(StorageError, match="No space left on device"):
        fill(m, engine, 20_000, 32)  # host must push to disk: fails
    monkeypatch.undo()
    close_open_caches(m)
    m.check_invariants()
    assert all(level in (0, 1) for level in levels_of(m, prompt))
    assert write_and_close(m, engine, prompt + [9]) == 4 * TPB  # verified
    disk = m.get_storage_statistics(2)[0]
    assert disk.free + disk.evictable == disk.total  # no slot leaked


def test_failed_disk_read_keeps_the_request_suspended_and_consistent(make, tmp_path, monkeypatch):
    m, engine = make()
    tokens = list(range(1, 6 * TPB + 1))
    cache = m.create_kv_cache()
    assert cache.resume() and engine.step(cache, tokens, tokens)
    cache.suspend()
    fill(m, engine, 10_000, 32)
    fill(m, engine, 20_000, 32)
    assert {p.level for p in cache.pages(0)} == {2}
    fail_disk_reads(monkeypatch, m)
    with pytest.raises(StorageError, match=r"disk level read .* Input/output error"):
        cache.resume()
    monkeypatch.undo()
    assert cache.status is KVCacheStatus.SUSPENDED
    m.check_invariants()
    assert cache.resume()
    engine.check(cache, tokens)
    cache.close()


def test_hybrid_model_across_three_levels(make, tmp_path):
    layers = hybrid_layers(TPB, num_layers=4, window=32, sinks=4, repeats=64)
    m, engine = make(layers=layers)
    rng = random.Random(11)
    prompts = [[rng.randrange(1 << 30) for _ in range(5 * TPB)] for _ in range(10)]
    for prompt in prompts:
        write_and_close(m, engine, prompt)
    hits = sum(write_and_close(m, engine, prompt + [1]) for prompt in prompts)
    assert hits > 0
    assert m._storage.state.num_moved[2] > 0


@pytest.mark.parametrize("with_host", [True, False], ids=["moved-down", "dropped"])
def test_a_full_level_evicts_a_batch_so_the_next_blocks_find_free_slots(make, tmp_path, with_host):
    """One block more than a full GPU level holds evicts 1 + 0.1% of the level's slots (4 of
    4096) in one batch, moved down a level (or dropped at the last level); the next 4 blocks
    evict nothing, the 5th evicts a batch again. The moved pages keep their bytes."""
    m, engine = make(
        layers=[record_layer(0, TPB)],
        tiers=tiers(tmp_path, gpu=2, host=2 if with_host else 0, disk=4 if with_host else 0),
    )
    assert m.get_slot_counts(0) == [4096]
    prompt = list(range(1, 4096 * TPB + 1))
    write_and_close(m, engine, prompt)  # the GPU level is full of cached pages
    assert m.get_storage_statistics(0)[0].free == 0

    def evicted():
        return m.num_moved_pages[1] if with_host else m.num_dropped_pages

    for request in range(6):
        write_and_close(m, engine, [500_000 + 100 * request + i for i in range(TPB)])
        assert evicted() == (5 if request < 5 else 10), request
    assert m.get_storage_statistics(0)[0].free == 4
    if with_host:
        assert m.num_moved_pages == [0, 10, 0] and m.num_dropped_pages == 0
        # Released last block first, the chain's last 10 blocks were the oldest pages.
        assert levels_of(m, prompt) == [0] * 4086 + [1] * 10
        held = m.create_kv_cache(None, prompt)  # holds them where they are
        assert held.num_committed_tokens == len(prompt)
        engine.check_anywhere(held, prompt)
        held.close()


def test_the_decision_record_names_each_move_by_slot_ids_and_the_copies_are_counted(make):
    """What replicated managers compare (`record_decisions`): a move is ("move", from level,
    to level, pool group, the slots it left, the slots it took), one id each per page; `stats()`
    counts the bytes those copies moved."""
    m, engine = make(tiers=[GpuCacheTierConfig(2 * MiB), HostCacheTierConfig(2 * MiB)])
    held = m.create_kv_cache()
    tokens = list(range(10 * TPB))
    assert held.resume() and engine.step(held, tokens, tokens)
    held.suspend()
    m.record_decisions(True)
    page_bytes = sum(m._storage.state.levels[0].pool_groups[0].slot_sizes)
    before = m.stats().copy_bytes
    write_and_close(m, engine, [50_000 + i for i in range(30 * TPB)])  # pushes `held` down
    moves = [d for d in m.take_decisions() if d[0] == "move"]
    took = [slot for move in moves for slot in move[5]]
    assert moves and all(move[1:4] == (0, 1, 0) for move in moves)
    assert all(len(move[4]) == len(move[5]) > 0 for move in moves)
    on_host = sorted(page.slot_id for page in held.pages(0) if page.level == 1)
    assert on_host and set(on_host) <= set(took)  # (the held pages went where the record says)
    assert m.stats().copy_bytes - before == len(took) * page_bytes
    assert held.resume()  # and back up: the record names exactly those slots
    again = [d for d in m.take_decisions() if d[0] == "move"]  # (others' pages make room)
    down = [slot for move in again if move[1:3] == (0, 1) for slot in move[5]]
    up = [move for move in again if move[1:3] == (1, 0)]
    assert sorted(slot for move in up for slot in move[4]) == on_host
    assert {slot for move in up for slot in move[5]} <= {page.slot_id for page in held.pages(0)}
    assert all(page.level == 0 for page in held.pages(0))
    moved = len(took) + len(down) + len(on_host)
    assert m.stats().copy_bytes - before == moved * page_bytes
    engine.check(held, tokens)
    held.close()


def buffer_bytes(m, cache):
    """Each committed block's bytes of every (layer, role), read through the GPU page views."""
    found = {}
    for layer in LAYERS:
        for buffer in layer.buffers:
            view = m.page_view(layer.layer_id, buffer.role)
            rows = cache.get_page_indices(layer.layer_id, buffer.role)
            for block, row in enumerate(rows):
                found[block, layer.layer_id, buffer.role] = bytes(view[int(row)])
    return found


def test_read_committed_reads_a_page_where_it_lies_and_moves_nothing(make, tmp_path, monkeypatch):
    """A suspended request reads its prefix's buffers from the GPU, host and disk levels
    byte for byte, and no page moves (a storage backend serving a page from disk)."""
    m, engine = make()
    prompt = list(range(1, 4 * TPB + 1))
    cache = m.create_kv_cache(None, prompt)
    assert cache.resume() and engine.step(cache, prompt, prompt)
    written = buffer_bytes(m, cache)
    cache.close()
    assert len(written) == 4 * 2 * 2 and len(set(written.values())) == len(written)
    for level, traffic in [(0, []), (1, [10_000]), (2, [20_000])]:
        for seed in traffic:
            fill(m, engine, seed, 32)
        assert levels_of(m, prompt) == [level] * 4
        moved = list(m.num_moved_pages)
        reader = m.create_kv_cache(None, prompt + [7])
        assert reader.num_committed_tokens == 4 * TPB
        for (block, layer_id, role), expected in written.items():
            out = np.full(len(expected), 0xEE, dtype=np.uint8)
            reader.read_committed(block, layer_id, role, out)
            assert out.tobytes() == expected, (level, block, layer_id, role)
        assert levels_of(m, prompt) == [level] * 4  # nothing brought up
        assert list(m.num_moved_pages) == moved
        reader.close()
        m.check_invariants()

    reader = m.create_kv_cache(None, prompt)
    size = len(written[0, 0, LAYERS[0].buffers[0].role])
    role = LAYERS[0].buffers[0].role
    bad = [
        ((4, 0, role, np.empty(size, np.uint8)), "block=4 is invalid"),
        ((0, 9, role, np.empty(size, np.uint8)), r"\(layer_id, role\)"),
        ((0, 0, role, np.empty(size - 1, np.uint8)), "out=.* 16383 bytes|out=.*x16383"),
        ((0, 0, role, np.empty(size, np.int8)), "out=.*int8"),
        ((0, 0, role, np.empty(2 * size, np.uint8)[::2]), "C-contiguous"),
        ((0, 0, role, bytearray(size)), "out=.*bytearray"),
    ]
    for args, message in bad:
        with pytest.raises(ArgumentError, match=message):
            reader.read_committed(*args)
    fail_disk_reads(monkeypatch, m)
    with pytest.raises(StorageError, match=r"disk level read .* Input/output error"):
        reader.read_committed(0, 0, role, np.empty(size, np.uint8))
    monkeypatch.undo()
    assert reader.status is KVCacheStatus.SUSPENDED and levels_of(m, prompt) == [2] * 4
    m.check_invariants()
    assert reader.resume()  # (still whole: brought up and checked)
    engine.check(reader, prompt)
    reader.close()
    reader.close()
    with pytest.raises(LogicError, match="closed"):
        reader.read_committed(0, 0, role, np.empty(size, np.uint8))

"""Forked requests (`KVCacheManager.fork_kv_cache`) share their pages, and a shared page is
copied before either writes it (`KVCache.prepare_write`): checked byte for byte with the
data-verifying engine, through commits and reuse, windows, SSM states, a full GPU, an
interrupted copy and suspension to the host."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool import GpuCacheTierConfig, HostCacheTierConfig, KVCacheManager, LogicError
from tests.engine_check import CheckingEngine
from tests.faults import state_of
from tests.helpers import MiB, make_config, record_layer, shutdown, ssm_layer

TPB = 16


def manager(layers=None, tiers=None, **options) -> KVCacheManager:
    layers = layers or [record_layer(0, TPB), record_layer(1, TPB)]
    return KVCacheManager(make_config(layers, tiers, TPB, **options))


def computed(m: KVCacheManager, engine: CheckingEngine, tokens: list[int]):
    """An active request that computed `tokens` (written, not committed: a beam's history)."""
    cache = m.create_kv_cache(None, [])
    assert cache.resume() and cache.resize(len(tokens))
    engine.write(cache, tokens, 0)
    assert cache.resize(len(tokens), len(tokens))
    return cache


def extend(cache, engine: CheckingEngine, tokens: list[int], new: list[int]) -> None:
    """One engine step the way a fork must take it: reserve, make the pages private, write."""
    start = cache.history_length
    assert cache.resize(start + len(new))
    assert cache.prepare_write(start, start + len(new))
    engine.write(cache, new, start)
    assert cache.resize(start + len(new), start + len(new))
    tokens += new


def records_at(m: KVCacheManager, page, position: int) -> list[int]:
    """The record layer 0's K buffer holds for `position` in `page`."""
    view = np.asarray(m.page_view(0, "k")).view(np.int32).reshape(-1, TPB, 4)
    row = m.layout.placement(0, "k").page_indices(np.array([page.slot_id], dtype=np.int32))[0]
    return view[row, position % TPB].tolist()


def test_a_fork_shares_every_page_and_only_the_block_written_is_copied():
    m = manager()
    engine = CheckingEngine(m)
    tokens = list(range(100, 140))  # 2.5 blocks
    a = computed(m, engine, tokens)
    b = m.fork_kv_cache(a)
    assert (b.capacity, b.history_length, b.num_committed_tokens) == (40, 40, 0)
    for g in range(m.layout.num_layer_groups):
        assert b.pages(g) == a.pages(g) and all(page.locks == 2 for page in a.pages(g))
        assert (b.get_base_page_indices(g) == a.get_base_page_indices(g)).all()
    engine.check(b, tokens)
    shared_tail = a.pages(0)[2]
    free = m.get_storage_statistics(0)[0].free
    a_tokens, b_tokens = list(tokens), list(tokens)
    extend(a, engine, a_tokens, [7000])  # into the shared partial block: copied first
    assert a.pages(0)[2] is not shared_tail and b.pages(0)[2] is shared_tail
    assert shared_tail.locks == 1 and a.pages(0)[2].locks == 1
    # The shared page was not written in place: b's page has nothing at position 40.
    assert records_at(m, shared_tail, 40) == [0, 0, 0, 0]
    assert records_at(m, a.pages(0)[2], 40) == [7000, 40, 0, 0]
    extend(b, engine, b_tokens, [8000])  # b owns the old page alone now: no copy
    assert b.pages(0)[2] is shared_tail
    assert m.stats().copy_on_write_pages == 1 and m.stats().forks == 1  # (one layer group)
    assert m.get_storage_statistics(0)[0].free == free - 1
    for g in range(m.layout.num_layer_groups):  # the full blocks stay shared
        assert a.pages(g)[:2] == b.pages(g)[:2]
    engine.check(a, a_tokens)
    engine.check(b, b_tokens)
    # Both commit: the shared full blocks go into the tree once, each tail as its own block.
    for cache, own in ((a, a_tokens), (b, b_tokens)):
        cache.commit(own)
        cache.close()
    m.check_invariants()
    for own in (a_tokens, b_tokens):
        reuse = m.create_kv_cache(None, own)
        assert reuse.num_committed_tokens == len(own) and reuse.resume()
        engine.check(reuse, own)
        reuse.close()
    assert engine.records_checked > 0
    shutdown(m)


def test_forks_of_forks_and_a_closed_source():
    m = manager()
    engine = CheckingEngine(m)
    tokens = list(range(1, 25))
    a = computed(m, engine, tokens)
    forks = [m.fork_kv_cache(a) for _ in range(3)]
    forks.append(m.fork_kv_cache(forks[0]))
    assert all(page.locks == 5 for page in a.pages(0))
    a.close()  # the forks keep the pages (uncommitted, still owned)
    assert all(page.locks == 4 and page.slot is not None for page in forks[0].pages(0))
    histories = []
    for n, cache in enumerate(forks):
        own = list(tokens)
        extend(cache, engine, own, [9000 + n] * 10)  # crosses into a new block
        histories.append(own)
    assert m.stats().copy_on_write_pages == 3  # the last writer had the page alone
    for cache, own in zip(forks, histories, strict=True):
        engine.check(cache, own)
        cache.close()
    m.check_invariants()
    assert m.get_storage_statistics(0)[0].free == m.get_slot_counts(0)[0]  # nothing leaked
    shutdown(m)


BIG = [record_layer(0, TPB, repeats=128), record_layer(1, TPB, repeats=128)]  # 16 per 2 MiB


def test_prepare_write_with_no_room_changes_nothing_and_an_interrupted_copy_neither():
    m = manager(BIG, [GpuCacheTierConfig(2 * MiB)])
    (slots,) = m.get_slot_counts(0)
    assert slots == 16
    engine = CheckingEngine(m)
    tokens = list(range(1, 21))
    a = computed(m, engine, tokens)  # 2 blocks
    b = m.fork_kv_cache(a)
    filler = m.create_kv_cache(None, [])
    assert filler.resume() and filler.resize((slots - 2) * TPB)
    assert a.resize(21)  # (still in the shared block 1)
    before = state_of(m)
    assert not a.prepare_write(20, 21)  # no slot for the copy
    assert state_of(m) == before and m.stats().copy_on_write_pages == 0
    filler.close()

    def interrupted(source, destination, pairs):
        raise KeyboardInterrupt

    copier = m._storage.state.copier  # (a Python object on both backends)
    copier.copy, real = interrupted, copier.copy  # type: ignore[method-assign]
    before = state_of(m)
    with pytest.raises(KeyboardInterrupt):
        a.prepare_write(20, 21)
    copier.copy = real  # type: ignore[method-assign]
    m.check_invariants()
    assert state_of(m) == before and a.pages(0)[1] is b.pages(0)[1]
    assert a.prepare_write(20, 21)  # and it works afterwards
    engine.write(a, [5], 20)
    assert a.resize(21, 21)
    engine.check(a, [*tokens, 5])
    engine.check(b, tokens)
    shutdown(m)


def test_a_write_into_committed_tokens_is_refused_and_a_committed_page_is_copied():
    m = manager()
    engine = CheckingEngine(m)
    tokens = list(range(1, 41))
    a = m.create_kv_cache(None, [])
    assert a.resume() and engine.step(a, tokens, tokens)
    with pytest.raises(ValueError, match=r"begin=10 is invalid: must be an integer in \[40, 40\]"):
        a.prepare_write(10, 20)
    a.stop_committing()  # the tail is a partial block in the tree now, shared with it
    tail = a.pages(0)[2]
    assert tail.block is not None and a.resize(48)
    assert a.prepare_write(40, 48) and a.pages(0)[2] is not tail
    assert tail.block is not None and tail.locks == 0  # the tree keeps its block, unchanged
    a.close()
    shutdown(m)


def test_forks_with_a_sliding_window_release_their_blocks_independently():
    layers = [record_layer(0, TPB, window=32), record_layer(1, TPB)]
    m = manager(layers)
    engine = CheckingEngine(m)
    tokens = list(range(1, 33))
    a = computed(m, engine, tokens)
    b = m.fork_kv_cache(a)
    own = list(tokens)
    extend(a, engine, own, list(range(50, 90)))  # a's window slides past block 0
    window_group = m.get_layer_group_id(0)
    first = b.pages(window_group)[0]
    assert a.pages(window_group)[0] is None and first.locks == 1  # b still has it
    engine.check(a, own)
    engine.check(b, tokens)
    a.close()
    b.close()
    m.check_invariants()
    shutdown(m)


def test_a_fork_gets_its_own_copy_of_each_ssm_state():
    m = manager([record_layer(0, TPB), ssm_layer(1, 64)])
    engine = CheckingEngine(m)
    tokens = list(range(1, 21))
    a = computed(m, engine, tokens)
    b = m.fork_kv_cache(a)
    ssm = m.get_layer_group_id(1)
    assert a.pages(ssm)[0] is not b.pages(ssm)[0]
    engine.check(b, tokens)  # the state record was copied
    own = list(tokens)
    extend(a, engine, own, [77])  # a's state moves on, b's stays
    engine.check(a, own)
    engine.check(b, tokens)
    a.close()
    b.close()
    shutdown(m)


def test_suspended_forks_share_pages_on_the_host_and_come_back():
    m = manager(BIG, [GpuCacheTierConfig(2 * MiB), HostCacheTierConfig(2 * MiB)])
    engine = CheckingEngine(m)
    tokens = list(range(1, 41))  # 3 blocks
    a = computed(m, engine, tokens)
    b = m.fork_kv_cache(a)
    a.suspend()
    b.suspend()
    other = m.create_kv_cache(None, [])
    assert other.resume() and other.resize(16 * TPB)  # pushes the forks' pages to the host
    assert all(page.level == 1 and page.holds == 2 for page in a.pages(0))
    other.close()
    assert a.resume() and b.resume()
    assert a.pages(0) == b.pages(0) and all(page.level == 0 for page in a.pages(0))
    engine.check(a, tokens)
    engine.check(b, tokens)
    a.close()
    b.close()
    shutdown(m)


def test_only_an_active_request_can_be_forked():
    m = manager()
    suspended = m.create_kv_cache(None, [])
    with pytest.raises(LogicError, match=r"fork_kv_cache\(\) of KV cache \d+, which is suspended"):
        m.fork_kv_cache(suspended)
    assert m.num_open_kv_caches == 1 and m.stats().forks == 0
    other = manager()
    foreign = other.create_kv_cache(None, [])
    assert foreign.resume()
    with pytest.raises(ValueError, match=r"cache=.* is invalid: must be an open KV cache"):
        m.fork_kv_cache(foreign)
    shutdown(other)
    shutdown(m)


def test_prepare_write_copies_a_page_a_suspended_fork_holds_and_nothing_twice():
    """A fork that is suspended holds the shared page (one lock, one hold: shared all the same);
    an empty range, or a range already private, needs no copy and says True; a copy that runs out
    of slots halfway gives back the copies it made."""
    m = manager(BIG, [GpuCacheTierConfig(2 * MiB), HostCacheTierConfig(2 * MiB)])
    engine = CheckingEngine(m)
    tokens = list(range(1, 21))
    a = computed(m, engine, tokens)  # 2 blocks, the second partial (no tree block)
    b = m.fork_kv_cache(a)
    b.suspend()
    shared = a.pages(0)[1]
    assert shared.block is None and shared.locks == 1 and shared.holds == 1
    assert a.prepare_write(20, 20) is True and m.stats().copy_on_write_pages == 0
    assert a.resize(21) and a.prepare_write(20, 21) is True
    assert a.pages(0)[1] is not shared and m.stats().copy_on_write_pages == 1
    assert a.prepare_write(20, 21) is True and m.stats().copy_on_write_pages == 1  # (private now)
    engine.write(a, [5], 20)
    assert a.resize(21, 21)
    engine.check(a, [*tokens, 5])
    assert b.resume()
    engine.check(b, tokens)  # untouched by a's write
    # Two shared pages, room for one copy: the first copy is given back, nothing changed.
    c = m.fork_kv_cache(b)
    filler = m.create_kv_cache(None, [])
    free = m.get_storage_statistics(0)[0].free
    assert filler.resume() and filler.resize((free - 2) * TPB)
    assert c.resize(40)  # (its third block takes one of the two free slots)
    before = state_of(m)
    assert not c.prepare_write(10, 40)  # blocks 0, 1 and 2 (new): 0 and 1 shared with b
    assert state_of(m) == before and m.get_storage_statistics(0)[0].free == 1
    for cache in (filler, a, b, c):
        cache.close()
    shutdown(m)


def test_prepare_write_needing_two_copies_with_room_for_one_changes_nothing():
    """A window and a full-attention layer in one pool group: the block being written is shared
    in both, so two copies are needed. The GPU can free one slot (by pushing a held page to the
    host's last free slot), not two. prepare_write must refuse before evicting anything: it used
    to make room for the first copy, find none for the second and return False with that page
    moved (found by a 100,000-operation fuzz of the hybrid layout)."""
    layers = [record_layer(0, TPB, repeats=128), record_layer(1, TPB, window=64, repeats=128)]
    m = manager(layers, [GpuCacheTierConfig(2 * MiB), HostCacheTierConfig(2 * MiB)])
    assert m.layout.num_layer_groups == 2 and m.get_slot_counts(0) == [32]

    def held(capacity, history=0):
        cache = m.create_kv_cache(None, [])
        assert cache.resume() and cache.resize(capacity)
        if history:
            assert cache.resize(capacity, history)
        cache.suspend()
        return cache

    def counts(level):
        return [(s.free, s.evictable) for s in m.get_storage_statistics(level)]

    held(11 * TPB), held(5 * TPB, 5 * TPB)  # 22 + 9 held pages (the window let one go)
    pusher = m.create_kv_cache(None, [])
    assert pusher.resume() and pusher.resize(16 * TPB)  # pushes the 31 held pages to the host
    pusher.close()
    held(TPB)  # 2 held pages on the GPU: its only evictable ones
    engine = CheckingEngine(m)
    tokens = list(range(1, 21))
    a = computed(m, engine, tokens)
    b = m.fork_kv_cache(a)
    assert a.resize(21)
    filler = m.create_kv_cache(None, [])
    assert filler.resume() and filler.resize(13 * TPB)
    assert counts(0) == [(0, 2)] and counts(1) == [(1, 0)]  # room for one copy, not two
    before = state_of(m)
    assert not a.prepare_write(20, 21)
    assert state_of(m) == before and counts(0) == [(0, 2)]
    filler.close()
    assert a.prepare_write(20, 21)  # and with room it copies both
    assert a.pages(0)[1] is not b.pages(0)[1] and a.pages(1)[1] is not b.pages(1)[1]
    engine.write(a, [5], 20)
    assert a.resize(21, 21)
    engine.check(a, [*tokens, 5])
    engine.check(b, tokens)
    shutdown(m)

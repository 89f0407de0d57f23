"""Request lifecycle: resize, commit, sliding-window release, page tables, misuse, out of pages."""

import numpy as np
import pytest

from kvpool import GpuCacheTierConfig, KVCacheManager, KVCacheStatus, LogicError
from kvpool.cache.growth import Growth
from kvpool.errors import ArgumentError
from tests.engine_check import CheckingEngine
from tests.helpers import MiB, hybrid_layers, make_config, record_layer, shutdown


@pytest.fixture
def manager():
    made = []

    def make(**kwargs):
        m = KVCacheManager(make_config(**kwargs))
        made.append(m)
        return m

    yield make
    for m in made:
        shutdown(m)


def test_one_request_512_tokens_with_window_and_sinks(manager):
    tpb = 16
    m = manager(
        layers=hybrid_layers(tpb, window=128, sinks=16),
        tokens_per_block=tpb,
        tiers=[GpuCacheTierConfig(4 * MiB)],
    )
    assert m.layout.num_layer_groups == 2 and m.num_pool_groups == 1
    engine = CheckingEngine(m)
    tokens = list(range(1000, 1512))
    cache = m.create_kv_cache()
    assert cache.status is KVCacheStatus.SUSPENDED
    assert cache.resume()
    swa, full = m.get_layer_group_id(0), m.get_layer_group_id(1)
    assert engine.step(cache, tokens, tokens[:1])  # prefill of one token
    engine.check(cache, tokens)
    for position in range(1, 512):
        assert engine.step(cache, tokens, tokens[position : position + 1])
        engine.check(cache, tokens)
        history = cache.history_length
        swa_table = cache.get_base_page_indices(swa)
        full_table = cache.get_base_page_indices(full)
        assert len(full_table) == -(-history // tpb) and (full_table >= 0).all()
        # Pages are released by resize, which saw history h - 1: the window [h - 128, h - 1]
        # plus the sink block have pages, nothing else.
        live = {b for b in range(len(swa_table)) if b == 0 or (b + 1) * tpb > history - 128}
        assert {int(b) for b in np.flatnonzero(swa_table >= 0)} == live, history
    assert cache.num_committed_tokens == cache.history_length == cache.capacity == 512
    assert engine.records_checked > 512 * 256
    assert m.get_storage_statistics(0)[0].free < m.get_storage_statistics(0)[0].total
    cache.close()
    cache.close()  # idempotent
    stats = m.get_storage_statistics(0)[0]
    # Every committed block stays cached in both layer groups (window pages too: they were
    # released when they went stale, but they are reusable by a shorter prefix).
    assert stats.evictable == 32 + 32
    m.clear_reusable_blocks()
    stats = m.get_storage_statistics(0)[0]
    assert stats.free == stats.total and stats.evictable == 0


def test_lengths_and_created_state(manager):
    m = manager()
    cache = m.create_kv_cache()
    assert (cache.capacity, cache.history_length, cache.num_committed_tokens) == (0, 0, 0)
    assert cache.resume()
    assert cache.resize(40)
    assert (cache.capacity, cache.history_length, cache.num_blocks) == (40, 0, 3)
    cache.commit(range(10))
    assert (cache.num_committed_tokens, cache.history_length) == (10, 10)
    assert cache.resize(40, 25)
    assert cache.history_length == 25
    assert cache.resize(25)  # capacity may shrink down to the history
    assert cache.num_blocks == 2
    assert (
        list(cache.get_base_page_indices(0)) == [0, 1]
        or (cache.get_base_page_indices(0) >= 0).all()
    )
    cache.close()


def test_misuse_names_the_state(manager):
    m = manager()
    cache = m.create_kv_cache()
    with pytest.raises(LogicError, match="resize\\(\\) on KV cache 0, which is suspended"):
        cache.resize(16)
    with pytest.raises(LogicError, match="commit\\(\\) on KV cache 0, which is suspended"):
        cache.commit([1])
    cache.resume()
    cache.resize(32, 8)
    with pytest.raises(LogicError, match="history_length cannot decrease \\(from 8 to 4\\)"):
        cache.resize(32, 4)
    with pytest.raises(LogicError, match="history_length 40 cannot exceed capacity 32"):
        cache.resize(32, 40)
    with pytest.raises(LogicError, match="cannot commit 33 tokens"):
        cache.commit(range(33))
    with pytest.raises(ArgumentError, match=r"tokens\[1\]=-1 is invalid"):
        cache.commit([1, -1])
    with pytest.raises(ArgumentError, match="capacity=-5 is invalid"):
        cache.resize(-5)
    assert (cache.capacity, cache.history_length, cache.num_committed_tokens) == (32, 8, 0)
    cache.commit([1, 2])
    cache.stop_committing()
    with pytest.raises(LogicError, match="cannot commit tokens after stop_committing"):
        cache.commit([3])
    cache.close()
    for call in (
        cache.resume,
        cache.suspend,
        lambda: cache.resize(8),
        lambda: cache.commit([1]),
        cache.stop_committing,
    ):
        with pytest.raises(LogicError, match="which is closed"):
            call()
    with pytest.raises(LogicError, match="which is closed"):
        cache.get_base_page_indices(0)


def test_page_tables_are_int32_arrays_kept_up_to_date(manager):
    m = manager(layers=[record_layer(0, 16), record_layer(1, 16)])
    cache = m.create_kv_cache()
    cache.resume()
    cache.resize(20)
    table = cache.get_base_page_indices(0)
    assert table.dtype == np.int32 and not table.flags.writeable
    rows = cache.get_page_indices(1, "v")
    assert rows.dtype == np.int32
    assert cache.get_page_indices(1, "v") is rows  # cached until the table changes
    placement = m.layout.buffers[1, "v"]
    assert list(rows) == [s * placement.buffers_per_slot + placement.position for s in table]
    cache.resize(40)
    assert len(cache.get_page_indices(1, "v")) == 3
    with pytest.raises(ArgumentError, match="layer_group_id=3 is invalid"):
        cache.get_base_page_indices(3)
    with pytest.raises(ArgumentError, match="\\(7, 'k'\\) is invalid"):
        cache.get_page_indices(7, "k")
    cache.close()


def slot_state(m):
    return [(s.free, s.evictable) for s in m.get_storage_statistics(0)]


def test_resize_out_of_pages_changes_nothing_and_others_continue(manager):
    tpb = 16
    # 64 KiB slots (4 layers x K,V x 8 KiB): a 2 MiB quota holds 32 of them.
    m = manager(
        layers=[record_layer(i, tpb, repeats=32) for i in range(4)],
        tokens_per_block=tpb,
        tiers=[GpuCacheTierConfig(2 * MiB)],
    )
    assert m.get_storage_statistics(0)[0].total == 32
    engine = CheckingEngine(m)
    a_tokens, b_tokens = list(range(0, 1000)), list(range(5000, 6000))
    a, b = m.create_kv_cache(), m.create_kv_cache()
    a.resume(), b.resume()
    assert engine.step(a, a_tokens, a_tokens[: 20 * tpb])  # 20 blocks
    assert engine.step(b, b_tokens, b_tokens[: 10 * tpb])  # 10 blocks: 2 left
    before = slot_state(m)
    table = a.get_base_page_indices(0).copy()
    assert not a.resize(a.capacity + 3 * tpb)  # needs 3
    assert (a.capacity, a.history_length, a.num_committed_tokens) == (20 * tpb, 20 * tpb, 20 * tpb)
    assert slot_state(m) == before
    assert np.array_equal(a.get_base_page_indices(0), table)
    engine.check(a, a_tokens)
    assert engine.step(b, b_tokens, b_tokens[10 * tpb : 12 * tpb])  # b still grows into the last 2
    engine.check(b, b_tokens)
    assert not engine.step(b, b_tokens, b_tokens[12 * tpb : 12 * tpb + 1])
    a.close()  # a's 20 committed blocks become evictable
    assert engine.step(b, b_tokens, b_tokens[12 * tpb : 13 * tpb])  # evicts one of them
    assert m.num_dropped_pages == 1
    engine.check(b, b_tokens)
    b.close()


def test_eviction_order_is_priority_then_age(manager):
    tpb = 16
    m = manager(
        layers=[record_layer(i, tpb, repeats=32) for i in range(4)],
        tokens_per_block=tpb,
        tiers=[GpuCacheTierConfig(2 * MiB)],
    )
    engine = CheckingEngine(m)
    priorities = {}  # prompt index -> priority of its single block

    def run(index, priority):
        tokens = list(range(index * 100, index * 100 + tpb))
        cache = m.create_kv_cache(priority_callback=lambda ordinal, group: priority)
        cache.resume()
        assert engine.step(cache, tokens, tokens)
        cache.close()
        priorities[index] = priority
        return tokens

    prompts = [run(i, p) for i, p in enumerate([50, 0, 50, 0, 100, 35, 0])]  # 0, 100: valid
    assert [m.probe_reuse(None, p) for p in prompts] == [tpb] * 7
    filler = m.create_kv_cache()
    filler.resume()

    def cached():
        return [int(m.probe_reuse(None, p) > 0) for p in prompts]

    assert filler.resize(27 * tpb)  # 25 free slots: evict 2, the oldest two of priority 0
    assert cached() == [1, 0, 1, 0, 1, 1, 1]
    assert filler.resize(29 * tpb)  # then the last 0, then the 35
    assert cached() == [1, 0, 1, 0, 1, 0, 0]
    assert filler.resize(30 * tpb)  # then the older of the two 50s
    assert cached() == [0, 0, 1, 0, 1, 0, 0]
    assert m.num_dropped_pages == 5
    filler.close()


def test_priority_callback_result_is_checked(manager):
    m = manager()
    cache = m.create_kv_cache(priority_callback=lambda ordinal, group: 101)
    cache.resume()
    cache.resize(16)
    with pytest.raises(
        ArgumentError,
        match=r"priority_callback\(0, 0\)=101 is invalid: must be an integer in \[0, 100\]",
    ):
        cache.commit(range(16))
    cache.close()


def test_open_requests_block_clear_and_shutdown(manager):
    m = manager()
    caches = [m.create_kv_cache() for _ in range(2)]
    with pytest.raises(
        LogicError, match=r"clear_reusable_blocks\(\) with 2 KV cache\(s\) still open"
    ):
        m.clear_reusable_blocks()
    with pytest.raises(LogicError, match=r"shutdown\(\) with 2 KV cache\(s\) still open"):
        m.shutdown()
    for cache in caches:
        cache.close()
    m.clear_reusable_blocks()


def test_ids(manager):
    m = manager()
    a = m.create_kv_cache(id=7)
    assert a.id == 7
    with pytest.raises(
        ArgumentError, match="id=7 is invalid: must not be the id of an open KV cache"
    ):
        m.create_kv_cache(id=7)
    assert m.create_kv_cache().id == 0
    assert m.num_open_kv_caches == 2
    a.close()
    assert m.create_kv_cache(id=7).id == 7


@pytest.mark.reference_only
def test_blocks_a_prefill_left_out_of_the_window_go_at_the_next_resize_oldest_first(
    manager, monkeypatch
):
    """After a prefill's commit the history has passed the window: the next resize that needs
    no new block releases every stale block but the sinks, in one run, oldest first in the
    eviction queue, and moves the window check past them (the next resize releases nothing)."""
    tpb = 16
    m = manager(
        layers=hybrid_layers(tpb, window=128, sinks=16),
        tokens_per_block=tpb,
        tiers=[GpuCacheTierConfig(4 * MiB)],
    )
    engine = CheckingEngine(m)
    releases = []
    release_stale = Growth._release_stale

    def counting(self, request, *args):
        releases.append(request.history_length)
        return release_stale(self, request, *args)

    monkeypatch.setattr(Growth, "_release_stale", counting)
    cache = m.create_kv_cache()
    cache.resume()
    tokens = list(range(500, 1012))
    assert engine.step(cache, tokens, tokens)  # one prefill of 512 tokens: no release yet
    swa = m.get_layer_group_id(0)
    held = cache.pages(swa)
    assert None not in held and not releases
    assert cache.resize(512)  # the history is 512 now: blocks 1 ... 23 left the window
    assert releases == [512]
    queue = m._storage.state.queues[0][0]
    assert list(queue) == held[1:24]  # oldest block first; the sink block 0 stays
    assert [p is not None for p in cache.pages(swa)] == [True] + [False] * 23 + [True] * 8
    engine.check(cache, tokens)
    assert cache.resize(512) and cache.resize(512, 512)
    assert releases == [512]  # nothing left the window since: the general path is not taken
    cache.close()


@pytest.mark.parametrize("commits", [False, True], ids=["uncommitted", "committed"])
def test_window_slides_in_a_full_pool(manager, commits):
    """The page leaving the window pays for the one entering it: an uncommitted page gives its
    slot directly, a committed one is evicted (it stays cached until then)."""
    tpb = 16
    # Window 49: 4 blocks live at most, and a block leaves the window in the step a new one
    # starts (history 64, 80, ...). 64 KiB slots: the 2 MiB pool holds 32.
    m = manager(
        layers=[record_layer(0, tpb, window=49, repeats=128)],
        tokens_per_block=tpb,
        tiers=[GpuCacheTierConfig(2 * MiB)],
    )
    assert m.get_storage_statistics(0)[0].total == 32
    engine = CheckingEngine(m)
    hog = m.create_kv_cache()
    hog.resume()
    assert hog.resize(28 * tpb)  # 28 slots locked, 4 left
    cache = m.create_kv_cache()
    cache.resume()
    tokens = list(range(7, 7 + 400))
    for position in range(400):
        if commits:
            assert engine.step(cache, tokens, tokens[position : position + 1]), position
        else:
            assert cache.resize(position + 1, position), position
            engine.write(cache, tokens[position : position + 1], position)
        engine.check(cache, tokens)
    assert cache.num_committed_tokens == (400 if commits else 0)
    assert sum(p is not None for p in cache.pages(0)) <= 4
    cache.close()
    hog.close()


@pytest.mark.parametrize("chunks", [[1] * 70, [70], [5, 40, 1, 1, 23], [16, 16, 38], [3, 30, 37]])
def test_block_keys_do_not_depend_on_how_tokens_are_committed(manager, chunks):
    """Single-token commits, long commits (their blocks sliced from one encoding), blocks that
    straddle two commits and digest (multimodal) tokens all give the same chained keys: a second
    request reuses every full block of the first."""
    m = manager(enable_partial_reuse=False)
    tokens = [*range(100, 148), bytes(range(32)), *range(200, 210), bytes(32), *range(7, 17)]
    assert len(tokens) == sum(chunks) == 70
    first = m.create_kv_cache()
    assert first.resume() and first.resize(70)
    position = 0
    for size in chunks:
        first.commit(tokens[position : position + size])
        position += size
    first.close()
    second = m.create_kv_cache(None, tokens)
    assert second.num_committed_tokens == 64  # every full block
    second.close()
    only_ints = m.create_kv_cache(None, list(range(100, 170)))
    assert only_ints.num_committed_tokens == 48  # the first three blocks have no digest
    only_ints.close()


@pytest.mark.parametrize("bad", [[-1], [2**31], [1.5], [3, -1], [b"short"]])
def test_invalid_tokens_are_refused_before_anything_changes(manager, bad):
    m = manager()
    cache = m.create_kv_cache()
    assert cache.resume() and cache.resize(32)
    cache.commit(range(10))
    with pytest.raises(ArgumentError, match=r"tokens\[\d+\]=.* is invalid"):
        cache.commit(bad)
    assert cache.num_committed_tokens == 10
    cache.commit(range(10, 32))  # still usable: the block keys are those of 0..31
    cache.close()
    assert m.create_kv_cache(None, list(range(33))).num_committed_tokens == 32


def test_eviction_at_the_last_level_frees_a_small_batch():
    """A full pool drops 0.1% of its slots more than an allocation needs, so that the next
    single-block allocations (decode steps) find a free slot without evicting again."""
    from kvpool.replay.prefix import exact_block_config

    m = KVCacheManager(exact_block_config(2048, 16))  # 2048 >> 10 = 2 extra slots per eviction
    for start in range(0, 2048 * 16, 1024):  # fill the pool with cached blocks
        cache = m.create_kv_cache()
        assert cache.resume() and cache.resize(1024)
        cache.commit(range(start, start + 1024))
        cache.close()
    (stats,) = m.get_storage_statistics(0)
    assert (stats.free, stats.evictable) == (0, 2048)
    cache = m.create_kv_cache()
    assert cache.resume() and cache.resize(16)
    assert m.num_dropped_pages == 3  # the one needed and two more
    assert cache.resize(32) and cache.resize(48)
    assert m.num_dropped_pages == 3  # no eviction for these two blocks
    assert cache.resize(64) and m.num_dropped_pages == 6
    # The oldest pages went first: the first request's last six blocks (closed leaf first).
    assert m.probe_reuse(None, list(range(1024))) == (64 - 6) * 16
    assert m.probe_reuse(None, list(range(1024, 2048))) == 1024
    cache.close()
    shutdown(m)

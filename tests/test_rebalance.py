"""Pool rebalancing: the estimate, the gates, adjust() (shrink, defrag, expand) and its data."""

import pytest

from kvpool import (
    BatchDesc,
    GpuCacheTierConfig,
    KVCacheDesc,
    KVCacheManager,
    KVCacheStatus,
    OutOfPagesError,
)
from kvpool.rebalance import MovingAverage
from tests.engine_check import CheckingEngine
from tests.helpers import MiB, kv_layer, make_config, record_layer

TPB = 32


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def two_pool_groups(clock=None, gpu_quota=256 * MiB, **overrides):
    """The seed's config: layer 0 K/V 8192 bytes with window 128, layer 1 K/V 2048 bytes."""
    step = BatchDesc([KVCacheDesc(160, 0)])
    overrides.setdefault("initial_pool_ratio", [0.5, 0.5])
    config = make_config(
        layers=[kv_layer(0, size=8192, window=128), kv_layer(1, size=2048)],
        tokens_per_block=TPB,
        tiers=[GpuCacheTierConfig(gpu_quota)],
        typical_step=step,
        constraints=[step],
        **overrides,
    )
    return KVCacheManager(config, clock=clock or Clock())


def force_rebalance_precondition(manager, skew=2.0):
    """Enough samples, cooldown over, and a GPU target with group 0's share times `skew`."""
    estimator = manager.rebalancer
    estimator.num_sampled = max(estimator.num_sampled, estimator.min_samples + 1)
    estimator.last_adjustment = estimator.clock() - estimator.cooldown - 1
    current = manager.level_storage(0).ratio
    skewed = [current[0] * skew, *current[1:]]
    estimator.gpu_target = [r / sum(skewed) for r in skewed]


def run_sequence(manager, engine, prompt, decode=96):
    cache = manager.create_kv_cache(None, prompt)
    reused = cache.num_committed_tokens
    assert cache.resume()
    engine.check(cache, prompt)
    tokens = prompt + [100_000 + cache.id * 1000 + i for i in range(decode)]
    assert engine.step(cache, tokens, prompt[reused:] if reused < len(prompt) else [])
    for position in range(len(prompt), len(tokens)):
        assert engine.step(cache, tokens, tokens[position : position + 1])
    engine.check(cache, tokens)
    cache.close()
    return reused


def test_moving_average_is_bias_corrected():
    average = MovingAverage(0.9)
    average.update(10.0)
    assert average.value == 10.0  # the first sample exactly
    average.update(20.0)
    assert average.value == pytest.approx(10 + 10 / 1.9)


def test_adjust_resizes_pool_groups():
    manager = two_pool_groups()
    engine = CheckingEngine(manager)
    assert manager.num_pool_groups == 2
    # 128 grains of 2 MiB, half each: 8192 slots of 16 KiB and 32768 of 4 KiB.
    assert manager.get_slot_counts(0) == [8192, 32768]
    run_sequence(manager, engine, list(range(64)))
    ratio_before = manager.level_storage(0).ratio
    force_rebalance_precondition(manager, skew=2.0)  # [0.5, 0.5] -> [2/3, 1/3]
    assert manager.need_adjustment
    manager.adjust()
    ratio_after = manager.level_storage(0).ratio
    assert ratio_after[0] / ratio_after[1] > ratio_before[0] / ratio_before[1]
    # By hand: group 1 (1/3) gets round(128 / 3) = 43 grains = 22016 slots (a shrink that only
    # ever issued a few low ids: the fast path), group 0 the other 85 = 10880 slots (expand).
    assert manager.get_slot_counts(0) == [10880, 22016]
    assert not manager.need_adjustment  # cooldown restarted
    manager.shutdown()


def test_kv_survives_adjust():
    manager = two_pool_groups()
    engine = CheckingEngine(manager)
    prompt = list(range(500, 564))
    run_sequence(manager, engine, prompt)
    force_rebalance_precondition(manager, skew=2.0)
    manager.adjust()
    checked = engine.records_checked
    reused = run_sequence(manager, engine, prompt)
    assert reused > 0, "replay reused no blocks; the KV check would be vacuous"
    assert engine.records_checked > checked
    manager.shutdown()


def defrag_manager(**overrides):
    # One pool group of 64 KiB slots: 2 MiB per grain holds 32; 8 MiB = 128 slots.
    config = make_config(
        layers=[record_layer(i, 16, repeats=64) for i in range(2)],
        tokens_per_block=16,
        tiers=overrides.pop("tiers", [GpuCacheTierConfig(8 * MiB)]),
        **overrides,
    )
    return KVCacheManager(config)


def test_shrink_moves_cached_pages_from_high_slot_ids_and_their_bytes_survive():
    m = defrag_manager()
    engine = CheckingEngine(m)
    low = m.create_kv_cache()
    low.resume()
    assert low.resize(60 * 16)  # ids 0..59, never committed
    prompt = list(range(9, 9 + 40 * 16))
    assert run_sequence(m, engine, prompt, decode=0) == 0  # 40 cached pages at ids 60..99
    low.close()  # the low ids are free again
    storage = m._storage.state
    assert min(storage.pages[0][0]) >= 60
    m.adjust_cache_level(0, [1.0], quota=4 * MiB)  # 64 slots: ids 64..99 must move
    assert m.get_slot_counts(0) == [64]
    assert storage.num_relocated == 36
    assert m.num_dropped_pages == 0
    assert max(storage.pages[0][0]) < 64
    assert run_sequence(m, engine, prompt + [1], decode=0) == len(prompt)  # verified bytes
    m.shutdown()


def test_shrink_evicts_the_least_valuable_when_compaction_is_not_enough():
    m = defrag_manager()
    engine = CheckingEngine(m)
    prompts = [list(range(k * 10_000, k * 10_000 + 30 * 16)) for k in range(4)]
    for prompt in prompts:  # 120 cached pages, oldest first
        run_sequence(m, engine, prompt, decode=0)
    m.adjust_cache_level(0, [1.0], quota=4 * MiB)  # 64 slots: 56 pages must go
    # Least valuable first: the oldest prompt's blocks from its last one back, then the 26
    # deepest of the second-oldest (its first 4 blocks stay). The two newest stay, compacted.
    assert m.num_dropped_pages == 56
    assert [m.probe_reuse(None, p) for p in prompts] == [
        0,
        4 * 16,
        len(prompts[2]),
        len(prompts[3]),
    ]
    assert run_sequence(m, engine, prompts[3] + [5], decode=0) == len(prompts[3])
    m.shutdown()


def test_held_pages_at_the_last_level_are_moved_not_dropped():
    m = defrag_manager()  # GPU only: it is the last level, held pages cannot leave it
    engine = CheckingEngine(m)
    low = m.create_kv_cache()
    low.resume()
    assert low.resize(60 * 16)  # ids 0..59
    tokens = list(range(3, 3 + 40 * 16))
    held = m.create_kv_cache()
    assert held.resume() and engine.step(held, tokens, tokens)  # ids 60..99
    held.suspend()
    low.close()
    m.adjust_cache_level(0, [1.0], quota=4 * MiB)  # 64 slots: 36 held pages must move
    assert m._storage.state.num_relocated == 36 and m.num_dropped_pages == 0
    assert max(p.slot_id for p in held.pages(0)) < 64
    assert held.resume()
    engine.check(held, tokens)
    held.close()
    m.shutdown()


def test_shrink_that_cannot_fit_held_pages_raises_and_changes_nothing():
    m = defrag_manager()  # GPU only: it is the last level
    engine = CheckingEngine(m)
    caches = []
    for k in range(3):  # 3 x 30 held pages
        tokens = list(range(k * 5000, k * 5000 + 30 * 16))
        cache = m.create_kv_cache()
        assert cache.resume() and engine.step(cache, tokens, tokens)
        cache.suspend()
        caches.append((cache, tokens))
    before = (m.get_slot_counts(0), m.get_storage_statistics(0), m.level_storage(0).quota)
    with pytest.raises(OutOfPagesError, match="nothing was changed"):
        m.adjust_cache_level(0, [1.0], quota=4 * MiB)  # 64 slots < 90 held pages
    assert (m.get_slot_counts(0), m.get_storage_statistics(0), m.level_storage(0).quota) == before
    m.check_invariants()
    for cache, tokens in caches:
        assert cache.resume()
        engine.check(cache, tokens)
        cache.close()
    m.shutdown()


def test_active_requests_stay_active_across_adjust():
    m = two_pool_groups(gpu_quota=8 * MiB, initial_pool_ratio=[0.5, 0.5])
    engine = CheckingEngine(m)
    hog = m.create_kv_cache()  # takes the low slot ids, then leaves
    hog.resume()
    assert hog.resize(200 * TPB)
    caches = []
    for k in range(4):
        tokens = list(range(k * 1000, k * 1000 + 300))
        cache = m.create_kv_cache()
        assert cache.resume() and engine.step(cache, tokens, tokens[:200])
        caches.append((cache, tokens))
    hog.close()
    force_rebalance_precondition(m, skew=0.2)  # shrink group 0 (the window group) hard
    relocated = m._storage.state.num_relocated
    m.adjust()
    assert m._storage.state.num_relocated > relocated  # locked pages moved
    for cache, tokens in caches:
        assert cache.status is KVCacheStatus.ACTIVE
        engine.check(cache, tokens)  # through the refreshed page tables and the new views
        for position in range(200, 300):
            assert engine.step(cache, tokens, tokens[position : position + 1])
        engine.check(cache, tokens)
        cache.close()
    m.shutdown()


def test_each_gate_switches_need_adjustment():
    clock = Clock()
    m = two_pool_groups(
        clock, rebalance_min_sampled_kv_caches=5000, rebalance_cooldown_secs=10_000.0
    )
    force_rebalance_precondition(m)
    m.rebalancer.num_sampled = 2001
    assert not m.need_adjustment  # samples
    m.rebalancer.num_sampled = 5001
    assert m.need_adjustment
    m.rebalancer.last_adjustment = clock.now
    assert not m.need_adjustment  # cooldown
    clock.now += 10_000
    assert m.need_adjustment
    m.shutdown()
    m = two_pool_groups(Clock(), rebalance_ratio_threshold=10.0)
    force_rebalance_precondition(m, skew=2.0)
    assert not m.need_adjustment  # threshold
    force_rebalance_precondition(m, skew=20.0)
    assert m.need_adjustment
    m.shutdown()


def test_excluded_requests_do_not_feed_the_estimate():
    clock = Clock()
    m = two_pool_groups(
        clock,
        rebalance_min_sampled_kv_caches=1,
        rebalance_cooldown_secs=0.0,
        rebalance_target_ratio_update_interval=1,
    )
    assert not m.need_adjustment  # no target yet
    dummy = m.create_kv_cache(id=1, exclude_from_stats=True)
    dummy.resume()
    assert dummy.resize(2048, 2047)
    dummy.close()
    assert m.rebalancer.num_sampled == 0 and not m.need_adjustment
    real = m.create_kv_cache(id=1)
    real.resume()
    assert real.resize(2048, 2047)
    real.close()
    assert m.rebalancer.num_sampled == 1
    # RMS capacity 2048 at history 2047: the window group needs 4 blocks of 16 KiB (60 of the 64
    # are stale), full attention 64 blocks of 4 KiB.
    assert m.rebalancer.gpu_target == pytest.approx([64 / 320, 256 / 320])
    assert m.need_adjustment
    m.shutdown()


def test_estimate_uses_root_mean_squares():
    m = two_pool_groups(
        Clock(), rebalance_target_ratio_update_interval=2, rebalance_moving_average_decay=0.5
    )
    for capacity in (100, 700):
        cache = m.create_kv_cache()
        cache.resume()
        assert cache.resize(capacity, capacity - 1)
        cache.close()
    estimator = m.rebalancer
    assert estimator.num_sampled == 2
    # Bias-corrected EMA with decay 0.5: weights 1 then 1.5; value = 100^2 + (700^2 - 100^2) / 1.5.
    assert estimator.sqr_capacity.value == pytest.approx(100**2 + (700**2 - 100**2) / 1.5)
    assert estimator.gpu_target is not None
    m.shutdown()

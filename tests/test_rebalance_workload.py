"""End to end: a workload that shifts from short to long contexts on a hybrid model. Rebalancing
through the real estimator (no forced precondition) lets more long requests run at once, with
requests ACTIVE across every adjust() and every record verified."""

import random

from kvpool import GpuCacheTierConfig, KVCacheManager, KVCacheStatus, _debug
from tests.engine_check import CheckingEngine
from tests.helpers import MiB, make_config, record_layer

TPB = 16


def hybrid_manager(rebalance):
    # Layers 0 and 2: window 64 (one pool group of 8 KiB slots); layer 1: full attention
    # (4 KiB slots). 16 MiB = 8 grains of 2 MiB, split evenly at first.
    layers = [
        record_layer(0, TPB, window=64, repeats=8),
        record_layer(1, TPB, repeats=8),
        record_layer(2, TPB, window=64, repeats=8),
    ]
    config = make_config(
        layers=layers,
        tokens_per_block=TPB,
        tiers=[GpuCacheTierConfig(16 * MiB)],
        initial_pool_ratio=[0.5, 0.5],
        rebalance_min_sampled_kv_caches=20 if rebalance else 10**9,
        rebalance_cooldown_secs=0.0,
        rebalance_target_ratio_update_interval=10,
        rebalance_moving_average_decay=0.9,
    )
    return KVCacheManager(config)


def workload(seed):
    rng = random.Random(seed)
    short = [(rng.randrange(32, 64), rng.randrange(8, 24)) for _ in range(200)]
    long = [(rng.randrange(1100, 1300), rng.randrange(30, 60)) for _ in range(80)]
    return [([rng.randrange(1 << 30) for _ in range(p + d)], p) for p, d in short + long]


def serve(rebalance, monkeypatch):
    monkeypatch.setattr(_debug, "DEBUG", False)  # full checks below, at chosen points
    m = hybrid_manager(rebalance)
    engine = CheckingEngine(m)
    waiting = list(enumerate(workload(5)))
    running = []  # (index, cache, tokens)
    concurrency = []  # running requests per step once the long phase runs
    adjustments = 0
    while waiting or running:
        if m.need_adjustment:
            statuses = [cache.status for _, cache, _ in running]
            m.adjust()
            adjustments += 1
            m.check_invariants()
            assert (
                [cache.status for _, cache, _ in running]
                == statuses
                == [KVCacheStatus.ACTIVE] * len(running)
            )
            for _, cache, tokens in running:
                engine.check(cache, tokens)
        while waiting and len(running) < 64:
            index, (tokens, prompt) = waiting[0]
            cache = m.create_kv_cache(None, tokens[: prompt - 1])
            done = cache.num_committed_tokens
            if not cache.resume() or not engine.step(cache, tokens, tokens[done:prompt]):
                cache.close()
                break
            waiting.pop(0)
            running.append((index, cache, tokens))
        for entry in list(running):
            index, cache, tokens = entry
            position = cache.history_length
            if position == len(tokens):
                engine.check(cache, tokens)
                cache.close()
                running.remove(entry)
            elif not engine.step(cache, tokens, tokens[position : position + 1]):
                cache.close()  # preempted: recompute later (its blocks stay cached)
                running.remove(entry)
                waiting.insert(0, (index, (tokens, len(tokens) - 1)))
            else:
                engine.check(cache, tokens)
        if any(index >= 200 for index, _, _ in running):
            concurrency.append(len(running))
    m.check_invariants()
    slots = m.get_slot_counts(0)
    m.clear_reusable_blocks()
    m.shutdown()
    tail = concurrency[len(concurrency) // 2 :]
    return sum(tail) / len(tail), adjustments, slots, engine.records_checked


def test_rebalancing_serves_more_long_requests_at_once(monkeypatch):
    fixed_concurrency, fixed_adjustments, fixed_slots, _ = serve(False, monkeypatch)
    tuned_concurrency, tuned_adjustments, tuned_slots, checked = serve(True, monkeypatch)
    assert fixed_adjustments == 0 and tuned_adjustments >= 1
    # Long contexts need few window blocks: memory moved to the full-attention group.
    assert tuned_slots[1] > fixed_slots[1] and tuned_slots[0] < fixed_slots[0]
    assert tuned_concurrency > 1.3 * fixed_concurrency, (tuned_concurrency, fixed_concurrency)
    assert checked > 1_000_000

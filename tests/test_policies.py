"""Eviction policies: the plug-in point (KVCacheManagerConfig.eviction_policy) and the age
policy's decisions, against hand-worked cases."""

from __future__ import annotations

import pytest

from kvpool import ConfigError, GpuCacheTierConfig, KVCacheManager
from kvpool.policies import TRANSIENT_PRIORITY, AgePolicy, EvictionPolicy
from kvpool.records import DEFAULT_PRIORITY, Block
from tests.engine_check import CheckingEngine
from tests.helpers import MiB, make_config, record_layer, shutdown

TPB = 16
LAYERS = [record_layer(i, TPB, repeats=64) for i in range(2)]  # 64 KiB pages: 32 per 2 MiB


def block(key: int, parent: Block | None = None) -> Block:
    return Block(key.to_bytes(32, "big"), parent, b"", TPB, [None])


def learned_policy() -> AgePolicy:
    """10 blocks of capacity, inserted one per second from t=1 (the rate is known at t=10: 10
    blocks in 9 s, so bins of 3.6 s, a horizon of 9 s, a sample every 1.125 s); cached leaves
    of every age from 0 to 40 s for exposure; then forty reuses of leaves 22 s after their last
    use and none sooner."""
    now = [0.0]
    policy = AgePolicy(
        10,
        lambda: [now[0] - age for age in range(41)],
        horizon_factor=1.0,
        bins=10,
        ghosts_per_block=4,
    )
    root = block(0)
    for second in range(1, 12):
        now[0] = float(second)
        policy.inserted([block(second, root)], float(second))
    assert policy.width == pytest.approx(3.6) and policy.horizon == pytest.approx(9.0)
    for t in range(12, 100):  # exposure samples as time goes on
        now[0] = float(t)
        policy.inserted([], float(t))
    assert all(x > 0 for x in policy.exposure)
    for _ in range(40):
        leaf = block(99, root)
        leaf.used_at = now[0] - 22.0
        policy.used([leaf], now[0])
    assert sum(policy.events) == 40
    return policy


def test_age_policy_makes_fresh_blocks_transient_when_older_ones_are_due_sooner():
    policy = learned_policy()
    # A fresh block (age 0) is reused within 9 s with probability 0; the oldest one (22 s)
    # is in the bin where every reuse happened: fresh blocks go first.
    assert policy.release_priority(200.0, 22.0) == TRANSIENT_PRIORITY
    # An oldest block past every reuse seen (or as fresh as the new ones): plain LRU.
    assert policy.release_priority(200.0, 300.0) == DEFAULT_PRIORITY
    assert policy.release_priority(200.0, 1.0) == DEFAULT_PRIORITY
    assert policy.release_priority(200.0, None) is None  # nothing queued yet


def test_age_policy_decides_nothing_before_it_has_seen_a_capacity_of_blocks():
    policy = AgePolicy(10)
    policy.inserted([block(1, block(0))], 1.0)
    assert policy.release_priority(5.0, 3.0) is None
    assert EvictionPolicy().release_priority(5.0, 3.0) is None


def test_ghosts_of_dropped_blocks_turn_their_return_into_a_reuse():
    policy = learned_policy()
    gone = block(7, block(0))
    gone.used_at = 150.0
    policy.dropped([gone])
    assert policy.ghosts[gone.key] == 150.0
    assert policy.events[5] == 0  # (the forty reuses were at 22 s: bin 6)
    policy.inserted([block(7, block(0))], 170.0)  # back after 20 s: bin 5
    assert policy.events[5] > 0.9 and gone.key not in policy.ghosts  # (0.96: one sample's fade)
    for key in range(1000, 1045):  # more ghosts than 4 per block of capacity: the oldest go
        dropped = block(key, block(0))
        dropped.used_at = 160.0
        policy.dropped([dropped])
    assert len(policy.ghosts) == 40


def test_a_transient_request_is_evicted_before_an_older_default_one(monkeypatch):
    m = KVCacheManager(
        make_config(LAYERS, [GpuCacheTierConfig(2 * MiB)], TPB, eviction_policy="age")
    )
    try:
        engine = CheckingEngine(m)
        decisions = iter([DEFAULT_PRIORITY, TRANSIENT_PRIORITY])
        monkeypatch.setattr(
            m._policy, "release_priority", lambda now, age: next(decisions, DEFAULT_PRIORITY)
        )
        older, newer = [list(range(n * 1000, n * 1000 + 8 * TPB)) for n in (1, 2)]
        for tokens in (older, newer):
            cache = m.create_kv_cache(None, [])
            assert cache.resume() and engine.step(cache, tokens, tokens)
            cache.close()
        filler = list(range(9000, 9000 + 24 * TPB))  # 24 of the 32 slots: 8 must go
        cache = m.create_kv_cache(None, [])
        assert cache.resume() and engine.step(cache, filler, filler)
        cache.close()
        assert m.probe_reuse(None, older) == 8 * TPB  # LRU would have dropped these
        assert m.probe_reuse(None, newer) == 0
    finally:
        shutdown(m)


def test_the_age_policy_learns_through_the_manager_and_lru_costs_nothing(tmp_path):
    import os

    from kvpool.replay.workloads import load_mooncake

    trace = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "traces")
    path = os.path.join(trace, "mooncake_conversation_trace.jsonl")
    if not os.path.isfile(path):
        pytest.skip("needs ../shared/traces")
    import dataclasses

    from kvpool import _debug
    from kvpool.replay.prefix import exact_block_config

    _debug_was, _debug.DEBUG = _debug.DEBUG, False
    try:
        now = [0.0]
        config = dataclasses.replace(exact_block_config(500), eviction_policy="age")
        m = KVCacheManager(config, clock=lambda: now[0])
        released = []
        policy = m._policy
        decide = policy.release_priority
        monkey = lambda t, age: released.append(decide(t, age)) or released[-1]  # noqa: E731
        policy.release_priority = monkey
        for request in load_mooncake(path, limit=1500):
            now[0] = request.arrival
            prompt = request.tokens()
            cache = m.create_kv_cache(None, prompt)
            if cache.resume() and cache.resize(len(prompt)):
                cache.commit(prompt[cache.num_committed_tokens :])
            cache.close()
        assert policy.width > 0 and sum(policy.events) > 0 and policy.ghosts
        assert TRANSIENT_PRIORITY in released and DEFAULT_PRIORITY in released
        m.clear_reusable_blocks()
        m.shutdown()
    finally:
        _debug.DEBUG = _debug_was
    lru = KVCacheManager(make_config(LAYERS, [GpuCacheTierConfig(2 * MiB)], TPB))
    assert lru._policy is None and lru._context.policy is None
    shutdown(lru)


def test_an_unknown_policy_is_refused_by_field():
    with pytest.raises(ConfigError, match=r"eviction_policy='mru' is invalid: must be one of"):
        KVCacheManager(make_config(eviction_policy="mru"))

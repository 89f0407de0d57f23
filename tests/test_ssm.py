"""SSM layers: one live state slot per request; reuse ends exactly at a state snapshot."""

import pytest

from kvpool import BufferConfig, GpuCacheTierConfig, KVCacheManager, SsmLayerConfig
from tests.engine_check import CheckingEngine
from tests.helpers import MiB, make_config, record_layer, shutdown

TPB = 16


@pytest.fixture
def ssm_manager():
    layers = [
        record_layer(0, TPB),
        SsmLayerConfig(1, [BufferConfig("state", 64)]),
        record_layer(2, TPB, window=32),
    ]
    m = KVCacheManager(
        make_config(layers=layers, tokens_per_block=TPB, tiers=[GpuCacheTierConfig(4 * MiB)])
    )
    yield m, CheckingEngine(m)
    shutdown(m)


def test_one_state_slot_per_request(ssm_manager):
    m, engine = ssm_manager
    ssm = m.get_layer_group_id(1)
    a, b = m.create_kv_cache(), m.create_kv_cache()
    assert list(a.get_base_page_indices(ssm)) == [-1]  # allocated on first resume
    a.resume(), b.resume()
    tokens = list(range(100))
    for cache in (a, b):
        assert engine.step(cache, tokens, tokens[:40])
        assert engine.step(cache, tokens, tokens[40:41])
        engine.check(cache, tokens)
    slots = [c.get_base_page_indices(ssm)[0] for c in (a, b)]
    assert len(set(slots)) == 2 and min(slots) >= 0
    a.suspend()
    assert a.get_base_page_indices(ssm)[0] == slots[0]
    a.resume()
    engine.check(a, tokens)
    a.close(), b.close()


def test_reuse_ends_at_a_snapshot_and_restores_the_state(ssm_manager):
    m, engine = ssm_manager
    tokens = list(range(1000, 1100))
    a = m.create_kv_cache(None, tokens[:32])
    a.resume()
    assert engine.step(a, tokens, tokens[:32])  # one commit of 2 blocks: a snapshot at 32 only
    for position in range(32, 50):  # block 2 completes at 48: a snapshot there
        assert engine.step(a, tokens, tokens[position : position + 1])
    a.close()  # the partial tail (48..50) goes in with a snapshot at 50
    assert m.probe_reuse(None, tokens[:20]) == 0  # no snapshot at 16
    assert m.probe_reuse(None, tokens[:45]) == 32
    assert m.probe_reuse(None, tokens[:48]) == 48
    assert m.probe_reuse(None, tokens[:60]) == 50
    for length, expected in ((60, 50), (45, 32), (48, 48)):
        cache = m.create_kv_cache(None, tokens[:length])
        assert cache.num_committed_tokens == expected
        assert cache.resume()
        engine.check(cache, tokens)  # the live state holds (token expected-1, expected)
        assert engine.step(cache, tokens, tokens[expected : expected + 3])
        engine.check(cache, tokens)
        cache.close()

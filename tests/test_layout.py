"""Layout: life cycles, stale ranges, pool-group formation, page-index conversion, floors."""

import numpy as np
import pytest

from kvpool import BatchDesc, BufferConfig, KVCacheDesc, KVCacheManager
from kvpool.layout import KVLayout
from kvpool.lifecycles import AttentionLifeCycle, SsmLifeCycle
from tests.helpers import kv_layer, make_config, ssm_layer


def brute_force_stale(h, tpb, window, sink_tokens):
    """Blocks wholly before the live window [h + 1 - w, h] and not holding a sink token."""
    if window is None:
        return set()
    sink_blocks = -(-sink_tokens // tpb)
    num_blocks = -(-h // tpb)
    return {b for b in range(num_blocks) if b >= sink_blocks and (b + 1) * tpb <= h + 1 - window}


@pytest.mark.parametrize("window", [None, 1, 16, 17, 40, 64])
@pytest.mark.parametrize("sinks", [0, 5, 16, 33])
def test_attention_stale_range_matches_definition(window, sinks):
    if window is None and sinks:
        return
    tpb = 16
    life_cycle = AttentionLifeCycle(window, -(-sinks // tpb))
    for h in range(0, 200):
        beg, end = life_cycle.stale_range(h, tpb)
        assert beg == min(-(-h // tpb), -(-sinks // tpb))
        assert set(range(beg, end)) == brute_force_stale(h, tpb, window, sinks), (h, beg, end)


def test_stale_range_examples():
    swa = AttentionLifeCycle(window=64, num_sink_blocks=1)
    assert swa.stale_range(0, 16) == (0, 0)
    assert swa.stale_range(63, 16) == (1, 1)  # window [0, 63]: nothing stale yet
    assert swa.stale_range(80, 16) == (1, 1)  # window [17, 80]: block 1 holds token 17
    assert swa.stale_range(81, 16) == (1, 1)  # window [18, 81]: block 1 holds token 18
    assert swa.stale_range(95, 16) == (1, 2)  # window [32, 95]: block 1 is stale, block 0 is a sink
    assert SsmLifeCycle().stale_range(50, 16) == (0, 3)
    assert AttentionLifeCycle(None, 0).stale_range(1000, 16) == (0, 0)


def test_equal_sizes_different_windows_share_one_pool_group():
    layout = KVLayout([kv_layer(0, window=128), kv_layer(1)], 32)
    assert layout.num_layer_groups == 2
    assert layout.num_pool_groups == 1
    assert layout.pool_groups[0].layer_groups == (0, 1)
    assert layout.pool_groups[0].slot_sizes == (2 * 4096,)


def test_different_sizes_make_two_pool_groups():
    layout = KVLayout([kv_layer(0, size=8192, window=128), kv_layer(1, size=2048)], 32)
    assert layout.num_pool_groups == 2
    assert [g.slot_sizes for g in layout.pool_groups] == [(16384,), (4096,)]
    assert layout.pool_group_of == [0, 1]


def test_quantization_scales_make_a_second_smaller_pool():
    scales = [BufferConfig("k_scale", 64), BufferConfig("v_scale", 64)]
    layout = KVLayout([kv_layer(0, extra=scales), kv_layer(1, extra=scales)], 16)
    assert layout.num_pool_groups == 1
    assert layout.pool_groups[0].slot_sizes == (4 * 4096, 4 * 64)
    placement = layout.buffers[1, "v_scale"]
    assert (placement.pool, placement.position, placement.buffers_per_slot) == (1, 3, 4)
    assert placement.offset == 3 * 64


def test_layer_groups_are_numbered_in_first_seen_order():
    layout = KVLayout([kv_layer(0), ssm_layer(1), kv_layer(2, window=64), kv_layer(3)], 16)
    assert [layout.layer_group_of[i] for i in range(4)] == [0, 1, 2, 0]
    assert isinstance(layout.life_cycles[1], SsmLifeCycle)


def test_sink_tokens_in_the_same_block_are_one_life_cycle():
    layout = KVLayout([kv_layer(0, window=64, sinks=1), kv_layer(1, window=64, sinks=16)], 16)
    assert layout.num_layer_groups == 1


def test_page_indices_address_one_buffer_inside_the_slot():
    """Row = slot x buffers-per-slot + position: writing a buffer's row lands at the right bytes."""
    manager = KVCacheManager(make_config(layers=[kv_layer(0, size=64), kv_layer(1, size=64)]))
    try:
        layout = manager.layout
        pool = manager.level_storage(0).pool_groups[0].pool_view(0)
        slots = np.array([5, -1, 2], dtype=np.int32)
        for (layer_id, role), placement in layout.buffers.items():
            rows = placement.page_indices(slots)
            assert rows.dtype == np.int32
            assert rows[1] == -1
            view = manager.page_view(layer_id, role)
            assert view.shape == (pool.shape[0] * 4, 64)
            marker = layer_id * 16 + placement.position + 1
            view[rows[0]] = marker
            view[rows[2]] = marker + 100
            start = placement.offset
            assert (pool[5, start : start + 64] == marker).all()
            assert (pool[2, start : start + 64] == marker + 100).all()
        # The four buffers of slot 5 are side by side and disjoint.
        assert sorted(set(pool[5].tolist())) == [1, 2, 19, 20]
    finally:
        manager.shutdown()


def test_min_slots_window_floor_and_full_attention_inherits_it():
    # window 40, tpb 16, 20 sink tokens: 2 sink blocks + ceil(39/16)=3 + 1 = 6.
    layout = KVLayout(
        [kv_layer(0, window=40, sinks=20), kv_layer(1, size=1024), ssm_layer(2, size=512)], 16
    )
    assert layout.num_pool_groups == 3
    assert layout.min_slots() == [6, 6, 1]
    shared = KVLayout([kv_layer(0, window=8), kv_layer(1)], 8)
    assert shared.min_slots() == [4]  # window 8, tpb 8: 2 each, one shared group


def test_slots_for_batch_counts_shared_prompt_once():
    layout = KVLayout([kv_layer(0, window=32), kv_layer(1, size=1024), ssm_layer(2, size=512)], 16)
    batch = BatchDesc([KVCacheDesc(100, 99), KVCacheDesc(64, 0)], system_prompt_length=40)
    # Full attention: 2 shared blocks once + (7 - 2) + (4 - 2) = 9.
    # Window 32 at history 99: stale blocks [0, 4); the second request (history 0) keeps the
    # shared blocks live, so they count: 2 + (7-4-0) + (4-2) = 7.
    # SSM: one slot per request.
    assert layout.slots_for_batch(batch) == [7, 9, 2]
    assert layout.slots_for_batch(BatchDesc([])) == [0, 0, 0]


def test_request_byte_ratio_favours_full_attention_for_long_requests():
    layout = KVLayout([kv_layer(0, window=64), kv_layer(1, size=2048)], 32)
    # capacity 2049, history 2048: window needs 3 live blocks of 8 KiB, full 65 blocks of 4 KiB.
    assert layout.blocks_needed(0, 2049, 2048) == 3
    assert layout.blocks_needed(1, 2049, 2048) == 65
    assert layout.request_byte_ratio(2049, 2048) == pytest.approx(
        [3 * 8192 / (3 * 8192 + 65 * 4096), 65 * 4096 / (3 * 8192 + 65 * 4096)]
    )

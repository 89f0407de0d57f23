"""Pools: slot counts from quota/ratio/granularity/floors (hand-computed), pool-group resize."""

import errno
import os

import numpy as np
import pytest

from kvpool import CacheTier, ConfigError
from kvpool.errors import ArgumentError, LogicError, StorageError
from kvpool.storage.pools import (
    LevelStorage,
    gpu_granularity,
    grains_for_slots,
    min_quota,
    slot_counts_from_ratio,
    slots_for_grains,
)

MiB = 1 << 20
GiB = 1 << 30


@pytest.mark.parametrize(
    ("quota", "granularity"),
    [
        (1, 2 * MiB),
        (GiB - 1, 2 * MiB),
        (GiB, 2 * MiB),
        (2 * GiB - 1, 2 * MiB),
        (2 * GiB, 4 * MiB),
        (3 * GiB, 4 * MiB),
        (8 * GiB, 16 * MiB),
        (16 * GiB, 32 * MiB),
        (1 << 40, 32 * MiB),
    ],
)
def test_gpu_granularity(quota, granularity):
    assert gpu_granularity(quota) == granularity


def test_grains_round_each_pool_up():
    # 3 slots of (60, 30) bytes with 100-byte grains: ceil(180/100) + ceil(90/100) = 2 + 1.
    assert grains_for_slots(3, (60, 30), 100) == 3
    assert grains_for_slots(4, (60, 30), 100) == 5
    assert grains_for_slots(0, (60, 30), 100) == 0
    assert slots_for_grains(3, (60, 30), 100) == 3
    assert slots_for_grains(4, (60, 30), 100) == 3  # 4 slots need ceil(2.4) + ceil(1.2) = 5
    assert slots_for_grains(5, (60, 30), 100) == 5  # 5 slots need ceil(3) + ceil(1.5) = 5
    assert slots_for_grains(0, (60, 30), 100) == 0
    for grains in range(60):
        n = slots_for_grains(grains, (150, 70, 33), 100)
        assert (
            grains_for_slots(n, (150, 70, 33), 100)
            <= grains
            < grains_for_slots(n + 1, (150, 70, 33), 100)
        )


def test_even_split():
    # 10 grains of 100 bytes; 50-byte and 100-byte slots, half each: 5 grains -> 10 and 5 slots.
    assert slot_counts_from_ratio(1000, [(50,), (100,)], [0.5, 0.5], 100, [1, 1]) == [10, 5]


def test_quota_rounds_down_to_whole_grains():
    assert slot_counts_from_ratio(1099, [(50,), (100,)], [0.5, 0.5], 100, [1, 1]) == [10, 5]


def test_per_pool_rounding():
    # Group 0 (ratio 0.3) first: round(10 x 0.3) = 3 grains -> 3 slots of (60, 30) (see above);
    # group 1 gets the remaining 7 grains -> 7 slots of 100 bytes.
    assert slot_counts_from_ratio(1000, [(60, 30), (100,)], [0.3, 0.7], 100, [1, 1]) == [3, 7]


def test_rounding_is_half_up():
    # round(10 x 0.25) = 2.5 -> 3 grains (Python's round() would give 2).
    assert slot_counts_from_ratio(1000, [(100,), (100,)], [0.25, 0.75], 100, [0, 0]) == [3, 7]


def test_group_below_its_floor_is_pinned_and_the_rest_resplit():
    # Group 0's share round(10 x 0.05) = 1 grain = 1 slot <= floor 3: pinned at 3 slots
    # (3 grains); group 1 gets the other 7.
    assert slot_counts_from_ratio(1000, [(100,), (100,)], [0.05, 0.95], 100, [3, 1]) == [3, 7]


def test_leftover_grains_go_where_another_slot_fits():
    # Group 0 (0.45): round(4.5) = 5 grains, but a 300-byte slot takes 3 grains: 1 slot, 2 grains
    # unused. Group 1: 5 grains = 5 slots. The 2 leftover grains: group 1 (larger ratio) first,
    # 2 more slots -> [1, 7], all 10 grains used.
    counts = slot_counts_from_ratio(1000, [(300,), (100,)], [0.45, 0.55], 100, [0, 0])
    assert counts == [1, 7]
    counts = slot_counts_from_ratio(1000, [(300,), (100,)], [0.6, 0.4], 100, [0, 0])
    # group 1 (0.4) first: round(4) = 4 slots; group 0: 6 grains -> 2 slots. Nothing left.
    assert counts == [2, 4]


def test_quota_below_the_floors_names_the_minimum():
    assert min_quota([(60, 30), (100,)], [4, 2], 100) == (3 + 2 + 2) * 100
    with pytest.raises(
        ConfigError, match=r"cache_tiers\[1\]\.quota=699 is invalid: must be at least 700 bytes"
    ):
        slot_counts_from_ratio(
            699, [(60, 30), (100,)], [0.5, 0.5], 100, [4, 2], "cache_tiers[1].quota"
        )
    # Exactly the minimum: both groups pinned at their floors, then group 0 gets a 5th slot for
    # free (4 and 5 slots of (60, 30) both take 5 grains).
    assert slot_counts_from_ratio(700, [(60, 30), (100,)], [0.5, 0.5], 100, [4, 2]) == [5, 2]


def test_slot_counts_never_exceed_quota_and_respect_floors():
    rng = np.random.default_rng(3)
    for _ in range(300):
        groups = int(rng.integers(1, 5))
        sizes = [
            tuple(int(x) for x in rng.integers(1, 400, int(rng.integers(1, 3))))
            for _ in range(groups)
        ]
        floors = [int(x) for x in rng.integers(0, 4, groups)]
        ratio = rng.random(groups) + 0.01
        ratio = list(ratio / ratio.sum())
        quota = min_quota(sizes, floors, 100) + int(rng.integers(0, 5000))
        counts = slot_counts_from_ratio(quota, sizes, ratio, 100, floors)
        used = sum(grains_for_slots(n, s, 100) for n, s in zip(counts, sizes, strict=True))
        assert used <= quota // 100
        assert all(n >= f for n, f in zip(counts, floors, strict=True))
        # No leftover grain could hold one more slot anywhere.
        for n, s in zip(counts, sizes, strict=True):
            assert (
                used - grains_for_slots(n, s, 100) + grains_for_slots(n + 1, s, 100) > quota // 100
            )


def test_level_storage_sizes_pools_and_reports_ratio():
    level = LevelStorage(
        CacheTier.HOST, 64 * 1024, [(64,), (128, 32)], [0.5, 0.5], [1, 1], granularity=1024
    )
    # 64 grains of 1 KiB, 32 each. Group 0: 32 x 1024 / 64 = 512 slots. Group 1: 200 slots take
    # ceil(200 x 128 / 1024) + ceil(200 x 32 / 1024) = 25 + 7 = 32 grains; 201 would take 33.
    assert level.slot_counts == [512, 200]
    assert level.used_bytes == 64 * 1024
    assert level.ratio == [0.5, 0.5]
    views = [level.pool_groups[1].pool_view(p) for p in (0, 1)]
    assert [v.shape for v in views] == [(level.slot_counts[1], 128), (level.slot_counts[1], 32)]
    level.close()


def fill_slots(group, slot_ids, seed):
    """Write recognizable bytes into every pool of `slot_ids`; return them for checking."""
    expected = {}
    for pool in range(len(group.slot_sizes)):
        view = group.pool_view(pool)
        for slot_id in slot_ids:
            data = np.full(view.shape[1], (seed + slot_id * 7 + pool) % 251, dtype=np.uint8)
            view[slot_id] = data
            expected[pool, slot_id] = data
    return expected


def check_slots(group, expected):
    for (pool, slot_id), data in expected.items():
        assert np.array_equal(group.pool_view(pool)[slot_id], data), (pool, slot_id)


def test_shrink_fast_path_and_expand_keep_data():
    level = LevelStorage(
        CacheTier.HOST, 1 << 20, [(256,), (64, 16)], [0.5, 0.5], [2, 2], granularity=4096
    )
    group = level.pool_groups[1]
    before = group.num_slots
    slots = group.allocator.allocate_multiple(10)
    expected = fill_slots(group, range(10), seed=5)
    level.shrink_pool_group(1, 100)  # high-water mark 10 <= 100: nothing to move
    assert group.num_slots == 100 and group.allocator.capacity == 100
    assert [m.size for m in group.memories] == [100 * 64, 100 * 16]
    check_slots(group, expected)
    level.expand_pool_group(1, before)
    assert group.num_slots == before
    check_slots(group, expected)
    assert len(group.allocator.allocate_multiple(before - 10)) == before - 10
    for slot in slots:
        group.allocator.release(slot)
    level.close()


def test_shrink_refused_while_removed_range_is_occupied_and_nothing_changes():
    level = LevelStorage(
        CacheTier.HOST, 1 << 20, [(256,), (64,)], [0.5, 0.5], [1, 1], granularity=4096
    )
    group = level.pool_groups[0]
    capacity = group.num_slots
    slots = group.allocator.allocate_multiple(40)
    expected = fill_slots(group, range(40), seed=9)
    with pytest.raises(
        LogicError, match=r"cannot shrink to 30 slots: 10 slot\(s\) .* occupied \(first 30\)"
    ):
        level.shrink_pool_group(0, 30)
    assert group.num_slots == capacity and not group.allocator.shrink_in_progress
    assert group.memories[0].size == capacity * 256
    check_slots(group, expected)
    # The caller's path: schedule the shrink, empty the removed range, then shrink.
    group.allocator.prepare_for_shrink(30)
    for slot in slots[30:]:
        group.allocator.release(slot)
    level.shrink_pool_group(0, 30)
    assert group.num_slots == 30 and group.memories[0].size == 30 * 256
    check_slots(group, {k: v for k, v in expected.items() if k[1] < 30})
    level.close()


def test_shrink_and_expand_argument_errors():
    level = LevelStorage(
        CacheTier.HOST, 1 << 20, [(256,), (64,)], [0.5, 0.5], [5, 1], granularity=4096
    )
    with pytest.raises(
        ArgumentError, match="new_num_slots=4 is invalid: must be >= pool group 0's floor 5"
    ):
        level.shrink_pool_group(0, 4)
    counts = level.slot_counts
    with pytest.raises(ArgumentError, match=r"new_num_slots=.* must be in \[0, "):
        level.shrink_pool_group(0, counts[0])
    with pytest.raises(ArgumentError, match="over the level's quota"):
        level.expand_pool_group(0, counts[0] + 16)
    level.shrink_pool_group(1, counts[1] - 256)  # frees 16 KiB = 4 grains
    level.expand_pool_group(0, counts[0] + 64)  # 64 x 256 bytes = 4 grains
    assert level.slot_counts == [counts[0] + 64, counts[1] - 256]
    assert level.used_bytes <= level.quota
    level.close()


def test_failed_expand_rolls_back_every_pool(tmp_path, monkeypatch):
    level = LevelStorage(
        CacheTier.DISK, 1 << 20, [(256, 64)], [1.0], [1], granularity=4096, disk_path=tmp_path
    )
    group = level.pool_groups[0]
    capacity = group.num_slots
    level.shrink_pool_group(0, capacity // 2)
    group.memories[0].write(0, b"first pool")
    real = os.posix_fallocate
    calls = []

    def fail_second(fd, offset, length):
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fail_second)
    with pytest.raises(StorageError, match="No space left on device"):
        level.expand_pool_group(0, capacity)
    monkeypatch.undo()
    assert len(calls) == 2
    assert group.num_slots == capacity // 2
    assert [m.size for m in group.memories] == [capacity // 2 * 256, capacity // 2 * 64]
    assert group.memories[0].read(0, 10).tobytes() == b"first pool"
    level.expand_pool_group(0, capacity)
    assert group.num_slots == capacity
    level.close()


def test_disk_level_has_no_view(tmp_path):
    level = LevelStorage(
        CacheTier.DISK, 1 << 20, [(256,)], [1.0], [1], granularity=4096, disk_path=tmp_path
    )
    with pytest.raises(ArgumentError, match="disk memory has no view"):
        level.pool_groups[0].pool_view(0)
    level.close()

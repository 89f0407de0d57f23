"""KVCacheManager foundation: levels sized from config, floors, page views, shutdown."""

import os

import numpy as np
import pytest

from kvpool import (
    BatchDesc,
    ConfigError,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheDesc,
    KVCacheManager,
    LogicError,
)
from kvpool.config import CacheTier
from kvpool.errors import ArgumentError
from tests.helpers import MiB, kv_layer, make_config, shutdown

TWO_GROUPS = [kv_layer(0, size=8192, window=128), kv_layer(1, size=2048)]


@pytest.fixture
def manager_factory():
    made = []

    def make(config):
        manager = KVCacheManager(config)
        made.append(manager)
        return manager

    yield make
    for manager in made:
        manager.shutdown()


def test_every_level_gets_the_same_pool_groups(manager_factory, tmp_path):
    tiers = [
        GpuCacheTierConfig(64 * MiB),
        HostCacheTierConfig(128 * MiB),
        DiskCacheTierConfig(32 * MiB, str(tmp_path)),
    ]
    manager = manager_factory(
        make_config(
            layers=TWO_GROUPS, tiers=tiers, tokens_per_block=32, initial_pool_ratio=[0.5, 0.5]
        )
    )
    assert manager.num_levels == 3 and manager.num_pool_groups == 2
    assert [manager.get_tier(level) for level in range(3)] == [
        CacheTier.GPU,
        CacheTier.HOST,
        CacheTier.DISK,
    ]
    # Half of each quota per group: 16 KiB and 4 KiB slots.
    assert manager.get_slot_counts(0) == [2048, 8192]
    assert manager.get_slot_counts(1) == [4096, 16384]
    assert manager.get_slot_counts(2) == [1024, 4096]
    assert [manager.get_quota(level) for level in range(3)] == [64 * MiB, 128 * MiB, 32 * MiB]
    assert list(tmp_path.iterdir()) == []


def test_initial_pool_ratio_is_per_layer_group(manager_factory):
    manager = manager_factory(
        make_config(layers=TWO_GROUPS, tokens_per_block=32, initial_pool_ratio=[0.75, 0.25])
    )
    # 16 MiB = 8 grains of 2 MiB: 6 grains of 16 KiB slots, 2 grains of 4 KiB slots.
    assert manager.get_slot_counts(0) == [768, 1024]
    shared = manager_factory(
        make_config(layers=[kv_layer(0, window=64), kv_layer(1)], initial_pool_ratio=[0.3, 0.7])
    )
    assert shared.num_pool_groups == 1
    assert shared.level_storage(0).ratio == [1.0]


def test_typical_step_sets_the_ratio(manager_factory):
    # One request of 2048 tokens at history 2047: the window needs 5 blocks of 16 KiB, full
    # attention 64 blocks of 4 KiB -> bytes 80 KiB : 256 KiB.
    step = BatchDesc([KVCacheDesc(2048, 2047)])
    manager = manager_factory(
        make_config(layers=TWO_GROUPS, tokens_per_block=32, typical_step=step)
    )
    assert manager.level_storage(0).ratio == pytest.approx([80 / 336, 256 / 336], abs=1 / 8)
    counts = manager.get_slot_counts(0)
    assert counts[1] * 4096 > 2 * counts[0] * 16384


def test_default_ratio_uses_a_long_request(manager_factory):
    manager = manager_factory(
        make_config(layers=TWO_GROUPS, tokens_per_block=32, tiers=[GpuCacheTierConfig(256 * MiB)])
    )
    # Capacity 2049 at history 2048: the window needs 5 blocks of 16 KiB, full attention 65 of 4 KiB.
    assert manager.level_storage(0).ratio == pytest.approx([80 / 340, 260 / 340], abs=0.01)


def test_constraints_raise_floors(manager_factory):
    batch = BatchDesc([KVCacheDesc(640, 0)] * 8)  # 8 requests x 20 blocks in both groups
    manager = manager_factory(
        make_config(
            layers=TWO_GROUPS,
            tokens_per_block=32,
            constraints=[batch],
            initial_pool_ratio=[0.99, 0.01],
        )
    )
    assert manager.min_slots == [160, 160]
    assert manager.get_slot_counts(0)[1] >= 160


def test_quota_below_floors_names_the_level_and_minimum():
    # Floors of 160 slots: 2.5 MiB of 16 KiB slots (2 grains) + 640 KiB of 4 KiB slots (1 grain).
    batch = BatchDesc([KVCacheDesc(640, 0)] * 8)
    config = make_config(
        layers=TWO_GROUPS,
        tokens_per_block=32,
        constraints=[batch],
        tiers=[GpuCacheTierConfig(2 * MiB)],
    )
    with pytest.raises(
        ConfigError,
        match=r"cache_tiers\[0\]\.quota=2097152 is invalid: must be at least 6291456 bytes",
    ):
        KVCacheManager(config)


def test_page_view_is_writable_pool_memory(manager_factory):
    manager = manager_factory(make_config(layers=TWO_GROUPS, tokens_per_block=32))
    view = manager.page_view(1, "v")
    group = manager.level_storage(0).pool_groups[1]
    assert view.dtype == np.uint8 and view.shape == (group.num_slots * 2, 2048)
    view[7] = 0xAB  # row 7 = slot 3, position 1 (v)
    assert (group.pool_view(0)[3, 2048:] == 0xAB).all()
    assert not group.pool_view(0)[3, :2048].any()


def test_lookup_errors_name_the_argument(manager_factory):
    manager = manager_factory(make_config(layers=TWO_GROUPS))
    assert manager.get_layer_group_id(1) == 1
    assert manager.get_pool_group_index(1) == 1
    with pytest.raises(ArgumentError, match=r"layer_id=5 is invalid: must be one of \[0, 1\]"):
        manager.get_layer_group_id(5)
    with pytest.raises(
        ArgumentError, match=r"layer_group_id=2 is invalid: must be an integer in \[0, 2\)"
    ):
        manager.get_pool_group_index(2)
    with pytest.raises(ArgumentError, match="'q'"):
        manager.page_view(0, "q")
    with pytest.raises(ArgumentError, match=r"level=1 is invalid: must be an integer in \[0, 1\)"):
        manager.get_quota(1)


def test_config_is_copied(manager_factory):
    layers = [kv_layer(0)]
    config = make_config(layers=layers)
    manager = manager_factory(config)
    config.tokens_per_block = 999
    layers.append(kv_layer(1))
    assert manager.tokens_per_block == 16
    assert manager.config.layers == [kv_layer(0)]


def test_shutdown_is_idempotent_and_final():
    manager = KVCacheManager(make_config())
    manager.shutdown()
    manager.shutdown()
    with pytest.raises(LogicError, match="shut down"):
        manager.get_quota(0)


def test_a_level_of_a_million_slots_makes_a_bounded_number_of_records():
    """The first level's records are made up front, but at most `PREMADE_RECORDS` per pool
    group; ids beyond them get their handle when first allocated."""
    import tracemalloc

    from kvpool import AttentionLayerConfig, BufferConfig, KVCacheManagerConfig
    from kvpool.tiers.state import PREMADE_RECORDS

    slots = 1 << 20
    layer = AttentionLayerConfig(0, [BufferConfig("k", 1024), BufferConfig("v", 1024)])
    config = KVCacheManagerConfig(16, [GpuCacheTierConfig(slots * 2048)], [layer])
    tracemalloc.start()
    try:
        m = KVCacheManager(config)
        built = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert m.get_slot_counts(0) == [slots] and slots > PREMADE_RECORDS
    allocator = m._storage.state.allocators[0][0]
    assert len(allocator._slots) == len(m._storage.state.spare_pages) == PREMADE_RECORDS
    assert len(m._tree._spare) == PREMADE_RECORDS
    assert built < 64 << 20, built  # (a record of each kind per slot: 400 MiB)
    taken = allocator.allocate_multiple(PREMADE_RECORDS + 100)  # beyond them: one at a time
    assert len(allocator._slots) == PREMADE_RECORDS + 100
    allocator.release_multiple(taken)
    shutdown(m)


def test_level_zero_in_shared_memory_lives_in_files_that_go_with_the_manager(tmp_path):
    from kvpool.storage.shared import map_shared

    config = make_config(tiers=[GpuCacheTierConfig(4 * MiB, shared_dir=str(tmp_path))])
    m = KVCacheManager(config)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == [f"pool-0-{i}" for i in range(len(m.layout.pool_groups[0].slot_sizes))]
    cache = m.create_kv_cache(None, [])
    assert cache.resume() and cache.resize(m.tokens_per_block)
    row = int(cache.get_page_indices(0, "k")[0])
    view = m.page_view(0, "k")
    view[row] = 42  # what an engine writes in this process ...
    placement = m.layout.placement(0, "k")
    shared = map_shared(tmp_path / f"pool-0-{placement.pool}")  # ... another process sees
    assert (shared.reshape(-1, placement.size)[row] == 42).all()
    cache.close()
    del view, shared
    shutdown(m)
    assert list(tmp_path.iterdir()) == []


def test_level_zero_shared_by_file_descriptor_leaves_no_file_and_other_processes_map_it():
    """memfd: another process maps each pool through /proc/<pid>/fd (it writes, we read)."""
    import subprocess
    import sys

    config = make_config(tiers=[GpuCacheTierConfig(4 * MiB, shared_by_fd=True)])
    m = KVCacheManager(config)
    paths = m.shared_memory()
    placement = m.layout.placement(0, "k")
    assert sorted(paths) == [f"pool-0-{i}" for i in range(len(m.layout.pool_groups[0].slot_sizes))]
    assert all(path.startswith(f"/proc/{os.getpid()}/fd/") for path in paths.values())
    cache = m.create_kv_cache(None, [])
    assert cache.resume() and cache.resize(m.tokens_per_block)
    row = int(cache.get_page_indices(0, "k")[0])
    writer = (
        "import sys\nfrom kvpool.storage.shared import map_shared\n"
        "pages = map_shared(sys.argv[1]).reshape(-1, int(sys.argv[2]))\n"
        "pages[int(sys.argv[3])] = 77\n"
    )
    path = paths[f"pool-0-{placement.pool}"]
    subprocess.run([sys.executable, "-c", writer, path, str(placement.size), str(row)], check=True)
    assert (m.page_view(0, "k")[row] == 77).all()
    target = os.readlink(path)
    assert target.startswith("/memfd:kvpool-pool-0-"), target  # (no file in any directory)
    cache.close()
    shutdown(m)
    assert not os.path.exists(path)  # (closed: the last holder gone, the kernel frees it)


def test_shared_by_fd_and_shared_dir_are_exclusive(tmp_path):
    tier = GpuCacheTierConfig(4 * MiB, shared_dir=str(tmp_path), shared_by_fd=True)
    with pytest.raises(ConfigError, match=r"cache_tiers\[0\]\.shared_by_fd"):
        KVCacheManager(make_config(tiers=[tier]))
    assert list(tmp_path.iterdir()) == []


def test_shared_dir_must_be_an_existing_directory(tmp_path):
    config = make_config(tiers=[GpuCacheTierConfig(4 * MiB, shared_dir=str(tmp_path / "no"))])
    with pytest.raises(ConfigError, match=r"cache_tiers\[0\]\.shared_dir"):
        KVCacheManager(config)


def test_the_first_levels_records_are_made_with_the_manager(manager_factory, tmp_path):
    """Slot handles, page records and block records of the GPU level exist before the first
    request; filling the level takes them (no new record), colder levels make theirs later."""
    config = make_config(
        [kv_layer(0, size=4096)],
        [GpuCacheTierConfig(2 * MiB), HostCacheTierConfig(2 * MiB)],
        tokens_per_block=16,
        max_util_for_resume=1.0,
    )
    m = manager_factory(config)
    slots = m.get_slot_counts(0)[0]
    storage, tree = m._storage.state, m._tree
    assert len(storage.spare_pages) == slots and len(tree._spare) == slots
    assert len(storage.allocators[0][0]._slots) == slots  # (handles: made)
    assert len(storage.allocators[1][0]._slots) == 0  # (the host's: when first needed)
    premade_pages = {id(page) for page in storage.spare_pages}
    premade_blocks = {id(block) for block in tree._spare}
    caches = []
    for index in range(slots // 4):  # every GPU slot, in committed blocks
        cache = m.create_kv_cache(None, [])
        assert cache.resume() and cache.resize(64)
        cache.commit(list(range(index * 1000, index * 1000 + 64)))
        caches.append(cache)
    used = 4 * (slots // 4)
    pages = list(storage.pages[0][0].values())
    assert len(pages) == used and {id(page) for page in pages} <= premade_pages
    assert len(tree.index) == used and {id(b) for b in tree.index.values()} <= premade_blocks
    assert len(storage.spare_pages) == len(tree._spare) == slots - used
    for cache in caches:
        cache.close()

"""Bad input at every public entry point: a kvpool error that names the argument (and the
allowed range), raised before anything changes, and the manager still usable afterwards."""

import math
import re

import pytest

from kvpool import (
    AttentionLayerConfig,
    BatchDesc,
    BufferConfig,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheDesc,
    KVCacheManager,
    KVCacheManagerConfig,
    KVPoolError,
    LogicError,
    ReuseScope,
)
from kvpool.errors import ArgumentError, ConfigError
from kvpool.storage import Slot, SlotAllocator
from tests.engine_check import CheckingEngine
from tests.faults import state_of
from tests.helpers import MiB, kv_layer, make_config, shutdown

TPB = 16


class Thing:
    """An object of no expected type."""


# The kinds of bad value tried on every argument they apply to.
NEGATIVE, ZERO, HUGE, FLOAT, NAN, BOOL, NONE, STR, OBJECT = (
    -1,
    0,
    10**30,
    1.5,
    math.nan,
    True,
    None,
    "1",
    Thing(),
)
INDEX_BAD = [NEGATIVE, HUGE, FLOAT, NAN, BOOL, NONE, STR, OBJECT]  # a level, a layer group
TOKENS_BAD = [
    5,
    None,
    "abc",
    b"abc",
    {1: 2},
    [True],
    [1, False],
    [-1],
    [2**31],
    [1.5],
    [None],
    [b"short"],
    [Thing()],
]
SCOPE_BAD = [
    5,
    "scope",
    (1, 2),
    ReuseScope(lora_id=-1),
    ReuseScope(lora_id=True),
    ReuseScope(lora_id=2**64),
    ReuseScope(salt=1.5),
]


@pytest.fixture
def setup(tmp_path):
    """A manager on three levels with one active and one suspended request and cached blocks."""
    tiers = [
        GpuCacheTierConfig(2 * MiB),
        HostCacheTierConfig(2 * MiB),
        DiskCacheTierConfig(4 * MiB, str(tmp_path)),
    ]
    m = KVCacheManager(make_config(tiers=tiers, layers=[kv_layer(0, size=16 * TPB * 64)]))
    engine = CheckingEngine(m)
    cached = list(range(100, 100 + 3 * TPB))
    first = m.create_kv_cache()
    assert first.resume() and engine.step(first, cached, cached)
    first.close()
    active = m.create_kv_cache(None, cached + [1])
    assert active.resume() and engine.step(active, cached + [1, 2], [1, 2])
    suspended = m.create_kv_cache()
    assert suspended.resume() and engine.step(suspended, [7] * 20, [7] * 20)
    suspended.suspend()
    yield m, active, suspended
    shutdown(m)


def entry_points(m, active, suspended):
    """(entry point, argument name, call taking the bad value, bad values)."""
    n = m.num_levels
    return [
        ("get_quota", "level", m.get_quota, INDEX_BAD + [n]),
        ("get_tier", "level", m.get_tier, INDEX_BAD),
        ("get_slot_counts", "level", m.get_slot_counts, INDEX_BAD),
        ("get_storage_statistics", "level", m.get_storage_statistics, INDEX_BAD),
        ("level_storage", "level", m.level_storage, INDEX_BAD),
        ("resize", "level", lambda v: m.resize(v, 2 * MiB), INDEX_BAD),
        (
            "resize",
            "quota",
            lambda v: m.resize(1, v),
            [NEGATIVE, ZERO, FLOAT, NAN, BOOL, NONE, STR, OBJECT],
        ),
        ("get_layer_group_id", "layer_id", m.get_layer_group_id, [*INDEX_BAD, 7]),
        ("get_pool_group_index", "layer_group_id", m.get_pool_group_index, INDEX_BAD),
        ("page_view", "(layer_id, role)", lambda v: m.page_view(v, "k"), INDEX_BAD),
        ("page_view", "(layer_id, role)", lambda v: m.page_view(0, v), [5, None, "q", b"k"]),
        ("adjust_cache_level", "level", lambda v: m.adjust_cache_level(v, [1.0]), INDEX_BAD),
        (
            "adjust_cache_level",
            "ratio",
            lambda v: m.adjust_cache_level(0, v),
            [
                None,
                5,
                "a",
                ["a"],
                [1e308, 1e308],
                [math.nan],
                [-1.0],
                [0.0],
                [1.0, 1.0],
                [True],
                [],
            ],
        ),
        (
            "adjust_cache_level",
            "quota",
            lambda v: m.adjust_cache_level(0, [1.0], v),
            [NEGATIVE, ZERO, FLOAT, NAN, BOOL, STR, OBJECT],
        ),
        ("create_kv_cache", "reuse_scope", lambda v: m.create_kv_cache(v), SCOPE_BAD),
        (
            "create_kv_cache",
            "input_tokens",
            lambda v: m.create_kv_cache(None, v),
            [v for v in TOKENS_BAD if v is not None],  # None: no prompt
        ),
        (
            "create_kv_cache",
            "id",
            lambda v: m.create_kv_cache(id=v),
            [FLOAT, BOOL, STR, OBJECT, active.id],
        ),
        (
            "create_kv_cache",
            "priority_callback",
            lambda v: m.create_kv_cache(priority_callback=v),
            [5, "f"],
        ),
        (
            "create_kv_cache",
            "exclude_from_stats",
            lambda v: m.create_kv_cache(exclude_from_stats=v),
            ["no", 1, None],
        ),
        ("probe_reuse", "reuse_scope", lambda v: m.probe_reuse(v, [1, 2]), SCOPE_BAD),
        ("probe_reuse", "input_tokens", lambda v: m.probe_reuse(None, v), TOKENS_BAD),
        ("resize", "capacity", active.resize, [NEGATIVE, FLOAT, NAN, BOOL, NONE, STR, OBJECT]),
        (
            "resize",
            "history_length",
            lambda v: active.resize(active.capacity, v),
            [NEGATIVE, FLOAT, NAN, BOOL, STR, OBJECT],
        ),
        ("commit", "tokens", active.commit, TOKENS_BAD),
        (
            "prepare_write",
            "begin",
            lambda v: active.prepare_write(v, active.capacity),
            [NEGATIVE, HUGE, FLOAT, NAN, BOOL, NONE, STR, OBJECT],
        ),
        (
            "prepare_write",
            "end",
            lambda v: active.prepare_write(active.num_committed_tokens, v),
            [NEGATIVE, HUGE, FLOAT, NAN, BOOL, NONE, STR, OBJECT],
        ),
        ("fork_kv_cache", "cache", m.fork_kv_cache, [NONE, STR, OBJECT, 5]),
        (
            "fork_kv_cache",
            "id",
            lambda v: m.fork_kv_cache(active, v),
            [FLOAT, BOOL, STR, OBJECT, active.id],
        ),
        ("prefetch", "level", suspended.prefetch, INDEX_BAD),
        ("get_base_page_indices", "layer_group_id", active.get_base_page_indices, INDEX_BAD),
        (
            "get_page_indices",
            "(layer_id, role)",
            lambda v: active.get_page_indices(v, "k"),
            INDEX_BAD + [[0]],
        ),
        (
            "get_page_indices",
            "(layer_id, role)",
            lambda v: active.get_page_indices(0, v),
            [5, None, "q"],
        ),
    ]


def test_every_entry_point_refuses_every_bad_kind(setup):
    m, active, suspended = setup
    tried = 0
    for entry, name, call, bad_values in entry_points(m, active, suspended):
        for value in bad_values:
            before = state_of(m)
            with pytest.raises(KVPoolError) as caught:
                result = call(value)
                pytest.fail(f"{entry}({name}={value!r}) returned {result!r}")
            message = str(caught.value)
            assert isinstance(caught.value, ArgumentError), (entry, name, value, message)
            assert re.match(rf"{re.escape(name)}[=\[.]", message), (entry, name, value, message)
            assert "must" in message, message  # the allowed range
            assert state_of(m) == before, (entry, name, value)
            tried += 1
    assert tried > 200
    # Still usable.
    m.check_invariants()
    assert active.resize(active.capacity + 1) and suspended.resume()


def test_calls_after_close_and_shutdown_are_logic_errors(setup):
    m, active, suspended = setup
    active.close()
    for operation, call in [
        ("resume", active.resume),
        ("suspend", active.suspend),
        ("resize", lambda: active.resize(40)),
        ("commit", lambda: active.commit([1])),
        ("stop_committing", active.stop_committing),
        ("prepare_write", lambda: active.prepare_write(0, 0)),
        ("prefetch", lambda: active.prefetch(1)),
        ("get_base_page_indices", lambda: active.get_base_page_indices(0)),
        ("get_page_indices", lambda: active.get_page_indices(0, "k")),
    ]:
        before = state_of(m)
        with pytest.raises(
            LogicError, match=rf"{operation}\(\) on KV cache {active.id}, which is closed"
        ):
            call()
        assert state_of(m) == before
    active.close()  # idempotent
    suspended.close()
    m.shutdown()
    for call in [
        m.create_kv_cache,
        lambda: m.fork_kv_cache(suspended),
        lambda: m.probe_reuse(None, [1]),
        lambda: m.get_quota(0),
        lambda: m.resize(0, 2 * MiB),
        lambda: m.page_view(0, "k"),
        m.adjust,
        m.clear_reusable_blocks,
        lambda: m.adjust_cache_level(0, [1.0]),
    ]:
        with pytest.raises(LogicError, match="the manager was shut down"):
            call()
    m.shutdown()  # idempotent


def test_slot_allocator_arguments():
    allocator = SlotAllocator(8)
    slot = allocator.allocate()
    for name, call, values in [
        ("capacity", SlotAllocator, [NEGATIVE, FLOAT, BOOL, NONE, STR]),
        ("count", allocator.allocate_multiple, [NEGATIVE, FLOAT, BOOL, NONE, STR]),
        ("new_capacity", allocator.prepare_for_shrink, [NEGATIVE, 8, HUGE, BOOL, NONE]),
        ("new_capacity", allocator.expand, [7, 8, BOOL, NONE, FLOAT]),
        ("slot", allocator.release, [None, 5, "x", Slot(0), Thing()]),
    ]:
        for value in values:
            with pytest.raises(KVPoolError) as caught:
                call(value)
            assert f"{name}=" in str(caught.value) or "slot" in str(caught.value), (name, value)
    assert allocator.num_occupied_slots == 1 and not allocator.shrink_in_progress
    allocator.release(slot)
    allocator.check_invariants()


def valid_config(**changes):
    config = make_config(layers=[kv_layer(0)])
    for field, value in changes.items():
        setattr(config, field, value)
    return config


@pytest.mark.parametrize(
    ("field", "value"),
    [("tokens_per_block", value) for value in (NEGATIVE, ZERO, FLOAT, BOOL, NONE, STR)]
    + [("cache_tiers", value) for value in (None, 5, [], [None], [Thing()], "tiers")]
    + [("layers", value) for value in (None, 5, [], [None], [AttentionLayerConfig(0, None)])]
    + [
        ("layers", [AttentionLayerConfig(0, [None])]),
        ("layers", [AttentionLayerConfig(0, [BufferConfig(None, 5)])]),
    ]
    + [
        ("layers", [AttentionLayerConfig(0, [BufferConfig("k", value)])])
        for value in (ZERO, FLOAT, BOOL, NONE)
    ]
    + [("initial_pool_ratio", value) for value in (5, "a", [None], [math.nan], [True])]
    + [("constraints", value) for value in (None, 5, [None], [BatchDesc(None)])]
    + [("typical_step", value) for value in (5, BatchDesc([KVCacheDesc(-1, 0)]))]
    + [("max_util_for_resume", value) for value in (ZERO, 2, NAN, BOOL, NONE, STR)]
    + [("enable_partial_reuse", value) for value in ("no", 1, NONE)]
    + [("rebalance_min_sampled_kv_caches", value) for value in (NEGATIVE, FLOAT, BOOL, NONE)]
    + [("rebalance_cooldown_secs", value) for value in (NEGATIVE, NAN, math.inf, BOOL, NONE)]
    + [("rebalance_ratio_threshold", value) for value in (1.0, NAN, BOOL, NONE)]
    + [("rebalance_moving_average_decay", value) for value in (ZERO, 1.0, NAN, BOOL, NONE)],
)
def test_config_field(field, value):
    config = valid_config(**{field: value})
    with pytest.raises(ConfigError) as caught:
        config.validate()
    assert str(caught.value).startswith(field), str(caught.value)
    with pytest.raises(ConfigError):
        KVCacheManager(config)


@pytest.mark.parametrize("config", [None, 5, "config", {"tokens_per_block": 16}, Thing()])
def test_manager_needs_a_config(config):
    with pytest.raises(
        ArgumentError, match=r"config=.* is invalid: must be a KVCacheManagerConfig"
    ):
        KVCacheManager(config)


def test_manager_clock_must_be_callable():
    with pytest.raises(ArgumentError, match="clock=5 is invalid"):
        KVCacheManager(make_config(), clock=5)


@pytest.mark.parametrize("path", ["/proc", "/sys"])
def test_unusable_disk_directory_is_a_kvpool_error(path):
    config = KVCacheManagerConfig(
        TPB,
        [GpuCacheTierConfig(2 * MiB), DiskCacheTierConfig(2 * MiB, path)],
        [kv_layer(0)],
    )
    with pytest.raises(KVPoolError, match=rf"cache_tiers\[1\].*{path}"):
        KVCacheManager(config)


def test_huge_quota_is_a_kvpool_error_saying_what_was_asked():
    with pytest.raises(
        KVPoolError, match=r"cache_tiers\[0\].quota=.*cannot reserve .* bytes .* available"
    ):
        KVCacheManager(make_config(tiers=[GpuCacheTierConfig(1 << 50)]))


def test_huge_quota_in_resize_fails_cleanly_on_every_level(setup):
    m, active, _ = setup
    active.suspend()
    for level in range(m.num_levels):
        before = state_of(m)
        with pytest.raises(
            KVPoolError, match=r"level \d: .*the quota stays \d+, nothing was changed"
        ):
            m.resize(level, HUGE)
        assert state_of(m) == before
    assert m.resize(2, 8 * MiB) and active.resume()


def test_huge_finite_weights_split_a_level_like_their_proportions():
    """Issue 30: `adjust_cache_level(0, [1e308, 1e308])` raised a raw OverflowError from the
    sum; the weights are scaled by the largest first, so huge ones split like small ones."""
    layers = [kv_layer(0, size=4096), kv_layer(1, size=16384, window=32)]
    m = KVCacheManager(make_config(layers=layers))
    m.adjust_cache_level(0, [1.0, 1.0])
    even = m.get_slot_counts(0)
    m.adjust_cache_level(0, [1.0, 3.0])
    assert m.get_slot_counts(0) != even
    m.adjust_cache_level(0, [1e308, 1e308])
    assert m.get_slot_counts(0) == even
    m.adjust_cache_level(0, [1e308, 3e307])
    m_small = KVCacheManager(make_config(layers=layers))
    m_small.adjust_cache_level(0, [10.0, 3.0])
    assert m.get_slot_counts(0) == m_small.get_slot_counts(0)
    with pytest.raises(ArgumentError, match=r"ratio=\[0.0, 0.0\] is invalid: must be 2 finite"):
        m.adjust_cache_level(0, [0.0, 0.0])
    config = make_config(layers=layers, initial_pool_ratio=[1e308, 1e308])
    with pytest.raises(ConfigError, match=r"initial_pool_ratio=.* summing to 1 \(they sum to inf"):
        config.validate()
    for manager in (m, m_small):
        shutdown(manager)

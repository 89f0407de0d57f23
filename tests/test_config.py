"""Config validation: every invalid value is rejected with the exact field named."""

import math
import re

import pytest

from kvpool import (
    AttentionLayerConfig,
    BatchDesc,
    BufferConfig,
    ConfigError,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheDesc,
    KVCacheManager,
)
from tests.helpers import MiB, kv_layer, make_config, ssm_layer


def expect_error(config, field, value_text):
    """`validate()` and `KVCacheManager(config)` both name `field` and the bad value."""
    pattern = rf"^{re.escape(field)}={re.escape(value_text)} is invalid: must be "
    with pytest.raises(ConfigError, match=pattern) as caught:
        config.validate()
    assert isinstance(caught.value, ValueError)
    with pytest.raises(ConfigError, match=pattern):
        KVCacheManager(config)
    return str(caught.value)


def test_valid_config_passes(tmp_path):
    config = make_config(
        layers=[kv_layer(0, window=64, sinks=4), kv_layer(1), ssm_layer(2)],
        tiers=[
            GpuCacheTierConfig(MiB),
            HostCacheTierConfig(MiB),
            DiskCacheTierConfig(MiB, str(tmp_path)),
        ],
        initial_pool_ratio=[0.25, 0.5, 0.25],
        typical_step=BatchDesc([KVCacheDesc(100, 50)], system_prompt_length=16),
    )
    assert config.validate() is None


@pytest.mark.parametrize("value", [0, -16, 1.5, True])
def test_tokens_per_block(value):
    message = expect_error(make_config(tokens_per_block=value), "tokens_per_block", repr(value))
    assert "an integer >= 1" in message


@pytest.mark.parametrize("value", [0, -1])
def test_quota(value, tmp_path):
    expect_error(
        make_config(tiers=[GpuCacheTierConfig(value)]), "cache_tiers[0].quota", repr(value)
    )
    tiers = [GpuCacheTierConfig(MiB), DiskCacheTierConfig(value, str(tmp_path))]
    expect_error(make_config(tiers=tiers), "cache_tiers[1].quota", repr(value))


@pytest.mark.parametrize("value", [0, -4096])
def test_buffer_size(value):
    layers = [kv_layer(0), kv_layer(1, extra=[BufferConfig("scale", value)])]
    message = expect_error(make_config(layers=layers), "layers[1].buffers[2].size", repr(value))
    assert "an integer >= 1" in message


def test_duplicate_layer_ids():
    message = expect_error(
        make_config(layers=[kv_layer(3), kv_layer(4), kv_layer(3)]), "layers[2].layer_id", "3"
    )
    assert "layers[0] has the same id" in message


def test_duplicate_roles_in_a_layer():
    layer = AttentionLayerConfig(
        0, [BufferConfig("k", 64), BufferConfig("v", 64), BufferConfig("k", 32)]
    )
    message = expect_error(make_config(layers=[layer]), "layers[0].buffers[2].role", "'k'")
    assert "layers[0].buffers[0] has it" in message


def test_sink_tokens_without_a_window():
    message = expect_error(
        make_config(layers=[kv_layer(0, sinks=4)]), "layers[0].num_sink_tokens", "4"
    )
    assert "sinks need a window" in message


@pytest.mark.parametrize(
    ("field", "layer"),
    [
        ("layers[0].sliding_window_size", kv_layer(0, window=0)),
        ("layers[0].num_sink_tokens", kv_layer(0, window=16, sinks=-1)),
    ],
)
def test_window_and_sink_ranges(field, layer):
    expect_error(make_config(layers=[layer]), field, "0" if "window" in field else "-1")


def test_empty_tier_list():
    expect_error(make_config(tiers=[]), "cache_tiers", "[]")


def test_first_tier_not_gpu():
    message = expect_error(
        make_config(tiers=[HostCacheTierConfig(MiB)]),
        "cache_tiers[0]",
        "HostCacheTierConfig(quota=1048576)",
    )
    assert "GpuCacheTierConfig" in message


def test_tiers_out_of_order(tmp_path):
    tiers = [
        GpuCacheTierConfig(MiB),
        DiskCacheTierConfig(MiB, str(tmp_path)),
        HostCacheTierConfig(MiB),
    ]
    expect_error(make_config(tiers=tiers), "cache_tiers[2]", "HostCacheTierConfig(quota=1048576)")


def test_disk_path_not_an_existing_directory(tmp_path):
    missing = str(tmp_path / "missing")
    tiers = [GpuCacheTierConfig(MiB), DiskCacheTierConfig(MiB, missing)]
    message = expect_error(make_config(tiers=tiers), "cache_tiers[1].path", repr(missing))
    assert "an existing directory" in message
    a_file = tmp_path / "file"
    a_file.write_text("x")
    tiers = [GpuCacheTierConfig(MiB), DiskCacheTierConfig(MiB, str(a_file))]
    expect_error(make_config(tiers=tiers), "cache_tiers[1].path", repr(str(a_file)))


def test_empty_layers_and_buffers():
    expect_error(make_config(layers=[]), "layers", "[]")
    expect_error(make_config(layers=[AttentionLayerConfig(0, [])]), "layers[0].buffers", "[]")


def test_initial_pool_ratio_wrong_length():
    layers = [kv_layer(0, window=32), kv_layer(1)]
    message = expect_error(
        make_config(layers=layers, initial_pool_ratio=[1.0]), "initial_pool_ratio", "[1.0]"
    )
    assert "2 values, got 1" in message


@pytest.mark.parametrize(
    ("ratio", "field", "shown"),
    [
        ([1.5, -0.5], "initial_pool_ratio[1]", "-0.5"),
        ([1.0, 0.0], "initial_pool_ratio[1]", "0.0"),
        ([math.nan, 1.0], "initial_pool_ratio[0]", "nan"),
    ],
)
def test_initial_pool_ratio_non_positive(ratio, field, shown):
    layers = [kv_layer(0, window=32), kv_layer(1)]
    expect_error(make_config(layers=layers, initial_pool_ratio=ratio), field, shown)


def test_initial_pool_ratio_not_summing_to_one():
    layers = [kv_layer(0, window=32), kv_layer(1)]
    message = expect_error(
        make_config(layers=layers, initial_pool_ratio=[0.5, 0.6]),
        "initial_pool_ratio",
        "[0.5, 0.6]",
    )
    assert "summing to 1" in message


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("rebalance_min_sampled_kv_caches", -1, "an integer >= 0"),
        ("rebalance_cooldown_secs", -0.5, "a finite number >= 0"),
        ("rebalance_cooldown_secs", math.inf, "a finite number >= 0"),
        ("rebalance_target_ratio_update_interval", 0, "an integer >= 1"),
        ("rebalance_ratio_threshold", 1.0, "a finite number > 1"),
        ("rebalance_ratio_threshold", math.inf, "a finite number > 1"),
        ("rebalance_moving_average_decay", 0.0, "(0, 1)"),
        ("rebalance_moving_average_decay", 1.0, "(0, 1)"),
    ],
)
def test_rebalance_settings(field, value, allowed):
    message = expect_error(make_config(**{field: value}), field, repr(value))
    assert allowed in message


@pytest.mark.parametrize("value", [0.0, -0.1, 1.01, math.nan])
def test_max_util_for_resume(value):
    message = expect_error(
        make_config(max_util_for_resume=value), "max_util_for_resume", repr(value)
    )
    assert "(0, 1]" in message


def test_max_util_for_resume_one_is_allowed():
    make_config(max_util_for_resume=1.0).validate()


def test_batch_descriptions():
    bad_history = BatchDesc([KVCacheDesc(8, 4), KVCacheDesc(8, 9)])
    expect_error(
        make_config(typical_step=bad_history), "typical_step.kv_caches[1].history_length", "9"
    )
    bad_prompt = BatchDesc([KVCacheDesc(8, 4)], system_prompt_length=-1)
    expect_error(
        make_config(constraints=[bad_history.__class__([]), bad_prompt]),
        "constraints[1].system_prompt_length",
        "-1",
    )


def test_manager_validates_before_touching_memory(tmp_path):
    """A bad field after a good disk tier: nothing is created in the folder."""
    tiers = [GpuCacheTierConfig(MiB), DiskCacheTierConfig(MiB, str(tmp_path))]
    with pytest.raises(ConfigError, match="max_util_for_resume"):
        KVCacheManager(make_config(tiers=tiers, max_util_for_resume=2.0))
    assert list(tmp_path.iterdir()) == []

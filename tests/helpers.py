"""Small config builders shared by tests."""

from kvpool import (
    AttentionLayerConfig,
    BufferConfig,
    GpuCacheTierConfig,
    KVCacheManagerConfig,
    SsmLayerConfig,
)

MiB = 1 << 20


def kv_layer(layer_id, size=4096, window=None, sinks=None, extra=()):
    """An attention layer with K and V buffers of `size` bytes per block (plus `extra` buffers)."""
    buffers = [BufferConfig("k", size), BufferConfig("v", size), *extra]
    return AttentionLayerConfig(
        layer_id, buffers, sliding_window_size=window, num_sink_tokens=sinks
    )


def ssm_layer(layer_id, size=8192):
    return SsmLayerConfig(layer_id, [BufferConfig("state", size)])


def make_config(layers=None, tiers=None, tokens_per_block=16, **overrides):
    return KVCacheManagerConfig(
        tokens_per_block,
        tiers if tiers is not None else [GpuCacheTierConfig(16 * MiB)],
        layers if layers is not None else [kv_layer(0), kv_layer(1)],
        **overrides,
    )

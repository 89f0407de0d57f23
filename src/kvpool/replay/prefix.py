"""Prefix-cache hit rate of a block trace at a fixed cache size, through the real manager.

The semantics of the independent `kvcache-simulator` (its numbers are in
../shared/traces/reference_hitrates_kvcache_simulator.json): one tier of exactly N blocks of 512
tokens, requests replayed one at a time in file order, the first half warms the cache up, and a
measured request's hit is its longest cached prefix (a partial last block counts its real
tokens). Each request is created (reusing its cached prefix), given pages for the rest, committed
and closed, so its blocks stay cached until eviction pushes them out.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from collections.abc import Callable, Sequence

from kvpool.config import (
    AttentionLayerConfig,
    BufferConfig,
    CacheTierConfig,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManagerConfig,
)
from kvpool.errors import ArgumentError
from kvpool.manager import KVCacheManager
from kvpool.replay.policy import OFFLINE_OPTIMUM, EvictionPolicy, policy_for
from kvpool.replay.results import PrefixCacheResult
from kvpool.replay.workloads import MOONCAKE_BLOCK, Request
from kvpool.storage.pools import gpu_granularity


def exact_block_config(
    capacity_blocks: int,
    tokens_per_block: int = MOONCAKE_BLOCK,
    tier_ratios: tuple[int, int] = (0, 0),
    disk_path: str | None = None,
) -> KVCacheManagerConfig:
    """A one-layer layout and a GPU quota that give exactly `capacity_blocks` slots: the slot
    size is chosen so that the blocks fill whole allocation grains. `tier_ratios` (host, disk)
    adds a host and a disk level of that many times the GPU's blocks (the disk's file in
    `disk_path`)."""
    if capacity_blocks < 1:
        raise ArgumentError(f"capacity_blocks={capacity_blocks} is invalid: must be >= 1")
    host, disk = tier_ratios
    if not all(type(ratio) is int and ratio >= 0 for ratio in tier_ratios):
        raise ArgumentError(f"tier_ratios={tier_ratios!r} is invalid: must be two integers >= 0")
    if disk and disk_path is None:
        raise ArgumentError("disk_path=None is invalid: a disk level needs a directory")
    granularity = 2 << 20
    while True:
        slot = granularity // math.gcd(granularity, capacity_blocks)
        quota = slot * capacity_blocks
        if gpu_granularity(quota) == granularity:
            break
        granularity = gpu_granularity(quota)
    layer = AttentionLayerConfig(0, [BufferConfig("kv", slot)])
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(quota)]
    if host:
        tiers.append(HostCacheTierConfig(host * quota))
    if disk:
        assert disk_path is not None
        tiers.append(DiskCacheTierConfig(disk * quota, disk_path))
    return KVCacheManagerConfig(tokens_per_block, tiers, [layer], max_util_for_resume=1.0)


def prefix_cache_hit_rate(
    requests: Sequence[Request],
    capacity_blocks: int,
    policy: str | EvictionPolicy = "lru",
    warmup_fraction: float = 0.5,
    progress: Callable[[int, int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    tier_ratios: tuple[int, int] = (0, 0),
) -> PrefixCacheResult:
    """Replay `requests` through a manager of exactly `capacity_blocks` 512-token blocks
    (stopping early, with a partial result, when `should_stop()` turns true); with
    `tier_ratios` (host, disk) below a host and a disk level of that many times as many
    blocks (the disk's file in a temporary directory), and the hits counted by the level
    they are served from. `policy` "belady" is the offline optimum instead
    (`kvpool.replay.belady`, one level of all the levels' blocks), a reference line."""
    if policy == OFFLINE_OPTIMUM:
        from kvpool.replay.belady import belady_hit_rate

        total = capacity_blocks * (1 + sum(tier_ratios))
        result = belady_hit_rate(requests, total, warmup_fraction, progress, should_stop)
        return dataclasses.replace(result, capacity_blocks=capacity_blocks, tier_ratios=tier_ratios)
    chosen = policy_for(policy)
    with tempfile.TemporaryDirectory(prefix="kvpool-prefix-") as disk_path:
        config = dataclasses.replace(
            exact_block_config(capacity_blocks, tier_ratios=tier_ratios, disk_path=disk_path),
            eviction_policy=chosen.manager_policy,
        )
        return _replay(
            requests,
            capacity_blocks,
            chosen,
            config,
            warmup_fraction,
            progress,
            should_stop,
            tier_ratios,
        )


def _replay(
    requests: Sequence[Request],
    capacity_blocks: int,
    chosen: EvictionPolicy,
    config: KVCacheManagerConfig,
    warmup_fraction: float,
    progress: Callable[[int, int], None] | None,
    should_stop: Callable[[], bool] | None,
    tier_ratios: tuple[int, int],
) -> PrefixCacheResult:
    now = [0.0]  # the trace's time: what an eviction policy learns block ages from
    manager = KVCacheManager(config, clock=lambda: now[0])
    assert manager.get_slot_counts(0) == [capacity_blocks]
    warmup = int(len(requests) * warmup_fraction)
    measured = hits = 0
    partial = False
    before = manager.stats().hit_tokens_by_level
    try:
        for index, request in enumerate(requests):
            if index == warmup:
                before = manager.stats().hit_tokens_by_level
            if should_stop is not None and should_stop():
                partial = True
                break
            if progress is not None and index % 256 == 0:
                progress(index, len(requests))
            prompt = request.tokens()
            now[0] = request.arrival
            cache = manager.create_kv_cache(None, prompt, priority_callback=chosen.priority)
            reused = cache.num_committed_tokens
            chosen.on_reuse(manager, cache)
            if index >= warmup:
                measured += len(prompt)
                hits += reused
            if cache.resume() and cache.resize(len(prompt)):
                cache.commit(prompt[reused:])
            cache.close()
        stats = manager.stats()
        manager.clear_reusable_blocks()
    finally:
        manager.shutdown()
    by_tier = {
        name: after - earlier
        for name, after, earlier in zip(
            stats.level_names, stats.hit_tokens_by_level, before, strict=True
        )
    }
    return PrefixCacheResult(
        capacity_blocks,
        chosen.name,
        measured,
        hits,
        max(0, len(requests) - warmup),
        partial,
        tier_ratios,
        by_tier if sum(tier_ratios) else {},
    )

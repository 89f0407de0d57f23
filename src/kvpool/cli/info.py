"""`kvpool info`: how a model's layers map to life cycles, pool groups and pools, and how each
level's quota is split into slots."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from kvpool import __version__, backend_info
from kvpool.config import (
    CacheTierConfig,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManagerConfig,
    LayerConfig,
)
from kvpool.errors import KVPoolError
from kvpool.manager import KVCacheManager
from kvpool.presets import PRESETS
from kvpool.replay.models import hf_config_layers
from kvpool.replay.report import format_bytes

DEFAULT_MODEL = "gemma-3-1b"


def layers_of(args: argparse.Namespace) -> tuple[list[LayerConfig], str]:
    """The layer configs of `--model` or `--hf-config`, and the model's description."""
    if args.hf_config:
        return hf_config_layers(args.hf_config, args.tokens_per_block), f"{args.hf_config}"
    preset = PRESETS[args.model]
    return preset.layers(args.tokens_per_block), preset.name


def tiers_of(args: argparse.Namespace) -> list[CacheTierConfig]:
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(args.gpu)]
    if args.host:
        tiers.append(HostCacheTierConfig(args.host))
    if args.disk:
        tiers.append(DiskCacheTierConfig(args.disk, args.disk_path))
    return tiers


def flag_names(tiers: Sequence[CacheTierConfig]) -> dict[str, str]:
    """Config fields the command's flags set, to name the flag in an error."""
    names = {
        "tokens_per_block": "--tokens-per-block",
        "hf_config=": "--hf-config ",
        "trace=": "trace ",
    }
    for level, tier in enumerate(tiers):
        flag = {GpuCacheTierConfig: "--gpu", HostCacheTierConfig: "--host"}.get(
            type(tier), "--disk"
        )
        names[f"cache_tiers[{level}].quota"] = flag
        names[f"cache_tiers[{level}].path"] = "--disk-path"
    return names


def in_flag_terms(error: KVPoolError, tiers: Sequence[CacheTierConfig]) -> KVPoolError:
    """`error` with the config field names replaced by the flags that set them."""
    message = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
    renamed = message
    for field, flag in flag_names(tiers).items():
        renamed = renamed.replace(field, flag)
    if renamed == message:
        return error
    if isinstance(error, OSError):
        return type(error)(error.errno, renamed)
    return type(error)(renamed)


def build_manager(config: KVCacheManagerConfig) -> KVCacheManager:
    try:
        return KVCacheManager(config)
    except KVPoolError as error:
        raise in_flag_terms(error, config.cache_tiers) from None


def _ranges(ids: Sequence[int]) -> str:
    """[0, 1, 2, 4] -> '0-2,4'."""
    runs: list[list[int]] = []
    for i in sorted(ids):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def info_command(args: argparse.Namespace) -> int:
    layers, description = layers_of(args)
    manager = build_manager(KVCacheManagerConfig(args.tokens_per_block, tiers_of(args), layers))
    try:
        layout = manager.layout
        gpu = manager.level_storage(0).pool_groups[0].memories[0]
        print(f"kvpool {__version__}, backend {backend_info().describe()}")
        print(
            f"model {description}"
            + (f": {PRESETS[args.model].description}" if not args.hf_config else "")
        )
        print(f"  {len(layers)} layers, {args.tokens_per_block} tokens per block")
        print(f"GPU level memory: {gpu.kind}")
        print("layer groups (life cycles):")
        for group, life_cycle in enumerate(layout.life_cycles):
            ids = [lid for lid, g in layout.layer_group_of.items() if g == group]
            print(
                f"  {group}: {life_cycle}; layers {_ranges(ids)}; "
                f"pool group {layout.pool_group_of[group]}"
            )
        print("pool groups:")
        for index, pool_group in enumerate(layout.pool_groups):
            sizes = ", ".join(format_bytes(s) for s in pool_group.slot_sizes)
            print(
                f"  {index}: {len(pool_group.slot_sizes)} pool(s), slot sizes [{sizes}]; "
                f"layer groups {list(pool_group.layer_groups)}; floor {manager.min_slots[index]} slots"
            )
        print("levels:")
        for level in range(manager.num_levels):
            storage = manager.level_storage(level)
            print(
                f"  {level} {storage.tier.name}: quota {format_bytes(storage.quota)}, "
                f"granularity {format_bytes(storage.granularity)}, used {format_bytes(storage.used_bytes)}"
            )
            for index, count in enumerate(storage.slot_counts):
                tokens = count * args.tokens_per_block
                print(
                    f"    pool group {index}: {count} slots ({tokens} tokens), "
                    f"{storage.ratio[index]:.1%} of the level"
                )
    finally:
        manager.shutdown()
    remote = getattr(args, "remote", None)
    return 0 if not remote else remote_nodes(remote)


def remote_nodes(urls: list[str]) -> int:
    """`--remote`: the shared tier's nodes, as the cluster describes them."""
    from kvpool.config import RemoteCacheTierConfig
    from kvpool.remote.cluster import describe
    from kvpool.remote.store import url_without_password

    config = RemoteCacheTierConfig(urls, cluster=True, timeout_ms=2000)  # (checked by _check)
    shown = ", ".join(url_without_password(url) for url in urls)
    views = describe(config)
    if not views:
        print(f"remote tier {shown}: no node answers")
        return 1
    print(f"remote tier {shown}: {len(views)} node(s)")
    for view in views:
        keys = "not answering" if view.keys is None else f"{view.keys:,} keys"
        used = "" if view.used_bytes is None else f", {format_bytes(view.used_bytes)} used"
        print(f"  {view.address} {view.role}: {view.slots} slots, {keys}{used}")
    return 0

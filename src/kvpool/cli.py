"""The `kvpool` command."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence

from kvpool import __version__
from kvpool.config import GpuCacheTierConfig, HostCacheTierConfig, KVCacheManagerConfig
from kvpool.errors import KVPoolError
from kvpool.manager import KVCacheManager
from kvpool.presets import PRESETS

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """'1GiB', '512M', '4096' -> bytes (binary units)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (examples: 4096, 512MiB, 8GiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _ranges(ids: Sequence[int]) -> str:
    """[0, 1, 2, 4] -> '0-2,4'."""
    runs: list[list[int]] = []
    for i in sorted(ids):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def info(args: argparse.Namespace) -> int:
    preset = PRESETS[args.model]
    tiers: list[GpuCacheTierConfig | HostCacheTierConfig] = [GpuCacheTierConfig(args.gpu_quota)]
    if args.host_quota:
        tiers.append(HostCacheTierConfig(args.host_quota))
    config = KVCacheManagerConfig(
        args.tokens_per_block, tiers, preset.layers(args.tokens_per_block)
    )
    manager = KVCacheManager(config)
    try:
        layout = manager.layout
        gpu = manager.level_storage(0).pool_groups[0].memories[0]
        print(f"kvpool {__version__}")
        print(f"model {preset.name}: {preset.description}")
        print(
            f"  {preset.num_layers} layers, {preset.num_kv_heads} KV heads x {preset.head_dim} dims, "
            f"{args.tokens_per_block} tokens per block"
        )
        print(f"GPU level memory: {gpu.kind}")
        print("layer groups (life cycles):")
        for group, life_cycle in enumerate(layout.life_cycles):
            layers = [lid for lid, g in layout.layer_group_of.items() if g == group]
            print(
                f"  {group}: {life_cycle}; layers {_ranges(layers)}; "
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
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpool", description="A paged, tiered KV-cache manager.")
    parser.add_argument("--version", action="version", version=f"kvpool {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    info_parser = commands.add_parser("info", help="print the pool-group layout of a model")
    info_parser.add_argument("--model", choices=sorted(PRESETS), default="gemma-3-1b")
    info_parser.add_argument("--tokens-per-block", type=int, default=32)
    info_parser.add_argument("--gpu-quota", type=parse_bytes, default=parse_bytes("1GiB"))
    info_parser.add_argument("--host-quota", type=parse_bytes, default=0)
    info_parser.set_defaults(run=info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        status: int = args.run(args)
    except KVPoolError as error:
        print(f"kvpool: error: {error}", file=sys.stderr)
        return 2
    return status


if __name__ == "__main__":
    sys.exit(main())

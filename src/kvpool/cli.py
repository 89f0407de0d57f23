"""The `kvpool` command."""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from collections.abc import Sequence

from kvpool import __version__
from kvpool.config import (
    CacheTierConfig,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManagerConfig,
)
from kvpool.errors import ArgumentError, KVPoolError
from kvpool.manager import KVCacheManager
from kvpool.presets import PRESETS
from kvpool.replay.driver import ReplayOptions, replay
from kvpool.replay.models import hf_config_layers, preset_layers
from kvpool.replay.policy import POLICIES
from kvpool.replay.prefix import prefix_cache_hit_rate
from kvpool.replay.report import format_bytes, print_report, write_json, write_plot
from kvpool.replay.workloads import (
    Request,
    load_azure,
    load_mooncake,
    synthetic_conversations,
    synthetic_system_prompts,
)

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """'1GiB', '512M', '4096' -> bytes (binary units)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (examples: 4096, 512MiB, 8GiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


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


def _workload(args: argparse.Namespace) -> tuple[list[Request], str]:
    """The requests to replay and a title for them."""
    if args.trace:
        kind = args.format
        if kind == "auto":
            kind = "azure" if str(args.trace).endswith(".csv") else "mooncake"
        if kind == "azure":
            return load_azure(args.trace, args.requests, args.seed), f"Azure trace {args.trace}"
        return load_mooncake(args.trace, args.requests), f"Mooncake trace {args.trace}"
    if args.synthetic == "system-prompts":
        workload = synthetic_system_prompts(num_requests=args.requests or 400, seed=args.seed)
        return workload, f"synthetic shared system prompts (seed {args.seed})"
    workload = synthetic_conversations(
        num_conversations=(args.requests or 240) // 4, seed=args.seed
    )
    return workload, f"synthetic conversations (seed {args.seed})"


def _tiers(args: argparse.Namespace) -> list[CacheTierConfig]:
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(args.gpu)]
    if args.host:
        tiers.append(HostCacheTierConfig(args.host))
    if args.disk:
        tiers.append(DiskCacheTierConfig(args.disk, args.disk_path))
    return tiers


def replay_command(args: argparse.Namespace) -> int:
    workload, title = _workload(args)
    if args.capacity_blocks:
        return _prefix_cache_table(args, workload, title)
    layers = (
        hf_config_layers(args.hf_config, args.tokens_per_block)
        if args.hf_config
        else preset_layers(args.model, args.tokens_per_block)
    )
    config = KVCacheManagerConfig(
        args.tokens_per_block,
        _tiers(args),
        layers,
        rebalance_min_sampled_kv_caches=args.rebalance_min_samples,
        rebalance_cooldown_secs=0.0,
        rebalance_target_ratio_update_interval=max(1, args.rebalance_min_samples // 4),
    )
    config.validate()
    longest = max((request.input_length + request.output_length for request in workload), default=0)
    _check_fits(config, longest, args.prefill_chunk)
    options = ReplayOptions(
        max_batch=args.max_batch,
        prefill_chunk=args.prefill_chunk,
        step_seconds=args.step_ms / 1000.0,
        as_fast_as_possible=args.asap,
        policy=args.policy,
        verify=args.verify,
        rebalance=not args.no_rebalance,
    )
    from rich.progress import Progress

    with Progress(transient=True, disable=not args.progress) as bar:
        task = bar.add_task("replaying", total=len(workload))
        report = replay(
            workload, config, options, progress=lambda done, total: bar.update(task, completed=done)
        )
    model = f"model {args.hf_config or args.model}"
    print_report(report, f"kvpool replay: {title}, {model}")
    if args.json:
        write_json(report, args.json, {"workload": title, "model": args.hf_config or args.model})
    if args.plot:
        write_plot(report, args.plot)
    return 0


def _check_fits(config: KVCacheManagerConfig, tokens: int, chunk: int) -> None:
    """Refuse a layout whose GPU level cannot hold even the workload's longest request (its
    last prefill chunk or decode step)."""
    manager = KVCacheManager(config)
    try:
        layout, storage = manager.layout, manager.level_storage(0)
        for pool_group, group in enumerate(layout.pool_groups):
            need = sum(
                layout.blocks_needed(g, tokens, max(0, tokens - chunk)) for g in group.layer_groups
            )
            have = storage.pool_groups[pool_group].num_slots
            if need > have:
                raise ArgumentError(
                    f"gpu={config.cache_tiers[0].quota} is too small: the longest request ({tokens} "
                    f"tokens) needs {need} slots of {group.slot_bytes} bytes in pool group "
                    f"{pool_group}, the GPU level has {have}; it needs about "
                    f"{format_bytes(int(need * group.slot_bytes / storage.ratio[pool_group]))} in all"
                )
    finally:
        manager.shutdown()


def _prefix_cache_table(args: argparse.Namespace, workload: list[Request], title: str) -> int:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"prefix-cache hit rate: {title} (512-token blocks, first half warms up)")
    for column in ("blocks", "policy", "hit rate", "hit tokens", "measured tokens"):
        table.add_column(column, justify="right")
    results = []
    for capacity in args.capacity_blocks:
        result = prefix_cache_hit_rate(workload, capacity, args.policy)
        results.append(result)
        table.add_row(
            f"{capacity:,}",
            result.policy,
            f"{result.hit_rate:.4f}",
            f"{result.hit_tokens:,}",
            f"{result.measured_tokens:,}",
        )
    Console().print(table)
    if args.json:
        import json

        with open(args.json, "w", encoding="utf-8") as file:
            json.dump([vars(r) | {"hit_rate": r.hit_rate} for r in results], file, indent=2)
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

    replay_parser = commands.add_parser(
        "replay",
        help="replay a serving trace (or a synthetic workload) through the manager",
        description="Replay requests through a real KVCacheManager with a continuous-batching "
        "scheduler (no model compute) and report cache hits, concurrency, tier traffic and "
        "rebalancing. Without a trace, a seeded synthetic multi-turn chat workload is used.",
    )
    replay_parser.add_argument("trace", nargs="?", help="Mooncake .jsonl or Azure .csv trace")
    replay_parser.add_argument("--format", choices=["auto", "mooncake", "azure"], default="auto")
    replay_parser.add_argument(
        "--synthetic", choices=["conversations", "system-prompts"], default="conversations"
    )
    replay_parser.add_argument(
        "--requests", type=int, default=None, help="replay at most this many requests"
    )
    replay_parser.add_argument("--seed", type=int, default=0)
    replay_parser.add_argument(
        "--model", default="gemma-3-1b", help=f"a preset: {', '.join(sorted(PRESETS))}"
    )
    replay_parser.add_argument(
        "--hf-config", help="a Hugging Face config.json to derive the layout from"
    )
    replay_parser.add_argument("--tokens-per-block", type=int, default=32)
    replay_parser.add_argument(
        "--gpu", type=parse_bytes, default=parse_bytes("512MiB"), help="GPU level quota"
    )
    replay_parser.add_argument(
        "--host", type=parse_bytes, default=parse_bytes("2GiB"), help="host level quota (0: none)"
    )
    replay_parser.add_argument(
        "--disk", type=parse_bytes, default=0, help="disk level quota (0: none)"
    )
    replay_parser.add_argument("--disk-path", default=tempfile.gettempdir())
    replay_parser.add_argument("--max-batch", type=int, default=64)
    replay_parser.add_argument(
        "--prefill-chunk", type=int, default=2048, help="prompt tokens per engine step"
    )
    replay_parser.add_argument(
        "--step-ms", type=float, default=20.0, help="simulated time of one engine step"
    )
    replay_parser.add_argument("--asap", action="store_true", help="ignore arrival times")
    replay_parser.add_argument("--policy", choices=sorted(POLICIES), default="default")
    replay_parser.add_argument("--no-rebalance", action="store_true")
    replay_parser.add_argument("--rebalance-min-samples", type=int, default=40)
    replay_parser.add_argument(
        "--verify", action="store_true", help="write and check every KV record"
    )
    replay_parser.add_argument(
        "--capacity-blocks",
        type=int,
        nargs="+",
        help="prefix-cache mode: hit rates at these cache sizes (blocks of 512 tokens)",
    )
    replay_parser.add_argument("--json", help="write every figure to this JSON file")
    replay_parser.add_argument(
        "--plot", help="write the occupancy / hit-rate plot to this PNG file"
    )
    replay_parser.add_argument("--no-progress", dest="progress", action="store_false")
    replay_parser.set_defaults(run=replay_command)
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

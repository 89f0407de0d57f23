"""`kvpool replay`: build the workload and the manager config from the flags, run the replay
(or the prefix-cache table), and report. Ctrl-C stops it cleanly with a partial report."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from kvpool import backend
from kvpool.cli.arguments import atomic_write, describe_size
from kvpool.cli.info import build_manager, in_flag_terms, layers_of, tiers_of
from kvpool.config import KVCacheManagerConfig, RemoteCacheTierConfig
from kvpool.errors import ArgumentError, KVPoolError
from kvpool.remote.store import url_without_password
from kvpool.replay.driver import ReplayOptions, ReplayReport, replay
from kvpool.replay.policy import policy_for
from kvpool.replay.prefix import prefix_cache_hit_rate
from kvpool.replay.report import (
    format_bytes,
    print_report,
    report_json,
    write_capacity_plot,
    write_json,
    write_plot,
)
from kvpool.replay.results import PrefixCacheResult
from kvpool.replay.workloads import (
    Request,
    load_azure,
    load_mooncake,
    synthetic_conversations,
    synthetic_system_prompts,
)

INTERRUPTED = 130  # the shell's status for a process stopped by SIGINT
logger = logging.getLogger("kvpool.replay")


@contextmanager
def stop_on_interrupt() -> Iterator[Callable[[], bool]]:
    """The first Ctrl-C asks the replay to stop after the current engine step (a clean, partial
    report); a second one interrupts at once. Yields `should_stop()`."""
    requested = [False]

    def handler(signum: int, frame: Any) -> None:
        requested[0] = True
        signal.signal(signal.SIGINT, signal.default_int_handler)
        print("kvpool: stopping after this step (Ctrl-C again to abort)", file=sys.stderr)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield lambda: requested[0]
    finally:
        signal.signal(signal.SIGINT, previous)


def load_workload(args: argparse.Namespace) -> tuple[list[Request], str, list[str]]:
    """The requests to replay, a title, and notes about them (an empty workload is an error)."""
    notes: list[str] = []
    if args.trace:
        kind = args.format
        if kind == "auto":
            kind = "azure" if str(args.trace).endswith(".csv") else "mooncake"
        if kind == "azure":
            workload = load_azure(args.trace, args.requests, args.seed)
            title = f"Azure trace {args.trace}"
            notes.append(
                "Azure traces carry no prefix information: every prompt is made of fresh "
                "tokens, so no request can reuse another's KV (hits are 0 by construction)"
            )
        else:
            workload, title = (
                load_mooncake(args.trace, args.requests),
                f"Mooncake trace {args.trace}",
            )
    elif args.synthetic == "system-prompts":
        workload = synthetic_system_prompts(num_requests=args.requests or 400, seed=args.seed)
        title = f"synthetic shared system prompts (seed {args.seed})"
    else:
        count = args.requests or 240
        turns = 4
        workload = synthetic_conversations(
            num_conversations=-(-count // turns), turns=turns, seed=args.seed
        )
        workload = workload[:count]
        title = f"synthetic multi-turn conversations (seed {args.seed})"
    if not workload:
        raise ArgumentError(f"trace={args.trace!r} is invalid: it holds no request")
    return workload, title, notes


def remote_config(args: argparse.Namespace) -> RemoteCacheTierConfig:
    urls = args.remote
    return RemoteCacheTierConfig(
        urls[0] if len(urls) == 1 else list(urls),
        namespace=args.remote_namespace,
        model_id=args.hf_config or args.model or "",
        cluster=args.remote_cluster,
    )


def manager_config(args: argparse.Namespace) -> tuple[KVCacheManagerConfig, str]:
    """The replay's manager config; the remote tier (`--remote`) is left out here and added
    only to the replay's own manager (the set-up checks must not connect to it)."""
    layers, description = layers_of(args)
    config = KVCacheManagerConfig(
        args.tokens_per_block,
        tiers_of(args),
        layers,
        rebalance_min_sampled_kv_caches=args.rebalance_min_samples,
        rebalance_cooldown_secs=0.0,
        rebalance_target_ratio_update_interval=max(1, args.rebalance_min_samples // 4),
        eviction_policy=policy_for(args.policy[0]).manager_policy,
    )
    try:
        config.validate()
    except KVPoolError as error:
        raise in_flag_terms(error, config.cache_tiers) from None
    return config, description


def setup_of(
    args: argparse.Namespace, config: KVCacheManagerConfig, title: str, model: str
) -> dict[str, Any]:
    """What was simulated, with every flag: the JSON's `setup` and the report's first rows."""
    manager = build_manager(config)
    try:
        pool_groups = manager.layout.pool_group_names()
        levels = [
            {
                "tier": manager.get_tier(level).name,
                "quota": manager.get_quota(level),
                "slot_counts": manager.get_slot_counts(level),
                "slot_bytes": [group.slot_bytes for group in manager.layout.pool_groups],
            }
            for level in range(manager.num_levels)
        ]
    finally:
        manager.shutdown()
    flags = {key: value for key, value in vars(args).items() if key != "run"}
    if args.remote:
        flags["remote"] = [url_without_password(url) for url in args.remote]
    sizes = {flag: describe_size(str(getattr(args, flag))) for flag in ("gpu", "host", "disk")}
    return {
        "argv": command_line(args),
        "flags": flags,
        "sizes": sizes,
        "workload": title,
        "model": model,
        "pool_groups": pool_groups,
        "tokens_per_block": args.tokens_per_block,
        "levels": levels,
        "policy": args.policy[0],
        "seed": args.seed,
        "scheduler": {
            "max_batch": args.max_batch,
            "prefill_chunk": args.prefill_chunk,
            "step_ms": args.step_ms,
            "asap": args.asap,
            "rebalance": not args.no_rebalance,
            "rebalance_min_samples": args.rebalance_min_samples,
        },
    }


def command_line(args: argparse.Namespace) -> list[str]:
    """A `kvpool replay` command line that repeats this run (every flag spelled out)."""
    argv = ["replay"]
    if args.trace:
        argv += [str(args.trace), "--format", args.format]
    elif args.synthetic:
        argv += ["--synthetic", args.synthetic]
    if args.requests is not None:
        argv += ["--requests", str(args.requests)]
    argv += ["--seed", str(args.seed)]
    argv += ["--hf-config", args.hf_config] if args.hf_config else ["--model", args.model]
    argv += ["--tokens-per-block", str(args.tokens_per_block)]
    argv += ["--gpu", str(args.gpu), "--host", str(args.host), "--disk", str(args.disk)]
    if args.disk:
        argv += ["--disk-path", str(args.disk_path)]
    argv += ["--max-batch", str(args.max_batch), "--prefill-chunk", str(args.prefill_chunk)]
    argv += ["--step-ms", repr(args.step_ms), "--policy", *args.policy]
    argv += ["--rebalance-min-samples", str(args.rebalance_min_samples)]
    argv += [
        flag
        for flag, on in (
            ("--asap", args.asap),
            ("--no-rebalance", args.no_rebalance),
            ("--verify", args.verify),
        )
        if on
    ]
    if args.capacity_blocks:
        argv += ["--capacity-blocks", *map(str, args.capacity_blocks)]
    if args.remote:
        urls = [url_without_password(url) for url in args.remote]  # (never in a report)
        argv += ["--remote", *urls, "--remote-namespace", args.remote_namespace]
        argv += ["--remote-cluster"] if args.remote_cluster else []
    return argv


def check_fits(config: KVCacheManagerConfig, tokens: int, chunk: int) -> None:
    """Refuse a GPU level that cannot hold the workload's longest request (its last prefill
    chunk or decode step), naming `--gpu` and a quota that fits."""
    manager = build_manager(config)
    try:
        layout, storage = manager.layout, manager.level_storage(0)
        for pool_group, group in enumerate(layout.pool_groups):
            need = sum(
                layout.blocks_needed(g, tokens, max(0, tokens - chunk)) for g in group.layer_groups
            )
            have = storage.pool_groups[pool_group].num_slots
            if need > have:
                fits = int(need * group.slot_bytes / storage.ratio[pool_group] * 1.1)
                raise ArgumentError(
                    f"--gpu {format_bytes(config.cache_tiers[0].quota)} is too small: the longest "
                    f"request ({tokens:,} tokens) needs {need} slots of {format_bytes(group.slot_bytes)} "
                    f"in pool group {pool_group}, the GPU level has {have}; use --gpu "
                    f"{-(-fits // (1 << 28)) / 4:.2f}GiB or more (or fewer --requests)"
                )
    finally:
        manager.shutdown()


def replay_command(args: argparse.Namespace) -> int:
    workload, title, notes = load_workload(args)
    if args.capacity_blocks:
        return prefix_cache_table(args, workload, title, notes)
    config, model = manager_config(args)
    longest = max(request.input_length + request.output_length for request in workload)
    check_fits(config, longest, args.prefill_chunk)
    setup = setup_of(args, config, title, model)
    options = ReplayOptions(
        max_batch=args.max_batch,
        prefill_chunk=args.prefill_chunk,
        step_seconds=args.step_ms / 1000.0,
        as_fast_as_possible=args.asap,
        policy=args.policy[0],
        verify=args.verify,
        rebalance=not args.no_rebalance,
    )
    if args.remote:
        config = dataclasses.replace(config, remote_tier=remote_config(args))
    from rich.progress import Progress

    with (
        stop_on_interrupt() as should_stop,
        Progress(transient=True, disable=not args.progress) as bar,
    ):
        task = bar.add_task("replaying", total=len(workload))
        metrics: list[Any] = []
        try:
            report = replay(
                workload,
                config,
                options,
                progress=lambda done, total: bar.update(task, completed=done),
                should_stop=should_stop,
                on_manager=None
                if args.metrics_port is None
                else lambda manager: metrics.append(serve_metrics(manager, args.metrics_port)),
            )
            finish(args, report, setup, notes, title)
            if metrics and args.metrics_hold and not report.partial:
                logger.info("serving /metrics for %g more seconds", args.metrics_hold)
                deadline = time.monotonic() + args.metrics_hold
                while not should_stop() and time.monotonic() < deadline:
                    time.sleep(0.05)
        finally:
            for served in metrics:
                served.close()
    return INTERRUPTED if report.partial else 0


def serve_metrics(manager: Any, port: int) -> Any:
    """`--metrics-port`: the manager's Prometheus metrics over HTTP on `port`."""
    from kvpool.metrics import PrometheusMetrics

    try:
        from prometheus_client import CollectorRegistry
    except ImportError:
        raise ArgumentError(
            "--metrics-port needs prometheus_client: pip install 'kvpool[metrics]'"
        ) from None
    metrics = PrometheusMetrics(manager, registry=CollectorRegistry())
    try:
        bound = metrics.serve(port)
    except ArgumentError as error:  # (closed already)
        raise ArgumentError(str(error).replace("port=", "--metrics-port ", 1)) from None
    logger.warning("serving Prometheus metrics on http://0.0.0.0:%d/metrics", bound)
    return metrics


def finish(
    args: argparse.Namespace,
    report: ReplayReport,
    setup: dict[str, Any],
    notes: list[str],
    title: str,
) -> None:
    if report.partial:
        notes = [*notes, f"partial report: stopped after {report.steps:,} engine steps (Ctrl-C)"]
    print_report(report, f"kvpool replay: {title}", setup, notes, args.explain)
    if args.json:
        atomic_write(args.json, lambda path: write_json(report_json(report, setup, notes), path))
    if args.plot:
        atomic_write(args.plot, lambda path: write_plot(report, path, setup["pool_groups"]))


def served_from(result: PrefixCacheResult) -> str:
    """Shares of the hit tokens by the level that served them, e.g. "GPU 70% HOST 30%"."""
    if not result.hit_tokens or not result.hit_tokens_by_tier:
        return "-"
    return " ".join(
        f"{name} {tokens / result.hit_tokens:.0%}"
        for name, tokens in result.hit_tokens_by_tier.items()
    )


def prefix_cache_table(
    args: argparse.Namespace, workload: list[Request], title: str, notes: list[str]
) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    results = []
    ratios = tuple(args.tier_ratios or (0, 0))
    assert len(ratios) == 2
    with (
        stop_on_interrupt() as should_stop,
        Progress(transient=True, disable=not args.progress) as bar,
    ):
        for policy in args.policy:
            for capacity in args.capacity_blocks:
                task = bar.add_task(f"{policy}, {capacity:,} blocks", total=len(workload))

                def advance(done: int, total: int, task: Any = task) -> None:
                    bar.update(task, completed=done)

                result = prefix_cache_hit_rate(
                    workload,
                    capacity,
                    policy,
                    progress=advance,
                    should_stop=should_stop,
                    tier_ratios=ratios,
                )
                bar.update(task, completed=len(workload))
                results.append(result)
                if result.partial:
                    break
            if results and results[-1].partial:
                break
    partial = any(result.partial for result in results)
    tiers = f", host {ratios[0]}x and disk {ratios[1]}x the GPU's blocks" if sum(ratios) else ""
    table = Table(
        title=f"prefix-cache hit rate: {title} (512-token blocks{tiers}, first half warms up)"
    )
    columns = ["blocks", "policy", "hit rate", "hit tokens", "measured tokens"]
    if sum(ratios):
        columns.insert(3, "served from")
    for column in columns:
        table.add_column(column, justify="right")
    for result in results:
        row = [
            f"{result.capacity_blocks:,}" + (" (partial)" if result.partial else ""),
            result.policy,
            f"{result.hit_rate:.4f}",
            f"{result.hit_tokens:,}",
            f"{result.measured_tokens:,}",
        ]
        if sum(ratios):
            row.insert(3, served_from(result))
        table.add_row(*row)
    if any(request.block_ids for request in workload):
        from kvpool.replay.belady import belady_hit_rate

        ceiling = belady_hit_rate(workload, 2**62).hit_rate
        notes = [*notes, f"ceiling (a cache that never evicts): {ceiling:.4f}"]
    console = Console()
    console.print(table)
    for note in notes:
        console.print(f"note: {note}")
    if args.json:
        data = {
            "schema": 1,
            "backend": backend(),
            "partial": partial,
            "setup": {"argv": command_line(args), "workload": title, "policy": args.policy},
            "notes": notes,
            "results": [vars(r) | {"hit_rate": r.hit_rate} for r in results],
        }
        atomic_write(args.json, lambda path: write_json(data, path))
    if args.plot:
        complete = [r for r in results if not r.partial]
        curves = {
            policy: [(r.capacity_blocks, r.hit_rate) for r in complete if r.policy == policy]
            for policy in args.policy
        }
        atomic_write(args.plot, lambda path: write_capacity_plot(curves, path))
    return INTERRUPTED if partial else 0

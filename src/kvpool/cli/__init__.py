"""The `kvpool` command: `kvpool info`, `kvpool replay`, `kvpool generate`, `kvpool serve`.

Every user error is one line, `kvpool: error: ...`, with exit status 2, raised before any work is
done; Ctrl-C during a replay stops it cleanly (a partial report, exit status 130). The library
prints nothing itself: it logs to the `kvpool` logger, which `--verbose`/`--quiet` tune.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import NoReturn

from kvpool import __version__
from kvpool.cli.arguments import (
    check_disk_directory,
    check_output_file,
    int_at_least,
    joined_negative_sizes,
    non_negative_number,
    parse_bytes,
)
from kvpool.cli.generate import add_generate_parser
from kvpool.cli.info import DEFAULT_MODEL, in_flag_terms, info_command, tiers_of
from kvpool.cli.replay import INTERRUPTED, remote_config, replay_command
from kvpool.cli.serve import add_serve_parser, check_serve
from kvpool.config import RemoteCacheTierConfig
from kvpool.errors import ConfigError, KVPoolError
from kvpool.presets import PRESETS
from kvpool.replay.policy import OFFLINE_OPTIMUM, POLICIES

__all__ = ["build_parser", "main", "parse_bytes"]


class Parser(argparse.ArgumentParser):
    """Errors in one line, `kvpool: error: ...` (status 2), with no usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"kvpool: error: {message} (see {self.prog} --help)\n")


class HelpFormatter(argparse.HelpFormatter):
    """Shows each flag's default where it has one (not for switches and unset options)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            action.default not in (None, False, True, argparse.SUPPRESS)
            and "%(default)" not in text
        ):
            text += " (default: %(default)s)"
        return text


def _model_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model layout")
    group.add_argument(
        "--model", choices=sorted(PRESETS), help=f"a preset (default: {DEFAULT_MODEL})"
    )
    group.add_argument(
        "--hf-config",
        metavar="PATH",
        help="a Hugging Face config.json (or a model directory holding one) instead of --model",
    )
    group.add_argument(
        "--tokens-per-block", type=int_at_least(1), default=32, metavar="N", help="block size"
    )


def _memory_flags(parser: argparse.ArgumentParser, gpu: str, host: str) -> None:
    group = parser.add_argument_group(
        "memory (sizes: 4096, 512MiB or 512M binary, 512MB decimal; 0 = no such level)"
    )
    group.add_argument(
        "--gpu",
        "--gpu-quota",
        type=parse_bytes,
        default=gpu,
        metavar="SIZE",
        help="GPU level quota",
    )
    group.add_argument(
        "--host",
        "--host-quota",
        type=parse_bytes,
        default=host,
        metavar="SIZE",
        help="host level quota",
    )
    group.add_argument(
        "--disk", type=parse_bytes, default="0", metavar="SIZE", help="disk level quota"
    )
    group.add_argument(
        "--disk-path",
        metavar="DIR",
        help="directory of the disk level's file (needs --disk; default: the temp directory)",
    )


def build_parser() -> argparse.ArgumentParser:
    formatter = HelpFormatter
    parser = Parser(prog="kvpool", description="A paged, tiered KV-cache manager.")
    parser.add_argument("--version", action="version", version=f"kvpool {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the library does")
    parser.add_argument("-q", "--quiet", action="store_true", help="only the report and errors")
    commands = parser.add_subparsers(dest="command", required=True)

    info_parser = commands.add_parser(
        "info",
        help="print how a model's layers map to pool groups and slots",
        formatter_class=formatter,
    )
    _model_flags(info_parser)
    _memory_flags(info_parser, gpu="1GiB", host="0")
    info_parser.add_argument(
        "--remote", nargs="+", metavar="URL",
        help="also list a shared tier's nodes (a Valkey server, or a cluster's nodes from any "
        "seed): role, hash slots, keys, memory",
    )  # fmt: skip
    info_parser.set_defaults(run=info_command)

    replay_parser = commands.add_parser(
        "replay",
        help="replay a serving trace (or a synthetic workload) through the manager",
        formatter_class=formatter,
        description="Replay requests through a real KVCacheManager with a continuous-batching "
        "scheduler (no model compute) and report cache hits, latency in simulated time, "
        "concurrency, tier traffic and rebalancing. Without a trace, a seeded synthetic "
        "multi-turn chat workload is used. Ctrl-C stops early with a partial report.",
    )
    workload = replay_parser.add_argument_group("workload")
    workload.add_argument("trace", nargs="?", help="a Mooncake .jsonl or Azure .csv trace")
    workload.add_argument(
        "--format", choices=["auto", "mooncake", "azure"], default="auto", help="trace format"
    )
    workload.add_argument(
        "--synthetic",
        choices=["conversations", "system-prompts"],
        help="a seeded synthetic workload (the default without a trace: conversations)",
    )
    workload.add_argument(
        "--requests",
        type=int_at_least(1),
        metavar="N",
        help="replay the first N requests (default: all of a trace; 240 conversation turns or "
        "400 system-prompt requests)",
    )
    workload.add_argument("--seed", type=int_at_least(0), default=0, help="synthetic workload seed")
    _model_flags(replay_parser)
    _memory_flags(replay_parser, gpu="512MiB", host="2GiB")
    scheduler = replay_parser.add_argument_group("scheduler")
    scheduler.add_argument(
        "--max-batch",
        type=int_at_least(1),
        default=64,
        metavar="N",
        help="requests per engine step",
    )
    scheduler.add_argument(
        "--prefill-chunk",
        type=int_at_least(1),
        default=2048,
        metavar="N",
        help="prompt tokens per request per engine step",
    )
    scheduler.add_argument(
        "--step-ms",
        type=non_negative_number,
        default=20.0,
        metavar="MS",
        help="simulated time of one engine step",
    )
    scheduler.add_argument("--asap", action="store_true", help="ignore arrival times")
    scheduler.add_argument(
        "--policy",
        choices=[*POLICIES, OFFLINE_OPTIMUM],
        nargs="+",
        default=next(iter(POLICIES)),
        help="eviction policy (default: %(default)s); with --capacity-blocks, several side by "
        f"side, and {OFFLINE_OPTIMUM}: the offline optimum",
    )
    scheduler.add_argument(
        "--no-rebalance", action="store_true", help="never move memory between pool groups"
    )
    scheduler.add_argument(
        "--rebalance-min-samples",
        type=int_at_least(0),
        default=40,
        metavar="N",
        help="closed requests before the first rebalance",
    )
    replay_parser.add_argument(
        "--verify",
        action="store_true",
        help="write and check every KV record (slow; proves no KV was corrupted)",
    )
    remote = replay_parser.add_argument_group("remote tier")
    remote.add_argument(
        "--remote",
        nargs="+",
        metavar="URL",
        help="a shared Valkey/Redis tier below the local levels: valkey://host:port[/db] "
        "(valkeys:// for TLS; several URLs: nodes of a cluster); replays run one after another "
        "against one server reuse each other's prefixes",
    )
    remote.add_argument(
        "--remote-namespace",
        default="",
        metavar="NAME",
        help="keys of this tenant only (default: none)",
    )
    remote.add_argument(
        "--remote-cluster", action="store_true", help="the one --remote URL is a cluster's node"
    )
    replay_parser.add_argument(
        "--capacity-blocks",
        type=int_at_least(1),
        nargs="+",
        metavar="N",
        help="prefix-cache mode: hit rates at these cache sizes (512-token blocks)",
    )
    replay_parser.add_argument(
        "--tier-ratios",
        type=int_at_least(0),
        nargs=2,
        metavar=("HOST", "DISK"),
        help="prefix-cache mode: add a host and a disk level of HOST and DISK times the GPU's "
        "blocks (hits reported per level)",
    )
    output = replay_parser.add_argument_group("output")
    output.add_argument(
        "--json", metavar="FILE", help="write the setup and every figure to this JSON file"
    )
    output.add_argument(
        "--plot", metavar="FILE", help="write the plot to this .png, .pdf or .svg file"
    )
    output.add_argument("--explain", action="store_true", help="explain the report's terms")
    output.add_argument(
        "--metrics-port",
        type=int_at_least(0),
        metavar="PORT",
        help="serve Prometheus /metrics on this port while replaying (0: a free port, logged)",
    )
    output.add_argument(
        "--metrics-hold",
        type=non_negative_number,
        default=0.0,
        metavar="SECONDS",
        help="keep serving /metrics this long after the report (Ctrl-C ends it), so a scraper "
        "sees the final figures",
    )
    output.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress bar"
    )
    replay_parser.set_defaults(run=replay_command)
    add_generate_parser(commands, formatter, _memory_flags)
    add_serve_parser(commands, formatter)
    return parser


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Checks across flags and of the files, before any work (argparse's one-line errors)."""
    try:
        if getattr(args, "hf_config", None) and getattr(args, "model", None):
            parser.error("--model and --hf-config: give one layout, not both")
        if args.disk_path is not None and not args.disk:
            parser.error("--disk-path needs --disk SIZE (a disk level); give both or neither")
        if args.disk:
            check_disk_directory(args.disk_path or _default_disk_path())
        if args.command == "info" and args.remote:
            try:
                RemoteCacheTierConfig(args.remote, cluster=True).validate()
            except ConfigError as error:
                parser.error(str(error).replace("remote_tier.url", "--remote"))
        if args.command == "replay":
            if args.trace and args.synthetic:
                parser.error("a trace and --synthetic: replay one workload, not both")
            if args.capacity_blocks and (args.verify or args.hf_config):
                parser.error(
                    "--capacity-blocks (prefix-cache mode) takes no --verify or --hf-config"
                )
            if OFFLINE_OPTIMUM in args.policy and not args.capacity_blocks:
                parser.error(
                    f"--policy {OFFLINE_OPTIMUM} knows the future: only in prefix-cache mode "
                    "(--capacity-blocks)"
                )
            if len(args.policy) > 1 and not args.capacity_blocks:
                parser.error(
                    "several --policy values: only in prefix-cache mode (--capacity-blocks)"
                )
            if args.tier_ratios and not args.capacity_blocks:
                parser.error("--tier-ratios: only in prefix-cache mode (--capacity-blocks)")
            if args.capacity_blocks and args.remote:
                parser.error("--capacity-blocks (prefix-cache mode) takes no --remote")
            if args.metrics_port is not None and args.capacity_blocks:
                parser.error("--capacity-blocks (prefix-cache mode) takes no --metrics-port")
            if args.metrics_hold and args.metrics_port is None:
                parser.error("--metrics-hold needs --metrics-port PORT")
            if args.metrics_port is not None and args.metrics_port > 65535:
                parser.error(
                    f"--metrics-port {args.metrics_port} is invalid: must be in [0, 65535]"
                )
            if args.remote_cluster and not args.remote:
                parser.error("--remote-cluster needs --remote URL")
            if args.remote:
                try:
                    remote_config(args).validate()
                except ConfigError as error:
                    parser.error(str(error).replace("remote_tier.url", "--remote"))
            check_output_file("--json", args.json, (".json",))
            check_output_file("--plot", args.plot, (".png", ".pdf", ".svg"))
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))


def _default_disk_path() -> str:
    import tempfile

    return tempfile.gettempdir()


def configure_logging(level: int) -> None:
    """The `kvpool` logger (the library's only output) to standard error, at `level`."""
    logger = logging.getLogger("kvpool")
    for handler in [h for h in logger.handlers if getattr(h, "kvpool_cli", False)]:
        logger.removeHandler(handler)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("kvpool: %(levelname)s: %(message)s"))
    handler.kvpool_cli = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(level)


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """The checked arguments of a `kvpool` command line, as `main` runs them; a bad one exits
    with status 2 and one line, `kvpool: error: ...`, before any work."""
    parser = build_parser()
    args = parser.parse_args(joined_negative_sizes(argv))
    if args.command == "serve":
        check_serve(parser, args)
        return args
    if args.disk and args.disk_path is None:
        args.disk_path = _default_disk_path()
    if isinstance(getattr(args, "policy", None), str):
        args.policy = [args.policy]  # (the default; given, it is a list)
    _check(parser, args)
    if hasattr(args, "model") and not args.hf_config and not args.model:
        args.model = DEFAULT_MODEL
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    configure_logging(
        logging.INFO if args.verbose else logging.ERROR if args.quiet else logging.WARNING
    )
    if args.quiet and hasattr(args, "progress"):
        args.progress = False
    try:
        status: int = args.run(args)
    except KVPoolError as error:
        error = in_flag_terms(error, tiers_of(args))  # name the flag, not the config field
        message = error.strerror if isinstance(error, OSError) and error.strerror else error
        print(f"kvpool: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvpool: interrupted", file=sys.stderr)
        return INTERRUPTED
    return status


if __name__ == "__main__":
    sys.exit(main())

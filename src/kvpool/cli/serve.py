"""`kvpool serve`: the node daemon (`kvpool.node.daemon`), in the foreground."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from kvpool.cli.arguments import int_at_least, parse_bytes
from kvpool.config import EVICTION_POLICIES
from kvpool.errors import ConfigError

DESCRIPTION = """\
One KV cache per node: owns one kvpool manager (host memory shared with the engines' workers,
an optional disk level and Valkey tier, KV events, Prometheus metrics) and serves every engine
on this node over a Unix socket. Point each engine's connector at it with
kv_connector_extra_config {"node_cache": "unix:///run/kvpool/kvpool.sock"}. The first engine's
model sets the slot layout (an engine of another layout is refused); engines of different
models never share KV. Runs in the foreground, logs to standard error, exits cleanly on
SIGTERM (releasing every engine's pages; a persistent disk level is written). Only this user
(and --group) may connect: the socket is created 0600 (0660 with --group)."""


def add_serve_parser(commands: Any, formatter: Any) -> None:
    parser = commands.add_parser(
        "serve",
        help="run the node daemon: one KV cache shared by every engine on this node",
        formatter_class=formatter,
        description=DESCRIPTION,
    )
    where = parser.add_argument_group("where engines connect")
    where.add_argument(
        "--socket", required=True, metavar="PATH", help="the Unix socket to create (absolute)"
    )
    where.add_argument("--group", metavar="NAME", help="a group whose members may connect too")
    levels = parser.add_argument_group("cache levels")
    levels.add_argument(
        "--host-bytes", type=parse_bytes, default="1GiB", help="shared host memory (first level)"
    )
    levels.add_argument("--disk-bytes", type=parse_bytes, default="0", help="a disk level")
    levels.add_argument("--disk-path", metavar="DIR", help="the disk level's directory")
    levels.add_argument(
        "--disk-persist", action="store_true", help="the disk level outlives the daemon"
    )
    levels.add_argument("--remote-url", metavar="URL", help="a Valkey server (valkey://host:port)")
    levels.add_argument("--remote-namespace", default="", help="separates tenants on one server")
    levels.add_argument("--remote-timeout-ms", type=int_at_least(1), default=500)
    levels.add_argument(
        "--eviction-policy", choices=EVICTION_POLICIES, default=EVICTION_POLICIES[0]
    )
    out = parser.add_argument_group("events and metrics")
    out.add_argument("--kv-events-endpoint", metavar="ZMQ", help="publish KV events here")
    out.add_argument("--metrics-port", type=int_at_least(0), help="serve /metrics on this port")
    limits = parser.add_argument_group("limits")
    limits.add_argument(
        "--io-timeout-ms",
        type=int_at_least(1),
        default=500,
        help="an engine that does not send or read a message within this is dropped",
    )
    limits.add_argument(
        "--release-grace-ms",
        type=int_at_least(0),
        default=2000,
        help="a gone engine's pages are released this long after its connection closed",
    )
    limits.add_argument("--max-clients", type=int_at_least(1), default=64)
    limits.add_argument(
        "--max-handles", type=int_at_least(1), default=4096, help="requests held per engine"
    )
    limits.add_argument(
        "--max-waiting", type=int_at_least(0), default=64, help="lookups per engine awaiting I/O"
    )
    limits.add_argument(
        "--busy-poll-us",
        type=int_at_least(0),
        default=200,
        help="after each message, poll this long for the next one before sleeping: no "
        "wake-up on a round trip, at the cost of CPU while engines are active (0: never)",
    )
    parser.set_defaults(run=serve_command)


def settings_of(args: argparse.Namespace) -> Any:
    from kvpool.node.settings import DaemonSettings

    return DaemonSettings(
        socket=args.socket,
        host_bytes=args.host_bytes,
        disk_bytes=args.disk_bytes,
        disk_path=args.disk_path,
        disk_persist=args.disk_persist,
        remote_url=args.remote_url,
        remote_namespace=args.remote_namespace,
        remote_timeout_ms=args.remote_timeout_ms,
        eviction_policy=args.eviction_policy,
        kv_events_endpoint=args.kv_events_endpoint,
        metrics_port=args.metrics_port,
        group=args.group,
        io_timeout_s=args.io_timeout_ms / 1000,
        release_grace_s=args.release_grace_ms / 1000,
        max_clients=args.max_clients,
        max_handles=args.max_handles,
        max_waiting=args.max_waiting,
        busy_poll_s=args.busy_poll_us / 1e6,
    )


def check_serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every flag checked before anything is created (one line naming the flag)."""
    try:
        settings_of(args).check()
    except ConfigError as error:
        parser.error(str(error))


def serve_command(args: argparse.Namespace) -> int:
    from kvpool.node.daemon import NodeDaemon

    settings = settings_of(args)
    if not args.quiet:
        logging.getLogger("kvpool").setLevel(logging.INFO)
    try:
        daemon = NodeDaemon(settings)
    except ConfigError as error:
        print(f"kvpool: error: {error}", file=sys.stderr)
        return 2
    print(f"kvpool: serving on {settings.socket}", file=sys.stderr, flush=True)
    daemon.serve_forever()
    return 0

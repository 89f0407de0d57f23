"""A Valkey cluster seen node by node: the slot map, one connection and one back-off per node.

Why not the cluster client of valkey-py: it fails a whole pipeline when one node fails and
rebuilds itself, so one dead node cost every hit of the tier. Here a call is split into one
pipeline per node, all sent before any answer is read, and the answers are awaited until one
`timeout_ms` after the sends (however many nodes stall, a call waits one timeout); a node that
fails or times out costs the keys it holds (they are misses) and goes into a back-off of its
own; the other nodes' answers stand.

The slot map is read with CLUSTER SLOTS (from any node that answers) at the first call, and
again, at most once per `reconnect_min_ms`, after a node failed (a failover may have moved its
slots) or answered MOVED. MOVED and ASK answers (a resharding in progress) are followed once,
within the same call. Reads and writes go to the primaries only: a replica that lags never
answers (and every value is checked against its key anyway).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from kvpool.config import RemoteCacheTierConfig
from kvpool.remote.statistics import RemoteStatistics

logger = logging.getLogger("kvpool.remote")

SLOTS = 16384
# Upper bounds (seconds) of the per-node latency histogram (`kvpool:remote_node_latency`).
LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


@dataclass
class NodeStatistics:
    """Counters of one cluster node, as this client saw it."""

    calls: int = 0  # pipelines the node answered
    commands: int = 0  # commands it answered
    errors: int = 0  # pipelines that failed: connection, timeout
    skipped_calls: int = 0  # pipelines not sent while it was backing off
    skipped_commands: int = 0
    redirects: int = 0  # MOVED or ASK answers followed
    reconnects: int = 0
    seconds: float = 0.0  # time spent on its answered and failed pipelines
    latency: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))

    def observe(self, seconds: float) -> None:
        self.seconds += seconds
        for i, bound in enumerate(LATENCY_BUCKETS):
            if seconds <= bound:
                self.latency[i] += 1
                return
        self.latency[-1] += 1

    def __add__(self, other: NodeStatistics) -> NodeStatistics:
        total = NodeStatistics()
        for name in ("calls", "commands", "errors", "skipped_calls", "skipped_commands"):
            setattr(total, name, getattr(self, name) + getattr(other, name))
        total.redirects = self.redirects + other.redirects
        total.reconnects = self.reconnects + other.reconnects
        total.seconds = self.seconds + other.seconds
        total.latency = [a + b for a, b in zip(self.latency, other.latency, strict=True)]
        return total


class Node:
    """One node: its connection pool and its back-off."""

    def __init__(self, address: str, options: dict[str, Any], backoff: float) -> None:
        import valkey

        host, port = address.rsplit(":", 1)
        self.address = address
        self.pool = valkey.ConnectionPool(
            connection_class=options.pop("connection_class", valkey.Connection),
            host=host,
            port=int(port),
            **options,
        )
        self.down = False
        self.retry_at = 0.0
        self.backoff = backoff
        self.last_error = ""


Command = tuple[Any, ...]
# One command of a call: its index in the call's answers, its key's slot, its arguments and
# whether it follows an ASK redirection (sent after ASKING).
Pending = tuple[int, int, Command, bool]


class ClusterClient:
    """Calls to a cluster, split per node; the answer of a command whose node failed is
    `UNREACHED`."""

    UNREACHED: Any = object()

    def __init__(
        self,
        config: RemoteCacheTierConfig,
        clock: Callable[[], float],
        errors: tuple[type[BaseException], ...],
        totals: RemoteStatistics,
        on_failure: Callable[[BaseException, str], None],
    ) -> None:
        self.config = config
        self._clock = clock
        self._errors = errors
        self._totals = totals  # the store's counters (errors, skipped calls, reconnects)
        self._on_failure = on_failure  # the store's log of a failed node
        self.last_exception: BaseException | None = None
        timeout = config.timeout_ms / 1000
        self._options: dict[str, Any] = dict(socket_timeout=timeout, socket_connect_timeout=timeout)
        first = urlsplit(config.urls[0])
        password = first.password or os.environ.get(config.password_env) or None
        if password is not None:
            self._options["password"] = password
        if first.username:
            self._options["username"] = first.username
        if first.scheme in ("valkeys", "rediss"):
            import valkey

            self._options["connection_class"] = valkey.SSLConnection
        self.seeds = [f"{urlsplit(u).hostname}:{urlsplit(u).port or 6379}" for u in config.urls]
        self.nodes: dict[str, Node] = {}
        self.stats: dict[str, NodeStatistics] = {}
        self.slots: list[str | None] = [None] * SLOTS
        self._stale = True
        self._refresh_at = 0.0
        self.topology_refreshes = 0

    # -- nodes and slots -------------------------------------------------------------------------

    def node(self, address: str) -> Node:
        node = self.nodes.get(address)
        if node is None:
            node = Node(address, dict(self._options), self.config.reconnect_min_ms / 1000)
            self.nodes[address] = node
            self.stats.setdefault(address, NodeStatistics())
        return node

    def primaries(self) -> list[str]:
        """The addresses that serve slots, in slot order."""
        return list(dict.fromkeys(a for a in self.slots if a is not None))

    def refresh(self, force: bool = False) -> bool:
        """Read the slot map again (from the first node that answers CLUSTER SLOTS); False when
        none did. Without `force`, only when it is stale and not more often than once per
        `reconnect_min_ms`."""
        now = self._clock()
        if not force and (not self._stale or now < self._refresh_at):
            return True
        self._refresh_at = now + self.config.reconnect_min_ms / 1000
        live = [a for a, n in self.nodes.items() if not n.down]
        for address in dict.fromkeys([*live, *self.seeds, *self.nodes]):
            node = self.node(address)
            try:
                answer = self._run(node, [("CLUSTER", "SLOTS")])[0]
            except self._errors as error:
                self.last_exception = error
                continue
            if isinstance(answer, BaseException) or not isinstance(answer, list):
                self.last_exception = answer if isinstance(answer, BaseException) else None
                continue
            slots: list[str | None] = [None] * SLOTS
            for entry in answer:
                first, last, primary = int(entry[0]), int(entry[1]), entry[2]
                host = primary[0].decode() if isinstance(primary[0], bytes) else str(primary[0])
                where = f"{host or address.rsplit(':', 1)[0]}:{int(primary[1])}"
                self.node(where)
                slots[first : last + 1] = [where] * (last - first + 1)
            self.slots = slots
            self._stale = False
            self.topology_refreshes += 1
            return True
        return False

    # -- calls -----------------------------------------------------------------------------------

    def execute(self, commands: Sequence[Command]) -> list[Any]:
        """The answer of each command (its key is its second argument): the node's answer, a
        `ResponseError` it answered, or `UNREACHED` (its node failed, backs off, or no node
        serves its slot)."""
        from valkey.crc import key_slot

        self.refresh()
        answers: list[Any] = [self.UNREACHED] * len(commands)
        by_node: dict[str, list[Pending]] = {}
        for i, command in enumerate(commands):
            slot = key_slot(command[1])
            address = self.slots[slot]
            if address is not None:
                by_node.setdefault(address, []).append((i, slot, command, False))
        redirected = self._round(by_node, answers)
        if redirected:  # (followed once: a second redirection is a miss)
            self._round(redirected, answers)
        return answers

    def _round(
        self, by_node: dict[str, list[Pending]], answers: list[Any]
    ) -> dict[str, list[Pending]]:
        """Send each node its commands, then read every answer; returns the commands answered
        by a redirection (MOVED, ASK), per node to ask next."""
        from valkey.exceptions import ResponseError
        from valkey.exceptions import TimeoutError as ValkeyTimeout

        sent: list[tuple[Node, Any, list[Pending], list[Command], float]] = []
        for address, pending in by_node.items():
            node = self.node(address)
            stats = self.stats[address]
            if node.down and self._clock() < node.retry_at:
                stats.skipped_calls += 1
                stats.skipped_commands += len(pending)
                self._totals.skipped_calls += 1
                continue
            wire: list[Command] = []
            for _, _, command, ask in pending:
                if ask:
                    wire.append(("ASKING",))
                wire.append(command)
            started = time.perf_counter()
            try:
                connection: Any = node.pool.get_connection("_")
            except self._errors as error:
                self._failed(node, error, time.perf_counter() - started)
                continue
            try:
                connection.send_packed_command(connection.pack_commands(wire), check_health=False)
            except self._errors as error:
                self._release(node, connection, broken=True)
                self._failed(node, error, time.perf_counter() - started)
                continue
            sent.append((node, connection, pending, wire, started))
        redirected: dict[str, list[Pending]] = {}
        deadline = time.perf_counter() + self.config.timeout_ms / 1000
        for node, connection, pending, wire, started in sent:
            replies: list[Any] = []
            try:
                # the call's timeout, not one per node: a node silent until the deadline (a
                # stalled one read before it used it up) failed this call
                if not connection.can_read(timeout=max(0.0, deadline - time.perf_counter())):
                    raise ValkeyTimeout(f"no answer from {node.address} within the call's timeout")
                for _ in wire:
                    try:
                        replies.append(connection.read_response())
                    except ResponseError as refused:
                        replies.append(refused)
            except self._errors as error:
                self._release(node, connection, broken=True)
                self._failed(node, error, time.perf_counter() - started)
                continue
            self._release(node, connection, broken=False)
            stats = self.stats[node.address]
            stats.observe(time.perf_counter() - started)
            stats.calls += 1
            stats.commands += len(pending)
            if node.down:
                node.down = False
                stats.reconnects += 1
                self._totals.reconnects += 1
                logger.info("the cluster node %s answers again", node.address)
            node.backoff = self.config.reconnect_min_ms / 1000
            replies = [
                r for r, command in zip(replies, wire, strict=True) if command[0] != "ASKING"
            ]
            for (i, slot, command, _), reply in zip(pending, replies, strict=True):
                target = _redirection(reply)
                if target is None:
                    answers[i] = reply
                    continue
                kind, where = target
                stats.redirects += 1
                if kind == "MOVED":
                    self.slots[slot] = where
                    self._stale = True
                redirected.setdefault(where, []).append((i, slot, command, kind == "ASK"))
        return redirected

    def _release(self, node: Node, connection: Any, broken: bool) -> None:
        if broken:
            with contextlib.suppress(*self._errors):
                connection.disconnect()
        node.pool.release(connection)

    def _failed(self, node: Node, error: BaseException, seconds: float) -> None:
        stats = self.stats[node.address]
        stats.errors += 1
        self._totals.errors += 1
        self.last_exception = error
        stats.observe(seconds)
        node.last_error = f"{type(error).__name__}: {error}"
        was_down = node.down
        node.down = True
        node.retry_at = self._clock() + node.backoff
        node.backoff = min(node.backoff * 2, self.config.reconnect_max_ms / 1000)
        self._stale = True  # (a failover may give its slots to another node)
        self._on_failure(error, node.address if not was_down else "")

    def _run(self, node: Node, commands: list[Command]) -> list[Any]:
        """Commands on one node, outside the per-node back-off (the slot map's reads)."""
        from valkey.exceptions import ResponseError

        connection: Any = node.pool.get_connection("_")
        try:
            connection.send_packed_command(connection.pack_commands(commands), check_health=False)
            replies: list[Any] = []
            for _ in commands:
                try:
                    replies.append(connection.read_response())
                except ResponseError as refused:
                    replies.append(refused)
        except BaseException:
            self._release(node, connection, broken=True)
            raise
        self._release(node, connection, broken=False)
        return replies

    def close(self) -> None:
        for node in self.nodes.values():
            with contextlib.suppress(*self._errors):
                node.pool.disconnect()


@dataclass
class NodeView:
    """One node as the cluster (and the node itself) describes it (`kvpool info --remote`)."""

    address: str
    role: str  # "primary", "replica of <address>", "standalone"; with ",failed" when failed
    slots: int
    keys: int | None  # None: it did not answer
    used_bytes: int | None


def describe(config: RemoteCacheTierConfig) -> list[NodeView]:
    """Every node of the server or cluster `config` names (CLUSTER NODES from the first seed
    that answers), with its keys and memory (DBSIZE, INFO memory), each call bounded by
    `timeout_ms`; empty when no seed answers."""
    from valkey.exceptions import ResponseError

    errors: tuple[type[BaseException], ...] = (OSError, Exception)
    client = ClusterClient(config, time.monotonic, errors, RemoteStatistics(), lambda e, a: None)
    try:
        listing: Any = None
        seed = ""
        for seed in client.seeds:
            try:
                listing = client._run(client.node(seed), [("CLUSTER", "NODES")])[0]
            except errors:
                continue
            break
        if listing is None:
            return []
        if isinstance(listing, ResponseError):  # (not a cluster: one server)
            rows = [(seed, "standalone", SLOTS)]
        else:
            text = listing.decode() if isinstance(listing, bytes) else str(listing)
            lines = [line.split() for line in text.splitlines() if line.strip()]
            by_id = {f[0]: f[1].split("@")[0] for f in lines}
            rows = []
            for fields in lines:
                address = fields[1].split("@")[0]
                flags = fields[2].split(",")
                role = "primary" if "master" in flags else f"replica of {by_id.get(fields[3])}"
                role += ",failed" if "fail" in flags else ""
                slots = 0
                for span in fields[8:]:
                    if not span.startswith("["):
                        first, _, last = span.partition("-")
                        slots += int(last or first) - int(first) + 1
                rows.append((address, role, slots))
            rows.sort(key=lambda row: (not row[1].startswith("primary"), row[0]))
        views = []
        for address, role, slots in rows:
            try:
                keys, memory = client._run(client.node(address), [("DBSIZE",), ("INFO", "memory")])
                text = memory.decode() if isinstance(memory, bytes) else str(memory)
                used = next(
                    int(line.split(":")[1])
                    for line in text.splitlines()
                    if line.startswith("used_memory:")
                )
                views.append(NodeView(address, role, slots, int(keys), used))
            except errors:
                views.append(NodeView(address, role, slots, None, None))
        return views
    finally:
        client.close()


def _redirection(reply: Any) -> tuple[str, str] | None:
    """("MOVED" or "ASK", "host:port") for a redirection answer, else None."""
    if not isinstance(reply, BaseException):
        return None
    words = str(reply).split()
    if len(words) == 3 and words[0] in ("MOVED", "ASK"):
        return words[0], words[2]
    return None


__all__ = ["LATENCY_BUCKETS", "ClusterClient", "NodeStatistics", "NodeView", "describe"]

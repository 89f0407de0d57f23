"""`kvpool serve`: one KV cache per node. The daemon owns one `KVCacheManager` (its first level
in shared memory, a disk level, a Valkey tier, KV events, metrics) and serves every engine on
the node over a Unix socket, one connection per engine.

- One thread (the caller of `serve_forever`) owns the manager and handles one message at a
  time, in order of arrival: the daemon's decisions depend only on the calls it receives.
  Look-ahead threads do the disk and remote reads of asynchronous lookups.
- The manager is built at the first engine's `Hello`, from its slot layout; an engine with
  another layout is refused, naming the difference. Every key is scoped by the engine's model
  identity, so engines of other models (same layout) never share KV.
- An engine's connection closing (its process died) releases everything it held after
  `release_grace_s` (its workers may still be copying for a moment); nothing else is touched.
- Back-pressure: a request is read and answered within `io_timeout_s` (SO_RCVTIMEO,
  SO_SNDTIMEO) or the engine is dropped; one request per engine at a time; at most
  `max_handles` held pages per engine and `max_waiting` lookups waiting for I/O.
- Only the daemon's user (or `group`) may connect: the socket file's mode (0600, 0660 with a
  group) and each peer's credentials (SO_PEERCRED) checked on accept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import grp
import logging
import os
import selectors
import signal
import socket
import stat
import struct
import time
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from kvpool.config import (
    EVICTION_POLICIES,
    AttentionLayerConfig,
    BufferConfig,
    CacheTierConfig,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    KVCacheManagerConfig,
    KVEventsConfig,
    RemoteCacheTierConfig,
    ReuseScope,
)
from kvpool.errors import ConfigError, KVPoolError
from kvpool.manager import KVCacheManager
from kvpool.node import protocol as p
from kvpool.node.store import Hit, LocalStore, Outcome, SavePlan

log = logging.getLogger("kvpool.node")


@dataclasses.dataclass(frozen=True)
class DaemonSettings:
    """What `kvpool serve` is told (its flags); `check()` names the first bad one."""

    socket: str
    host_bytes: int = 1 << 30
    disk_bytes: int = 0
    disk_path: str | None = None
    disk_persist: bool = False
    remote_url: str | None = None
    remote_namespace: str = ""
    remote_timeout_ms: int = 500
    eviction_policy: str = EVICTION_POLICIES[0]
    kv_events_endpoint: str | None = None
    metrics_port: int | None = None
    group: str | None = None  # a group whose members may connect too (socket mode 0660)
    io_timeout_s: float = 0.5
    release_grace_s: float = 2.0
    max_clients: int = 64
    max_handles: int = 4096  # pages-holding requests per engine
    max_waiting: int = 64  # lookups per engine waiting for I/O

    def check(self) -> None:
        def fail(flag: str, value: object, allowed: str) -> None:
            raise ConfigError(f"--{flag}={value!r} is invalid: must be {allowed}")

        directory = os.path.dirname(self.socket) or "."
        if not os.path.isabs(self.socket) or len(self.socket.encode()) > 107:
            fail("socket", self.socket, "an absolute path of at most 107 bytes")
        if not os.path.isdir(directory):
            fail("socket", self.socket, f"in an existing directory ({directory} is none)")
        if self.host_bytes < 1:
            fail("host-bytes", self.host_bytes, ">= 1")
        if self.disk_bytes < 0:
            fail("disk-bytes", self.disk_bytes, ">= 0")
        if self.disk_bytes and (self.disk_path is None or not os.path.isdir(self.disk_path)):
            fail("disk-path", self.disk_path, "an existing directory when --disk-bytes > 0")
        if self.disk_path is not None and not self.disk_bytes:
            fail("disk-bytes", self.disk_bytes, "> 0 when --disk-path is set")
        if self.disk_persist and not self.disk_bytes:
            fail("disk-persist", True, "left out without a disk level")
        if self.eviction_policy not in EVICTION_POLICIES:
            fail("eviction-policy", self.eviction_policy, f"one of {list(EVICTION_POLICIES)}")
        if self.remote_timeout_ms < 1:
            fail("remote-timeout-ms", self.remote_timeout_ms, ">= 1")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            fail("metrics-port", self.metrics_port, "a port in [0, 65535]")
        if not 0.001 <= self.io_timeout_s <= 60:
            fail("io-timeout-ms", int(self.io_timeout_s * 1000), "in [1, 60000]")
        if not 0 <= self.release_grace_s <= 600:
            fail("release-grace-ms", int(self.release_grace_s * 1000), "in [0, 600000]")
        for flag, value in (("max-clients", self.max_clients), ("max-handles", self.max_handles)):
            if value < 1:
                fail(flag, value, ">= 1")
        if self.max_waiting < 0:
            fail("max-waiting", self.max_waiting, ">= 0")
        if self.group is not None:
            self.group_id()
        if self.remote_url is not None:
            try:
                self.remote_tier().validate("remote_url")
            except ConfigError as error:
                fail("remote-url", self.remote_url, f"a server URL ({error})")

    def group_id(self) -> int | None:
        if self.group is None:
            return None
        try:
            return int(self.group) if self.group.isdigit() else grp.getgrnam(self.group).gr_gid
        except KeyError:
            raise ConfigError(f"--group={self.group!r} is invalid: no such group") from None

    def remote_tier(self) -> RemoteCacheTierConfig:
        assert self.remote_url is not None
        return RemoteCacheTierConfig(
            url=self.remote_url,
            namespace=self.remote_namespace,
            model_id="kvpool-node",  # (each key's scope carries its engine's model identity)
            timeout_ms=self.remote_timeout_ms,
            tolerate_unavailable=True,
        )

    def manager_config(self, hello: p.Hello) -> KVCacheManagerConfig:
        """The manager for the first engine's layout: level 0 in shared memory (memfds), then
        disk, then the remote tier; whole blocks only (engines load whole blocks)."""
        tiers: list[CacheTierConfig] = [GpuCacheTierConfig(self.host_bytes, shared_by_fd=True)]
        if self.disk_bytes:
            assert self.disk_path is not None
            persistent = "kvpool-node" if self.disk_persist else None
            tiers.append(DiskCacheTierConfig(self.disk_bytes, self.disk_path, persistent))
        layers = [
            AttentionLayerConfig(
                layer.layer_id,
                [BufferConfig(name, size) for name, size in layer.buffers],
                sliding_window_size=layer.window,
            )
            for layer in hello.layers
        ]
        events = None
        if self.kv_events_endpoint is not None:
            events = KVEventsConfig(endpoint=self.kv_events_endpoint)
        return KVCacheManagerConfig(
            tokens_per_block=hello.tokens_per_block,
            cache_tiers=tiers,
            layers=layers,
            enable_partial_reuse=False,
            remote_tier=None if self.remote_url is None else self.remote_tier(),
            kv_events=events,
            eviction_policy=self.eviction_policy,
            max_util_for_resume=1.0,
        )


@dataclasses.dataclass
class _Client:
    """One engine's connection and what it holds."""

    number: int
    sock: socket.socket
    conn: Connection
    pid: int
    uid: int
    hello: p.Hello | None = None
    handles: dict[int, Any] = dataclasses.field(default_factory=dict)
    waiting: set[str] = dataclasses.field(default_factory=set)

    @property
    def name(self) -> str:
        label = f" {self.hello.name}" if self.hello and self.hello.name else ""
        return f"engine {self.number} (pid {self.pid}{label})"


@dataclasses.dataclass
class DaemonCounters:
    connections: int = 0
    refused: int = 0  # credentials, layout, version, too many clients
    dropped: int = 0  # protocol errors and time limits
    disconnects: int = 0  # connections closed (engines that ended or died)
    requests: int = 0
    released_on_disconnect: int = 0  # handles released after their engine went away
    no_room: int = 0  # saves refused: no room (or the engine's handle limit)


_TIMEVAL = "ll"


def _set_timeouts(sock: socket.socket, seconds: float) -> None:
    whole = int(seconds)
    value = struct.pack(_TIMEVAL, whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end (the kernel's, not the peer's word)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def _groups_of(pid: int) -> set[int]:
    """A process's supplementary groups (empty where /proc does not show it)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except OSError:
        pass
    return set()


class NodeDaemon:
    """The daemon (module docstring). `serve_forever()` until `stop()` or SIGTERM/SIGINT."""

    def __init__(self, settings: DaemonSettings) -> None:
        settings.check()
        self.settings = settings
        self.counters = DaemonCounters()
        self.store: LocalStore | None = None
        self.layout: p.Hello | None = None
        self.instance = f"{os.getpid()}-{time.time_ns()}"
        self._clients: dict[int, _Client] = {}
        self._numbers = 0
        self._handles = 0
        self._graces: list[tuple[float, _Client]] = []  # (release at, engine gone)
        self._stop = False
        self._metrics: Any = None
        self._group = settings.group_id()
        self.selector = selectors.DefaultSelector()
        self.listener = self._listen()

    def _listen(self) -> socket.socket:
        path = self.settings.socket
        if os.path.exists(path):
            if not stat.S_ISSOCK(os.stat(path).st_mode):
                raise ConfigError(f"--socket={path!r} is invalid: a file that is not a socket")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(path)
            except OSError:
                os.unlink(path)  # (a daemon that died left it)
            else:
                raise ConfigError(f"--socket={path!r} is invalid: another daemon serves it")
            finally:
                probe.close()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        staged = f"{path}.{os.getpid()}"  # (renamed once it listens: no refused connects)
        old = os.umask(0o177 if self._group is None else 0o117)  # (no window with wider modes)
        try:
            listener.bind(staged)
        finally:
            os.umask(old)
        if self._group is not None:
            os.chown(staged, -1, self._group)
            os.chmod(staged, 0o660)
        listener.listen(128)
        os.rename(staged, path)
        listener.setblocking(False)
        self.selector.register(listener, selectors.EVENT_READ, None)
        return listener

    # -- the loop ------------------------------------------------------------------------
    def serve_forever(self, handle_signals: bool = True) -> None:
        if handle_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self.stop())
        log.info("kvpool node daemon on %s", self.settings.socket)
        try:
            while not self._stop:
                timeout = 0.2 if not self._graces else 0.05
                for key, _ in self.selector.select(timeout):
                    if key.data is None:
                        self._accept()
                    elif key.data.number in self._clients:
                        self._serve(key.data)
                self._release_expired(time.monotonic())
        finally:
            self.close()

    def stop(self) -> None:
        self._stop = True

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        sock.setblocking(True)
        _set_timeouts(sock, self.settings.io_timeout_s)
        pid, uid, gid = peer_credentials(sock)
        self._numbers += 1
        conn = Connection(os.dup(sock.fileno()))
        client = _Client(self._numbers, sock, conn, pid, uid)
        allowed = uid == os.geteuid() or (
            self._group is not None and (gid == self._group or self._group in _groups_of(pid))
        )
        if not allowed or len(self._clients) >= self.settings.max_clients:
            why = (
                f"uid {uid} is not the daemon's user {os.geteuid()} (nor in its group)"
                if not allowed
                else f"{self.settings.max_clients} engines are connected already"
            )
            log.warning("kvpool node: refused %s: %s", client.name, why)
            self.counters.refused += 1
            self._send(client, p.Refused(why))
            self._close(client)
            return
        self._clients[client.number] = client
        self.selector.register(conn, selectors.EVENT_READ, client)
        self.counters.connections += 1

    def _serve(self, client: _Client) -> None:
        """One request of `client`, answered; the engine is dropped on a closed connection,
        a time limit, or a frame that is not a request."""
        try:
            message = p.request_decoder.decode(client.conn.recv_bytes(p.MAX_MESSAGE))
        except EOFError:
            return self._gone(client, "closed the connection")
        except (OSError, msgspec.DecodeError) as error:
            self.counters.dropped += 1
            return self._gone(client, f"dropped: {error!r}")
        self.counters.requests += 1
        if isinstance(message, p.Hello):
            reply: p.Reply = self._hello(client, message)
        elif isinstance(message, p.Stats):  # (no hello needed: an operator's look)
            reply = p.StatsReply(self.statistics())
        elif client.hello is None:
            reply = p.Refused("the first message must be a hello")
        else:
            reply = self._answer(client, message)
        if isinstance(reply, p.Welcome):
            ok = self._send(client, reply, self._shared_fds())
        else:
            ok = self._send(client, reply)
        if not ok:
            self.counters.dropped += 1
            return self._gone(client, "dropped: it does not read its replies")
        if isinstance(reply, p.Refused):
            self.counters.refused += 1
            self._gone(client, f"refused: {reply.reason}")

    def _send(self, client: _Client, reply: p.Reply, fds: list[int] | None = None) -> bool:
        try:
            client.conn.send_bytes(p.encoder.encode(reply))
            if fds:
                socket.send_fds(client.sock, [b"f"], fds)
        except OSError:
            return False
        return True

    def _gone(self, client: _Client, why: str) -> None:
        """The engine is gone: its lookups are cancelled now, its pages released after the
        grace period (its workers may still be copying)."""
        log.info("kvpool node: %s %s", client.name, why)
        self.counters.disconnects += 1
        self._clients.pop(client.number, None)
        self._close(client)
        if self.store is not None:
            for key in client.waiting:
                self.store.cancel(f"{client.number}/{key}")
        client.waiting.clear()
        if client.handles:
            self._graces.append((time.monotonic() + self.settings.release_grace_s, client))

    def _close(self, client: _Client) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(client.conn)
        client.conn.close()
        client.sock.close()

    def _release_expired(self, now: float) -> None:
        while self._graces and self._graces[0][0] <= now:
            _, client = self._graces.pop(0)
            assert self.store is not None
            for handle in client.handles.values():
                self.store.release(handle)
            self.counters.released_on_disconnect += len(client.handles)
            client.handles.clear()

    # -- requests ------------------------------------------------------------------------
    def _hello(self, client: _Client, hello: p.Hello) -> p.Reply:
        if hello.version != p.VERSION:
            return p.Refused(f"protocol version {hello.version}; the daemon speaks {p.VERSION}")
        if client.hello is not None:
            return p.Refused("a second hello on one connection")
        if self.layout is None:
            try:
                manager = KVCacheManager(self.settings.manager_config(hello))
            except (ConfigError, KVPoolError) as error:
                return p.Refused(f"the daemon's settings do not fit this layout: {error}")
            self.layout = hello
            self.store = LocalStore(manager, hello.tier_group, lookup_limit=1 << 30)
            if self.settings.metrics_port is not None:
                self._serve_metrics(manager)
        else:
            mismatch = _layout_mismatch(self.layout, hello)
            if mismatch:
                return p.Refused(
                    f"the daemon serves another slot layout ({mismatch}; the first engine's "
                    "model sets it): start a daemon per layout"
                )
        client.hello = hello
        log.info("kvpool node: %s connected, model %s", client.name, hello.model[:16])
        assert self.store is not None
        return p.Welcome(list(self.store.shared_memory()), self.instance)

    def _serve_metrics(self, manager: KVCacheManager) -> None:
        from kvpool.metrics import PrometheusMetrics

        assert self.settings.metrics_port is not None
        self._metrics = PrometheusMetrics(manager, labels={"node": socket.gethostname()})
        self._metrics.serve(self.settings.metrics_port)

    def _shared_fds(self) -> list[int]:
        assert self.store is not None
        return [int(path.rsplit("/", 1)[1]) for path in self.store.shared_memory().values()]

    def _scope(self, client: _Client, lora_id: int | None, salt: str | None) -> ReuseScope:
        """The engine's scope, within its model identity: engines of other models never
        share a block, whatever their token ids."""
        assert client.hello is not None
        model = f"model:{client.hello.model}"
        return ReuseScope(lora_id, model if salt is None else f"{model}|{salt}")

    def _answer(self, client: _Client, message: Any) -> p.Reply:
        store = self.store
        assert store is not None
        if isinstance(message, p.Lookup):
            key = f"{client.number}/{message.key}"
            if len(client.handles) >= self.settings.max_handles:
                return p.LookupReply(Outcome.MISS.value)
            if message.key not in client.waiting and len(client.waiting) >= (
                self.settings.max_waiting
            ):  # (no I/O on the daemon's thread: a miss, the engine computes)
                return p.LookupReply(Outcome.MISS.value)
            scope = self._scope(client, message.lora_id, message.salt)
            found = store.lookup(key, scope, message.tokens, True)  # (no I/O on this thread)
            if found is Outcome.WAITING:
                client.waiting.add(message.key)
                return p.LookupReply(Outcome.WAITING.value)
            client.waiting.discard(message.key)
            if not isinstance(found, Hit):
                return p.LookupReply(found.value)
            return p.LookupReply(
                "hit", self._hold(client, found.handle), found.tokens, found.slots, found.tiers
            )
        if isinstance(message, p.PlanSave):
            if len(client.handles) >= self.settings.max_handles:
                self.counters.no_room += 1
                return p.SaveReply(Outcome.NO_ROOM.value)
            plan = store.plan_save(
                self._scope(client, message.lora_id, message.salt), message.tokens
            )
            if not isinstance(plan, SavePlan):
                self.counters.no_room += plan is Outcome.NO_ROOM
                return p.SaveReply(plan.value)
            handle = self._hold(client, plan.handle)
            return p.SaveReply("plan", handle, plan.first_block, plan.slots)
        if isinstance(message, p.CommitSave):
            cache = client.handles.pop(message.handle, None)
            if cache is not None:
                store.commit_save(cache, message.tokens, message.first_block)
            return p.Done()
        if isinstance(message, p.Release):
            cache = client.handles.pop(message.handle, None)
            if cache is not None:
                store.release(cache)
            return p.Done()
        if isinstance(message, p.Cancel):
            if message.key in client.waiting:
                client.waiting.discard(message.key)
                store.cancel(f"{client.number}/{message.key}")
            return p.Done()
        if isinstance(message, p.Stats):
            return p.StatsReply(self.statistics())
        return p.Refused(f"unknown request {type(message).__name__}")

    def _hold(self, client: _Client, cache: Any) -> int:
        self._handles += 1
        client.handles[self._handles] = cache
        return self._handles

    def statistics(self) -> dict[str, Any]:
        stats: dict[str, Any] = {
            **dataclasses.asdict(self.counters),
            "engines": sum(c.hello is not None for c in self._clients.values()),
            "held": sum(len(c.handles) for c in self._clients.values()),
            "held_by_gone_engines": sum(len(c.handles) for _, c in self._graces),
        }
        if self.store is not None:
            stats.update(self.store.statistics())
            stats["open_requests"] = self.store.manager.num_open_kv_caches
        return stats

    def close(self) -> None:
        """Drop every engine, release what they held, write what waits for the remote tier
        (and a persistent disk level), remove the socket."""
        for client in list(self._clients.values()):
            self._gone(client, "closed by the daemon")
        self._release_expired(float("inf"))
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(self.listener)
        self.listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.settings.socket)
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self.store is not None:
            log.info("kvpool node daemon: %s", self.statistics())
            store, self.store = self.store, None
            store.shutdown(self.settings.disk_persist)


def _layout_mismatch(first: p.Hello, other: p.Hello) -> str:
    """What differs between two engines' slot layouts ("" when nothing does)."""
    if first.tokens_per_block != other.tokens_per_block:
        return f"{other.tokens_per_block} tokens per block, not {first.tokens_per_block}"
    if len(first.layers) != len(other.layers):
        return f"{len(other.layers)} layers, not {len(first.layers)}"
    for mine, theirs in zip(first.layers, other.layers, strict=True):
        if mine != theirs:
            return f"layer {theirs.layer_id}: {theirs}, not {mine}"
    return ""


__all__ = ["DaemonSettings", "NodeDaemon", "peer_credentials"]

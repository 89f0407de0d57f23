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
- Latency: after a message the loop polls for the next for `busy_poll_s` before it sleeps, and
  clients poll for their replies (`frames`): an engine's lookup costs no process wake-up on
  either side while it is active, for the CPU the polling takes.
- Only the daemon's user (or `group`) may connect: the socket file's mode (0600, 0660 with a
  group) and each peer's credentials (SO_PEERCRED) checked on accept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import selectors
import signal
import socket
import stat
import time
from typing import Any

import msgspec

from kvpool.config import ReuseScope
from kvpool.errors import ConfigError, KVPoolError
from kvpool.manager import KVCacheManager
from kvpool.node import protocol as p
from kvpool.node.frames import FrameSocket
from kvpool.node.settings import DaemonSettings
from kvpool.node.sockets import groups_of, peer_credentials, set_timeouts
from kvpool.node.store import Hit, LocalStore, Outcome, SavePlan

log = logging.getLogger("kvpool.node")


@dataclasses.dataclass
class _Client:
    """One engine's connection and what it holds."""

    number: int
    frames: FrameSocket
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
    polled: int = 0  # messages found by polling after the last one (no wake-up)


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
        polling_until = 0.0  # (after a message, poll for the next before sleeping: no wake-up)
        try:
            while not self._stop:
                busy = time.perf_counter() < polling_until
                events = self.selector.select(0 if busy else 0.2 if not self._graces else 0.05)
                for key, _ in events:
                    if key.data is None:
                        self._accept()
                    elif key.data.number in self._clients:
                        self._serve(key.data)
                if events:
                    if busy:
                        self.counters.polled += len(events)
                    polling_until = time.perf_counter() + self.settings.busy_poll_s
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
        set_timeouts(sock, self.settings.io_timeout_s)
        pid, uid, gid = peer_credentials(sock)
        self._numbers += 1
        client = _Client(self._numbers, FrameSocket(sock), pid, uid)
        allowed = uid == os.geteuid() or (
            self._group is not None and (gid == self._group or self._group in groups_of(pid))
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
        self.selector.register(client.frames, selectors.EVENT_READ, client)
        self.counters.connections += 1

    def _serve(self, client: _Client) -> None:
        """One request of `client`, answered; the engine is dropped on a closed connection,
        a time limit, or a frame that is not a request."""
        try:
            message = p.request_decoder.decode(client.frames.recv(p.MAX_MESSAGE))
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
        elif client.frames.buffered:  # (one request at a time: it did not wait for its reply)
            self.counters.dropped += 1
            self._gone(client, "dropped: it sent a request before reading its last reply")

    def _send(self, client: _Client, reply: p.Reply, fds: list[int] | None = None) -> bool:
        try:
            client.frames.send(p.encoder.encode(reply))
            if fds:
                socket.send_fds(client.frames.sock, [b"f"], fds)
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
            self.selector.unregister(client.frames)
        client.frames.close()

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


__all__ = ["DaemonSettings", "NodeDaemon"]

"""An engine's side of the node daemon: a `store.Store` whose decisions the daemon takes. It
never holds up the engine: a call the daemon does not answer within `timeout_s` (or a daemon
that is gone) is a miss or no save; the client then drops the connection (the daemon releases
what it held), marks the daemon down, and connects again on a later call, after a back-off.

The daemon's shared memory arrives as file descriptors with its welcome (SCM_RIGHTS); the
client keeps them open and gives the engine's workers `/proc/<this pid>/fd/<fd>` paths, so it
works across PID namespaces. Each connection is a new `generation`: handles and slots of an
older one are stale (the connector fails their copies; `release` and `commit_save` ignore
them).

The scheduler's thread polls for a reply for up to `poll_s` before it sleeps (a wake-up costs
more than the daemon's answer to a small lookup); it stops polling while the daemon's answers
take longer than that (`frames.FrameSocket`)."""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from kvpool.config import ReuseScope
from kvpool.errors import ConfigError
from kvpool.node import protocol as p
from kvpool.node.frames import FrameSocket
from kvpool.node.sockets import set_timeouts
from kvpool.node.store import Hit, Outcome, SavePlan
from kvpool.tokens import Token

log = logging.getLogger("kvpool.node")
IDLE_S = 0.002  # the longest pause of an empty step while this engine's lookups wait


@dataclass
class RemoteHandle:
    """A daemon's request holding pages for this engine."""

    client: NodeClient
    generation: int
    number: int

    def close(self) -> None:
        self.client.release(self)


class NodeClient:
    """A `store.Store` over a `kvpool serve` daemon at `path` (module docstring)."""

    def __init__(
        self,
        path: str,
        hello: p.Hello,
        timeout_s: float = 0.1,
        poll_s: float = 0.0003,
        retry_s: tuple[float, float] = (0.25, 5.0),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.hello = hello
        self.timeout_s = timeout_s
        self.poll_s = poll_s  # (a reply is polled for this long before the thread sleeps)
        self.retry_s = retry_s
        self.clock = clock
        # the connection whose memory `shared_memory()` maps; a connection lost (the daemon
        # releases what it held) or made changes it
        self.generation = 0
        # (`polled`: replies that came while this thread polled for them, without sleeping)
        self.counters = {"connects": 0, "failures": 0, "refusals": 0, "calls": 0, "polled": 0}
        self.last_error = ""
        self._conn: FrameSocket | None = None
        self._fds: dict[str, int] = {}
        self._next_try = 0.0
        self._backoff = retry_s[0]
        self._lock = threading.Lock()  # (the reconnecting thread installs a connection)
        self._connecting = False

    def connect(self, required: bool = False, welcome_s: float = 10.0) -> bool:
        """Connect and say hello now, waiting up to `welcome_s` for the welcome (the daemon's
        first engine makes it build its manager); False (logged) if the daemon is not there.
        A daemon that refuses this engine (another layout, another protocol version) is a
        `ConfigError` with `required`."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            set_timeouts(sock, self.timeout_s)
            sock.connect(self.path)
            conn = FrameSocket(sock, self.poll_s)
            conn.send(p.encoder.encode(self.hello))
            waiting = select.poll()  # (not select(): an engine's descriptors pass 1,024)
            waiting.register(sock, select.POLLIN)
            if not waiting.poll(max(self.timeout_s, welcome_s) * 1000):
                raise TimeoutError("no welcome")
            # (read to the welcome's last byte: the descriptors ride on the next one)
            reply = p.reply_decoder.decode(conn.recv_frame_exact(p.MAX_MESSAGE))
            if isinstance(reply, p.Refused):
                self.counters["refusals"] += 1
                raise ConfigError(f"the kvpool node daemon at {self.path} refused: {reply.reason}")
            if not isinstance(reply, p.Welcome):
                raise OSError(f"unexpected reply {type(reply).__name__}")
            fds: list[int] = []
            if reply.pools:
                _, fds, _, _ = socket.recv_fds(sock, 1, len(reply.pools))
            if len(fds) != len(reply.pools):
                for fd in fds:
                    os.close(fd)
                raise OSError(f"{len(fds)} descriptors for {len(reply.pools)} pools")
        except ConfigError as error:
            sock.close()
            with self._lock:
                self._down(str(error))
            if required:
                raise
            log.error("kvpool: %s", error)
            return False
        except (OSError, EOFError, TimeoutError, msgspec.DecodeError) as error:
            sock.close()
            with self._lock:
                self._down(f"cannot connect to the kvpool node daemon at {self.path}: {error!r}")
            return False
        with self._lock:
            self._close_connection()
            old = self._fds
            self._fds = dict(zip(reply.pools, fds, strict=True))
            for fd in old.values():  # (after the new ones are open: no number reused at once)
                os.close(fd)
            self._conn = conn
            self.generation += 1
            self.counters["connects"] += 1
            self._backoff = self.retry_s[0]
        log.info("kvpool: connected to the node daemon at %s (%s)", self.path, reply.daemon)
        return True

    def _reconnect_in_background(self) -> None:
        """Connect again off the caller's thread (an engine's scheduler never waits for a
        daemon that is starting, or stuck); calls are misses until it is done."""
        if self._connecting or self.clock() < self._next_try:
            return
        self._connecting = True

        def run() -> None:
            try:
                self.connect()
            finally:
                self._connecting = False

        threading.Thread(target=run, name="kvpool-node-reconnect", daemon=True).start()

    @property
    def connected(self) -> bool:
        return self._conn is not None

    def _down(self, why: str) -> None:
        """Drop the connection (the daemon releases what this engine held). A connection that
        worked is tried again on the next call (a restarted daemon is likely there already);
        a failed connect after the back-off, doubled each time."""
        was_up = self._conn is not None  # (the caller holds the lock)
        if was_up or why != self.last_error:
            log.warning("kvpool: node daemon unavailable (%s); computing without it", why)
        self.last_error = why
        self.counters["failures"] += 1
        self._close_connection()
        if was_up:  # (the daemon releases this connection's handles: they are stale now)
            self.generation += 1
            self._backoff = self.retry_s[0]
            self._next_try = self.clock()
        else:
            self._next_try = self.clock() + self._backoff
            self._backoff = min(self._backoff * 2, self.retry_s[1])

    def _close_connection(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn = None

    def _call(self, message: Any) -> Any:
        """The daemon's reply, or None (it is down or too slow: the caller's fallback)."""
        with self._lock:
            conn = self._conn
            if conn is None:
                self._reconnect_in_background()
                return None
            self.counters["calls"] += 1
            polled = conn.polled
            try:
                conn.send(p.encoder.encode(message))
                # (SO_RCVTIMEO bounds the wait: past `timeout_s` an OSError, EAGAIN)
                reply = p.reply_decoder.decode(conn.recv(p.MAX_MESSAGE))
            except (OSError, EOFError, TimeoutError, msgspec.DecodeError) as error:
                self._down(repr(error))
                return None
            self.counters["polled"] += conn.polled - polled
            if isinstance(reply, p.Refused):
                self._down(f"refused: {reply.reason}")
                return None
            return reply

    # -- the store -----------------------------------------------------------------------
    def lookup(
        self, key: str, scope: ReuseScope | None, tokens: Sequence[Token], async_io: bool
    ) -> Hit | Outcome:
        lora, salt = _scope(scope)
        reply = self._call(p.Lookup(key, lora, salt, _ints(tokens), async_io))
        if not isinstance(reply, p.LookupReply):
            return Outcome.MISS
        if reply.outcome != "hit":
            return Outcome(reply.outcome)
        handle = RemoteHandle(self, self.generation, reply.handle)
        return Hit(handle, reply.tokens, reply.slots, reply.tiers)

    def cancel(self, key: str) -> None:
        if self._conn is not None:
            self._call(p.Cancel(key))

    def idle(self, timeout_s: float, wake: Callable[[], bool] | None = None) -> None:
        """(The daemon's look-aheads are not seen from here: a pause in place of a step that
        would ask the daemon again at once, of at most `IDLE_S`, since a longer one would
        only answer a ready lookup later.)"""
        deadline = time.monotonic() + min(timeout_s, IDLE_S)
        while (left := deadline - time.monotonic()) > 0:
            if wake is not None and wake():
                return
            time.sleep(min(0.0002, left))

    def plan_save(self, scope: ReuseScope | None, tokens: Sequence[Token]) -> SavePlan | Outcome:
        lora, salt = _scope(scope)
        reply = self._call(p.PlanSave(lora, salt, _ints(tokens)))
        if not isinstance(reply, p.SaveReply):
            return Outcome.NO_ROOM  # (unreachable: no save)
        if reply.outcome != "plan":
            return Outcome(reply.outcome)
        handle = RemoteHandle(self, self.generation, reply.handle)
        return SavePlan(handle, reply.first_block, reply.slots)

    def commit_save(self, handle: Any, tokens: Sequence[Token], first_block: int) -> None:
        if self._current(handle):
            self._call(p.CommitSave(handle.number, _ints(tokens), first_block))

    def release(self, handle: Any) -> None:
        if self._current(handle):
            self._call(p.Release(handle.number))

    def _current(self, handle: RemoteHandle) -> bool:
        """Whether the daemon still holds it (a dropped connection released everything)."""
        return self._conn is not None and handle.generation == self.generation

    def shared_memory(self) -> dict[str, str]:
        return self.memory()[1]

    def memory(self) -> tuple[int, dict[str, str]]:
        """The generation and its shared memory's paths, together (a reconnect changes both)."""
        pid = os.getpid()
        with self._lock:
            paths = {name: f"/proc/{pid}/fd/{fd}" for name, fd in self._fds.items()}
            return self.generation, paths

    def statistics(self) -> dict[str, Any]:
        reply = self._call(p.Stats())  # (down: None at once, and a reconnect begins)
        node = reply.stats if isinstance(reply, p.StatsReply) else None
        return {"node": node, "node_client": dict(self.counters, generation=self.generation)}

    def shutdown(self, persist: bool = False) -> None:
        """Close the connection (the daemon releases what is left) and the shared memory's
        descriptors (the workers' mappings keep theirs until they end)."""
        with self._lock:
            self._next_try = float("inf")  # (no reconnecting after this)
            self._close_connection()
            for fd in self._fds.values():
                os.close(fd)
            self._fds = {}


def daemon_statistics(path: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """A daemon's statistics, asked without a hello (an operator's or a test's look)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        set_timeouts(sock, timeout_s)
        sock.connect(path)
        conn = FrameSocket(sock)
        conn.send(p.encoder.encode(p.Stats()))
        reply = p.reply_decoder.decode(conn.recv(p.MAX_MESSAGE))
    if not isinstance(reply, p.StatsReply):
        raise OSError(f"the daemon at {path} answered {reply!r}")
    return reply.stats


def _scope(scope: ReuseScope | None) -> tuple[int | None, str | None]:
    if scope is None:
        return None, None
    salt = scope.salt
    if salt is not None and not isinstance(salt, str):
        salt = repr(salt)
    return scope.lora_id, salt


def _ints(tokens: Sequence[Token]) -> list[int]:
    """(Token ids of an engine are ints; msgspec checks as it encodes.)"""
    found: Any = tokens if isinstance(tokens, list) else list(tokens)
    return found  # type: ignore[no-any-return]


__all__ = ["NodeClient", "RemoteHandle", "daemon_statistics"]

"""Lookups whose I/O runs off the manager's thread (`KVCacheManager.look_ahead`).

An engine's scheduler must not wait on a disk or a server: one request's fetch would stall
every running request's next step. `look_ahead(scope, tokens)` matches the prompt in the
local tree at once (no I/O) and hands what the lookup would wait for to a small pool of
threads: the disk pages of the local match are read ahead (into the page cache, so that
bringing them up later copies from memory), and the remote tier is asked, on the thread's own
connection, which blocks past the local prefix it holds, and those values are fetched and
checked. The scheduler asks `ready` on later steps; once ready, `create_kv_cache(...,
lookahead=...)` takes the remote prefix and its values from it (no I/O on the manager's
thread; the tree is matched again then, so what changed meanwhile counts).

The threads take no decision and touch no manager state: a read-ahead of a slot that is
reused meanwhile only warms other bytes, and a remote result that no longer continues the
local match (local blocks dropped meanwhile) is not used. Decisions stay a function of the
manager's calls and of what the server holds.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpool.remote import RemotePrefix, RemoteStatistics, RemoteTier
from kvpool.remote.store import RemoteStore
from kvpool.tokens import Token

READ_AHEAD_CHUNK = 1 << 20


@dataclass(frozen=True)
class DiskRange:
    """Bytes of a disk level's file to read ahead: one page's slot of one pool."""

    fd: int
    offset: int
    nbytes: int


@dataclass
class RemoteQuery:
    """What the remote tier is asked: the blocks of `tokens` past the first `start` (local)."""

    parent_key: bytes
    tokens: list[Token]
    start: int
    parent_tag: bytes = b""  # the tag of local block start - 1 (`Block.tag`)


@dataclass(eq=False)
class Lookahead:
    """One lookup's I/O, done by the manager's look-ahead threads. `ready` once it is done
    (at once when it needs none); `cancel()` when its request goes away."""

    scope_key: bytes
    tokens: list[Token]
    disk: list[DiskRange]
    query: RemoteQuery | None
    remote: RemotePrefix | None = None  # the remote prefix found, its values fetched
    stats: RemoteStatistics = field(default_factory=RemoteStatistics)
    read_ahead_bytes: int = 0
    cancelled: bool = False
    _done: threading.Event = field(default_factory=threading.Event)

    @property
    def needs_io(self) -> bool:
        return bool(self.disk) or self.query is not None

    @property
    def ready(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until ready (tests and tools; an engine polls `ready`)."""
        return self._done.wait(timeout)

    def cancel(self) -> None:
        """Its request went away: skip the work if not started, drop its result."""
        self.cancelled = True
        self.remote = None

    def _finish(self) -> None:
        self._done.set()


class LookaheadPool:
    """`threads` daemon threads, started on first use, each with its own remote connection."""

    def __init__(self, remote: RemoteTier | None, threads: int) -> None:
        self._remote = remote
        self._count = threads
        self._queue: queue.SimpleQueue[Lookahead | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._closed = False

    def submit(self, lookahead: Lookahead) -> None:
        if not lookahead.needs_io:
            lookahead._finish()
            return
        if not self._threads:
            for i in range(self._count):
                thread = threading.Thread(
                    target=self._run, name=f"kvpool-lookahead-{i}", daemon=True
                )
                thread.start()
                self._threads.append(thread)
        self._queue.put(lookahead)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the threads (work queued and not started is dropped, marked ready); each
        call in progress is bounded by the remote tier's timeout."""
        self._closed = True
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join(timeout)
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item.cancel()
                item._finish()

    def _run(self) -> None:
        store: RemoteStore | None = None
        scratch = bytearray(READ_AHEAD_CHUNK)
        while True:
            lookahead = self._queue.get()
            if lookahead is None:
                return
            try:
                if not lookahead.cancelled and not self._closed:
                    lookahead.read_ahead_bytes = _read_ahead(lookahead.disk, scratch)
                if lookahead.query is not None and self._remote is not None:
                    if store is None:
                        store = self._remote.new_store()  # (the tier closes it)
                    if not lookahead.cancelled and not self._closed:
                        lookahead.remote = _fetch_remote(
                            self._remote, store, lookahead.query, lookahead.stats
                        )
            except Exception:  # (a failed look-ahead is a miss; the thread goes on)
                lookahead.remote = None
            finally:
                if lookahead.cancelled:
                    lookahead.remote = None
                lookahead._finish()


def _read_ahead(ranges: Sequence[DiskRange], scratch: bytearray) -> int:
    """Read `ranges` (into the page cache; the bytes are not kept). Errors are left for the
    manager's own read to meet and handle."""
    done = 0
    view = memoryview(scratch)
    for item in ranges:
        offset, left = item.offset, item.nbytes
        while left > 0:
            try:
                got = os.preadv(item.fd, [view[: min(left, len(scratch))]], offset)
            except OSError:
                break
            if got <= 0:
                break
            offset, left, done = offset + got, left - got, done + got
    return done


def _fetch_remote(
    tier: RemoteTier, store: RemoteStore, query: RemoteQuery, stats: RemoteStatistics
) -> RemotePrefix | None:
    """The remote prefix past the local match, its values fetched and checked (None: none)."""
    prefix = tier.lookup(
        query.parent_key, query.tokens, query.start, store=store, stats=stats,
        parent_tag=query.parent_tag,
    )  # fmt: skip
    if prefix is None:
        return None
    end, payloads = tier.fetch(prefix, store=store, stats=stats)
    if end == prefix.start:
        return None
    return tier.shortened(prefix, end, payloads)


__all__ = ["DiskRange", "Lookahead", "LookaheadPool", "RemoteQuery"]

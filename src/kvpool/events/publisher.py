"""Publishing KV event batches over ZMQ from a thread of its own (vLLM's protocol).

The PUB socket sends each batch as (topic, sequence number, payload); the last `buffer_steps`
batches are kept, and a ROUTER socket (`replay_endpoint`) answers a request carrying a start
sequence number (8 bytes, big-endian) with every kept batch from there on, as (empty frame,
topic, sequence, payload) frames after the requester's identity, then an end marker (sequence
-1, empty payload). A subscriber that joins late (or notices a gap) subscribes first, asks for a
replay from 0 (or the gap), then applies live batches past the replayed ones.

The engine's thread only enqueues the step's records; this thread turns them into events,
encodes and sends them. The queue is bounded: a publisher that falls that far behind makes the
engine wait rather than lose events.
"""

from __future__ import annotations

import logging
import queue
import struct
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from kvpool.config import KVEventsConfig, ReuseScope
from kvpool.errors import ConfigError
from kvpool.events.log import Record

logger = logging.getLogger("kvpool.events")
END_SEQUENCE = (-1).to_bytes(8, "big", signed=True)
_DIGEST_MARKER = b"\xff\xff\xff\xff"


class KVEventPublisher:
    """Owns the sockets and the thread; `publish(records)` from the engine's thread."""

    def __init__(self, config: KVEventsConfig, media: Sequence[str], tokens_per_block: int):
        try:
            import msgspec
            import zmq
        except ImportError:
            raise ConfigError(
                "kv_events needs msgspec and pyzmq: pip install 'kvpool[events]'"
            ) from None
        from kvpool.events import wire

        self._wire = wire
        self._encoder = msgspec.msgpack.Encoder()
        self.config = config
        self._media = list(media)
        self._tpb = tokens_per_block
        self._unpack = struct.Struct(f"<{tokens_per_block}i").unpack
        self._data_bytes = 4 * tokens_per_block  # a block's tokens, encoded, without digests
        self.scopes: dict[bytes, ReuseScope] = {}  # scope key -> scope, for lora ids and salts
        self._topic = config.topic.encode()
        self._queue: queue.Queue[list[Record] | None] = queue.Queue(config.max_queue_batches)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_sequence = 0
        self.num_batches = 0  # sent so far
        self.num_events = 0
        context: Any = zmq.Context.instance()
        self._pub = context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:
            self._pub.bind(config.endpoint)
            self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint: str | None = None
            if config.replay_endpoint is not None:
                self._replay = context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))
                self._replay.bind(config.replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as error:
            self._close_sockets()
            raise ConfigError(
                f"kv_events: cannot bind {config.endpoint!r} / {config.replay_endpoint!r}: {error}"
            ) from None
        self._thread = threading.Thread(target=self._run, name="kvpool-kv-events", daemon=True)
        self._thread.start()

    def publish(self, records: list[Record]) -> None:
        self._queue.put(records)

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (up to `timeout` seconds), then close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=100)
        if self._replay is not None:
            self._replay.close(linger=100)

    # -- the thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:
                    logger.exception("a KV event replay request failed")
            try:
                records = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if records is None:
                return
            try:
                events = self._events(records)
                batch = self._wire.EventBatch(time.time(), events, self.config.data_parallel_rank)
                payload = self._encoder.encode(batch)
                sequence = self._next_sequence
                self._next_sequence += 1
                self._pub.send_multipart((self._topic, sequence.to_bytes(8, "big"), payload))
                self._buffer.append((sequence, payload))
                self.num_batches += 1
                self.num_events += len(events)
            except Exception:
                logger.exception("publishing a KV event batch failed")

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("ignored a malformed KV event replay request (%d frames)", len(frames))
            return
        identity, _, start = frames
        first = int.from_bytes(start, "big")
        for sequence, payload in list(self._buffer):
            if sequence >= first:
                self._replay.send_multipart(
                    (identity, b"", self._topic, sequence.to_bytes(8, "big"), payload)
                )
        self._replay.send_multipart((identity, b"", b"", END_SEQUENCE, b""))

    def _events(self, records: list[Record]) -> list[Any]:
        """Records as wire events, runs merged: consecutive stores of a chain on one medium and
        layer group are one `BlockStored`, consecutive removals one `BlockRemoved`."""
        media, external = self._media, self._wire.MEDIUM_EXTERNAL
        merger = _Merger(self)
        for record in records:
            kind = record[0]
            if kind == "R":
                _, key, group, level = record
                merger.removed(key, group, media[level])
            elif kind == "S":
                _, keys, parents, datas, scope, group, level = record
                medium = media[level]
                for key, parent, data in zip(keys, parents, datas, strict=True):
                    merger.stored(key, parent, data, scope, group, medium)
            elif kind == "M":
                _, keys, parents, datas, scopes, groups, source, target = record
                for key, group in zip(keys, groups, strict=True):
                    merger.removed(key, group, media[source])
                medium = media[target]
                for key, parent, data, scope, group in zip(
                    keys, parents, datas, scopes, groups, strict=True
                ):
                    merger.stored(key, parent, data, scope, group, medium)
            elif kind == "X":
                _, keys, parents, datas, scopes, groups = record
                for key, parent, data, scope, group in zip(
                    keys, parents, datas, scopes, groups, strict=True
                ):
                    merger.stored(key, parent, data, scope, group, external)
            else:
                merger.cleared()
        return merger.events

    def _tokens(self, data: bytes) -> tuple[list[int], list[bytes]]:
        """A block's token ids (-1 for a multimodal digest) and its digests."""
        tokens: list[int] = []
        digests: list[bytes] = []
        offset = 0
        while offset < len(data):
            if data[offset : offset + 4] == _DIGEST_MARKER:
                digests.append(data[offset + 4 : offset + 36])
                tokens.append(-1)
                offset += 36
            else:
                tokens.append(int.from_bytes(data[offset : offset + 4], "little"))
                offset += 4
        return tokens, digests

    @staticmethod
    def _extra(scope: ReuseScope | None, digests: list[bytes]) -> tuple[Any, ...] | None:
        extra: tuple[Any, ...] = tuple(digests)
        if scope is not None and scope.salt is not None:
            extra = (scope.salt, *extra)
        return extra or None


class _Merger:
    """Builds wire events from records one block at a time, extending the last event while
    the run continues (same kind, medium, layer group; for stores, the next block of the
    chain in the same scope)."""

    def __init__(self, publisher: KVEventPublisher) -> None:
        self._publisher = publisher
        self._wire = publisher._wire
        self.events: list[Any] = []
        self._stored: Any = None
        self._removed: Any = None
        self._last_key = b""
        self._last_scope = b""

    def removed(self, key: bytes, group: int, medium: str) -> None:
        self._stored = None
        hashed = int.from_bytes(key[-8:], "big")  # (wire.block_hash, inlined: a hot loop)
        last = self._removed
        if last is not None and last.group_idx == group and last.medium == medium:
            last.block_hashes.append(hashed)
        else:
            self._removed = self._wire.BlockRemoved([hashed], medium, group_idx=group)
            self.events.append(self._removed)

    def stored(
        self, key: bytes, parent: bytes, data: bytes, scope: bytes, group: int, medium: str
    ) -> None:
        self._removed = None
        publisher = self._publisher
        if len(data) == publisher._data_bytes:
            tokens, extra = list(publisher._unpack(data)), self._salt(scope)
        else:
            tokens, digests = publisher._tokens(data)
            extra = publisher._extra(publisher.scopes.get(scope), digests)
        hashed = int.from_bytes(key[-8:], "big")
        last = self._stored
        if (
            last is not None
            and parent == self._last_key
            and scope == self._last_scope
            and last.group_idx == group
            and last.medium == medium
        ):
            last.block_hashes.append(hashed)
            last.token_ids += tokens
            if last.extra_keys is not None or extra is not None:
                if last.extra_keys is None:
                    last.extra_keys = [None] * (len(last.block_hashes) - 1)
                last.extra_keys.append(extra)
        else:
            scope_of = publisher.scopes.get(scope)
            self._stored = self._wire.BlockStored(
                [hashed],
                None if parent == scope else int.from_bytes(parent[-8:], "big"),
                tokens,
                publisher._tpb,
                None if scope_of is None else scope_of.lora_id,
                medium,
                None,
                extra_keys=None if extra is None else [extra],
                group_idx=group,
            )
            self.events.append(self._stored)
        self._last_key, self._last_scope = key, scope

    def _salt(self, scope: bytes) -> tuple[Any, ...] | None:
        """The extra key of a block without digests: its scope's salt, if any."""
        scope_of = self._publisher.scopes.get(scope)
        if scope_of is None or scope_of.salt is None:
            return None
        return (scope_of.salt,)

    def cleared(self) -> None:
        self._stored = self._removed = None
        self.events.append(self._wire.AllBlocksCleared())


__all__ = ["END_SEQUENCE", "KVEventPublisher"]

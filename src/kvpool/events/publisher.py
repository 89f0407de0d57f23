"""Publishing KV event batches over ZMQ from a thread of its own (vLLM's protocol).

The PUB socket sends each batch as (topic, sequence number, payload); the last `buffer_steps`
batches are kept, and a ROUTER socket (`replay_endpoint`) answers a request carrying a start
sequence number (8 bytes, big-endian) with every kept batch from there on, one message each
(topic, sequence, payload), then an end marker (empty topic, sequence -1, empty payload). The
requester is a DEALER socket: a request of (empty frame, start), vLLM's form, gets replies
that begin with an empty frame too; a request of (start) alone, replies without it. (A REQ
socket takes one reply per request: it would see the first batch only.) A subscriber that
joins late (or notices a gap) subscribes first, asks for a replay from 0 (or the gap), then
applies live batches past the replayed ones.

The engine's thread builds the step's events (`KVEventLog`); this thread stamps, encodes and
sends them. The queue is bounded: a publisher that falls that far behind makes the
engine wait rather than lose events.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

from kvpool.config import KVEventsConfig
from kvpool.errors import ConfigError

logger = logging.getLogger("kvpool.events")
END_SEQUENCE = (-1).to_bytes(8, "big", signed=True)


class KVEventPublisher:
    """Owns the sockets and the thread; `publish(records)` from the engine's thread."""

    def __init__(self, config: KVEventsConfig):
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
        self._topic = config.topic.encode()
        self._queue: queue.Queue[list[Any] | None] = queue.Queue(config.max_queue_batches)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_sequence = 0
        self.num_batches = 0  # sent so far
        self.num_events = 0
        # A context of its own: terminating it waits until its sockets are really closed and
        # their ports released (closing a socket alone hands that to ZMQ's I/O thread, so a
        # start that failed could keep its PUB port bound for a while after it raised).
        context: Any = zmq.Context()
        self._context = context
        self._pub = context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        field = "endpoint"
        try:
            self._pub.bind(config.endpoint)
            self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint: str | None = None
            if config.replay_endpoint is not None:
                field = "replay_endpoint"
                self._replay = context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))
                self._replay.bind(config.replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as error:
            self._close_sockets(linger=0)
            raise ConfigError(
                f"kv_events.{field}={getattr(config, field)!r} is invalid: must be an address "
                f"this process can bind (ZMQ: {error})"
            ) from None
        self._thread = threading.Thread(target=self._run, name="kvpool-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[Any]) -> None:
        """Queue a step's wire events (from `KVEventLog`) to be sent as one batch."""
        self._queue.put(events)

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (up to `timeout` seconds), then close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self, linger: int = 100) -> None:
        """Close the sockets (sending what is queued for up to `linger` ms) and release their
        endpoints before returning."""
        self._pub.close(linger=linger)
        if self._replay is not None:
            self._replay.close(linger=linger)
        thread = getattr(self, "_thread", None)
        if thread is None or not thread.is_alive():  # (no socket in use by the thread)
            self._context.term()

    # -- the thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:
                    logger.exception("a KV event replay request failed")
            try:
                events = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if events is None:
                return
            try:
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
        if len(frames) not in (2, 3) or len(frames[-1]) != 8 or (len(frames) == 3 and frames[1]):
            logger.warning("ignored a malformed KV event replay request (%d frames)", len(frames))
            return
        identity, *envelope, start = frames  # (envelope: the empty frame, or none)
        first = int.from_bytes(start, "big")
        for sequence, payload in list(self._buffer):
            if sequence >= first:
                self._replay.send_multipart(
                    (identity, *envelope, self._topic, sequence.to_bytes(8, "big"), payload)
                )
        self._replay.send_multipart((identity, *envelope, b"", END_SEQUENCE, b""))


__all__ = ["END_SEQUENCE", "KVEventPublisher"]

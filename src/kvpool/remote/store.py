"""The connection to the shared store: batched calls with a bounded time each, and a server
that may come and go.

Every call is one pipeline (one round trip per server, or per node of a cluster), bounded by
the socket timeout. A failed call (connection refused, timeout, a server error) returns None
and marks the server down for a backoff that doubles up to a limit; calls in that window are
skipped (counted) instead of waiting on a dead server, and the first call after it reconnects.
On a cluster (`kvpool.remote.cluster`) the same holds per node: a failed node costs the keys
it holds, the others answer. Nothing here raises on a server problem: the remote tier is a
cache.

`WriteBack` writes values from a thread of its own (with a client of its own), so an engine
step never waits for the network; its queue is bounded and what does not fit is dropped and
counted.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from kvpool.config import RemoteCacheTierConfig
from kvpool.errors import ConfigError, StorageError
from kvpool.remote.cluster import ClusterClient
from kvpool.remote.statistics import RemoteStatistics

logger = logging.getLogger("kvpool.remote")


def url_without_password(url: str) -> str:
    """`url` as logs and reports may show it: scheme, host, port and database only."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}:{parts.port or 6379}{parts.path}"


def _client_errors() -> tuple[type[BaseException], ...]:
    from valkey.exceptions import ValkeyError

    return (ValkeyError, OSError)


class RemoteStore:
    """One client of the server or cluster named by a `RemoteCacheTierConfig`."""

    def __init__(self, config: RemoteCacheTierConfig, clock: Callable[[], float] = time.monotonic):
        try:
            import valkey  # noqa: F401
        except ImportError:
            raise ConfigError(
                "remote_tier needs the valkey client: pip install 'kvpool[remote]'"
            ) from None
        self.config = config
        self.stats = RemoteStatistics()
        self._clock = clock
        self._client: Any = None
        self._errors = _client_errors()
        from valkey.exceptions import ResponseError

        self._answer_errors: type[BaseException] = ResponseError
        self._backoff = config.reconnect_min_ms / 1000
        self._retry_at = 0.0
        self._down = False
        self.last_error = ""  # the last failed call's error (never with a password)
        self._last_exception: BaseException | None = None
        self.cluster: ClusterClient | None = None  # (per node: `kvpool.remote.cluster`)
        if config.cluster or len(config.urls) > 1:
            self.cluster = ClusterClient(config, clock, self._errors, self.stats, self._node_failed)
        self.last_unreached: frozenset[int] = frozenset()  # keys of the last call not asked

    @property
    def where(self) -> str:
        """The server's address, without the password."""
        return ", ".join(url_without_password(url) for url in self.config.urls)

    @property
    def available(self) -> bool:
        if self.cluster is not None:
            return not self.cluster.nodes or any(not n.down for n in self.cluster.nodes.values())
        return not self._down

    def connect(self) -> None:
        """Reach the server now: `StorageError` naming it and the cause (refused, timed out,
        credentials refused, a database it does not have) when it does not answer (unless the
        config tolerates that: then a warning, and the tier runs degraded until it answers)."""
        if self.cluster is not None:
            reached = self.cluster.refresh(force=True)
            if not reached:
                self.stats.errors += 1
                self._last_exception = self.cluster.last_exception
                error = self._last_exception
                self.last_error = self._without_passwords(f"{type(error).__name__}: {error}")
        else:
            reached = self._call(lambda client: client.ping(), quiet=True) is not None
        if not reached:
            code, cause = self._cause()
            message = f"the remote tier at {self.where} {cause} ({self.last_error})"
            if not self.config.tolerate_unavailable:
                self.close()
                raise StorageError(
                    code, message + " (remote_tier.tolerate_unavailable=True starts without it)"
                )
            logger.warning("%s: running without it until it does", message)

    def _cause(self) -> tuple[int, str]:
        """The errno and words of the last failed call's cause."""
        from valkey.exceptions import AuthenticationError, ResponseError
        from valkey.exceptions import TimeoutError as ValkeyTimeout

        error = self._last_exception
        if isinstance(error, AuthenticationError):
            return errno.EACCES, "refuses the credentials"
        if isinstance(error, ValkeyTimeout | TimeoutError):
            return errno.ETIMEDOUT, "does not answer in time"
        if isinstance(error, ResponseError):
            return errno.EINVAL, "refuses the connection's setup"
        for inner in (error, getattr(error, "__context__", None)):
            if isinstance(inner, OSError) and inner.errno is not None and inner.errno > 0:
                if inner.errno == errno.ECONNREFUSED:
                    return inner.errno, "refuses connections (no server listening there?)"
                return inner.errno, f"cannot be reached ({os.strerror(inner.errno)})"
        return errno.EHOSTUNREACH, "cannot be reached"

    def exists(self, keys: Sequence[bytes]) -> list[bool] | None:
        """Whether each key is stored (None: the server could not be asked)."""
        if not keys:
            return []
        if self.cluster is not None:
            answers = self._on_cluster([("EXISTS", key) for key in keys])
            return [answer == 1 for answer in answers]

        def run(client: Any) -> list[bool]:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            return [found is True or found == 1 for found in self._answers(pipe)]

        result: list[bool] | None = self._call(run)
        return result

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None] | None:
        """The value of each key (None for an absent one; None for all: no server)."""
        self.last_unreached = frozenset()
        if not keys:
            return []
        if self.cluster is not None:
            answers = self._on_cluster([("GET", key) for key in keys])
            return [v if isinstance(v, bytes) else None for v in answers]

        def run(client: Any) -> list[bytes | None]:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.get(key)
            return [v if isinstance(v, bytes) else None for v in self._answers(pipe)]

        values: list[bytes | None] | None = self._call(run)
        return values

    def set_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        """Store each (key, value); returns how many the server confirmed (0 when the call
        failed)."""
        if not items:
            return 0
        if self.cluster is not None:
            answers = self._on_cluster([("SET", key, value) for key, value in items])
            return sum(1 for answer in answers if answer in (b"OK", "OK", True))

        def run(client: Any) -> int:
            pipe = client.pipeline(transaction=False)
            for key, value in items:
                pipe.set(key, value)
            return sum(1 for answer in self._answers(pipe) if answer is True)

        written: int | None = self._call(run)
        return written or 0

    def delete_many(self, keys: Sequence[bytes]) -> bool:
        if self.cluster is not None:
            answers = self._on_cluster([("DEL", key) for key in keys])
            return all(isinstance(answer, int) for answer in answers)

        def run(client: Any) -> bool:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.delete(key)
            self._answers(pipe)
            return True

        return bool(self._call(run))

    def _on_cluster(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """`commands` on the cluster's nodes: a refused command answers None (counted), one
        whose node was not reached answers None too (its index in `last_unreached`)."""
        assert self.cluster is not None
        answers = self.cluster.execute(commands)
        unreached = set()
        for i, answer in enumerate(answers):
            if answer is ClusterClient.UNREACHED:
                unreached.add(i)
                answers[i] = None
            elif isinstance(answer, BaseException):
                self.stats.refused_commands += 1
                answers[i] = None
        self.last_unreached = frozenset(unreached)
        return answers

    def _node_failed(self, error: BaseException, address: str) -> None:
        """A cluster node failed a call (`address`: empty when it was down already)."""
        self._last_exception = error
        self.last_error = self._without_passwords(f"{type(error).__name__}: {error}")
        if address:
            logger.warning(
                "the cluster node %s of the remote tier failed (%s): backing off",
                address,
                self.last_error,
            )

    def _answers(self, pipe: Any) -> list[Any]:
        """Run a pipeline; a command the server refused (a key of another type, an
        out-of-memory refusal) answers None, counted, and leaves the others standing."""
        answers = list(pipe.execute(raise_on_error=False))
        for i, answer in enumerate(answers):
            if isinstance(answer, BaseException):
                if not isinstance(answer, self._answer_errors):
                    raise answer  # the connection failed: the whole call did
                self.stats.refused_commands += 1
                answers[i] = None
        return answers

    def _call(self, run: Callable[[Any], Any], quiet: bool = False) -> Any:
        if self._down and self._clock() < self._retry_at:
            self.stats.skipped_calls += 1
            return None
        try:
            if self._client is None:
                self._client = self._make_client()
            result = run(self._client)
        except self._errors as error:
            self._failed(error, quiet)
            return None
        if self._down:
            self._down = False
            self.stats.reconnects += 1
            logger.info("the remote tier at %s answers again", self.where)
        self._backoff = self.config.reconnect_min_ms / 1000
        return result

    def _failed(self, error: BaseException, quiet: bool) -> None:
        self.stats.errors += 1
        self._last_exception = error
        self.last_error = self._without_passwords(f"{type(error).__name__}: {error}")
        if not self._down and not quiet:
            logger.warning(
                "the remote tier at %s failed (%s): backing off", self.where, self.last_error
            )
        self._down = True
        self._retry_at = self._clock() + self._backoff
        self._backoff = min(self._backoff * 2, self.config.reconnect_max_ms / 1000)

    def _without_passwords(self, text: str) -> str:
        """`text` with every password this store knows (URLs, the environment) masked."""
        secrets = [urlsplit(url).password for url in self.config.urls]
        secrets.append(os.environ.get(self.config.password_env))
        for secret in secrets:
            if secret:
                text = text.replace(secret, "***")
        return text

    def _make_client(self) -> Any:
        import valkey

        config = self.config
        timeout = config.timeout_ms / 1000
        options: dict[str, Any] = dict(socket_timeout=timeout, socket_connect_timeout=timeout)
        first = urlsplit(config.urls[0])
        password = first.password or os.environ.get(config.password_env) or None
        if password is not None and first.password is None:
            options["password"] = password
        return valkey.Valkey.from_url(config.urls[0], **options)

    def _drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(*self._errors):
                client.close()

    def close(self) -> None:
        self._drop_client()
        if self.cluster is not None:
            self.cluster.close()


class WriteBack:
    """Writes queued values from a thread of its own, in pipelined batches."""

    BATCH_VALUES = 64
    BATCH_BYTES = 16 << 20

    def __init__(self, store: RemoteStore, max_pending: int) -> None:
        self.store = store
        self._max_pending = max_pending
        self._queue: deque[tuple[bytes, bytes]] = deque()
        self._busy = False
        self._closed = False
        self._condition = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kvpool-remote-writer", daemon=True)
        self._thread.start()

    def submit(self, items: list[tuple[bytes, bytes]]) -> int:
        """Queue values to write; those beyond the queue's bound are dropped (counted). Returns
        how many were queued (the first ones)."""
        with self._condition:
            room = max(0, self._max_pending - len(self._queue))
            self._queue.extend(items[:room])
            stats = self.store.stats
            queued = min(room, len(items))
            stats.queued_writes += queued
            stats.dropped_writes += len(items) - queued
            self._condition.notify()
            return queued

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued value was written (or failed); False on timeout."""
        with self._condition:
            return self._condition.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self, timeout: float) -> None:
        """Write what is queued (up to `timeout` seconds), then stop the thread."""
        self.flush(timeout)
        with self._condition:
            self._closed = True
            self._queue.clear()
            self._condition.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        store = self.store
        while True:
            with self._condition:
                self._condition.wait_for(lambda: self._queue or self._closed)
                if self._closed:
                    return
                batch: list[tuple[bytes, bytes]] = []
                size = 0
                while self._queue and len(batch) < self.BATCH_VALUES and size < self.BATCH_BYTES:
                    item = self._queue.popleft()
                    batch.append(item)
                    size += len(item[1])
                self._busy = True
            try:
                written = store.set_many(batch)
                store.stats.written_values += written
                store.stats.failed_writes += len(batch) - written
                if written == len(batch):
                    store.stats.bytes_written += size
            except BaseException:  # a bug: count it and keep the thread alive
                store.stats.failed_writes += len(batch)
                logger.exception("the remote write-back failed")
            finally:
                with self._condition:
                    self._busy = False
                    self._condition.notify_all()


__all__ = ["RemoteStatistics", "RemoteStore", "WriteBack", "url_without_password"]

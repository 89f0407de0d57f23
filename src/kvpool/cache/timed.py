"""A KV cache whose hot calls are timed (`KVCacheManager.time_calls()`): the manager creates
these instead of plain `KVCache`s while timing is on, so timing costs nothing otherwise."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import SupportsIndex

from kvpool.cache.kvcache import KVCache
from kvpool.stats import LatencyHistogram
from kvpool.tokens import Token


class TimedKVCache(KVCache):
    """`KVCache` with resume, suspend, resize, commit, prefetch and close timed."""

    def _histogram(self, name: str) -> LatencyHistogram:
        calls = self._ctx.counters.calls
        if calls is None:  # timing was turned off since this cache was made
            return LatencyHistogram()
        return calls.setdefault(name, LatencyHistogram())

    def resume(self) -> bool:
        started = time.perf_counter()
        try:
            return super().resume()
        finally:
            self._histogram("resume").observe(time.perf_counter() - started)

    def suspend(self) -> None:
        started = time.perf_counter()
        try:
            super().suspend()
        finally:
            self._histogram("suspend").observe(time.perf_counter() - started)

    def resize(self, capacity: SupportsIndex, history_length: SupportsIndex | None = None) -> bool:
        started = time.perf_counter()
        try:
            return super().resize(capacity, history_length)
        finally:
            self._histogram("resize").observe(time.perf_counter() - started)

    def commit(self, tokens: Sequence[Token]) -> None:
        started = time.perf_counter()
        try:
            super().commit(tokens)
        finally:
            self._histogram("commit").observe(time.perf_counter() - started)

    def prefetch(self, level: SupportsIndex) -> bool:
        started = time.perf_counter()
        try:
            return super().prefetch(level)
        finally:
            self._histogram("prefetch").observe(time.perf_counter() - started)

    def close(self) -> None:
        started = time.perf_counter()
        try:
            super().close()
        finally:
            self._histogram("close").observe(time.perf_counter() - started)


__all__ = ["TimedKVCache"]

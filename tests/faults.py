"""Fault injection into the disk levels' system calls, and snapshots of a manager's state.

`DiskFaults` replaces `os.pwritev`, `os.preadv` and `os.posix_fallocate` with wrappers that raise
an `OSError` on chosen calls against one manager's disk files (other files are untouched), and
counts the calls it saw, so that a test can assert that it reached the I/O point it names.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvpool import CacheTier, KVCacheManager

CALLS = ("pwritev", "preadv", "posix_fallocate")


def disk_fds(manager: KVCacheManager) -> set[int]:
    fds = set()
    for level in manager._storage.state.levels:
        if level.tier is CacheTier.DISK:
            for group in level.pool_groups:
                fds.update(memory.fileno for memory in group.memories)
    return fds


@dataclass
class DiskFaults:
    """Arm with `fail(call, code, skip=0, times=1)`: after `skip` more calls of `call` on the
    manager's disk files succeed, the next `times` raise `OSError(code)` (`KeyboardInterrupt`
    for code None: Ctrl-C in the middle of the I/O)."""

    manager: KVCacheManager
    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CALLS, 0))
    injected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CALLS, 0))
    _plan: dict[str, tuple[int, int, int | None]] = field(default_factory=dict)  # skip, times, code
    _paused: bool = False

    def install(self, monkeypatch) -> DiskFaults:
        for name in CALLS:
            monkeypatch.setattr(os, name, self._wrap(name, getattr(os, name)))
        return self

    def fail(self, call: str, code: int | None = errno.EIO, skip: int = 0, times: int = 1) -> None:
        assert call in CALLS, call
        self._plan[call] = (skip, times, code)

    def disarm(self) -> None:
        self._plan.clear()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Neither counted nor failed inside (a test's own reads, for instance)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    @property
    def total_injected(self) -> int:
        return sum(self.injected.values())

    def _wrap(self, name, real):
        def call(fd, *args):
            if not self._paused and fd in disk_fds(self.manager):
                self.calls[name] += 1
                plan = self._plan.get(name)
                # Ctrl-C reaches only the main thread: an interrupt is injected there alone.
                if plan is not None and (plan[2] is not None or _in_main_thread()):
                    skip, times, code = plan
                    if skip:
                        self._plan[name] = (skip - 1, times, code)
                    elif times:
                        self._plan[name] = (0, times - 1, code)
                        self.injected[name] += 1
                        if code is None:
                            raise KeyboardInterrupt
                        raise OSError(code, os.strerror(code))
            return real(fd, *args)

        return call


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def page_locations(manager: KVCacheManager) -> dict[int, tuple[int, int, int]]:
    """id(page) -> (level, pool group, slot id) for every page in a slot."""
    where = {}
    for level, groups in enumerate(manager._storage.state.pages):
        for pool_group, registry in enumerate(groups):
            for slot_id, page in registry.items():
                where[id(page)] = (level, pool_group, slot_id)
    return where


def state_of(manager: KVCacheManager) -> dict[str, object]:
    """Everything "nothing changed" promises: slot counts and use per level, quotas, where every
    page is, the cached blocks, the open requests and the counters."""
    levels = range(manager.num_levels)
    return {
        "quotas": [manager.get_quota(level) for level in levels],
        "slots": [
            [(s.total, s.free, s.evictable) for s in manager.get_storage_statistics(level)]
            for level in levels
        ],
        "pages": page_locations(manager),
        "blocks": sorted(block.key for block in manager._tree.blocks()),
        "caches": {
            cache.id: (
                cache.status,
                cache.capacity,
                cache.history_length,
                cache.num_committed_tokens,
                [
                    [id(p) if p is not None else None for p in cache.pages(g)]
                    for g in range(manager.layout.num_layer_groups)
                ],
            )
            for cache in manager._living.values()
        },
        "dropped": manager.num_dropped_pages,
        "moved": list(manager.num_moved_pages),
    }

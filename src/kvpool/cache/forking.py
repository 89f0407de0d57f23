"""Forking: a request that continues another's history (beam search, several samples of one
prompt) shares every page of it, and a shared page is copied into a private one only when one
of the requests is about to write into it (copy-on-write, `prepare_write`).

Full blocks are never written again, so forks keep sharing them for good; only the block the
next token goes into (a partial block) is copied, once per fork that writes it. A page's
sharing is its owner count: a page locked by two requests is shared, and it is freed when the
last of them lets it go. SSM states are rewritten every step, so a fork gets its own copy of
each live state at once.

The engine's contract: forks commit the same tokens for the positions they had when they were
forked (their KV is the same bytes). kvpool cannot check it (the history's uncommitted tokens
are the engine's), so a fork that commits other tokens there poisons the reuse of those blocks.
"""

from __future__ import annotations

from typing import SupportsIndex, cast

from kvpool.cache.state import ACTIVE, GPU_LEVEL, CacheContext, RequestState
from kvpool.errors import ArgumentError, LogicError, OutOfPagesError
from kvpool.records import Page


class Forking:
    """`prepare_write`, and the copy of a request that `KVCacheManager.fork_kv_cache` makes."""

    def __init__(self, context: CacheContext) -> None:
        self._ctx = context

    def prepare_write(
        self, request: RequestState, begin: SupportsIndex, end: SupportsIndex
    ) -> bool:
        """`KVCache.prepare_write`."""
        if request._status is not ACTIVE:
            request._require_active("prepare_write")
        for name, value, low, high in (
            ("begin", begin, request._committed, request._capacity),
            ("end", end, begin if type(begin) is int else 0, request._capacity),
        ):
            if type(value) is not int or not low <= value <= high:
                raise ArgumentError(
                    f"{name}={value!r} is invalid: must be an integer in [{low}, {high}]"
                )
        begin, end = cast(int, begin), cast(int, end)  # (checked)
        if begin == end:
            return True
        tpb = request._tpb
        shared = [
            (g, index, page)
            for g in request._attention_groups
            for index in range(begin // tpb, -(-end // tpb))
            if (page := request._pages[g][index]) is not None
            and (page.block is not None or page.locks + page.holds > 1)
        ]
        if not shared:
            return True
        owners, allocation, migration = self._ctx.owners, self._ctx.allocation, self._ctx.migration
        # Make room for every copy first: taking them one by one, the first could evict (move
        # or drop cached pages) before the second finds no room, and False would have changed
        # the cache.
        layout = self._ctx.layout
        counts = [0] * layout.num_pool_groups
        for g, _, _ in shared:
            counts[layout.pool_group_of[g]] += 1
        if not allocation.reserve(GPU_LEVEL, counts):
            return False
        private: list[Page] = []
        try:
            for g, _, _ in shared:
                private.append(request._new_page(g))
            migration.copy_pages(
                [(page, copy) for (_, _, page), copy in zip(shared, private, strict=True)]
            )
        except OutOfPagesError:
            for copy in private:
                owners.unlock(copy)
            return False
        except BaseException:
            for copy in private:
                owners.unlock(copy)
            raise
        for (g, index, page), copy in zip(shared, private, strict=True):
            request._set_page(g, index, copy)
            owners.unlock(page)
        self._ctx.counters.copy_on_write_pages += len(private)
        if request._checks:
            self._ctx.check()
        return True

    def fork_into(self, request: RequestState, child: RequestState) -> None:
        """Make `child` (new, SUSPENDED, holding nothing) an ACTIVE copy of the ACTIVE `request`:
        the same lengths, committed tail and page tables, every attention page locked once more
        (shared), each SSM live state copied into a page of its own. `OutOfPagesError` (no slot
        for a state) or `StorageError` (the copy failed) with nothing changed."""
        if request._status is not ACTIVE:
            raise LogicError(
                f"fork_kv_cache() of KV cache {request.id}, which is {request._status.value} "
                "(it must be active)"
            )
        owners, migration = self._ctx.owners, self._ctx.migration
        states: list[tuple[int, Page]] = []  # (SSM layer group, the child's copy of its state)
        try:
            for g in request._ssm:
                if request._pages[g][0] is not None:
                    states.append((g, request._new_page(g)))
            migration.copy_pages([(request._pages[g][0], copy) for g, copy in states])  # type: ignore[misc]
        except BaseException:
            for _, copy in states:
                owners.unlock(copy)
            raise
        for g in request._attention_groups:
            for page in request._pages[g]:
                if page is not None:
                    owners.lock(page)
        child._table.copy_from(request._table)
        for g, copy in states:
            child._table.set(g, 0, copy)
        child._capacity, child._history = request._capacity, request._history
        child._committed, child._committing = request._committed, request._committing
        child._prev_key, child._tail = request._prev_key, list(request._tail)
        child._released_end = list(request._released_end)
        child._window_check = request._window_check
        child.reused_length = request.reused_length
        child._status = ACTIVE
        self._ctx.counters.forks += 1

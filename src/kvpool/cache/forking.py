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

from kvpool.cache.remote_loading import RemoteLoading
from kvpool.cache.state import ACTIVE, GPU_LEVEL, RequestState
from kvpool.errors import ArgumentError, LogicError, OutOfPagesError
from kvpool.records import Page


class Forking(RemoteLoading):
    """`prepare_write`, and the copy of a request that `KVCacheManager.fork_kv_cache` makes."""

    def prepare_write(self, begin: SupportsIndex, end: SupportsIndex) -> bool:
        """Make the pages of token positions [begin, end) this request's alone before the
        engine writes their KV: a page shared with a fork (or with the tree) is copied into a
        new private page, once. Returns False, with nothing changed, when no slot can be had
        even by eviction. `begin >= num_committed_tokens` (committed tokens are final) and
        `end <= capacity`."""
        if self._status is not ACTIVE:
            self._require_active("prepare_write")
        for name, value, low, high in (
            ("begin", begin, self._committed, self._capacity),
            ("end", end, begin if type(begin) is int else 0, self._capacity),
        ):
            if type(value) is not int or not low <= value <= high:
                raise ArgumentError(
                    f"{name}={value!r} is invalid: must be an integer in [{low}, {high}]"
                )
        begin, end = cast(int, begin), cast(int, end)  # (checked)
        if begin == end:
            return True
        tpb = self._tpb
        shared = [
            (g, index, page)
            for g in self._attention_groups
            for index in range(begin // tpb, -(-end // tpb))
            if (page := self._pages[g][index]) is not None
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
                private.append(self._new_page(g))
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
            self._set_page(g, index, copy)
            owners.unlock(page)
        self._ctx.counters.copy_on_write_pages += len(private)
        if self._checks:
            self._ctx.check()
        return True

    def _fork_into(self, child: RequestState) -> None:
        """Make `child` (new, SUSPENDED, holding nothing) an ACTIVE copy of this ACTIVE request:
        the same lengths, committed tail and page tables, every attention page locked once more
        (shared), each SSM live state copied into a page of its own. `OutOfPagesError` (no slot
        for a state) or `StorageError` (the copy failed) with nothing changed."""
        if self._status is not ACTIVE:
            raise LogicError(
                f"fork_kv_cache() of KV cache {self.id}, which is {self._status.value} "
                "(it must be active)"
            )
        owners, migration = self._ctx.owners, self._ctx.migration
        states: list[tuple[int, Page]] = []  # (SSM layer group, the child's copy of its state)
        try:
            for g in self._ssm:
                if self._pages[g][0] is not None:
                    states.append((g, self._new_page(g)))
            migration.copy_pages([(self._pages[g][0], copy) for g, copy in states])  # type: ignore[misc]
        except BaseException:
            for _, copy in states:
                owners.unlock(copy)
            raise
        for g in self._attention_groups:
            for page in self._pages[g]:
                if page is not None:
                    owners.lock(page)
        child._table.copy_from(self._table)
        for g, copy in states:
            child._table.set(g, 0, copy)
        child._capacity, child._history = self._capacity, self._history
        child._committed, child._committing = self._committed, self._committing
        child._prev_key, child._tail = self._prev_key, list(self._tail)
        child._released_end = list(self._released_end)
        child._window_check = self._window_check
        child.reused_length = self.reused_length
        child._status = ACTIVE
        self._ctx.counters.forks += 1

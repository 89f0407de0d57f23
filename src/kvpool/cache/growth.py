"""Growth: reserving blocks for a request (`resize`), and releasing the blocks that fall out of a
sliding window as the history grows (sink blocks stay)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn, SupportsIndex

from kvpool.cache.state import ACTIVE, GPU_LEVEL, CacheContext, RequestState
from kvpool.errors import ArgumentError, LogicError
from kvpool.records import Page


class Growth:
    """`resize` and the sliding-window release it does on the way."""

    def __init__(self, context: CacheContext) -> None:
        self._ctx = context
        layout = context.layout
        # (layer group, pool group) of each attention layer group, and their count per pool group
        self._attention_pools = layout.attention_pools
        self._attention_per_pool = layout.attention_per_pool

    def resize(
        self,
        request: RequestState,
        capacity: SupportsIndex,
        history_length: SupportsIndex | None = None,
    ) -> bool:
        """`KVCache.resize`: the usual call (no block leaves a window) is kept short."""
        if request._status is not ACTIVE:
            request._require_active("resize")
        history = request._history if history_length is None else history_length
        if (  # (one test for the usual call; bool is not accepted either)
            type(capacity) is not int
            or type(history) is not int
            or not request._history <= history <= capacity
        ):
            self._refuse_resize(request, capacity, history)
        request._sum_capacity += capacity
        request._sum_history += history
        request._num_resizes += 1
        tpb = request._tpb
        old_blocks, new_blocks = -(-request._capacity // tpb), -(-capacity // tpb)
        stale: list[tuple[int, tuple[int, int]]] | tuple[()] = ()
        unchanged = True
        if request._windowed and history >= request._window_check:
            stale = [(g, lc.stale_range(history, tpb)) for g, lc in request._windowed]
            unchanged = all(end <= request._released_end[g] for g, (_, end) in stale)
            if unchanged:
                request._window_check = self._next_window_check(request)
        if unchanged:  # nothing leaves a window: the common case, kept short
            if new_blocks > old_blocks and not self._grow(request, new_blocks - old_blocks):
                return False
            if new_blocks >= old_blocks:
                request._capacity, request._history = capacity, history
                if request._checks:
                    self._ctx.check()
                return True
        if new_blocks == old_blocks:  # only blocks leaving a window (decode, or after a prefill)
            self._release_stale(request, stale, old_blocks)
            request._capacity, request._history = capacity, history
            if request._checks:
                self._ctx.check()
            return True
        layout, owners, allocation, state = (
            self._ctx.layout,
            self._ctx.owners,
            self._ctx.allocation,
            self._ctx.state,
        )
        stale_of = dict(stale)
        releases: list[tuple[int, int]] = []
        grants: dict[int, list[int]] = {}
        for g in request._attention_groups:
            pages = request._pages[g]
            beg, end = stale_of.get(g, (0, 0))
            # Newly stale blocks, then blocks past a smaller capacity (stale ones never reach
            # that far: end <= ceil(history / tpb) <= new_blocks).
            for index in (
                *range(max(beg, request._released_end[g]), min(end, old_blocks)),
                *range(new_blocks, old_blocks),
            ):
                if pages[index] is not None:
                    releases.append((g, index))
            if new_blocks > old_blocks:
                wanted = [i for i in range(old_blocks, new_blocks) if not beg <= i < end]
                if wanted:
                    grants[g] = wanted
        # Pages owned only by the request: an uncommitted one gives its slot straight to a new
        # block of its layer group; a committed one becomes evictable, so it frees a slot too.
        recycle: dict[int, list[int]] = {}  # layer group -> blocks whose page moves to a new block
        freed_committed: dict[int, list[Page]] = {}  # per pool group
        for g, index in releases:
            page = request._pages[g][index]
            assert page is not None
            if page.locks + page.holds == 1:
                if page.block is None:
                    chosen = recycle.setdefault(g, [])
                    if len(chosen) < len(grants.get(g, ())):
                        chosen.append(index)
                else:
                    freed_committed.setdefault(page.pool_group, []).append(page)
        fresh = [0] * layout.num_pool_groups  # slots to allocate per pool group
        for g, wanted in grants.items():
            fresh[layout.pool_group_of[g]] += len(wanted) - len(recycle.get(g, ()))
        # Make room before releasing anything, so that a refusal (or an I/O error) changes
        # nothing: by the usual eviction if it can, else by dropping its own released cached
        # pages afterwards (which needs no I/O).
        drop_own = False
        if not allocation.reserve(GPU_LEVEL, fresh):
            first = [max(0, n - len(freed_committed.get(pg, ()))) for pg, n in enumerate(fresh)]
            if not freed_committed or not allocation.reserve(GPU_LEVEL, first):
                return False
            drop_own = True
        recycled: dict[int, list[Page]] = {}
        unlocking: list[Page] = []  # (in one call: cached pages are queued in one batch)
        for g, index in releases:
            if index in recycle.get(g, ()):
                page = request._pages[g][index]
                assert page is not None
                recycled.setdefault(g, []).append(page)  # keeps its slot and the lock
                request._table.clear(g, index)
            else:
                unlocking.append(request._table.clear(g, index))
        owners.unlock_all(unlocking)
        for g in request._attention_groups:
            request._table.resize(g, new_blocks)
        if drop_own:
            for pool_group, pages_freed in freed_committed.items():
                missing = fresh[pool_group] - state.num_free(GPU_LEVEL, pool_group)
                if missing > 0:
                    owners.drop([page for page in pages_freed if page.queued][:missing])
        for g, wanted in grants.items():
            reuse = recycled.get(g, [])
            reuse += request._new_pages(g, len(wanted) - len(reuse))
            request._table.set_many(g, wanted, reuse)
        self._advance_released(request, stale)
        request._capacity, request._history = capacity, history
        if request._checks:
            self._ctx.check()
        return True

    def _refuse_resize(self, request: RequestState, capacity: object, history: object) -> NoReturn:
        """Raise the error for `resize` arguments that fail its checks, the first one first."""
        if type(capacity) is not int or capacity < 0:
            raise ArgumentError(f"capacity={capacity!r} is invalid: must be an integer >= 0")
        if type(history) is not int or history < 0:
            raise ArgumentError(f"history_length={history!r} is invalid: must be an integer >= 0")
        if history < request._history:
            raise LogicError(
                f"history_length cannot decrease (from {request._history} to {history})"
            )
        raise LogicError(f"history_length {history} cannot exceed capacity {capacity}")

    def _release_stale(
        self, request: RequestState, stale: Sequence[tuple[int, tuple[int, int]]], num_blocks: int
    ) -> None:
        """Unlock the blocks newly out of each window (a run per layer group, sinks kept), in
        one call, in the order `resize`'s general path releases them."""
        unlocking: list[Page] = []
        for g, (beg, end) in stale:
            first, stop = max(beg, request._released_end[g]), min(end, num_blocks)
            if first < stop:
                unlocking += request._table.clear_range(g, first, stop)
        self._ctx.owners.unlock_all(unlocking)
        self._advance_released(request, stale)

    def _advance_released(
        self, request: RequestState, stale: Sequence[tuple[int, tuple[int, int]]]
    ) -> None:
        """Record how far each window has released its blocks, and when to look again."""
        for g, (_, end) in stale:
            if end > request._released_end[g]:
                request._released_end[g] = end
        request._window_check = self._next_window_check(request)

    def _next_window_check(self, request: RequestState) -> int:
        """The least history length at which a sliding window may let a block beyond the
        released ones go (`stale_range`'s end passes them: h + 1 - w >= (released + 1) * tpb)."""
        check = 2**63
        for g, lc in request._windowed:
            assert lc.window is not None
            check = min(check, (request._released_end[g] + 1) * request._tpb + lc.window - 1)
        return check

    def _grow(self, request: RequestState, count: int) -> bool:
        """Append `count` new blocks to every attention layer group (all or nothing)."""
        allocation = self._ctx.allocation
        per_pool = self._attention_per_pool
        if not allocation.reserve(
            GPU_LEVEL, per_pool if count == 1 else [count * n for n in per_pool]
        ):
            return False
        for g, pool_group in self._attention_pools:
            request._table.extend(g, allocation.new_pages(GPU_LEVEL, pool_group, g, count, locks=1))
        return True

"""StorageManager: pages of every level, their ownership counts and eviction.

It turns slot allocation into page allocation: when a pool group lacks free slots it evicts the
least valuable evictable pages. This issue's single GPU level is also the last level, so evicted
pages are dropped (their tree blocks lose them); colder levels will catch them instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvpool.errors import OutOfPagesError
from kvpool.eviction import EvictionQueue
from kvpool.pages import Page
from kvpool.storage.pools import LevelStorage


class StorageManager:
    """Owns the levels' pools and eviction queues; every page count change goes through it."""

    def __init__(self, levels: Sequence[LevelStorage]) -> None:
        self.levels = list(levels)
        self.queues = [[EvictionQueue() for _ in level.pool_groups] for level in self.levels]
        # Called when a committed page is dropped; returns pages that lost their block with it.
        self.on_drop: Callable[[Page], list[Page]] = lambda page: []
        self.num_dropped = 0

    @property
    def last_level(self) -> int:
        return len(self.levels) - 1

    # -- capacity --------------------------------------------------------------------------------

    def num_free(self, level: int, pool_group: int) -> int:
        return self.levels[level].pool_groups[pool_group].allocator.num_free_slots

    def num_evictable(self, level: int, pool_group: int) -> int:
        return len(self.queues[level][pool_group])

    def num_available(self, level: int, pool_group: int) -> int:
        """Slots a new page can get now: free ones plus what eviction can free."""
        return self.num_free(level, pool_group) + self.num_evictable(level, pool_group)

    def can_allocate(self, level: int, counts: Sequence[int]) -> bool:
        """Whether `counts[pg]` new pages per pool group fit at `level` (with eviction)."""
        return all(n <= self.num_available(level, pg) for pg, n in enumerate(counts) if n)

    # -- pages -----------------------------------------------------------------------------------

    def new_pages(self, level: int, pool_group: int, layer_group: int, count: int) -> list[Page]:
        """`count` new pages (evicting if needed), or `OutOfPagesError` and nothing changed.
        The caller must lock or hold each one at once."""
        if count > self.num_available(level, pool_group):
            raise OutOfPagesError(
                f"need {count} pages in pool group {pool_group} at level {level}, only "
                f"{self.num_free(level, pool_group)} free and {self.num_evictable(level, pool_group)} evictable"
            )
        shortfall = count - self.num_free(level, pool_group)
        if shortfall > 0:
            self.evict(level, pool_group, shortfall)
        allocator = self.levels[level].pool_groups[pool_group].allocator
        return [
            Page(slot, level, pool_group, layer_group)
            for slot in allocator.allocate_multiple(count)
        ]

    def evict(self, level: int, pool_group: int, count: int) -> None:
        """Drop the `count` least valuable evictable pages of a pool group."""
        queue = self.queues[level][pool_group]
        if count > len(queue):
            raise OutOfPagesError(
                f"need to evict {count} pages in pool group {pool_group}, only {len(queue)} evictable"
            )
        for _ in range(count):
            self._drop(queue.pop())

    def _drop(self, page: Page) -> None:
        orphans = self.on_drop(page) if page.block is not None else []
        self._free(page)
        self.num_dropped += 1
        for orphan in orphans:
            self.settle(orphan)

    def _free(self, page: Page) -> None:
        assert page.slot is not None and page.locks == 0 and page.holds == 0, page
        if page.queued:
            self.queues[page.level][page.pool_group].remove(page)
        self.levels[page.level].pool_groups[page.pool_group].allocator.release(page.slot)
        page.slot = None

    def is_evictable(self, page: Page) -> bool:
        """Committed pages nobody owns; held pages too, except at the last level (they could
        only be dropped)."""
        if page.locks:
            return False
        if page.holds:
            return page.level != self.last_level
        return page.block is not None

    def settle(self, page: Page) -> None:
        """After a page's owners or block changed: free it, queue it or unqueue it."""
        if page.slot is None:
            return
        if not page.locks and not page.holds and page.block is None:
            self._free(page)
        elif self.is_evictable(page):
            if not page.queued:
                self.queues[page.level][page.pool_group].push(page)
        elif page.queued:
            self.queues[page.level][page.pool_group].remove(page)

    def lock(self, page: Page) -> None:
        page.locks += 1
        self.settle(page)

    def unlock(self, page: Page) -> None:
        assert page.locks > 0, page
        page.locks -= 1
        self.settle(page)

    def hold(self, page: Page) -> None:
        page.holds += 1
        self.settle(page)

    def unhold(self, page: Page) -> None:
        assert page.holds > 0, page
        page.holds -= 1
        self.settle(page)

    def copy_slots(
        self, level: int, pool_group: int, sources: Sequence[int], destinations: Sequence[int]
    ) -> None:
        """Copy whole slots (every pool of the group) inside one level."""
        group = self.levels[level].pool_groups[pool_group]
        for pool in range(len(group.slot_sizes)):
            view = group.pool_view(pool)
            view[list(destinations)] = view[list(sources)]

    def close(self) -> None:
        for level in self.levels:
            level.close()
        self.levels = []

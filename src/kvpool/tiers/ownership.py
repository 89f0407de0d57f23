"""Ownership: the owner counts of pages (locks, holds), what follows from them (queued for
eviction, or freed), priorities, and dropping pages whose KV is no longer wanted."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvpool.eviction import EvictionQueue
from kvpool.records import Page
from kvpool.tiers.state import StorageState


class Ownership:
    """Every change of a page's owners goes through here."""

    def __init__(self, state: StorageState) -> None:
        self._state = state

    def is_evictable(self, page: Page) -> bool:
        """Committed pages nobody owns; held pages too, except at the last level (they could
        only be dropped)."""
        if page.locks:
            return False
        if page.holds:
            return page.level != self._state.last_level
        return page.block is not None

    def settle(self, page: Page) -> None:
        """After a page's owners, block or level changed: free it, queue it or unqueue it."""
        if page.slot is None:
            return
        if page.locks:
            evictable = False
        elif page.holds:
            evictable = page.level != self._state.last_level
        elif page.block is None:
            self._free(page)
            return
        else:
            evictable = True
        if evictable:
            if not page.queued:
                self._state.queues[page.level][page.pool_group].push(page)
        elif page.queued:
            self._state.queues[page.level][page.pool_group].remove(page)

    def set_priority(self, page: Page, priority: int) -> None:
        """Change a page's eviction priority; a queued page moves to its new priority's list
        (as its newest page)."""
        if page.queued:
            queue = self._state.queues[page.level][page.pool_group]
            queue.remove(page)
            page.priority = priority
            queue.push(page)
        else:
            page.priority = priority

    # Owner counts change only through these; each settles the page only when its status can
    # have changed (a page with locks left stays locked whatever its holds).

    def lock(self, page: Page) -> None:
        page.locks += 1
        if page.queued:
            self._state.queues[page.level][page.pool_group].remove(page)

    def unlock(self, page: Page) -> None:
        assert page.locks > 0, page
        page.locks -= 1
        if not page.locks:
            self.settle(page)

    def unlock_all(self, pages: Iterable[Page]) -> None:
        """`unlock` each page, in order (the order they become evictable in)."""
        cached: list[Page] = []  # unowned now, in the tree, at the GPU level: evictable
        for page in pages:
            assert page.locks > 0, page
            page.locks -= 1
            if page.locks:
                continue
            if not page.holds and page.block is not None and not page.queued and not page.level:
                cached.append(page)
            else:
                if cached:  # keep the order
                    self._push_all(cached)
                    cached = []
                self.settle(page)
        if cached:
            self._push_all(cached)

    def _push_all(self, pages: list[Page]) -> None:
        """Queue GPU pages in their pool groups' queues, in order: one batch per queue."""
        queues = self._state.queues[0]
        pool_group = pages[0].pool_group
        if len(queues) == 1 or all(page.pool_group == pool_group for page in pages):
            queues[pool_group].push_all(pages)
            return
        batches: dict[int, list[Page]] = {}
        for page in pages:
            batches.setdefault(page.pool_group, []).append(page)
        for group, batch in batches.items():
            queues[group].push_all(batch)

    def hold(self, page: Page) -> None:
        page.holds += 1
        if not page.locks:
            self.settle(page)

    def hold_all(self, pages: Iterable[Page]) -> None:
        """`hold` each page (at the last level a held page is not evictable: it leaves its
        queue, in one batch per queue)."""
        leaving = []
        last = self._state.last_level
        for page in pages:
            page.holds += 1
            if page.locks:
                continue
            if page.level == last and page.queued:
                leaving.append(page)
            else:
                self.settle(page)
        self._dequeue_all(leaving)

    def lock_held(self, pages: Iterable[Page]) -> None:
        """Turn one hold of each page into a lock (a locked page is never queued)."""
        leaving = []
        for page in pages:
            assert page.holds > 0, page
            page.holds -= 1
            page.locks += 1
            if page.queued:
                leaving.append(page)
        self._dequeue_all(leaving)

    def _dequeue_all(self, pages: list[Page]) -> None:
        """Take queued pages out of their queues, one batch per queue."""
        batches: dict[EvictionQueue, list[Page]] = {}
        for page in pages:
            batches.setdefault(self._state.queues[page.level][page.pool_group], []).append(page)
        for queue, batch in batches.items():
            queue.remove_all(batch)

    def unhold(self, page: Page) -> None:
        assert page.holds > 0, page
        page.holds -= 1
        if not page.locks:
            self.settle(page)

    def unhold_all(self, pages: Iterable[Page]) -> None:
        for page in pages:
            self.unhold(page)

    def drop(self, pages: list[Page]) -> None:
        """Drop queued, unowned pages of one pool group (any levels) now, with no I/O: their
        KV is gone."""
        by_level: dict[int, list[Page]] = {}
        for page in pages:
            if page.slot is not None:  # (else an earlier drop orphaned and freed it)
                by_level.setdefault(page.level, []).append(page)
        orphans = [self._drop_group(level, group) for level, group in by_level.items()]
        for lost in orphans:
            self._settle_orphans(lost)

    def _settle_orphans(self, pages: Sequence[Page]) -> None:
        """`settle` pages that lost their block: the unowned ones are freed, one batch per
        (level, pool group), in order (the ids are recycled in the same order)."""
        unowned: dict[tuple[int, int], list[Page]] = {}
        for page in pages:
            if page.slot is not None and not page.locks and not page.holds:
                unowned.setdefault((page.level, page.pool_group), []).append(page)
            else:
                self.settle(page)
        for (level, pool_group), batch in unowned.items():
            queued = [page for page in batch if page.queued]
            if queued:
                self._state.queues[level][pool_group].remove_all(queued)
            self._release_slots(level, pool_group, batch)

    def _drop_group(self, level: int, pages: list[Page]) -> Sequence[Page]:
        """Drop queued pages of one pool group at `level`: out of their queue and the tree,
        slots freed in one call. Returns the pages that lost their block with them, for the
        caller to settle once every group is dropped."""
        pool_group = pages[0].pool_group
        if self._state.events is not None:
            self._state.events.append(
                ("drop", level, pool_group, tuple(page.slot_id for page in pages))
            )
        self._state.queues[level][pool_group].remove_all(pages)
        orphans = self._state.on_drop(pages)
        self._release_slots(level, pool_group, pages)
        self._state.num_dropped += len(pages)
        self._state.num_dropped_at[level] += len(pages)
        return orphans

    def _release_slots(self, level: int, pool_group: int, pages: list[Page]) -> None:
        """Free the slots of unowned pages (out of their queue) of one pool group at `level`, in
        one release; the page records are kept for reuse."""
        registry = self._state.pages[level][pool_group]
        slots = []
        for page in pages:
            slot = page.slot
            assert slot is not None and page.pool_group == pool_group and not page.holds, page
            del registry[slot.slot_id]
            slots.append(slot)
            page.slot = None
        self._state.spare_pages += pages
        self._state.allocators[level][pool_group].release_multiple(slots)

    def _free(self, page: Page) -> None:
        slot = page.slot
        assert slot is not None and page.locks == 0 and page.holds == 0, page
        if page.queued:
            self._state.queues[page.level][page.pool_group].remove(page)
        del self._state.pages[page.level][page.pool_group][slot.slot_id]
        self._state.allocators[page.level][page.pool_group].release(slot)
        page.slot = None
        self._state.spare_pages.append(page)

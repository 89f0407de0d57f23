"""Prioritized LRU of evictable pages, one per (level, pool group).

Lowest priority first, then least recently pushed. Push, remove and pop are O(1) (an ordered dict
per priority, plus a sorted list of the priorities in use, at most 101).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Iterator
from itertools import islice

from kvpool.errors import CorruptedError, OutOfPagesError
from kvpool.records import Page


class EvictionQueue:
    """Evictable pages of one pool group at one level."""

    def __init__(self) -> None:
        self._lists: dict[int, OrderedDict[Page, None]] = {}
        self._priorities: list[int] = []  # sorted; only priorities with pages
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Page]:
        """Pages in eviction order (lazily: do not change the queue while iterating)."""
        for priority in self._priorities:
            yield from self._lists[priority]

    def oldest(self, count: int) -> list[Page]:
        """The next `count` pages to evict (fewer if the queue is shorter), without removing them."""
        pages: list[Page] = []
        for priority in self._priorities:
            pages += islice(self._lists[priority], count - len(pages))
            if len(pages) >= count:
                break
        return pages

    def first_at(self, priority: int) -> Page | None:
        """The page of `priority` evicted first among them (None if there is none)."""
        pages = self._lists.get(priority)
        return next(iter(pages)) if pages else None

    def push(self, page: Page, evict_first: bool = False) -> None:
        """Add `page` as the newest of its priority (or the oldest, with `evict_first`)."""
        assert not page.queued, page
        pages = self._lists.get(page.priority)
        if pages is None:
            pages = self._lists[page.priority] = OrderedDict()
            bisect.insort(self._priorities, page.priority)
        pages[page] = None
        if evict_first:
            pages.move_to_end(page, last=False)
        page.queued = True
        self._len += 1

    def push_all(self, pages: list[Page]) -> None:
        """`push` each page, in order."""
        lists = self._lists
        for page in pages:
            assert not page.queued, page
            bucket = lists.get(page.priority)
            if bucket is None:
                bucket = lists[page.priority] = OrderedDict()
                bisect.insort(self._priorities, page.priority)
            bucket[page] = None
            page.queued = True
        self._len += len(pages)

    def remove_all(self, pages: list[Page]) -> None:
        """`remove` each page (all queued here)."""
        lists = self._lists
        for page in pages:
            del lists[page.priority][page]
            page.queued = False
        self._len -= len(pages)
        for priority in tuple(self._priorities):
            if not lists[priority]:
                self._forget(priority)

    def remove(self, page: Page) -> None:
        pages = self._lists[page.priority]
        del pages[page]
        if not pages:
            self._forget(page.priority)
        page.queued = False
        self._len -= 1

    def pop(self) -> Page:
        """The page to evict next."""
        if not self._len:
            raise OutOfPagesError("no evictable page")
        priority = self._priorities[0]
        pages = self._lists[priority]
        page, _ = pages.popitem(last=False)
        if not pages:
            self._forget(priority)
        page.queued = False
        self._len -= 1
        return page

    def _forget(self, priority: int) -> None:
        del self._lists[priority]
        del self._priorities[bisect.bisect_left(self._priorities, priority)]

    def check_invariants(self) -> None:
        """Raise `CorruptedError` unless every page sits in its own priority's list, once."""
        problems = []
        if self._priorities != sorted(self._lists) or any(not self._lists[p] for p in self._lists):
            problems.append(f"priorities {self._priorities} do not match the lists")
        for priority, pages in self._lists.items():
            for page in pages:
                if page.priority != priority or not page.queued:
                    problems.append(f"{page} (priority {page.priority}) is in list {priority}")
        if sum(map(len, self._lists.values())) != self._len:
            problems.append(f"length {self._len} != {sum(map(len, self._lists.values()))} pages")
        if problems:
            raise CorruptedError("EvictionQueue: " + "; ".join(problems[:10]))

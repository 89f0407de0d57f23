"""Prioritized LRU of evictable pages, one per (level, pool group).

Lowest priority first, then least recently pushed. Push, remove and pop are O(1) (an ordered dict
per priority, plus a sorted list of the priorities in use, at most 101).

Under an eviction policy other than LRU (`kvpool.policies`) the last level's queues are
`ClassedQueue`s: the default-priority pages the policy classes are ordered by their block's
last use within each class, and the policy picks which class gives up its oldest leaf.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import OrderedDict
from collections.abc import Iterator, Set
from itertools import islice
from typing import TYPE_CHECKING

from kvpool.errors import CorruptedError, OutOfPagesError
from kvpool.records import DEFAULT_PRIORITY, Page

if TYPE_CHECKING:
    from kvpool.policies import EvictionPolicy


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

    def push(self, page: Page) -> None:
        """Add `page` as the newest of its priority."""
        assert not page.queued, page
        pages = self._lists.get(page.priority)
        if pages is None:
            pages = self._lists[page.priority] = OrderedDict()
            bisect.insort(self._priorities, page.priority)
        pages[page] = None
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
        listed = sum(map(len, self._lists.values())) + self._num_classed()
        if listed != self._len:
            problems.append(f"length {self._len} != {listed} pages")
        problems += self._class_problems()
        if problems:
            raise CorruptedError(f"{type(self).__name__}: " + "; ".join(problems[:10]))

    def _num_classed(self) -> int:
        return 0

    def _class_problems(self) -> list[str]:
        return []


def _is_leaf(page: Page, going: Set[Page]) -> bool:
    """No child block holds a page of `page`'s layer group (other than pages in `going`):
    dropping it drops nothing else."""
    block = page.block
    if block is None or block.kids is None:
        return True
    group = page.layer_group
    kids = block.kids
    if isinstance(kids, dict):
        return all(kid[group] is None or kid[group] in going for kid in kids.values())
    return kids[group] is None or kids[group] in going


class ClassedQueue(EvictionQueue):
    """The last level's queue under an eviction policy: the default-priority pages the policy
    classes (`policy.classify(page)` > 0) sit in one heap per class ordered by their block's
    last use; each eviction takes the oldest leaf of the class `policy.pick` chooses. Other
    pages (engine priorities; pages queued before the policy classes anything) keep LRU order
    around them.

    Push is O(log n), remove O(1) (heap entries go stale and are skipped; the heaps are rebuilt
    when most entries are stale), taking a page O(classes + log n). A page that is not a leaf
    when it reaches the top of its heap waits aside until a child page of it leaves the queue
    (or is picked to go, in the same batch: victims are picked as if taken one by one)."""

    def __init__(self, policy: EvictionPolicy, classes: int) -> None:
        super().__init__()
        self.policy = policy
        self._heaps: list[list[tuple[float, int, Page]]] = [[] for _ in range(classes + 1)]
        self._interior: dict[Page, None] = {}
        self._classed = 0  # queued classed pages (in a heap or interior)
        self._entries = 0  # heap entries, stale ones included
        self._stamps = itertools.count(1)

    def push(self, page: Page) -> None:
        klass = self.policy.classify(page) if page.priority == DEFAULT_PRIORITY else 0
        if not klass:
            page.klass = 0
            super().push(page)
            return
        assert not page.queued, page
        page.klass = klass
        self._heap_push(page)
        page.queued = True
        self._classed += 1
        self._len += 1

    def push_all(self, pages: list[Page]) -> None:
        for page in pages:
            self.push(page)

    def remove(self, page: Page) -> None:
        """Take `page` out (dropped or locked); its parent's page may be a leaf now."""
        if page.klass:
            assert page.queued, page
            page.queued = False
            page.klass = page.stamp = 0  # (its heap entry is stale now, wherever it goes next)
            self._interior.pop(page, None)
            self._classed -= 1
            self._len -= 1
        else:
            super().remove(page)
        self._expose_parent(page)

    def remove_all(self, pages: list[Page]) -> None:
        for page in pages:
            self.remove(page)

    def pop(self) -> Page:
        victims = self.oldest(1)
        if not victims:
            raise OutOfPagesError("no evictable page")
        self.remove(victims[0])
        return victims[0]

    def __iter__(self) -> Iterator[Page]:
        return iter(self.oldest(len(self)))

    def oldest(self, count: int) -> list[Page]:
        if not self._classed:
            return super().oldest(count)
        pages: list[Page] = []
        band_done = False
        for priority in self._priorities:
            if priority > DEFAULT_PRIORITY and not band_done:
                pages += self._take_classed(count - len(pages))
                band_done = True
            if len(pages) >= count:
                return pages
            pages += islice(self._lists[priority], count - len(pages))
        if not band_done:
            pages += self._take_classed(count - len(pages))
        return pages

    def _expose_parent(self, page: Page) -> None:
        block = page.block
        parent = block.parent if block is not None else None
        if parent is not None:
            above = parent[page.layer_group]
            if above is not None and above.level == page.level:
                self.expose(above)

    def expose(self, page: Page) -> None:
        """`page`'s block lost a child: if it was waiting aside, it may be a leaf now."""
        if page in self._interior:
            del self._interior[page]
            self._heap_push(page)

    def _heap_push(self, page: Page) -> None:
        assert page.block is not None, page
        stamp = page.stamp = next(self._stamps)
        heapq.heappush(self._heaps[page.klass], (page.block.used_at, stamp, page))
        self._entries += 1
        if self._entries > 2 * self._classed + 1024:
            self._compact()

    def _compact(self) -> None:
        """Drop the stale heap entries."""
        for heap in self._heaps:
            heap[:] = [entry for entry in heap if entry[2].queued and entry[2].stamp == entry[1]]
            heapq.heapify(heap)
        self._entries = sum(map(len, self._heaps))

    def _top(self, klass: int, going: Set[Page]) -> Page | None:
        """The oldest leaf of class `klass` once the pages `going` are gone (stale entries
        dropped, non-leaves set aside)."""
        heap = self._heaps[klass]
        while heap:
            _, stamp, page = heap[0]
            if page.queued and page.stamp == stamp:
                if _is_leaf(page, going):
                    return page
                page.stamp = 0
                self._interior[page] = None
            heapq.heappop(heap)
            self._entries -= 1
        return None

    def _take_classed(self, count: int) -> list[Page]:
        """The next `count` classed pages to evict, as the policy picks them (left queued)."""
        pages: list[Page] = []
        going: set[Page] = set()
        taken: list[tuple[int, tuple[float, int, Page]]] = []
        classes = range(1, len(self._heaps))
        while len(pages) < count:
            heads, their_classes = [], []
            for klass in classes:
                page = self._top(klass, going)
                if page is not None:
                    heads.append(page)
                    their_classes.append(klass)
            if not heads:
                break
            chosen = self.policy.pick(heads)
            klass, page = their_classes[chosen], heads[chosen]
            taken.append((klass, heapq.heappop(self._heaps[klass])))
            pages.append(page)
            going.add(page)
            self._expose_parent(page)  # (a leaf once this one goes, as evictions go one by one)
        for klass, entry in taken:  # (still queued: back in place)
            heapq.heappush(self._heaps[klass], entry)
        if len(pages) < count:  # pages whose children are evictable only after them
            pages += islice(self._interior, count - len(pages))
        return pages

    def _num_classed(self) -> int:
        return self._classed

    def _class_problems(self) -> list[str]:
        live = [
            entry[2]
            for heap in self._heaps
            for entry in heap
            if entry[2].queued and entry[2].stamp == entry[1]
        ]
        problems = []
        if len(live) + len(self._interior) != self._classed:
            problems.append(
                f"{len(live)} pages in heaps + {len(self._interior)} aside != {self._classed}"
            )
        for page in [*live, *self._interior]:
            if not page.klass or page.priority != DEFAULT_PRIORITY or not page.queued:
                problems.append(f"{page} (class {page.klass}) is classed")
        return problems

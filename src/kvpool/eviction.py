"""Prioritized LRU of evictable pages, one per (level, pool group).

Lowest priority first, then least recently pushed. Push, remove and pop are O(1) (an ordered dict
per priority, plus a sorted list of the priorities in use, at most 101).

Under an eviction policy other than LRU (`kvpool.policies`) the last level's queues are
`ClassedQueue`s: the default-priority pages the policy classes sit in one list per class (in
release order), and the policy's scores decide which class gives up its oldest leaf.
"""

from __future__ import annotations

import bisect
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
    classes (`policy.classify(page)` > 0) sit in one list per class, in release order; each
    eviction takes, of the classes' oldest leaves, the one `policy.scorer()` scores lowest
    (LRU's choice, the one used longest ago, unless another scores lower by more than
    `policy.margin` and both uncertainties). Other pages (engine priorities; pages queued
    before the policy classes anything) keep LRU order around them.

    Push and remove are O(1), taking a page O(classes). A page that is not a leaf when it
    reaches the head of its list waits aside until a child page of it leaves the queue (or is
    picked to go in the same batch: victims are picked as if taken one by one); then it goes
    back to the head of its list (it was the oldest there)."""

    def __init__(self, policy: EvictionPolicy, classes: int) -> None:
        super().__init__()
        self.policy = policy
        self._classes: list[OrderedDict[Page, None]] = [OrderedDict() for _ in range(classes + 1)]
        self._interior: dict[Page, None] = {}  # classed pages set aside: not leaves
        self._classed = 0  # queued classed pages (in a list or aside)

    def push(self, page: Page) -> None:
        klass = self.policy.classify(page) if page.priority == DEFAULT_PRIORITY else 0
        if not klass:
            super().push(page)
            return
        assert not page.queued, page
        page.klass = klass
        self._classes[klass][page] = None
        page.queued = True
        self._classed += 1
        self._len += 1

    def push_all(self, pages: list[Page]) -> None:
        for page in pages:
            self.push(page)

    def remove(self, page: Page) -> None:
        klass = page.klass
        if not klass:
            super().remove(page)
            return
        assert page.queued, page
        if page in self._interior:
            del self._interior[page]
        else:
            del self._classes[klass][page]
        page.queued = False
        page.klass = 0
        self._classed -= 1
        self._len -= 1

    def remove_all(self, pages: list[Page]) -> None:
        """`remove` each page (dropped or moved): their parents' pages may be leaves now."""
        for page in pages:
            self.remove(page)
        if self._interior:
            for page in pages:
                self._expose_parent(page)

    def pop(self) -> Page:
        victims = self.oldest(1)
        if not victims:
            raise OutOfPagesError("no evictable page")
        self.remove_all(victims)
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

    def _expose_parent(self, page: Page) -> int:
        """If `page`'s parent page was set aside, back to the head of its list (it was the
        oldest there); returns its class (0: none)."""
        block = page.block
        parent = block.parent if block is not None else None
        if parent is not None:
            above = parent[page.layer_group]
            if above is not None and above in self._interior:
                del self._interior[above]
                pages = self._classes[above.klass]
                pages[above] = None
                pages.move_to_end(above, last=False)
                return above.klass
        return 0

    def _head(self, klass: int, going: Set[Page]) -> Page | None:
        """The oldest leaf of class `klass` once the pages `going` are gone (the non-leaves
        before it set aside)."""
        pages = self._classes[klass]
        while pages:
            page = next(iter(pages))
            if _is_leaf(page, going):
                return page
            del pages[page]
            self._interior[page] = None
        return None

    def _take_classed(self, count: int) -> list[Page]:
        """The next `count` classed pages to evict, as the policy scores them (left queued)."""
        pages: list[Page] = []
        going: set[Page] = set()
        lists, score = self._classes, self.policy.scorer()
        ranks: dict[int, tuple[float, float]] = {}  # class -> its head's (score, last use)
        errors: dict[int, float] = {}  # class -> its head's score's uncertainty
        heads: dict[int, Page] = {}

        def refresh(klass: int) -> None:
            page = self._head(klass, going) if lists[klass] else None
            if page is None:
                ranks.pop(klass, None)
                heads.pop(klass, None)
            else:
                value, errors[klass] = score(page)
                ranks[klass] = (value, page.block.used_at)  # type: ignore[union-attr]
                heads[klass] = page

        for klass in range(1, len(lists)):
            refresh(klass)
        margin = self.policy.margin
        try:
            while len(pages) < count and heads:
                if len(ranks) > 1:
                    klass = min(ranks, key=ranks.__getitem__)
                    oldest = min(ranks, key=lambda other: ranks[other][1])
                    doubt = margin + errors[oldest] + errors[klass]
                    if ranks[oldest][0] - ranks[klass][0] <= doubt:  # (not worth leaving LRU)
                        klass = oldest
                else:
                    klass = next(iter(ranks))
                page = heads[klass]
                pages.append(page)  # (first: whatever happens, `finally` puts it back)
                del lists[klass][page]
                going.add(page)
                exposed = self._expose_parent(page)  # (a leaf once this one goes)
                refresh(klass)
                if exposed and exposed != klass:
                    refresh(exposed)
        finally:  # the pages stay queued: back at the heads of their lists, in order
            for page in reversed(pages):
                head = lists[page.klass]
                head[page] = None
                head.move_to_end(page, last=False)
        if len(pages) < count:  # pages whose children are evictable only after them
            pages += islice(self._interior, count - len(pages))
        return pages

    def _num_classed(self) -> int:
        return self._classed

    def _class_problems(self) -> list[str]:
        problems = []
        listed = sum(map(len, self._classes)) + len(self._interior)
        if listed != self._classed:
            problems.append(f"{listed} classed pages listed != {self._classed}")
        for klass, pages in enumerate(self._classes):
            for page in pages:
                if page.klass != klass or page.priority != DEFAULT_PRIORITY or not page.queued:
                    problems.append(f"{page} (class {page.klass}) is in class list {klass}")
        for page in self._interior:
            if not page.klass or page.priority != DEFAULT_PRIORITY or not page.queued:
                problems.append(f"{page} (class {page.klass}) is set aside")
        return problems

"""Prioritized LRU of evictable pages, one per (level, pool group).

Lowest priority first, then least recently pushed. Push, remove and pop are O(1) (a list of pages
linked through the pages, `kvpool.page_list`, per priority, plus a sorted list of the priorities in
use, at most 101).

Under an eviction policy other than LRU (`kvpool.policies`) the last level's queues are
`ClassedQueue`s: the default-priority pages the policy classes sit in one list per class (in
release order), and the policy's scores decide which class gives up its oldest leaf.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from itertools import islice

from kvpool.errors import CorruptedError, OutOfPagesError
from kvpool.page_list import PageList
from kvpool.policies import EvictionPolicy
from kvpool.records import DEFAULT_PRIORITY, Block, Page


class EvictionQueue:
    """Evictable pages of one pool group at one level."""

    def __init__(self) -> None:
        self._lists: dict[int, PageList] = {}
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
            self._lists[priority].take(count - len(pages), pages)
            if len(pages) >= count:
                break
        return pages

    def push(self, page: Page) -> None:
        """Add `page` as the newest of its priority."""
        assert not page.queued, page
        pages = self._lists.get(page.priority)
        if pages is None:
            pages = self._lists[page.priority] = PageList()
            bisect.insort(self._priorities, page.priority)
        pages.append(page)
        page.queued = True
        self._len += 1

    def push_all(self, pages: list[Page]) -> None:
        """`push` each page, in order."""
        lists = self._lists
        for page in pages:
            assert not page.queued, page
            bucket = lists.get(page.priority)
            if bucket is None:
                bucket = lists[page.priority] = PageList()
                bisect.insort(self._priorities, page.priority)
            bucket.append(page)
            page.queued = True
        self._len += len(pages)

    def remove_all(self, pages: list[Page]) -> None:
        """`remove` each page (all queued here)."""
        lists = self._lists
        for page in pages:
            lists[page.priority].remove(page)
            page.queued = False
        self._len -= len(pages)
        for priority in tuple(self._priorities):
            if not lists[priority].size:
                self._forget(priority)

    def remove(self, page: Page) -> None:
        pages = self._lists[page.priority]
        pages.remove(page)
        if not pages.size:
            self._forget(page.priority)
        page.queued = False
        self._len -= 1

    def pop(self) -> Page:
        """The page to evict next."""
        if not self._len:
            raise OutOfPagesError("no evictable page")
        priority = self._priorities[0]
        pages = self._lists[priority]
        page = pages.popleft()
        if not pages.size:
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
        if self._priorities != sorted(self._lists) or any(
            not self._lists[p].size for p in self._lists
        ):
            problems.append(f"priorities {self._priorities} do not match the lists")
        for priority, pages in self._lists.items():
            problems += pages.problems()
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


def _used_at(page: Page) -> int:
    """When `page`'s block was last used (a queued classed page is committed)."""
    block = page.block
    assert block is not None
    return block.used_at


def _is_leaf(page: Page) -> bool:
    """No child block holds a page of `page`'s layer group (other than pages picked to go in
    this batch): dropping it drops nothing else."""
    block = page.block
    if block is None or block.kids is None:
        return True
    group = page.layer_group
    kids = block.kids
    if isinstance(kids, dict):
        for kid in kids.values():
            below = kid.pages[group]
            if below is not None and not below.going:
                return False
        return True
    below = kids.pages[group]
    return below is None or below.going


def _next_is(page: Page, parent: Block) -> bool:
    """Whether the page after `page` in its list is `parent`'s page of its layer group and not
    set aside: then the parent's page is known not to be aside without reading the parent's
    page list (a cache miss). A request's pages are queued deepest first, so it usually is."""
    after = page.after
    return (
        after is not None
        and after.block is parent
        and after.layer_group == page.layer_group
        and not after.aside
    )


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
    back to the head of its list (it was the oldest there). When the policy's scores depend
    only on a page's class and last use (`policy.scores_by_age`), the leaves after a picked
    page in its list that were used at the same time (a request's blocks committed in one
    step) are taken with it, scored once: the choice would be the same for each."""

    def __init__(self, policy: EvictionPolicy, classes: int) -> None:
        super().__init__()
        self.policy = policy
        self._classes: list[PageList] = [PageList() for _ in range(classes + 1)]
        # Classed pages set aside (not leaves), in the order they were; `Page.aside` says
        # whether a page is here (a flag: no hash probe per page removed).
        self._interior: dict[Page, None] = {}
        self._classed = 0  # queued classed pages (in a list or aside)

    def push(self, page: Page) -> None:
        klass = self.policy.classify(page) if page.priority == DEFAULT_PRIORITY else 0
        if not klass:
            super().push(page)
            return
        assert not page.queued, page
        page.klass = klass
        self._classes[klass].append(page)
        page.queued = True
        self._classed += 1
        self._len += 1

    def push_all(self, pages: list[Page]) -> None:
        lists, classed = self._classes, 0
        plain: list[Page] = []  # (the priority lists' pages: in order, in one batch)
        classes = self.policy.classify_all(pages)
        assert len(classes) == len(pages)
        for i in range(len(pages)):  # (not zip(..., strict=True): generic, compiled or not)
            page, klass = pages[i], classes[i]
            if not klass or page.priority != DEFAULT_PRIORITY:
                plain.append(page)
                continue
            assert not page.queued, page
            page.klass = klass
            lists[klass].append(page)
            page.queued = True
            classed += 1
        self._classed += classed
        self._len += classed
        if plain:
            super().push_all(plain)

    def remove(self, page: Page) -> None:
        klass = page.klass
        if not klass:
            super().remove(page)
            return
        assert page.queued, page
        if page.aside:
            del self._interior[page]
            page.aside = False
        else:
            self._classes[klass].remove(page)
        page.queued = False
        page.klass = 0
        self._classed -= 1
        self._len -= 1

    def remove_all(self, pages: list[Page]) -> None:
        """`remove` each page (dropped or moved): their parents' pages may be leaves now."""
        lists, interior = self._classes, self._interior
        classed = 0
        for page in pages:
            klass = page.klass
            if not klass:
                super().remove(page)
                continue
            assert page.queued, page
            if page.aside:
                del interior[page]
                page.aside = False
            else:
                lists[klass].remove(page)
            page.queued = False
            page.klass = 0
            classed += 1
        self._classed -= classed
        self._len -= classed
        if interior:  # a parent set aside is a leaf now: back to the head of its list
            for page in pages:
                block = page.block
                parent = block.parent if block is not None else None
                if parent is not None:
                    above = parent.pages[page.layer_group]
                    if above is not None and above.aside:
                        del interior[above]
                        above.aside = False
                        lists[above.klass].appendleft(above)  # (it was the oldest there)

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
            self._lists[priority].take(count - len(pages), pages)
        if not band_done:
            pages += self._take_classed(count - len(pages))
        return pages

    def _parent_aside(self, page: Page) -> Page | None:
        """`page`'s parent page, taken out of the pages set aside if it was there (it may be
        a leaf now), else None."""
        block = page.block
        parent = block.parent if block is not None else None
        if parent is not None:
            above = parent.pages[page.layer_group]
            if above is not None and above.aside:
                del self._interior[above]
                above.aside = False
                return above
        return None

    def _take_classed(self, count: int) -> list[Page]:
        """The next `count` classed pages to evict, as the policy scores them (left queued).
        The lists are only read while picking: per class a cursor walks its list from the head
        (`nexts`), and a stack (`fronts`) holds the parents that became leaves in this batch
        (older than the cursor's page). `_settle_batch` then leaves a list whose cursor only
        took leaves as it was (the usual case) and rearranges the others as if each pick had
        been taken out and put back at the head."""
        lists, interior, score = self._classes, self._interior, self.policy.scorer()
        classes = len(lists)
        pages: list[Page] = []  # (each flagged `going` until the batch is settled)
        nexts: list[Page | None] = [pages_of.first for pages_of in lists]
        fronts: list[list[Page]] = [[] for _ in range(classes)]
        passed: list[list[Page]] = [[] for _ in range(classes)]  # non-leaves a cursor passed
        touched = [False] * classes  # a cursor passed a non-leaf, or a front page was picked
        # per class: its head's (score, last use, uncertainty, page), or None
        heads: list[tuple[float, int, float, Page] | None] = [None] * classes

        def refresh(klass: int) -> None:
            front = fronts[klass]
            while front:
                page = front[-1]
                if _is_leaf(page):
                    value, error = score(page)
                    heads[klass] = (value, _used_at(page), error, page)
                    return
                front.pop()
                interior[page] = None
                page.aside = True
            later = nexts[klass]
            while later is not None:
                if _is_leaf(later):
                    value, error = score(later)
                    heads[klass] = (value, _used_at(later), error, later)
                    return
                interior[later] = None
                later.aside = True
                passed[klass].append(later)
                touched[klass] = True
                later = nexts[klass] = later.after
            heads[klass] = None

        for klass in range(1, classes):
            refresh(klass)
        margin, by_age = self.policy.margin, self.policy.scores_by_age
        try:
            while len(pages) < count:
                best = oldest = 0
                chosen = first = None
                for klass in range(1, classes):
                    head = heads[klass]
                    if head is None:
                        continue
                    if chosen is None or first is None:
                        best = oldest = klass
                        chosen = first = head
                        continue
                    if head[0] < chosen[0] or (head[0] == chosen[0] and head[1] < chosen[1]):
                        best, chosen = klass, head
                    if head[1] < first[1]:
                        oldest, first = klass, head
                if chosen is None or first is None:
                    break
                if oldest != best and first[0] - chosen[0] <= margin + first[2] + chosen[2]:
                    best, chosen = oldest, first  # (not worth leaving LRU's choice)
                page = chosen[3]
                pages.append(page)
                page.going = True
                front = fronts[best]
                if front and front[-1] is page:
                    front.pop()
                    touched[best] = True
                    above = self._parent_aside(page)  # (a leaf once this one goes?)
                else:  # (the cursor's page)
                    nexts[best] = page.after
                    above = self._parent_aside(page)  # (a leaf once this one goes?)
                    if above is None and by_age:
                        # The pages after it used at the same time score the same: the same
                        # choice follows for each, while nothing else changes.
                        nexts[best], above = self._take_run(page.after, chosen[1], pages, count)
                if above is not None:
                    fronts[above.klass].append(above)
                refresh(best)
                if above is not None and above.klass != best:
                    refresh(above.klass)
        finally:
            self._settle_batch(pages, fronts, passed, touched)
        if len(pages) < count:  # pages whose children are evictable only after them
            pages += islice(self._interior, count - len(pages))
        return pages

    def _take_run(
        self,
        page: Page | None,
        used_at: int,
        pages: list[Page],
        count: int,
    ) -> tuple[Page | None, Page | None]:
        """Add to `pages` (flagged `going`) `page` and the ones after it in its list while they
        are leaves last used at `used_at`, up to `count` pages or a parent set aside (which
        may be a leaf now). Returns the list's next page and that parent (or None)."""
        interior = self._interior
        room = count - len(pages)
        last = pages[-1]  # the page picked last
        while page is not None and room:
            block = page.block
            assert block is not None  # (queued: committed)
            if block.used_at != used_at:
                break
            kids = block.kids
            group = page.layer_group
            # (An only child just picked in this layer group, the usual case since a request's
            # pages are queued deepest first, is going: its pages need no reading.)
            if kids is not None and (kids is not last.block or last.layer_group != group):
                if isinstance(kids, dict):
                    if not _is_leaf(page):
                        break
                elif (kid := kids.pages[group]) is not None and not kid.going:
                    break
            pages.append(page)
            page.going = True
            last = page
            room -= 1
            if interior:  # (else no parent waits aside)
                parent = block.parent
                above = None if parent is None or _next_is(page, parent) else parent.pages[group]
                if above is not None and above.aside:
                    del interior[above]
                    above.aside = False
                    return page.after, above
            page = page.after
        return page, None

    def _settle_batch(
        self,
        pages: list[Page],
        fronts: list[list[Page]],
        passed: list[list[Page]],
        touched: list[bool],
    ) -> None:
        """After picking `pages`: the non-leaves the cursors passed leave their lists (they
        wait aside); in a class whose cursor passed one, or whose front pages were picked or
        are left, the parents exposed and not picked go to the head (the latest first), and
        the picked pages before them, in order."""
        lists = self._classes
        for klass, aside in enumerate(passed):
            for page in aside:
                if page.aside:
                    lists[klass].remove(page)
        for klass, front in enumerate(fronts):
            if front:
                touched[klass] = True
                head = lists[klass]
                for page in front:
                    head.move_to_front(page)
        for page in reversed(pages):
            page.going = False
            if touched[page.klass]:
                lists[page.klass].move_to_front(page)

    def _num_classed(self) -> int:
        return self._classed

    def _class_problems(self) -> list[str]:
        problems = []
        listed = sum(map(len, self._classes)) + len(self._interior)
        if listed != self._classed:
            problems.append(f"{listed} classed pages listed != {self._classed}")
        for klass, pages in enumerate(self._classes):
            problems += pages.problems()
            for page in pages:
                if (
                    page.klass != klass
                    or page.priority != DEFAULT_PRIORITY
                    or not page.queued
                    or page.aside
                    or page.going  # (only while a batch is picked)
                ):
                    problems.append(f"{page} (class {page.klass}) is in class list {klass}")
        for page in self._interior:
            if not page.aside:
                problems.append(f"{page} is set aside without its flag")
            if not page.klass or page.priority != DEFAULT_PRIORITY or not page.queued:
                problems.append(f"{page} (class {page.klass}) is set aside")
        return problems

"""An ordered list of pages linked through the pages themselves: the eviction queues' lists.

A page sits in at most one eviction list at a time, so the links live on the page (`before`,
`after`): adding, removing and moving a page anywhere in the list is a few pointer writes, with
no object per page and no hashing (an OrderedDict keeps a node and a hash-table entry per key, and
each insertion or removal probes that table). A walk is a chain of attribute reads.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvpool.records import Page


class PageList:
    """Pages in order (the first: the one to evict first)."""

    __slots__ = ("first", "last", "size")

    def __init__(self) -> None:
        self.first: Page | None = None
        self.last: Page | None = None
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[Page]:
        """The pages in order (do not change the list while iterating)."""
        page = self.first
        while page is not None:
            yield page
            page = page.after

    def holds(self, page: Page) -> bool:
        """Whether `page` is in this list (given it is in this one or in none)."""
        return page.before is not None or self.first is page

    def append(self, page: Page) -> None:
        """Add `page` (in no list) last."""
        last = self.last
        page.before = last
        page.after = None
        if last is None:
            self.first = page
        else:
            last.after = page
        self.last = page
        self.size += 1

    def appendleft(self, page: Page) -> None:
        """Add `page` (in no list) first."""
        first = self.first
        page.after = first
        page.before = None
        if first is None:
            self.last = page
        else:
            first.before = page
        self.first = page
        self.size += 1

    def remove(self, page: Page) -> None:
        """Take `page` (in this list) out."""
        before, after = page.before, page.after
        if before is None:
            self.first = after
        else:
            before.after = after
        if after is None:
            self.last = before
        else:
            after.before = before
        page.before = None
        page.after = None
        self.size -= 1

    def popleft(self) -> Page:
        """Take the first page out (the list is not empty)."""
        page = self.first
        assert page is not None
        self.remove(page)
        return page

    def move_to_front(self, page: Page) -> None:
        """Make `page` (in this list or in none) the first."""
        if self.holds(page):
            if self.first is page:
                return
            self.remove(page)
        self.appendleft(page)

    def problems(self) -> list[str]:
        """What is wrong with the links (for invariant checks): each page's `before` must be
        the page ahead of it, the last page `last`, and the pages `size`."""
        found, ahead, page = [], None, self.first
        count = 0
        while page is not None and count <= self.size:
            if page.before is not ahead:
                found.append(f"{page}: its before link is not the page ahead of it")
            ahead, page = page, page.after
            count += 1
        if count != self.size or ahead is not self.last:
            found.append(f"the links hold {count} pages ending at {ahead}; size {self.size}")
        return found

    def take(self, count: int, pages: list[Page]) -> None:
        """Append the first `count` pages (fewer if the list is shorter) to `pages`."""
        page = self.first
        while page is not None and count > 0:
            pages.append(page)
            count -= 1
            page = page.after

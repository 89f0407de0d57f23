"""One request's page tables: its page per block and layer group, and the int32 slot-id arrays
that attention kernels read (grown by doubling, updated in place, never rebuilt per step)."""

from __future__ import annotations

from collections.abc import Collection

import numpy as np
import numpy.typing as npt

from kvpool.layout import BAD_PAGE_INDEX, BufferPlacement
from kvpool.records import Page


class PageTable:
    """`pages[g][block]` and `tables[g][block]` (its slot id, -1 where none) per layer group;
    an SSM layer group has one entry, the live state."""

    def __init__(self, num_layer_groups: int, ssm_groups: Collection[int]) -> None:
        self._ssm_groups = ssm_groups
        self.pages: list[list[Page | None]] = [
            [None] if g in ssm_groups else [] for g in range(num_layer_groups)
        ]
        self.tables = [
            np.full(1 if g in ssm_groups else 16, BAD_PAGE_INDEX, dtype=np.int32)
            for g in range(num_layer_groups)
        ]
        self.version = 0  # bumped on every change, to invalidate cached page indices
        self._indices: dict[tuple[int, str], tuple[int, npt.NDArray[np.int32]]] = {}

    def set(self, g: int, index: int, page: Page) -> None:
        self.pages[g][index] = page
        self.tables[g][index] = page.slot_id
        self.version += 1

    def set_many(self, g: int, indices: list[int], pages: list[Page]) -> None:
        """`set` each index to its page (one numpy write)."""
        page_list = self.pages[g]
        assert len(indices) == len(pages)
        for i in range(len(pages)):  # (not zip(..., strict=True): generic, compiled or not)
            page_list[indices[i]] = pages[i]
        _write_slot_ids(self.tables[g], indices, pages)
        self.version += 1

    def extend(self, g: int, pages: list[Page]) -> None:
        """Append blocks to an attention layer group."""
        page_list = self.pages[g]
        start = len(page_list)
        page_list += pages
        table = self.tables[g]
        if len(page_list) > table.size:
            table = self._grow(g, len(page_list))
        if len(pages) == 1:
            table[start] = pages[0].slot.slot_id  # type: ignore[union-attr]
        else:  # (a slice: no index array)
            table[start : len(page_list)] = [page.slot.slot_id for page in pages]  # type: ignore[union-attr]
        self.version += 1

    def clear_all(self, g: int) -> list[Page | None]:
        """Empty one layer group's table; returns its pages (None where a block had none)."""
        pages = self.pages[g]
        self.pages[g] = [None] if g in self._ssm_groups else []
        self.tables[g][: len(pages)] = BAD_PAGE_INDEX
        self.version += 1
        return pages

    def clear(self, g: int, index: int) -> Page:
        page = self.pages[g][index]
        assert page is not None
        self.pages[g][index] = None
        self.tables[g][index] = BAD_PAGE_INDEX
        self.version += 1
        return page

    def clear_range(self, g: int, start: int, stop: int) -> list[Page]:
        """`clear` blocks `start` ... `stop - 1` where they have a page; returns those pages."""
        pages = self.pages[g]
        cleared = [page for page in pages[start:stop] if page is not None]
        pages[start:stop] = [None] * (stop - start)
        self.tables[g][start:stop] = BAD_PAGE_INDEX
        self.version += 1
        return cleared

    def resize(self, g: int, num_blocks: int) -> None:
        """Give an attention layer group `num_blocks` entries (new ones empty)."""
        pages, old = self.pages[g], len(self.pages[g])
        if num_blocks < old:
            del pages[num_blocks:]
            self.tables[g][num_blocks:old] = BAD_PAGE_INDEX
        else:
            pages.extend([None] * (num_blocks - old))
            if num_blocks > self.tables[g].size:
                self._grow(g, num_blocks)
        self.version += 1

    def _grow(self, g: int, num_blocks: int) -> npt.NDArray[np.int32]:
        """Reallocate a table for at least `num_blocks` entries (doubling)."""
        table = self.tables[g]
        grown = np.full(max(num_blocks, 2 * table.size), BAD_PAGE_INDEX, dtype=np.int32)
        grown[: table.size] = table
        self.tables[g] = grown
        return grown

    def copy_from(self, other: PageTable) -> None:
        """Take `other`'s pages and slot ids (a fork of its request)."""
        for g, pages in enumerate(other.pages):
            self.pages[g][:] = pages
            self.tables[g] = other.tables[g].copy()
        self.version += 1

    def refresh(self) -> None:
        """Rewrite the slot ids from the pages (they change when pages move)."""
        for g, pages in enumerate(self.pages):
            self.tables[g][: len(pages)] = [
                BAD_PAGE_INDEX if page is None else page.slot_id for page in pages
            ]
        self.version += 1

    def base_indices(self, g: int) -> npt.NDArray[np.int32]:
        """A read-only view of one layer group's slot ids."""
        view = self.tables[g][: len(self.pages[g])]
        view.flags.writeable = False
        return view

    def page_indices(self, placement: BufferPlacement) -> npt.NDArray[np.int32]:
        """Rows of one buffer's page view per block (cached until the table changes)."""
        key = (placement.layer_id, placement.role)
        cached = self._indices.get(key)
        if cached is not None and cached[0] == self.version:
            return cached[1]
        indices = placement.page_indices(self.base_indices(placement.layer_group))
        indices.flags.writeable = False
        self._indices[key] = (self.version, indices)
        return indices


def _write_slot_ids(table: npt.NDArray[np.int32], indices: list[int], pages: list[Page]) -> None:
    """table[indices[i]] = pages[i]'s slot id."""
    assert len(indices) == len(pages)
    if len(pages) < 8:  # numpy's per-call cost beats a few scalar writes
        for i in range(len(pages)):
            table[indices[i]] = pages[i].slot.slot_id  # type: ignore[union-attr]
    else:
        table[indices] = [page.slot.slot_id for page in pages]  # type: ignore[union-attr]

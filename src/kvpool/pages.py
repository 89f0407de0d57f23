"""Pages: one slot holding one block of one layer group at one cache level.

A page's status is derived from its owners: requests that are running *lock* it (it must stay on
the GPU), suspended requests *hold* it (it may move to a colder level but is never dropped).
A page attached to a radix-tree block is *committed*: immutable and shareable; when nobody owns it
any more it stays cached and becomes evictable. An uncommitted page nobody owns is freed at once.

The storage manager reuses the Page object of a freed page for a later one (`reset`), so nothing
may keep a page after it is freed; nothing in kvpool does (owners, blocks and queues let go first).
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpool.radix import Block
    from kvpool.storage.slots import Slot


DEFAULT_PRIORITY = 35
MIN_PRIORITY = 0
MAX_PRIORITY = 100


class PageStatus(Enum):
    LOCKED = "locked"
    HELD = "held"
    DROPPABLE = "droppable"


class Page:
    """Ownership record of one slot; the `StorageManager` changes the counts."""

    __slots__ = (
        "block",
        "holds",
        "layer_group",
        "level",
        "locks",
        "pool_group",
        "priority",
        "queued",
        "slot",
    )

    def __init__(
        self, slot: Slot | None, level: int, pool_group: int, layer_group: int, locks: int = 0
    ) -> None:
        self.reset(slot, level, pool_group, layer_group, locks)

    def reset(
        self, slot: Slot | None, level: int, pool_group: int, layer_group: int, locks: int
    ) -> None:
        """(Re)start as a new page in `slot` (the storage manager reuses freed Page objects)."""
        self.slot: Slot | None = slot
        self.level = level
        self.pool_group = pool_group
        self.layer_group = layer_group
        self.block: Block | None = None  # set while the page is the tree block's copy
        self.locks = locks
        self.holds = 0
        self.priority = DEFAULT_PRIORITY
        self.queued = False  # in its (level, pool group) eviction queue

    @property
    def slot_id(self) -> int:
        assert self.slot is not None, "page was freed"
        return self.slot.slot_id

    @property
    def status(self) -> PageStatus:
        if self.locks:
            return PageStatus.LOCKED
        return PageStatus.HELD if self.holds else PageStatus.DROPPABLE

    def __repr__(self) -> str:
        slot = self.slot.slot_id if self.slot is not None else "freed"
        kind = "committed" if self.block is not None else "uncommitted"
        return (
            f"Page(level {self.level}, pool group {self.pool_group}, slot {slot}, {kind}, "
            f"locks {self.locks}, holds {self.holds})"
        )

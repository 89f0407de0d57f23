"""The data every part of the `StorageManager` reads and changes: the levels' pools, their
allocators, the eviction queues, the page in each occupied slot, the spare page records and the
counters. The parts hold it; it holds none of them and has no behaviour beyond counting."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

from kvpool.events.log import KVEventLog
from kvpool.eviction import EvictionQueue
from kvpool.records import Page
from kvpool.storage.copier import Copier
from kvpool.storage.pools import LevelStorage
from kvpool.tiers.persistence import DiskRecords

PREMADE_RECORDS: Final = 1 << 17  # per pool group: at most about 53 MiB of records


class StorageState:
    """Pools, queues and page registries of every level (shared by the parts of the
    `StorageManager`)."""

    def __init__(self, levels: Sequence[LevelStorage]) -> None:
        self.levels = list(levels)
        self.last_level: Final = len(self.levels) - 1
        # Freed Page objects, reused for new pages: no garbage per page in the hot loop once as
        # many pages have lived at once as ever will (nothing keeps a freed page).
        self.spare_pages: list[Page] = []
        self.allocators = [[group.allocator for group in level.pool_groups] for level in levels]
        self.queues = [[EvictionQueue() for _ in level.pool_groups] for level in self.levels]
        # The page in each occupied slot, per level and pool group.
        self.pages = [[{} for _ in level.pool_groups] for level in self.levels]  # type: list[list[dict[int, Page]]]
        self.copier = Copier()
        # (the memories' own resizes, reads and closes ordered with the copies: `attach`)
        self.copier.attach(
            [memory for level in self.levels for g in level.pool_groups for memory in g.memories]
        )
        # Called with dropped pages; returns the other pages that lost their block with them.
        self.on_drop: Callable[[Sequence[Page]], Sequence[Page]] = lambda pages: ()
        self.num_dropped = 0
        self.num_dropped_at = [0] * len(self.levels)  # per level
        self.num_moved = [0] * len(self.levels)  # pages that arrived at each level
        self.bytes_moved = [0] * len(self.levels)
        self.num_swapped = 0  # pages brought up by staging them through RAM
        self.num_relocated = 0  # pages moved inside their level by a shrink
        self.bytes_relocated = 0
        self.copy_bytes = 0  # bytes copied by page moves (between and inside levels)
        self.copy_seconds = 0.0  # and the time those copies took
        # Eviction decisions (drops and moves, with slot ids) while a replica check records them;
        # None (the usual case) costs one test per batch.
        self.events: list[tuple[object, ...]] | None = None
        # Told when the tree's pages change level (None: no KV events).
        self.kv_events: KVEventLog | None = None
        # Told where pages arrive at a persistent disk level (None: the level is not one).
        self.persist: DiskRecords | None = None

    def make_records(self, level: int, limit: int = PREMADE_RECORDS) -> int:
        """Make the slot handles and page records of `level`'s slots now (up to `limit` per
        pool group), so that filling the level makes none: its records are made once, where a
        manager is made, not in the engine's loop (where the collector would also walk them
        while they pile up). Returns the most made for one pool group."""
        most = 0
        for allocator in self.allocators[level]:
            count = min(allocator.capacity, limit)
            allocator.make_handles(count)
            self.spare_pages += [Page(None, level, 0, 0) for _ in range(count)]
            most = max(most, count)
        return most

    def num_free(self, level: int, pool_group: int) -> int:
        return self.allocators[level][pool_group].num_free_slots

    def num_evictable(self, level: int, pool_group: int) -> int:
        return len(self.queues[level][pool_group])

    def num_available(self, level: int, pool_group: int) -> int:
        """Free slots plus evictable pages (an upper bound of what allocation can get)."""
        return self.num_free(level, pool_group) + self.num_evictable(level, pool_group)

    def close(self) -> None:
        self.copier.close()
        for level in self.levels:
            level.close()
        self.levels = []
        self.allocators = []
        self.queues = []
        self.pages = []
        self.spare_pages = []

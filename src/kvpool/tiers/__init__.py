"""StorageManager: the pages of every level, their owners, eviction and migration between levels.

It is a composition of parts, each an object with one concern, that share one `StorageState`
(the levels' pools, allocators, eviction queues, the page in each slot and the counters):

- `owners` (`Ownership`): owner counts (locks, holds), queueing and freeing that follow from
  them, priorities, drops;
- `planner` (`Planner`): eviction plans, made with counts only (reads, never changes);
- `migration` (`Migration`): batched copies between and inside levels, staging in RAM;
- `allocation` (`Allocation`): carrying plans out, new pages, bringing pages up;
- `resizing` (`Resizing`): new slot counts for a level.

Each part is given only the parts it calls. Callers hold the part they need (a request's cache
the owners, the allocation and the migration; the rebalancer the resizing).

Allocation on a full level cascades: the least valuable evictable pages of that level move to the
next level, which may in turn push its own down; only the last level drops pages. Held pages (a
suspended request needs them) may move down but are never dropped: an allocation that would need
that fails with `OutOfPagesError` before anything changed, because every cascade is planned with
counts first and carried out only when the plan succeeds.

Failures: a page a request locks or holds survives every failed operation. Bytes that must be
read from a level that can fail (the disk) are read into RAM before anything changes, so a
failed read changes nothing. A failed write while pages move down leaves each page either where
it was or where it went (a batch moves whole or not at all); cached pages that eviction had
already dropped or moved by then stay so: that is the one documented partial outcome.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.storage.pools import LevelStorage
from kvpool.tiers.allocation import Allocation
from kvpool.tiers.migration import NOTHING_STAGED, Migration, Staged
from kvpool.tiers.ownership import Ownership
from kvpool.tiers.planning import Credit, Planner
from kvpool.tiers.resizing import Resizing
from kvpool.tiers.state import StorageState


class StorageManager:
    """Owns the levels' pools and eviction queues; every page count change goes through one of
    its parts."""

    def __init__(self, levels: Sequence[LevelStorage]) -> None:
        self.state = StorageState(levels)
        self.owners = Ownership(self.state)
        self.planner = Planner(self.state)
        self.migration = Migration(self.state, self.owners)
        self.allocation = Allocation(self.state, self.owners, self.migration, self.planner)
        self.resizing = Resizing(self.state, self.planner, self.allocation, self.migration)

    def close(self) -> None:
        self.state.close()


__all__ = [
    "NOTHING_STAGED",
    "Allocation",
    "Credit",
    "Migration",
    "Ownership",
    "Planner",
    "Resizing",
    "Staged",
    "StorageManager",
    "StorageState",
]

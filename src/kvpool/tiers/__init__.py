"""StorageManager: the pages of every level, their owners, eviction and migration between levels.

It is assembled from parts on a shared `StorageState`: `Ownership` (owner counts, queueing,
drops), `Planning` (eviction plans), `Migration` (copies, staging), `Allocation` (carrying plans
out, bringing pages up) and `Resizing` (new slot counts for a level).

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

from kvpool.tiers.migration import NOTHING_STAGED, Staged
from kvpool.tiers.planning import Credit
from kvpool.tiers.resizing import Resizing


class StorageManager(Resizing):
    """Owns the levels' pools and eviction queues; every page count change goes through it."""


__all__ = ["NOTHING_STAGED", "Credit", "Staged", "StorageManager"]

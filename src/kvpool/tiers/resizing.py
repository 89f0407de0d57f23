"""Resizing a level: new slot counts per pool group (a rebalance, or a new quota). Shrinking
evicts or relocates the pages in the removed slot range; every failure rolls back."""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.errors import StorageError
from kvpool.records import Page
from kvpool.tiers.allocation import Allocation
from kvpool.tiers.migration import Migration
from kvpool.tiers.planning import Plan, Planner
from kvpool.tiers.state import StorageState


class Resizing:
    """`adjust_cache_level` and the shrink it plans (with the planner), carries out (with the
    allocation) and defragments (with the migration)."""

    def __init__(
        self, state: StorageState, planner: Planner, allocation: Allocation, migration: Migration
    ) -> None:
        self._state = state
        self._planner = planner
        self._allocation = allocation
        self._migration = migration

    def adjust_cache_level(
        self, level: int, counts: Sequence[int], quota: int | None = None
    ) -> bool:
        """Give each pool group of `level` its new slot count (and the level a new quota):
        shrink first (freeing memory), then expand. False, with nothing changed, when a
        shrinking group's pages that must stay do not fit.

        On a `StorageError` no page a request owns is lost and no shrink stays scheduled:
        a failed move out of a removed slot range cancels every shrink (relocated pages keep
        their new slots, the rest their old ones; cached pages already evicted to make room
        stay evicted), and a failed grow undoes the grows before it and keeps the old quota
        (the message says which pool groups had shrunk)."""
        storage = self._state.levels[level]
        old = storage.slot_counts
        shrinking = [pg for pg, (new, was) in enumerate(zip(counts, old, strict=True)) if new < was]
        plans: list[Plan] = []
        for pg in shrinking:
            plan = self._plan_shrink(level, pg, counts[pg])
            if plan is None:
                for done in shrinking[: len(plans)]:
                    storage.pool_groups[done].allocator.cancel_shrink()
                return False
            plans.append(plan)
        try:
            for pg, plan in zip(shrinking, plans, strict=True):
                self._allocation.execute(plan)
                self._relocate(level, pg)
        except BaseException:
            for pg in shrinking:
                storage.pool_groups[pg].allocator.cancel_shrink()
            raise
        for pg in shrinking:  # every removed range is empty now: this cannot fail
            storage.shrink_pool_group(pg, counts[pg])
        old_quota = storage.quota
        if quota is not None:
            storage.quota = quota
        grown: list[int] = []
        try:
            for pg, (new, was) in enumerate(zip(counts, old, strict=True)):
                if new > was:
                    storage.expand_pool_group(pg, new)
                    grown.append(pg)
        except BaseException as error:
            for pg in grown:  # their new slots were never handed out
                storage.shrink_pool_group(pg, old[pg])
            storage.quota = old_quota
            if not isinstance(error, StorageError):
                raise
            shrunk = (
                f"pool groups {shrinking} had shrunk to {[counts[pg] for pg in shrinking]} slots"
                if shrinking
                else "nothing was changed"
            )
            raise StorageError(
                error.errno,
                f"level {level}: {error.strerror}; the quota stays {old_quota}, {shrunk}",
            ) from error
        return True

    def pages_that_must_stay(self, level: int) -> list[int]:
        """Per pool group: pages that cannot leave `level` (locked, or held at the last level)."""
        last = level == self._state.last_level
        return [
            sum(1 for page in pages.values() if page.locks or (last and page.holds))
            for pages in self._state.pages[level]
        ]

    def _plan_shrink(self, level: int, pool_group: int, new_num_slots: int) -> Plan | None:
        """Schedule the allocator's shrink and plan the evictions it needs (or cancel, None)."""
        allocator = self._state.levels[level].pool_groups[pool_group].allocator
        allocator.prepare_for_shrink(new_num_slots)
        if allocator.num_active_slots <= new_num_slots:
            return Plan(free=0)  # fast path: no id in the removed range was ever issued
        free_below = allocator.num_free_slots  # ids under the new size only, now
        blocking = set(allocator.get_slots_blocking_shrink())
        victims: list[Page] = []
        queue = self._state.queues[level][pool_group]
        for page in queue:
            if free_below >= len(blocking):
                break
            victims.append(page)
            if page.slot_id in blocking:
                blocking.discard(page.slot_id)
            else:
                free_below += 1
        plan = (
            self._planner.plan_eviction(level, pool_group, victims)
            if free_below >= len(blocking)
            else None
        )
        if plan is None:
            allocator.cancel_shrink()
        return plan

    def _relocate(self, level: int, pool_group: int) -> None:
        """After a shrink's planned evictions: move the pages left in the removed range into
        free slots below it (a defragmenting copy)."""
        allocator = self._state.levels[level].pool_groups[pool_group].allocator
        blocking = [
            self._state.pages[level][pool_group][i] for i in allocator.get_slots_blocking_shrink()
        ]
        if blocking:
            self._migration.migrate_batch(blocking, level, level, pool_group)
            self._state.num_relocated += len(blocking)
            slot_bytes = sum(self._state.levels[level].pool_groups[pool_group].slot_sizes)
            self._state.bytes_relocated += len(blocking) * slot_bytes

"""Allocation: making room at a level by carrying out eviction plans, new pages, and bringing a
request's pages up a level (`bring_to` for resume, `lift` for prefetch)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from kvpool.records import Page
from kvpool.storage.slots import wait_before
from kvpool.tiers.migration import Migration
from kvpool.tiers.ownership import Ownership
from kvpool.tiers.planning import Plan, Planner
from kvpool.tiers.state import StorageState

# A full level evicts `capacity >> EVICTION_SPARE_SHIFT` pages (0.1%) more than it needs.
EVICTION_SPARE_SHIFT = 10  # (not Final: read once per eviction; the fuzzer sets it)


class Allocation:
    """Slots made free by cascading eviction, and pages moved up into them: carries out the
    planner's plans with the owners' drops and the migration's copies."""

    def __init__(
        self, state: StorageState, owners: Ownership, migration: Migration, planner: Planner
    ) -> None:
        self._state = state
        self._owners = owners
        self._migration = migration
        self._planner = planner

    def reserve(self, level: int, counts: Sequence[int]) -> bool:
        """Make `counts[pg]` slots free per pool group at `level` (by cascading eviction), or
        return False with nothing changed."""
        plans, drops = [], []
        allocators, queues = self._state.allocators[level], self._state.queues[level]
        for pool_group, count in enumerate(counts):
            missing = count - allocators[pool_group].num_free_slots
            if missing <= 0:
                continue
            # Evict a few more than needed (0.1% of the pool group), so that the next small
            # allocations (a decode step's new block) find a free slot: eviction's fixed cost (a
            # plan, a batched copy down each level, a drop) is then paid once per batch, not once
            # per block. Best effort: the plan may free fewer, never fewer than `count`.
            spare = allocators[pool_group].capacity >> EVICTION_SPARE_SHIFT
            if level == self._state.last_level:  # dropping the oldest pages is all eviction can do
                victims = queues[pool_group].oldest(missing + spare)
                if len(victims) < missing:
                    return False
                drops.append(victims)
            else:
                plan = self._planner.plan(level, pool_group, count + spare, count)
                if plan is None:
                    return False
                plans.append(plan)
        for victims in drops:
            self._owners.drop(victims)
        for plan in plans:
            self.execute(plan)
        return True

    def new_pages(
        self, level: int, pool_group: int, layer_group: int, count: int, locks: int = 0
    ) -> list[Page]:
        """`count` new pages (evicting if needed), or `OutOfPagesError` and nothing changed.
        With `locks=0` the caller must lock or hold each one at once."""
        allocator = self._state.allocators[level][pool_group]
        if allocator.num_free_slots < count:
            self.make_room(level, pool_group, count)
        spare, registry = self._state.spare_pages, self._state.pages[level][pool_group]
        pages = []
        for slot in allocator.allocate_multiple(count):
            if slot.ready_event is not None:  # a copy from it may still run: let it finish
                on_device = self._state.levels[level].pool_groups[pool_group].on_device
                wait_before(slot.ready_event, on_device)  # (the engine's kernels write it)
                slot.ready_event = None
            if spare:
                page = spare.pop()
                page.reset(slot, level, pool_group, layer_group, locks)
            else:
                page = Page(slot, level, pool_group, layer_group, locks)
            registry[slot.slot_id] = page
            pages.append(page)
        return pages

    def make_room(self, level: int, pool_group: int, count: int) -> None:
        """Free `count` slots at `level` by cascading eviction; `OutOfPagesError`, with nothing
        changed, when they cannot be had."""
        if self._state.num_free(level, pool_group) < count:
            self.execute(self._planner.plan_most(level, pool_group, count, count))

    def execute(self, plan: Plan) -> None:
        if plan.drops:
            self._owners.drop(plan.drops)
        for level, pages in plan.moves:
            alive = [page for page in pages if page.slot is not None and page.level == level]
            self._migration.migrate(alive, level + 1)

    def bring_to(self, pages: Sequence[Page], level: int, extra: Sequence[int]) -> bool:
        """Move `pages` (locked by the caller, so never chosen for eviction) to `level` and
        leave `extra[pg]` more free slots there, pushing other pages down as needed. All or
        nothing: False, with nothing changed and no I/O, when it cannot be done.

        Pages on disk are read into RAM first, so a failed read changes nothing. When the
        colder levels are full too (partly with `pages` themselves), the pages swap places
        with the pages they push down: all their bytes are staged in RAM, their slots freed
        for the pushed pages, and then written to their new slots. If pushing fails half way,
        each staged page is written back to a free slot (its old level first)."""
        needs = list(extra)
        moving = [page for page in pages if page.level != level]
        for page in moving:
            needs[page.pool_group] += 1
        if self._planner.can_allocate(level, needs):
            staged = self._migration.stage(moving)
            try:
                for pool_group, count in enumerate(needs):
                    if count:
                        self.make_room(level, pool_group, count)
                self._migration.migrate(moving, level, staged)
            finally:
                staged.close()
            return True
        credit = Counter((page.level, page.pool_group) for page in moving)
        if not moving or not self._planner.can_allocate(level, needs, credit):
            return False
        staged = self._migration.stage(moving, every=True)
        homes = [page.level for page in moving]
        try:
            for page in moving:
                self._migration.release_slot(page)
            try:
                for pool_group, count in enumerate(needs):
                    if count:
                        self.make_room(level, pool_group, count)
            except BaseException:
                for page, home in zip(moving, homes, strict=True):
                    self._migration.place(page, [home, level], staged)
                raise
            for page, home in zip(moving, homes, strict=True):
                self._migration.place(page, [level, home], staged)
        finally:
            staged.close()
        self._state.num_swapped += len(moving)
        return True

    def lift(self, pages: Sequence[Page], level: int) -> None:
        """Move as many of `pages` (colder than `level`, locked by the caller) up to `level`
        as it can take by pushing other pages down (best effort). Disk pages are read into RAM
        first, so a failed read changes nothing."""
        by_group: dict[int, list[Page]] = {}
        for page in pages:
            by_group.setdefault(page.pool_group, []).append(page)
        plans = [
            (
                pool_group,
                group_pages,
                self._planner.plan_most(level, pool_group, len(group_pages), 0),
            )
            for pool_group, group_pages in by_group.items()
        ]
        fitting = [page for _, group_pages, plan in plans for page in group_pages[: plan.free]]
        staged = self._migration.stage(fitting)
        try:
            for pool_group, group_pages, plan in plans:
                self.execute(plan)
                room = min(plan.free, self._state.num_free(level, pool_group))
                self._migration.migrate(group_pages[:room], level, staged)
        finally:
            staged.close()

"""StorageManager: the pages of every level, their owners, eviction and migration between levels.

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

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from kvpool.config import CacheTier
from kvpool.errors import CorruptedError, OutOfPagesError, StorageError
from kvpool.eviction import EvictionQueue
from kvpool.records import Page
from kvpool.storage.copier import Copier
from kvpool.storage.memory import HostMemory
from kvpool.storage.pools import LevelStorage, PoolGroup

logger = logging.getLogger("kvpool")

Credit = dict[tuple[int, int], int]
"""Slots to count as free per (level, pool group) when planning (pages about to leave them)."""


class _Plan:
    """Steps that free slots, in the order to carry them out (coldest level first), and how
    many slots are then free at the level planned for."""

    __slots__ = ("drops", "free", "moves")

    def __init__(
        self,
        free: int,
        drops: list[Page] | None = None,
        moves: list[tuple[int, list[Page]]] | None = None,  # (from level, pages)
    ) -> None:
        self.free = free
        self.drops = [] if drops is None else drops
        self.moves = [] if moves is None else moves


class Staged:
    """Copies of some pages' bytes in RAM, one staging slot per page, read before anything
    changes: a failed read raises with nothing changed, and the copy in RAM is what the pages
    are later written from. `close()` releases the memory."""

    def __init__(self) -> None:
        self.groups: dict[int, PoolGroup] = {}  # per pool group: staging pools in RAM
        self.slot_of: dict[int, int] = {}  # id(page) -> its staging slot

    def has(self, page: Page) -> bool:
        return id(page) in self.slot_of

    def close(self) -> None:
        for group in self.groups.values():
            group.close()
        self.groups.clear()
        self.slot_of.clear()


_NOTHING_STAGED = Staged()


class StorageManager:
    """Owns the levels' pools and eviction queues; every page count change goes through it."""

    def __init__(self, levels: Sequence[LevelStorage]) -> None:
        self.levels = list(levels)
        self._last_level = len(self.levels) - 1
        # Freed Page objects, reused for new pages: no garbage per page in the hot loop (nothing
        # keeps a freed page). Records for the GPU level's slots are made now.
        self._spare_pages = [Page(None, 0, 0, 0) for _ in range(sum(self.levels[0].slot_counts))]
        self.allocators = [[group.allocator for group in level.pool_groups] for level in levels]
        self.queues = [[EvictionQueue() for _ in level.pool_groups] for level in self.levels]
        # The page in each occupied slot, per level and pool group.
        self.pages = [[{} for _ in level.pool_groups] for level in self.levels]  # type: list[list[dict[int, Page]]]
        self.copier = Copier()
        # Called with dropped pages; returns the other pages that lost their block with them.
        self.on_drop: Callable[[Sequence[Page]], Sequence[Page]] = lambda pages: ()
        self.num_dropped = 0
        self.num_moved = [0] * len(self.levels)  # pages that arrived at each level
        self.bytes_moved = [0] * len(self.levels)
        self.num_swapped = 0  # pages brought up by staging them through RAM
        self.num_relocated = 0  # pages moved inside their level by a shrink

    @property
    def last_level(self) -> int:
        return self._last_level

    # -- capacity --------------------------------------------------------------------------------

    def num_free(self, level: int, pool_group: int) -> int:
        return self.allocators[level][pool_group].num_free_slots

    def num_evictable(self, level: int, pool_group: int) -> int:
        return len(self.queues[level][pool_group])

    def num_available(self, level: int, pool_group: int) -> int:
        """Free slots plus evictable pages (an upper bound of what allocation can get)."""
        return self.num_free(level, pool_group) + self.num_evictable(level, pool_group)

    def can_allocate(self, level: int, counts: Sequence[int], credit: Credit | None = None) -> bool:
        """Whether `counts[pg]` new slots per pool group can be made free at `level` (by
        cascading eviction), counting `credit` slots as free too."""
        return all(
            count <= self.num_free(level, pool_group)
            or self._plan(level, pool_group, count, count, credit) is not None
            for pool_group, count in enumerate(counts)
        )

    def reserve(self, level: int, counts: Sequence[int]) -> bool:
        """Make `counts[pg]` slots free per pool group at `level` (by cascading eviction), or
        return False with nothing changed."""
        plans, drops = [], []
        allocators, queues = self.allocators[level], self.queues[level]
        for pool_group, count in enumerate(counts):
            missing = count - allocators[pool_group].num_free_slots
            if missing <= 0:
                continue
            if level == self._last_level:  # dropping the oldest pages is all eviction can do
                # Drop a few more than needed (0.1% of the pool group), so that the next small
                # allocations (a decode step's new block) find a free slot: eviction's fixed cost
                # is then paid once per batch, not once per block.
                spare = allocators[pool_group].capacity >> 10
                victims = queues[pool_group].oldest(missing + spare)
                if len(victims) < missing:
                    return False
                drops.append(victims)
            else:
                plan = self._plan(level, pool_group, count, count)
                if plan is None:
                    return False
                plans.append(plan)
        for victims in drops:
            self.drop(victims)
        for plan in plans:
            self._execute(plan)
        return True

    # -- allocation ------------------------------------------------------------------------------

    def new_pages(
        self, level: int, pool_group: int, layer_group: int, count: int, locks: int = 0
    ) -> list[Page]:
        """`count` new pages (evicting if needed), or `OutOfPagesError` and nothing changed.
        With `locks=0` the caller must lock or hold each one at once."""
        allocator = self.allocators[level][pool_group]
        if allocator.num_free_slots < count:
            self.make_room(level, pool_group, count)
        spare, owners = self._spare_pages, self.pages[level][pool_group]
        pages = []
        for slot in allocator.allocate_multiple(count):
            if spare:
                page = spare.pop()
                page.reset(slot, level, pool_group, layer_group, locks)
            else:
                page = Page(slot, level, pool_group, layer_group, locks)
            owners[slot.slot_id] = page
            pages.append(page)
        return pages

    def make_room(
        self, level: int, pool_group: int, count: int, at_least: int | None = None
    ) -> int:
        """Free up to `count` slots (at least `at_least`, default all) at `level` by cascading
        eviction; returns how many are free. `OutOfPagesError`, with nothing changed, when even
        `at_least` cannot be had."""
        if self.num_free(level, pool_group) >= count:
            return count
        plan = self._plan_most(level, pool_group, count, count if at_least is None else at_least)
        self._execute(plan)
        return min(count, self.num_free(level, pool_group))

    def _plan_most(
        self, level: int, pool_group: int, want: int, at_least: int, credit: Credit | None = None
    ) -> _Plan:
        """The plan freeing the most slots up to `want` at `level`, at least `at_least`, or
        `OutOfPagesError`. Evicting fewer of the oldest pages never needs more room below, so
        when all `want` cannot be had the most that can is found by bisection."""
        plan = self._plan(level, pool_group, want, at_least, credit)
        if plan is None and at_least < want:
            free = self.num_free(level, pool_group) + (credit or {}).get((level, pool_group), 0)
            low, high = max(at_least, min(free, want)), want - 1
            best = self._plan(level, pool_group, low, low, credit)
            while best is not None and low < high:
                middle = (low + high + 1) // 2
                candidate = self._plan(level, pool_group, middle, middle, credit)
                if candidate is None:
                    high = middle - 1
                else:
                    low, best = middle, candidate
            plan = best
        if plan is None:
            raise OutOfPagesError(
                f"cannot free {at_least} slots in pool group {pool_group} at level {level}: "
                f"{self.num_free(level, pool_group)} free, {self.num_evictable(level, pool_group)} "
                "evictable, and the pages that would have to move are held with no room below"
            )
        return plan

    def _plan(
        self, level: int, pool_group: int, want: int, at_least: int, credit: Credit | None = None
    ) -> _Plan | None:
        """Plan freeing up to `want` (at least `at_least`) slots at `level`, or None."""
        free = self.num_free(level, pool_group)
        if credit:
            free += credit.get((level, pool_group), 0)
        if free >= want:
            return _Plan(free=want)
        victims = self.queues[level][pool_group].oldest(want - free)
        if free + len(victims) < at_least:
            return None
        plan = self._plan_eviction(level, pool_group, victims, credit)
        if plan is None and level != self._last_level:
            plan = self._plan_around_held(level, pool_group, want - free, at_least - free, credit)
        if plan is not None:
            plan.free += free
        return plan

    def _plan_around_held(
        self, level: int, pool_group: int, want: int, at_least: int, credit: Credit | None
    ) -> _Plan | None:
        """The oldest pages include held ones that the levels below cannot take (their own
        pages are held too): take, in queue order, as many held pages as the level below has
        free slots for, and drop cached pages further back instead of the others."""
        room = self.num_free(level + 1, pool_group)
        if credit:
            room += credit.get((level + 1, pool_group), 0)
        held: list[Page] = []
        droppable: list[Page] = []
        for page in self.queues[level][pool_group]:
            if not page.holds:
                droppable.append(page)
            elif len(held) < room:
                held.append(page)
            else:
                continue
            if len(held) + len(droppable) == want:
                break
        if len(held) + len(droppable) < at_least:
            return None
        return _Plan(free=len(held) + len(droppable), drops=droppable, moves=[(level, held)])

    def _plan_eviction(
        self, level: int, pool_group: int, victims: list[Page], credit: Credit | None = None
    ) -> _Plan | None:
        """Plan where evicted pages go: held ones must find room below, droppable ones move
        down while there is room (the most valuable first) and are dropped otherwise."""
        if level == self.last_level:
            # Held pages are never queued at the last level: every victim can be dropped.
            return _Plan(len(victims), victims)
        held = [page for page in victims if page.holds]
        droppable = [page for page in victims if not page.holds]
        below = self._plan(level + 1, pool_group, len(victims), len(held), credit)
        if below is None:
            return None
        keep = below.free - len(held)
        moving = held + droppable[len(droppable) - keep :] if keep else held
        dropped = droppable[: len(droppable) - keep]
        return _Plan(
            free=len(victims), drops=below.drops + dropped, moves=[*below.moves, (level, moving)]
        )

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
        storage = self.levels[level]
        old = storage.slot_counts
        shrinking = [pg for pg, (new, was) in enumerate(zip(counts, old, strict=True)) if new < was]
        plans: list[_Plan] = []
        for pg in shrinking:
            plan = self._plan_shrink(level, pg, counts[pg])
            if plan is None:
                for done in shrinking[: len(plans)]:
                    storage.pool_groups[done].allocator.cancel_shrink()
                return False
            plans.append(plan)
        try:
            for pg, plan in zip(shrinking, plans, strict=True):
                self._execute(plan)
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
        last = level == self.last_level
        return [
            sum(1 for page in pages.values() if page.locks or (last and page.holds))
            for pages in self.pages[level]
        ]

    def _relocate(self, level: int, pool_group: int) -> None:
        """After a shrink's planned evictions: move the pages left in the removed range into
        free slots below it (a defragmenting copy)."""
        allocator = self.levels[level].pool_groups[pool_group].allocator
        blocking = [self.pages[level][pool_group][i] for i in allocator.get_slots_blocking_shrink()]
        if blocking:
            self._migrate_batch(blocking, level, level, pool_group)
            self.num_relocated += len(blocking)

    def _plan_shrink(self, level: int, pool_group: int, new_num_slots: int) -> _Plan | None:
        """Schedule the allocator's shrink and plan the evictions it needs (or cancel, None)."""
        allocator = self.levels[level].pool_groups[pool_group].allocator
        allocator.prepare_for_shrink(new_num_slots)
        if allocator.num_active_slots <= new_num_slots:
            return _Plan(free=0)  # fast path: no id in the removed range was ever issued
        free_below = allocator.num_free_slots  # ids under the new size only, now
        blocking = set(allocator.get_slots_blocking_shrink())
        victims: list[Page] = []
        queue = self.queues[level][pool_group]
        for page in queue:
            if free_below >= len(blocking):
                break
            victims.append(page)
            if page.slot_id in blocking:
                blocking.discard(page.slot_id)
            else:
                free_below += 1
        plan = (
            self._plan_eviction(level, pool_group, victims) if free_below >= len(blocking) else None
        )
        if plan is None:
            allocator.cancel_shrink()
        return plan

    def _execute(self, plan: _Plan) -> None:
        if plan.drops:
            self.drop(plan.drops)
        for level, pages in plan.moves:
            alive = [page for page in pages if page.slot is not None and page.level == level]
            self.migrate(alive, level + 1)

    def drop(self, pages: list[Page]) -> None:
        """Drop queued, unowned pages of one pool group (any levels) now, with no I/O: their
        KV is gone."""
        by_level: dict[int, list[Page]] = {}
        for page in pages:
            if page.slot is not None:  # (else an earlier drop orphaned and freed it)
                by_level.setdefault(page.level, []).append(page)
        orphans = [self._drop_group(level, group) for level, group in by_level.items()]
        for lost in orphans:
            for orphan in lost:
                self.settle(orphan)

    def _drop_group(self, level: int, pages: list[Page]) -> Sequence[Page]:
        """Drop queued pages of one pool group at `level`: out of their queue and the tree,
        slots freed in one call. Returns the pages that lost their block with them, for the
        caller to settle once every group is dropped."""
        pool_group = pages[0].pool_group
        self.queues[level][pool_group].remove_all(pages)
        orphans = self.on_drop(pages)
        registry = self.pages[level][pool_group]
        slots = []
        for page in pages:
            slot = page.slot
            assert slot is not None and page.pool_group == pool_group and not page.holds, page
            del registry[slot.slot_id]
            slots.append(slot)
            page.slot = None
        self._spare_pages += pages
        self.allocators[level][pool_group].release_multiple(slots)
        self.num_dropped += len(pages)
        return orphans

    def _free(self, page: Page) -> None:
        slot = page.slot
        assert slot is not None and page.locks == 0 and page.holds == 0, page
        if page.queued:
            self.queues[page.level][page.pool_group].remove(page)
        del self.pages[page.level][page.pool_group][slot.slot_id]
        self.levels[page.level].pool_groups[page.pool_group].allocator.release(slot)
        page.slot = None
        self._spare_pages.append(page)

    # -- migration -------------------------------------------------------------------------------

    def migrate(self, pages: Sequence[Page], level: int, staged: Staged = _NOTHING_STAGED) -> None:
        """Move pages (any levels, one pool group each) to `level`, copying their bytes in
        batches (from their RAM copies where `staged` has them). The destination must have free
        slots. On a copy error the failing batch does not move: the error is raised, its
        sources stay valid and its destination slots are released."""
        batches: dict[tuple[int, int], list[Page]] = {}
        for page in pages:
            if page.level != level:
                batches.setdefault((page.level, page.pool_group), []).append(page)
        for (source_level, pool_group), batch in batches.items():
            self._migrate_batch(batch, source_level, level, pool_group, staged)

    def _migrate_batch(
        self,
        batch: list[Page],
        source_level: int,
        level: int,
        pool_group: int,
        staged: Staged = _NOTHING_STAGED,
    ) -> None:
        allocator = self.levels[level].pool_groups[pool_group].allocator
        slots = allocator.allocate_multiple(len(batch))
        for slot in slots:
            if slot.ready_event is not None:
                slot.ready_event.wait()  # the slot's previous copy must be done before we write
        source_group = self.levels[source_level].pool_groups[pool_group]
        target_group = self.levels[level].pool_groups[pool_group]
        if staged.slot_of and staged.has(batch[0]):
            copy_from, slot_of = staged.groups[pool_group], staged.slot_of
            pairs = [
                (slot_of[id(page)], slot.slot_id) for page, slot in zip(batch, slots, strict=True)
            ]
        else:
            copy_from = source_group
            pairs = [(page.slot_id, slot.slot_id) for page, slot in zip(batch, slots, strict=True)]
        try:
            event = self.copier.copy(copy_from, target_group, pairs)
            event.check()
        except BaseException:  # (an interrupt in an inline copy too)
            allocator.release_multiple(slots)
            raise
        source_pages, target_pages = (
            self.pages[source_level][pool_group],
            self.pages[level][pool_group],
        )
        queued = [page for page in batch if page.queued]
        if queued:
            self.queues[source_level][pool_group].remove_all(queued)
        old_slots = []
        for page, slot in zip(batch, slots, strict=True):
            old = page.slot
            assert old is not None
            del source_pages[old.slot_id]
            old_slots.append(old)
            slot.ready_event = event
            page.slot, page.level = slot, level
            target_pages[slot.slot_id] = page
        source_group.allocator.release_multiple(old_slots, ready_event=event)
        evictable = []  # `settle` each page, queueing in one batch
        for page in batch:
            if self.is_evictable(page):
                evictable.append(page)
            else:
                self.settle(page)
        self.queues[level][pool_group].push_all(evictable)
        if source_level != level:
            self.num_moved[level] += len(batch)
            self.bytes_moved[level] += len(batch) * sum(source_group.slot_sizes)

    def stage(self, pages: Sequence[Page], every: bool = False) -> Staged:
        """Read the bytes of those `pages` that live on a disk level (or of all of them, with
        `every`) into RAM. A failed read raises `StorageError` with nothing changed."""
        wanted = [page for page in pages if every or self.levels[page.level].tier is CacheTier.DISK]
        if not wanted:
            return _NOTHING_STAGED
        staged = Staged()
        batches: dict[tuple[int, int], list[Page]] = {}
        for page in wanted:
            batches.setdefault((page.level, page.pool_group), []).append(page)
        sizes = Counter(page.pool_group for page in wanted)
        try:
            for pool_group, count in sizes.items():
                staged.groups[pool_group] = PoolGroup(
                    self.levels[0].pool_groups[pool_group].slot_sizes,
                    count,
                    lambda pool, size: HostMemory(size),
                )
            taken = Counter[int]()
            for (level, pool_group), batch in batches.items():
                first = taken[pool_group]
                taken[pool_group] += len(batch)
                pairs = [(page.slot_id, first + i) for i, page in enumerate(batch)]
                self.copier.copy(
                    self.levels[level].pool_groups[pool_group], staged.groups[pool_group], pairs
                ).check()
                for i, page in enumerate(batch):
                    staged.slot_of[id(page)] = first + i
        except BaseException:
            staged.close()
            raise
        return staged

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
        if self.can_allocate(level, needs):
            staged = self.stage(moving)
            try:
                for pool_group, count in enumerate(needs):
                    if count:
                        self.make_room(level, pool_group, count)
                self.migrate(moving, level, staged)
            finally:
                staged.close()
            return True
        credit = Counter((page.level, page.pool_group) for page in moving)
        if not moving or not self.can_allocate(level, needs, credit):
            return False
        staged = self.stage(moving, every=True)
        homes = [page.level for page in moving]
        try:
            for page in moving:
                self._release_slot(page)
            try:
                for pool_group, count in enumerate(needs):
                    if count:
                        self.make_room(level, pool_group, count)
            except BaseException:
                for page, home in zip(moving, homes, strict=True):
                    self._place(page, [home, level], staged)
                raise
            for page, home in zip(moving, homes, strict=True):
                self._place(page, [level, home], staged)
        finally:
            staged.close()
        self.num_swapped += len(moving)
        return True

    def lift(self, pages: Sequence[Page], level: int) -> None:
        """Move as many of `pages` (colder than `level`, locked by the caller) up to `level`
        as it can take by pushing other pages down (best effort). Disk pages are read into RAM
        first, so a failed read changes nothing."""
        by_group: dict[int, list[Page]] = {}
        for page in pages:
            by_group.setdefault(page.pool_group, []).append(page)
        plans = [
            (pool_group, group_pages, self._plan_most(level, pool_group, len(group_pages), 0))
            for pool_group, group_pages in by_group.items()
        ]
        fitting = [page for _, group_pages, plan in plans for page in group_pages[: plan.free]]
        staged = self.stage(fitting)
        try:
            for pool_group, group_pages, plan in plans:
                self._execute(plan)
                room = min(plan.free, self.num_free(level, pool_group))
                self.migrate(group_pages[:room], level, staged)
        finally:
            staged.close()

    def _release_slot(self, page: Page) -> None:
        """Take a (staged) page out of its slot; `_place` gives it a new one."""
        assert page.slot is not None and not page.queued
        del self.pages[page.level][page.pool_group][page.slot_id]
        self.levels[page.level].pool_groups[page.pool_group].allocator.release(page.slot)
        page.slot = None

    def _place(self, page: Page, levels: Sequence[int], staged: Staged) -> None:
        """Write a staged page into a free slot: of the first of `levels` with one, else of any
        level, trying the next free slot when a write fails."""
        source, source_slot = staged.groups[page.pool_group], staged.slot_of[id(page)]
        failure: BaseException | None = None
        for level in dict.fromkeys([*levels, *range(len(self.levels))]):
            group = self.levels[level].pool_groups[page.pool_group]
            if not group.allocator.num_free_slots:
                continue
            slot = group.allocator.allocate()
            if slot.ready_event is not None:
                slot.ready_event.wait()
            try:
                self.copier.copy(source, group, [(source_slot, slot.slot_id)]).check()
            except StorageError as error:
                group.allocator.release(slot)
                failure = error
                continue
            page.slot, page.level = slot, level
            self.pages[level][page.pool_group][slot.slot_id] = page
            self.settle(page)
            return
        raise CorruptedError(
            f"no level could take staged {page} (last write error: {failure}): its KV is lost"
        )

    def copy_pages(
        self, pairs: Iterable[tuple[Page, Page]], staged: Staged = _NOTHING_STAGED
    ) -> None:
        """Copy each source page's bytes (from its RAM copy where `staged` has it) into its
        destination page (any levels)."""
        batches: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
        sources: dict[tuple[int, int, int], PoolGroup] = {}
        for source, destination in pairs:
            assert source.pool_group == destination.pool_group
            pool_group = source.pool_group
            if staged.has(source):
                key = (-1, destination.level, pool_group)
                sources[key] = staged.groups[pool_group]
                slot = staged.slot_of[id(source)]
            else:
                key = (source.level, destination.level, pool_group)
                sources[key] = self.levels[source.level].pool_groups[pool_group]
                slot = source.slot_id
            batches.setdefault(key, []).append((slot, destination.slot_id))
        events = [
            self.copier.copy(sources[key], self.levels[key[1]].pool_groups[key[2]], slot_pairs)
            for key, slot_pairs in batches.items()
        ]
        for event in events:
            event.check()

    # -- ownership -------------------------------------------------------------------------------

    def is_evictable(self, page: Page) -> bool:
        """Committed pages nobody owns; held pages too, except at the last level (they could
        only be dropped)."""
        if page.locks:
            return False
        if page.holds:
            return page.level != self.last_level
        return page.block is not None

    def settle(self, page: Page) -> None:
        """After a page's owners, block or level changed: free it, queue it or unqueue it."""
        if page.slot is None:
            return
        if page.locks:
            evictable = False
        elif page.holds:
            evictable = page.level != self.last_level
        elif page.block is None:
            self._free(page)
            return
        else:
            evictable = True
        if evictable:
            if not page.queued:
                self.queues[page.level][page.pool_group].push(page)
        elif page.queued:
            self.queues[page.level][page.pool_group].remove(page)

    def set_priority(self, page: Page, priority: int) -> None:
        """Change a page's eviction priority; a queued page moves to its new priority's list
        (as its newest page)."""
        if page.queued:
            queue = self.queues[page.level][page.pool_group]
            queue.remove(page)
            page.priority = priority
            queue.push(page)
        else:
            page.priority = priority

    # Owner counts change only through these; each settles the page only when its status can
    # have changed (a page with locks left stays locked whatever its holds).

    def lock(self, page: Page) -> None:
        page.locks += 1
        if page.queued:
            self.queues[page.level][page.pool_group].remove(page)

    def unlock(self, page: Page) -> None:
        assert page.locks > 0, page
        page.locks -= 1
        if not page.locks:
            self.settle(page)

    def unlock_all(self, pages: Iterable[Page]) -> None:
        """`unlock` each page, in order (the order they become evictable in)."""
        cached: list[Page] = []  # unowned now, in the tree, at the GPU level: evictable
        for page in pages:
            assert page.locks > 0, page
            page.locks -= 1
            if page.locks:
                continue
            if not page.holds and page.block is not None and not page.queued and not page.level:
                cached.append(page)
            else:
                if cached:  # keep the order
                    self._push_all(cached)
                    cached = []
                self.settle(page)
        if cached:
            self._push_all(cached)

    def _push_all(self, pages: list[Page]) -> None:
        queues = self.queues[0]
        pool_group = pages[0].pool_group
        if all(page.pool_group == pool_group for page in pages):
            queues[pool_group].push_all(pages)
        else:
            for page in pages:
                queues[page.pool_group].push(page)

    def hold(self, page: Page) -> None:
        page.holds += 1
        if not page.locks:
            self.settle(page)

    def hold_all(self, pages: Iterable[Page]) -> None:
        """`hold` each page (at the last level a held page is not evictable: it leaves its
        queue, in one batch per queue)."""
        leaving = []
        last = self._last_level
        for page in pages:
            page.holds += 1
            if page.locks:
                continue
            if page.level == last and page.queued:
                leaving.append(page)
            else:
                self.settle(page)
        self._dequeue_all(leaving)

    def lock_held(self, pages: Iterable[Page]) -> None:
        """Turn one hold of each page into a lock (a locked page is never queued)."""
        leaving = []
        for page in pages:
            assert page.holds > 0, page
            page.holds -= 1
            page.locks += 1
            if page.queued:
                leaving.append(page)
        self._dequeue_all(leaving)

    def _dequeue_all(self, pages: list[Page]) -> None:
        """Take queued pages out of their queues, one batch per queue."""
        batches: dict[EvictionQueue, list[Page]] = {}
        for page in pages:
            batches.setdefault(self.queues[page.level][page.pool_group], []).append(page)
        for queue, batch in batches.items():
            queue.remove_all(batch)

    def unhold(self, page: Page) -> None:
        assert page.holds > 0, page
        page.holds -= 1
        if not page.locks:
            self.settle(page)

    def unhold_all(self, pages: Iterable[Page]) -> None:
        for page in pages:
            self.unhold(page)

    def close(self) -> None:
        self.copier.close()
        for level in self.levels:
            level.close()
        self.levels = []
        self.allocators = []
        self.queues = []
        self.pages = []
        self._spare_pages = []

"""Planning: which pages to evict, and where to, so that a level gets free slots. Plans are made
with counts only and carried out (`Allocation.execute`) only when they succeed, so a refusal
changes nothing. Held pages (a suspended request needs them) may move down but are never dropped.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.errors import OutOfPagesError
from kvpool.records import Page
from kvpool.tiers.state import StorageState

Credit = dict[tuple[int, int], int]
"""Slots to count as free per (level, pool group) when planning (pages about to leave them)."""


class Plan:
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


class Planner:
    """Plans of cascading eviction (reads the queues and allocators, changes nothing)."""

    def __init__(self, state: StorageState) -> None:
        self._state = state

    def can_allocate(self, level: int, counts: Sequence[int], credit: Credit | None = None) -> bool:
        """Whether `counts[pg]` new slots per pool group can be made free at `level` (by
        cascading eviction), counting `credit` slots as free too."""
        return all(
            count <= self._state.num_free(level, pool_group)
            or self.plan(level, pool_group, count, count, credit) is not None
            for pool_group, count in enumerate(counts)
        )

    def plan_most(
        self, level: int, pool_group: int, want: int, at_least: int, credit: Credit | None = None
    ) -> Plan:
        """The plan freeing the most slots up to `want` at `level`, at least `at_least`, or
        `OutOfPagesError`. (`plan` already frees the most it can: where the oldest pages are
        held with no room below, `_plan_around_held` takes the ones that fit and cached pages
        further back instead.)"""
        plan = self.plan(level, pool_group, want, at_least, credit)
        if plan is None:
            raise OutOfPagesError(
                f"cannot free {at_least} slots in pool group {pool_group} at level {level}: "
                f"{self._state.num_free(level, pool_group)} free, {self._state.num_evictable(level, pool_group)} "
                "evictable, and the pages that would have to move are held with no room below"
            )
        return plan

    def plan(
        self, level: int, pool_group: int, want: int, at_least: int, credit: Credit | None = None
    ) -> Plan | None:
        """Plan freeing up to `want` (at least `at_least`) slots at `level`, or None."""
        free = self._state.num_free(level, pool_group)
        if credit:
            free += credit.get((level, pool_group), 0)
        if free >= want:
            return Plan(free=want)
        victims = self._state.queues[level][pool_group].oldest(want - free)
        if free + len(victims) < at_least:
            return None
        plan = self.plan_eviction(level, pool_group, victims, credit)
        if plan is None and level != self._state.last_level:
            plan = self._plan_around_held(level, pool_group, want - free, at_least - free, credit)
        if plan is not None:
            plan.free += free
        return plan

    def _plan_around_held(
        self, level: int, pool_group: int, want: int, at_least: int, credit: Credit | None
    ) -> Plan | None:
        """The oldest pages include held ones that the levels below cannot take (their own
        pages are held too): take, in queue order, as many held pages as the level below has
        free slots for, and drop cached pages further back instead of the others."""
        room = self._state.num_free(level + 1, pool_group)
        if credit:
            room += credit.get((level + 1, pool_group), 0)
        held: list[Page] = []
        droppable: list[Page] = []
        for page in self._state.queues[level][pool_group]:
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
        return Plan(free=len(held) + len(droppable), drops=droppable, moves=[(level, held)])

    def plan_eviction(
        self, level: int, pool_group: int, victims: list[Page], credit: Credit | None = None
    ) -> Plan | None:
        """Plan where evicted pages go: held ones must find room below, droppable ones move
        down while there is room (the most valuable first) and are dropped otherwise."""
        if level == self._state.last_level:
            # Held pages are never queued at the last level: every victim can be dropped.
            return Plan(len(victims), victims)
        held = [page for page in victims if page.holds]
        droppable = [page for page in victims if not page.holds]
        below = self.plan(level + 1, pool_group, len(victims), len(held), credit)
        if below is None:
            return None
        keep = below.free - len(held)
        moving = held + droppable[len(droppable) - keep :] if keep else held
        dropped = droppable[: len(droppable) - keep]
        return Plan(
            free=len(victims), drops=below.drops + dropped, moves=[*below.moves, (level, moving)]
        )

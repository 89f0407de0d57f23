"""SlotAllocator: hands out the slot ids of one pool group at one level (DESIGN section 3).

Fresh ids are issued sequentially, so `num_active_slots` is a high-water mark: ids below it are
occupied, recycled (free, FIFO), waiting (free, but its last use, e.g. a copy, may still run) or
overflow (free, scheduled for removal by a shrink). A shrink is
two-phase: `prepare_for_shrink(n)` stops issuing ids >= n and parks freed ones in overflow;
`finish_shrink()` succeeds once every issued id >= n is back, i.e. when
``len(overflow) == max(0, num_active_slots - n)``. The ``max(0, ...)`` lets a pool whose high-water
mark is below the new size shrink at once.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

import numpy as np

from kvpool import _debug
from kvpool.errors import ArgumentError, CorruptedError, LogicError, OutOfPagesError


class ReadyEvent(Protocol):
    """Completion of the last operation on a slot (e.g. a copy); `threading.Event` is one."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...


class Slot:
    """One allocated slot id. Before using the slot, wait on `ready_event` if it is not None.

    When releasing, set `ready_event` to the event that marks this owner's last use, so that the
    next owner waits for it.
    """

    __slots__ = ("ready_event", "released", "slot_id")

    def __init__(self, slot_id: int, ready_event: ReadyEvent | None = None) -> None:
        self.slot_id = slot_id
        self.ready_event = ready_event
        self.released = False

    def __repr__(self) -> str:
        state = " released" if self.released else ""
        return f"Slot({self.slot_id}{state})"


class SlotAllocator:
    """Slot ids [0, capacity) of one pool group at one level, with scheduled shrink and expand."""

    def __init__(self, capacity: int) -> None:
        _check_int("capacity", capacity, 0, None)
        self._capacity = capacity
        self._target = capacity
        self._num_active = 0
        self._recycled: deque[int] = deque()
        self._waiting: deque[int] = deque()
        self._overflow: list[int] = []
        self._occupied = bytearray(capacity)
        self._num_occupied = 0
        # Ready events of free ids (waiting or overflow) whose last use may still be running.
        self._pending: dict[int, ReadyEvent] = {}

    # -- queries ---------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def target_capacity(self) -> int:
        """The capacity a scheduled shrink will leave; equal to `capacity` when none is scheduled."""
        return self._target

    @property
    def num_active_slots(self) -> int:
        """High-water mark: ids below it have been handed out at least once."""
        return self._num_active

    @property
    def num_free_slots(self) -> int:
        """Slots `allocate()` can hand out now (ids below the target capacity)."""
        return len(self._recycled) + len(self._waiting) + max(self._target - self._num_active, 0)

    @property
    def num_occupied_slots(self) -> int:
        return self._num_occupied

    @property
    def num_overflow_slots(self) -> int:
        """Free ids at or above the target capacity, waiting for `finish_shrink()`."""
        return len(self._overflow)

    @property
    def shrink_in_progress(self) -> bool:
        return self._target < self._capacity

    def is_occupied(self, slot_id: int) -> bool:
        return 0 <= slot_id < self._capacity and self._occupied[slot_id] == 1

    def get_slots_blocking_shrink(self) -> list[int]:
        """Occupied ids at or above the target capacity: they must be released (or their pages
        moved) before `finish_shrink()` can succeed."""
        return self.occupied_at_or_above(self._target)

    def occupied_at_or_above(self, first: int) -> list[int]:
        """Occupied ids >= `first`, ascending."""
        end = min(self._capacity, self._num_active)
        if first >= end:
            return []
        start = max(first, 0)
        occupied = np.frombuffer(self._occupied, dtype=np.uint8, count=end - start, offset=start)
        return [start + int(i) for i in np.flatnonzero(occupied)]

    # -- allocation ------------------------------------------------------------------------------

    def allocate(self) -> Slot:
        """One free slot: a ready recycled id, else a fresh id, else a waiting id whose
        `ready_event` the caller must wait on. Raises `OutOfPagesError` when none is free."""
        waiting = self._waiting
        while waiting and self._pending[waiting[0]].is_set():
            del self._pending[waiting[0]]
            self._recycled.append(waiting.popleft())
        if self._recycled:
            slot_id = self._recycled.popleft()
        elif self._num_active < self._target:
            slot_id = self._num_active
            self._num_active += 1
        elif waiting:
            slot_id = waiting.popleft()
        else:
            raise OutOfPagesError(
                f"no free slot: all {self._target} slots below the target capacity are occupied"
            )
        self._occupied[slot_id] = 1
        self._num_occupied += 1
        slot = Slot(slot_id, self._pending.pop(slot_id, None))
        if _debug.DEBUG:
            self.check_invariants()
        return slot

    def allocate_multiple(self, count: int) -> list[Slot]:
        """`count` slots, or `OutOfPagesError` and nothing allocated."""
        _check_int("count", count, 0, None)
        if count > self.num_free_slots:
            raise OutOfPagesError(f"need {count} free slots, only {self.num_free_slots} are free")
        return [self.allocate() for _ in range(count)]

    def release(self, slot: Slot, ready_event: ReadyEvent | None = None) -> None:
        """Return a slot. `ready_event` (or `slot.ready_event`) marks when its last use is done."""
        slot_id = slot.slot_id
        if slot.released:
            raise LogicError(f"slot {slot_id} was already released")
        if not self.is_occupied(slot_id):
            raise LogicError(f"slot {slot_id} is not occupied (capacity {self._capacity})")
        self._occupied[slot_id] = 0
        self._num_occupied -= 1
        slot.released = True
        event = ready_event if ready_event is not None else slot.ready_event
        in_use = False
        if event is not None and not event.is_set():
            self._pending[slot_id] = event
            in_use = True
        if slot_id >= self._target:
            self._overflow.append(slot_id)
        elif in_use:
            self._waiting.append(slot_id)
        else:
            self._recycled.append(slot_id)
        if _debug.DEBUG:
            self.check_invariants()

    def release_multiple(self, slots: list[Slot]) -> None:
        """`release` each slot."""
        for slot in slots:
            self.release(slot)

    # -- resizing --------------------------------------------------------------------------------

    def prepare_for_shrink(self, new_capacity: int) -> None:
        """Schedule a shrink to `new_capacity`: ids >= it are no longer issued, and free ones
        (now or when released) wait in overflow."""
        if self.shrink_in_progress:
            raise LogicError(f"a shrink to {self._target} is already in progress")
        _check_int("new_capacity", new_capacity, 0, self._capacity - 1)
        for name in ("_recycled", "_waiting"):
            kept: deque[int] = deque()
            for slot_id in getattr(self, name):
                (kept if slot_id < new_capacity else self._overflow).append(slot_id)
            setattr(self, name, kept)
        self._target = new_capacity
        if _debug.DEBUG:
            self.check_invariants()

    def finish_shrink(self) -> bool:
        """Complete the scheduled shrink; returns True. Refused with `LogicError` (nothing
        changed) while an id at or above the target capacity is still occupied."""
        if not self.shrink_in_progress:
            raise LogicError("finish_shrink() without prepare_for_shrink()")
        if len(self._overflow) != max(0, self._num_active - self._target):
            blocking = self.get_slots_blocking_shrink()
            shown = ", ".join(map(str, blocking[:8])) + (", ..." if len(blocking) > 8 else "")
            raise LogicError(
                f"cannot finish shrink to {self._target}: {len(blocking)} slot(s) at or above it "
                f"are still occupied ({shown}); release them first"
            )
        for slot_id in self._overflow:
            event = self._pending.pop(slot_id, None)
            if event is not None:
                event.wait()
        self._overflow.clear()
        self._capacity = self._target
        self._num_active = min(self._num_active, self._capacity)
        del self._occupied[self._capacity :]
        if _debug.DEBUG:
            self.check_invariants()
        return True

    def cancel_shrink(self) -> None:
        """Abandon the scheduled shrink: overflow ids become free again."""
        if not self.shrink_in_progress:
            raise LogicError("cancel_shrink() without prepare_for_shrink()")
        for slot_id in self._overflow:
            (self._waiting if slot_id in self._pending else self._recycled).append(slot_id)
        self._overflow.clear()
        self._target = self._capacity
        if _debug.DEBUG:
            self.check_invariants()

    def expand(self, new_capacity: int) -> None:
        """Grow to `new_capacity` slots (no shrink may be in progress)."""
        if self.shrink_in_progress:
            raise LogicError(f"cannot expand while a shrink to {self._target} is in progress")
        _check_int("new_capacity", new_capacity, self._capacity + 1, None)
        self._occupied.extend(bytes(new_capacity - self._capacity))
        self._capacity = self._target = new_capacity
        if _debug.DEBUG:
            self.check_invariants()

    # -- consistency -----------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise `CorruptedError` if the bookkeeping is inconsistent (O(capacity), numpy)."""
        capacity, target, active = self._capacity, self._target, self._num_active
        problems = []
        if not 0 <= target <= capacity or not 0 <= active <= capacity:
            problems.append(f"target {target}, active {active}, capacity {capacity}")
        if len(self._occupied) != capacity:
            problems.append(f"occupied map has {len(self._occupied)} entries")
        occupied = np.frombuffer(self._occupied, dtype=np.uint8)
        if int(np.count_nonzero(occupied)) != self._num_occupied:
            problems.append(
                f"occupied count {self._num_occupied} != map {np.count_nonzero(occupied)}"
            )
        if occupied[active:].any():
            problems.append("an id at or above the high-water mark is occupied")
        recycled = np.array([*self._recycled, *self._waiting], dtype=np.int64)
        overflow = np.array(self._overflow, dtype=np.int64)
        if recycled.size and (recycled.min() < 0 or recycled.max() >= min(target, active)):
            problems.append("a recycled or waiting id is outside [0, min(target, high-water))")
        if overflow.size and (overflow.min() < target or overflow.max() >= min(capacity, active)):
            problems.append("an overflow id is outside [target, min(capacity, high-water))")
        free = np.concatenate([recycled, overflow])
        if np.unique(free).size != free.size:
            problems.append("an id is free twice")
        elif free.size and occupied[free[free < capacity]].any():
            problems.append("an id is both free and occupied")
        if recycled.size + overflow.size + self._num_occupied != active:
            problems.append(
                f"recycled+waiting {recycled.size} + overflow {overflow.size} + occupied "
                f"{self._num_occupied} != high-water mark {active}"
            )
        if any(slot_id not in self._pending for slot_id in self._waiting):
            problems.append("a waiting id has no ready event")
        if any(self.is_occupied(slot_id) for slot_id in self._pending):
            problems.append("an occupied id has a pending release event")
        if problems:
            raise CorruptedError("SlotAllocator: " + "; ".join(problems))


def _check_int(name: str, value: object, low: int, high: int | None) -> None:
    """Raise `ArgumentError` unless `value` is an int in [low, high] (no upper bound if None)."""
    if (
        isinstance(value, int)
        and not isinstance(value, bool)
        and value >= low
        and (high is None or value <= high)
    ):
        return
    if high is None:
        allowed = f"an integer >= {low}"
    elif high < low:
        allowed = "an integer in an empty range (no value is valid in the current state)"
    else:
        allowed = f"an integer in [{low}, {high}]"
    raise ArgumentError(f"{name}={value!r} is invalid: must be {allowed}")

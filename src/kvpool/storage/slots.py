"""SlotAllocator: hands out the slot ids of one pool group at one level (docs/architecture.md).

Fresh ids are issued sequentially, so `num_active_slots` is a high-water mark: ids below it are
occupied, recycled (free, FIFO) or overflow (free, scheduled for removal by a shrink). Which id
is handed out depends only on the sequence of calls, never on timing: a freed id whose last use
(a copy) may still run is recycled like any other, carrying its `ready_event` for the next owner
to wait on. Replicated managers (one per tensor-parallel rank) therefore hand out the same ids.
A shrink is
two-phase: `prepare_for_shrink(n)` stops issuing ids >= n and parks freed ones in overflow;
`finish_shrink()` succeeds once every issued id >= n is back, i.e. when
``len(overflow) == max(0, num_active_slots - n)``. The ``max(0, ...)`` lets a pool whose high-water
mark is below the new size shrink at once.

Each id has one `Slot` object for the allocator's life, made when the id is first issued (a
large, little-used level costs no memory per slot; the manager makes its first level's up front,
`make_handles`) and handed out again on every allocation: no
object per allocation, as the engine's hot loop allocates and frees thousands per second. So a
double release is caught, but a handle kept after its release is the next owner's handle too:
owners must drop it when they release (pages do).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, NoReturn, Protocol, SupportsIndex, cast

import numpy as np

from kvpool import _debug
from kvpool.errors import ArgumentError, CorruptedError, LogicError, OutOfPagesError
from kvpool.validation import check_int

COMPACT_AFTER: Final = 256  # handed-out recycled handles kept before the list is cut (see `_head`)


class ReadyEvent(Protocol):
    """Completion of the last operation on a slot (e.g. a copy); `threading.Event` is one."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...


def wait_before(event: ReadyEvent | None, on_device: bool) -> None:
    """Before the next use of a slot: wait for `event` unless that use is ordered after it on
    the GPU already (`on_device`: the next user is the engine's kernels or a copy on the copy
    stream, and the event is a copy on the copy stream, which the engine's stream waits for)."""
    if event is None or (on_device and getattr(event, "on_device", False)) or event.is_set():
        return
    event.wait()


class Slot:
    """The handle of one slot id. Before using the slot, wait on `ready_event` if it is not None.

    When releasing, set `ready_event` to the event that marks this owner's last use, so that the
    next owner waits for it. `released` is nonzero while the id is free (the serial of the
    release that freed it; 1 before its first allocation) and 0 while it is occupied.
    """

    __slots__ = ("ready_event", "released", "slot_id")

    def __init__(self, slot_id: int, ready_event: ReadyEvent | None = None) -> None:
        self.slot_id = slot_id
        self.ready_event = ready_event
        self.released = 1  # free until allocated

    def __repr__(self) -> str:
        state = " released" if self.released else ""
        return f"Slot({self.slot_id}{state})"


class SlotAllocator:
    """Slot ids [0, capacity) of one pool group at one level, with scheduled shrink and expand."""

    def __init__(self, capacity: SupportsIndex) -> None:
        capacity = check_int("capacity", capacity, 0)
        self._capacity = capacity
        self._checks = _debug.DEBUG  # (read once: a field per call, not a module lookup)
        self._target = capacity
        self._num_active = 0
        # Free slots, as their handles: recycled (FIFO: `_recycled[_head:]`, the longest free
        # first; taking a slice and cutting off the taken part now and then is several times
        # cheaper than popping handles one by one) and overflow (at or above the target
        # capacity of a shrink).
        self._recycled: list[Slot] = []
        self._head = 0
        self._overflow: list[Slot] = []
        # The handle of each id below the high-water mark (and above it, of ids never handed
        # out, where `make_handles` made them up front).
        self._slots: list[Slot] = []
        self._num_occupied = 0
        self._serial = 1  # of the last `release_multiple` call, its mark (above a new slot's 1)

    def make_handles(self, count: int) -> None:
        """Make the handles of ids below `count` now rather than at their first allocation (for
        a level every id of which will be used: no object made in the hot loop)."""
        if len(self._slots) < count:
            self._slots += map(Slot, range(len(self._slots), count))

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
        return len(self._recycled) - self._head + max(self._target - self._num_active, 0)

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
        return 0 <= slot_id < self._num_active and not self._slots[slot_id].released

    def get_slots_blocking_shrink(self) -> list[int]:
        """Occupied ids at or above the target capacity: they must be released (or their pages
        moved) before `finish_shrink()` can succeed."""
        return self.occupied_at_or_above(self._target)

    def occupied_at_or_above(self, first: int) -> list[int]:
        """Occupied ids >= `first`, ascending."""
        slots = self._slots[max(first, 0) : self._num_active]
        return [slot.slot_id for slot in slots if not slot.released]

    # -- allocation ------------------------------------------------------------------------------

    def allocate(self) -> Slot:
        """One free slot: the longest-free recycled id, else a fresh id. Wait on its
        `ready_event` (if not None) before using it. `OutOfPagesError` when none is free."""
        if not self.num_free_slots:
            raise OutOfPagesError(
                f"no free slot: all {self._target} slots below the target capacity are occupied"
            )
        return self.allocate_multiple(1)[0]

    def allocate_multiple(self, count: SupportsIndex) -> list[Slot]:
        """`count` slots, in `allocate()` order, or `OutOfPagesError` and nothing allocated."""
        if type(count) is not int or count < 0:
            count = check_int("count", count, 0)
        recycled, head = self._recycled, self._head
        available = len(recycled) - head
        if count > available and count - available > self._target - self._num_active:  # > free
            raise OutOfPagesError(f"need {count} free slots, only {self.num_free_slots} are free")
        if count < available:
            end = head + count
            taken = recycled[head:end]
            if end >= COMPACT_AFTER and 2 * end >= len(recycled):  # amortized O(1) per slot
                del recycled[:end]
                end = 0
            self._head = end
        else:  # every recycled id, then fresh ones
            if head:
                taken = recycled[head:]
                recycled.clear()
            else:  # (the list itself: no copy)
                taken, self._recycled = recycled, []
            self._head = 0
            if count > available:
                fresh = count - available
                first = self._num_active
                if len(self._slots) < first + fresh:
                    self._slots += map(Slot, range(len(self._slots), first + fresh))
                taken += self._slots[first : first + fresh]
                self._num_active += fresh
        for slot in taken:
            slot.released = 0
        self._num_occupied += count
        if self._checks:
            self.check_invariants()
        return taken

    def release(self, slot: object, ready_event: ReadyEvent | None = None) -> None:
        """Return a slot. `ready_event` (or `slot.ready_event`) marks when its last use is done."""
        self.release_multiple((slot,), ready_event)

    def release_multiple(
        self, slots: Sequence[object], ready_event: ReadyEvent | None = None
    ) -> None:
        """`release` each slot; all or nothing (a bad slot raises before any is released)."""
        own = self._slots
        waiting: list[Slot] = []  # the slots with a ready event (few: most copies are done)
        # Each slot is checked and marked in one pass (a slot given twice is found marked; an
        # id beyond the handles raises IndexError). The mark is this call's serial, so that a
        # refusal can unmark exactly the slots it marked: nothing is released then.
        mark = self._serial = self._serial + 1
        try:
            for item in slots:
                slot = cast(Slot, item)  # (a stranger raises TypeError or AttributeError)
                if slot.released or own[slot.slot_id] is not slot:
                    self._unmark(slots, mark)
                    self._refuse_release(slot, slots)
                slot.released = mark
                if slot.ready_event is not None:
                    waiting.append(slot)
        except (AttributeError, IndexError, TypeError):  # not a handle of this allocator
            self._unmark(slots, mark)
            self._refuse_release(next(s for s in slots if not self._is_own(s)), slots)
        handles = cast(Sequence[Slot], slots)  # (every one checked)
        # File each id as recycled or overflow, in order: whether its last use is done changes
        # only whether the next owner has an event to wait on, never which id it gets.
        target, recycled = self._target, self._recycled
        if ready_event is None and self._num_active <= target:  # usual: every id is recycled
            for slot in waiting:
                event = slot.ready_event
                if event is not None and event.is_set():
                    slot.ready_event = None
            recycled.extend(handles)
        else:
            for slot in handles:
                if ready_event is not None:
                    slot.ready_event = ready_event
                event = slot.ready_event
                if event is not None and event.is_set():
                    slot.ready_event = None
                (self._overflow if slot.slot_id >= target else recycled).append(slot)
        self._num_occupied -= len(slots)
        if self._checks:
            self.check_invariants()

    def _unmark(self, slots: Sequence[object], mark: int) -> None:
        """Undo a refused `release_multiple`'s marks."""
        for slot in slots:
            if isinstance(slot, Slot) and self._is_own(slot) and slot.released == mark:
                slot.released = 0

    def _is_own(self, slot: object) -> bool:
        """`slot` is one of this allocator's handles."""
        if not isinstance(slot, Slot):
            return False
        slot_id = slot.slot_id
        return (
            type(slot_id) is int
            and 0 <= slot_id < len(self._slots)
            and self._slots[slot_id] is slot
        )

    def _refuse_release(self, slot: object, slots: Sequence[object]) -> NoReturn:
        if not isinstance(slot, Slot):
            raise ArgumentError(f"slot={slot!r} is invalid: must be a Slot of this allocator")
        if not self._is_own(slot):
            raise LogicError(
                f"{slot!r} is not a slot of this allocator (capacity {self._capacity})"
            )
        if sum(other is slot for other in slots) > 1:
            raise LogicError(f"slot {slot.slot_id} is given twice")
        raise LogicError(f"slot {slot.slot_id} was already released")

    # -- resizing --------------------------------------------------------------------------------

    def prepare_for_shrink(self, new_capacity: SupportsIndex) -> None:
        """Schedule a shrink to `new_capacity`: ids >= it are no longer issued, and free ones
        (now or when released) wait in overflow."""
        if self.shrink_in_progress:
            raise LogicError(f"a shrink to {self._target} is already in progress")
        new_capacity = check_int("new_capacity", new_capacity, 0, self._capacity - 1)
        kept: list[Slot] = []
        for slot in self._recycled[self._head :]:
            (kept if slot.slot_id < new_capacity else self._overflow).append(slot)
        self._recycled, self._head = kept, 0
        self._target = new_capacity
        if self._checks:
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
        for slot in self._overflow:
            if slot.ready_event is not None:
                slot.ready_event.wait()
        self._overflow.clear()
        self._capacity = self._target
        self._num_active = min(self._num_active, self._capacity)
        del self._slots[self._capacity :]
        if self._checks:
            self.check_invariants()
        return True

    def cancel_shrink(self) -> None:
        """Abandon the scheduled shrink: overflow ids become free again."""
        if not self.shrink_in_progress:
            raise LogicError("cancel_shrink() without prepare_for_shrink()")
        self._recycled.extend(self._overflow)
        self._overflow.clear()
        self._target = self._capacity
        if self._checks:
            self.check_invariants()

    def expand(self, new_capacity: SupportsIndex) -> None:
        """Grow to `new_capacity` slots (no shrink may be in progress)."""
        if self.shrink_in_progress:
            raise LogicError(f"cannot expand while a shrink to {self._target} is in progress")
        new_capacity = check_int("new_capacity", new_capacity, self._capacity + 1)
        self._capacity = self._target = new_capacity
        if self._checks:
            self.check_invariants()

    # -- consistency -----------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise `CorruptedError` if the bookkeeping is inconsistent (O(high-water mark))."""
        capacity, target, active = self._capacity, self._target, self._num_active
        problems = []
        if not 0 <= target <= capacity or not 0 <= active <= capacity:
            problems.append(f"target {target}, active {active}, capacity {capacity}")
        handles = len(self._slots)
        if not active <= handles <= max(capacity, active):
            problems.append(
                f"{handles} slot handles for a high-water mark of {active} and a capacity of "
                f"{capacity}"
            )
        if any(slot.slot_id != i for i, slot in enumerate(self._slots)):
            problems.append("a slot handle has the wrong id")
        if any(not slot.released for slot in self._slots[active:]):
            problems.append("a handle above the high-water mark is occupied")
        slots = self._slots[:active]  # ids above it were never handed out
        occupied = np.fromiter((not slot.released for slot in slots), dtype=bool, count=len(slots))
        if int(np.count_nonzero(occupied)) != self._num_occupied:
            problems.append(
                f"occupied count {self._num_occupied} != handles {np.count_nonzero(occupied)}"
            )
        free_recycled = self._recycled[self._head :]
        recycled = np.array([slot.slot_id for slot in free_recycled], dtype=np.int64)
        overflow = np.array([slot.slot_id for slot in self._overflow], dtype=np.int64)
        if recycled.size and (recycled.min() < 0 or recycled.max() >= min(target, active)):
            problems.append("a recycled id is outside [0, min(target, high-water))")
        if overflow.size and (overflow.min() < target or overflow.max() >= min(capacity, active)):
            problems.append("an overflow id is outside [target, min(capacity, high-water))")
        free = np.concatenate([recycled, overflow])
        if np.unique(free).size != free.size:
            problems.append("an id is free twice")
        elif free.size and free.max() < len(slots) and occupied[free].any():
            problems.append("an id is both free and occupied")
        if recycled.size + overflow.size + self._num_occupied != active:
            problems.append(
                f"recycled {recycled.size} + overflow {overflow.size} + occupied "
                f"{self._num_occupied} != high-water mark {active}"
            )
        if problems:
            raise CorruptedError("SlotAllocator: " + "; ".join(problems))

"""SlotAllocator: allocation, release, scheduled shrink and expand (DESIGN sections 3-4)."""

import random
import threading
from collections import deque

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool import _debug
from kvpool.errors import ArgumentError, CorruptedError, LogicError, OutOfPagesError
from kvpool.storage import SlotAllocator
from kvpool.storage import slots as slots_module


def test_debug_checks_are_on():
    assert _debug.DEBUG, "tests must run with KVPOOL_DEBUG=1"


def test_shrink_underused_pool():
    """NVBug 6225866: a pool whose high-water mark is below the new size shrinks at once."""
    allocator = SlotAllocator(184064)
    slots = allocator.allocate_multiple(2048)
    assert [s.slot_id for s in slots] == list(range(2048))
    for slot in slots:
        allocator.release(slot)
    assert allocator.num_active_slots == 2048
    allocator.prepare_for_shrink(122624)
    assert allocator.num_overflow_slots == 0
    assert allocator.finish_shrink() is True
    assert allocator.capacity == 122624
    assert allocator.num_active_slots == 2048
    assert not allocator.shrink_in_progress


def test_shrink_touched_pool():
    """The migration path: every freed id above the new size goes to overflow first."""
    allocator = SlotAllocator(16)
    slots = allocator.allocate_multiple(16)
    for slot in slots[8:]:
        allocator.release(slot)
    allocator.prepare_for_shrink(8)
    assert allocator.num_overflow_slots == 8
    assert allocator.finish_shrink() is True
    assert allocator.capacity == 8
    assert allocator.num_active_slots == 8
    for slot in slots[:8]:
        allocator.release(slot)
    assert allocator.num_free_slots == 8
    assert allocator.num_occupied_slots == 0
    allocator.check_invariants()


def test_finish_shrink_refused_while_removed_range_is_occupied():
    allocator = SlotAllocator(8)
    slots = allocator.allocate_multiple(8)
    allocator.release(slots[1])
    allocator.prepare_for_shrink(4)
    with pytest.raises(LogicError, match=r"2 slot\(s\).*\(5, 7\)") as refused:
        allocator.release(slots[4])
        allocator.release(slots[6])
        allocator.finish_shrink()
    assert "release them first" in str(refused.value)
    # Refusal changed nothing: still shrinking, same capacity, same overflow.
    assert allocator.shrink_in_progress
    assert allocator.capacity == 8
    assert allocator.num_overflow_slots == 2
    assert allocator.get_slots_blocking_shrink() == [5, 7]
    # Ids above the target are no longer issued: only the freed id 1 is left.
    assert allocator.allocate().slot_id == 1
    with pytest.raises(OutOfPagesError):
        allocator.allocate()
    allocator.release(slots[5])
    allocator.release(slots[7])
    assert allocator.num_overflow_slots == 4
    assert allocator.finish_shrink() is True
    assert allocator.capacity == 4
    assert allocator.num_active_slots == 4
    assert allocator.num_occupied_slots == 4


@pytest.mark.parametrize("high_water", [3, 5, 8])
def test_shrink_with_high_water_below_equal_above_new_size(high_water):
    allocator = SlotAllocator(10)
    for slot in allocator.allocate_multiple(high_water):
        allocator.release(slot)
    allocator.prepare_for_shrink(5)
    assert allocator.num_overflow_slots == max(0, high_water - 5)
    assert allocator.finish_shrink()
    assert (allocator.capacity, allocator.num_active_slots) == (5, min(high_water, 5))
    assert allocator.num_free_slots == 5
    assert sorted(s.slot_id for s in allocator.allocate_multiple(5)) == [0, 1, 2, 3, 4]


def test_shrink_to_zero():
    allocator = SlotAllocator(4)
    for slot in allocator.allocate_multiple(4):
        allocator.release(slot)
    allocator.prepare_for_shrink(0)
    assert allocator.num_free_slots == 0
    assert allocator.finish_shrink()
    assert (allocator.capacity, allocator.num_active_slots, allocator.num_free_slots) == (0, 0, 0)
    with pytest.raises(OutOfPagesError):
        allocator.allocate()
    allocator.expand(2)
    assert [s.slot_id for s in allocator.allocate_multiple(2)] == [0, 1]


def test_expand_after_shrink_issues_fresh_ids():
    allocator = SlotAllocator(6)
    slots = allocator.allocate_multiple(6)
    for slot in slots[3:]:
        allocator.release(slot)
    allocator.prepare_for_shrink(3)
    allocator.finish_shrink()
    allocator.expand(5)
    assert (allocator.capacity, allocator.target_capacity, allocator.num_free_slots) == (5, 5, 2)
    assert [s.slot_id for s in allocator.allocate_multiple(2)] == [3, 4]
    with pytest.raises(OutOfPagesError):
        allocator.allocate()


def test_repeated_shrink_expand_cycles_keep_held_slots():
    allocator = SlotAllocator(32)
    held = {s.slot_id: s for s in allocator.allocate_multiple(4)}
    for cycle in range(20):
        extra = allocator.allocate_multiple(allocator.num_free_slots)
        for slot in extra:
            allocator.release(slot)
        allocator.prepare_for_shrink(4 + cycle % 3)
        allocator.finish_shrink()
        allocator.expand(32 + cycle)
        assert allocator.num_occupied_slots == 4
        assert all(allocator.is_occupied(i) for i in held)
    assert allocator.num_free_slots == allocator.capacity - 4


def test_release_of_overflow_range_id_during_shrink():
    allocator = SlotAllocator(4)
    slots = allocator.allocate_multiple(4)
    allocator.prepare_for_shrink(2)
    allocator.release(slots[3])
    assert allocator.num_overflow_slots == 1
    assert allocator.num_free_slots == 0
    allocator.release(slots[0])
    assert allocator.num_free_slots == 1
    assert allocator.allocate().slot_id == 0


def test_cancel_shrink_frees_overflow_again():
    allocator = SlotAllocator(4)
    slots = allocator.allocate_multiple(4)
    allocator.release(slots[3])
    allocator.prepare_for_shrink(2)
    assert allocator.num_free_slots == 0
    allocator.cancel_shrink()
    assert not allocator.shrink_in_progress
    assert allocator.allocate().slot_id == 3


def test_double_release_names_the_slot():
    allocator = SlotAllocator(4)
    slot = allocator.allocate()
    allocator.release(slot)
    with pytest.raises(LogicError, match="slot 0 was already released"):
        allocator.release(slot)
    # One handle per id for the allocator's life: no object is made per allocation.
    again = allocator.allocate()
    assert again is slot and not again.released
    assert allocator.num_free_slots == 3


def test_release_multiple_is_all_or_nothing():
    allocator = SlotAllocator(8)
    slots = allocator.allocate_multiple(4)
    with pytest.raises(LogicError, match="slot 2 is given twice"):
        allocator.release_multiple([slots[0], slots[2], slots[2]])
    with pytest.raises(LogicError, match="not a slot of this allocator"):
        allocator.release_multiple([slots[1], SlotAllocator(8).allocate()])
    # Failing on an object that is no handle (AttributeError inside) or on an id beyond the
    # handles (IndexError) after marking some: the marks are undone too.
    with pytest.raises(ArgumentError, match="must be a Slot of this allocator"):
        allocator.release_multiple([slots[3], slots[1], "slot 2"])
    with pytest.raises(LogicError, match=r"Slot\(40\) is not a slot of this allocator"):
        allocator.release_multiple([slots[0], SlotAllocator(64).allocate_multiple(41)[-1]])
    assert allocator.num_occupied_slots == 4
    assert not any(slot.released for slot in slots)
    allocator.release_multiple(slots)
    assert allocator.num_free_slots == 8
    allocator.check_invariants()


def test_release_of_a_foreign_slot_names_it():
    allocator = SlotAllocator(4)
    foreign = SlotAllocator(8).allocate_multiple(6)[-1]
    with pytest.raises(LogicError, match=r"Slot\(5\) is not a slot of this allocator"):
        allocator.release(foreign)


def test_allocate_with_no_free_slot_raises_out_of_pages():
    allocator = SlotAllocator(2)
    allocator.allocate_multiple(2)
    with pytest.raises(OutOfPagesError, match="no free slot"):
        allocator.allocate()


def test_allocate_multiple_is_all_or_none():
    allocator = SlotAllocator(5)
    allocator.allocate_multiple(2)
    with pytest.raises(OutOfPagesError, match="need 4 free slots, only 3"):
        allocator.allocate_multiple(4)
    assert allocator.num_occupied_slots == 2
    assert allocator.num_free_slots == 3
    assert len(allocator.allocate_multiple(3)) == 3


def test_recycled_ids_are_reused_first_in_fifo_order():
    allocator = SlotAllocator(8)
    slots = allocator.allocate_multiple(4)
    allocator.release(slots[2])
    allocator.release(slots[0])
    assert [allocator.allocate().slot_id for _ in range(3)] == [2, 0, 4]


def test_fifo_order_holds_across_the_recycled_lists_compaction():
    """The recycled handles are a list read from a head index and cut now and then: ids come
    back in release order across the cuts, and the list stays bounded."""
    rng = random.Random(5)
    allocator = SlotAllocator(4000)
    held = allocator.allocate_multiple(3000)
    model: deque[int] = deque()  # free recycled ids, longest free first
    compactions = 0
    for _ in range(3000):
        rng.shuffle(held)
        if held and rng.random() < 0.5:
            count = rng.randint(1, min(40, len(held)))
            going, held = held[:count], held[count:]
            allocator.release_multiple(going)
            model.extend(slot.slot_id for slot in going)
        count = rng.randint(0, min(30, len(model)))
        head_before = allocator._head
        taken = allocator.allocate_multiple(count)
        assert [slot.slot_id for slot in taken] == [model.popleft() for _ in range(count)]
        compactions += allocator._head < head_before and bool(model)  # (not: took them all)
        held += taken
        assert len(allocator._recycled) <= 2 * len(model) + slots_module.COMPACT_AFTER + 40
        assert allocator.num_free_slots == len(model) + 1000
    assert compactions > 10  # (the cut really happened)
    allocator.check_invariants()


def test_hand_out_order_does_not_depend_on_copy_timing():
    """Two allocators given the same calls hand out the same ids whenever copies finish:
    a slot whose copy still runs is recycled in turn, with its event for the next owner."""
    handed = []
    for finished in (False, True):
        allocator = SlotAllocator(3)
        a, b = allocator.allocate_multiple(2)
        copy_done = threading.Event()
        if finished:
            copy_done.set()
        allocator.release(a, ready_event=copy_done)
        allocator.release(b)
        first = allocator.allocate()
        assert first.slot_id == a.slot_id
        assert first.ready_event is (None if finished else copy_done)
        handed.append([first.slot_id] + [allocator.allocate().slot_id for _ in range(2)])
        allocator.check_invariants()
    assert handed[0] == handed[1] == [0, 1, 2]


def test_finish_shrink_waits_for_overflow_events():
    allocator = SlotAllocator(2)
    low, high = allocator.allocate_multiple(2)
    event = threading.Event()
    allocator.release(high, ready_event=event)
    allocator.prepare_for_shrink(1)
    threading.Timer(0.05, event.set).start()
    assert allocator.finish_shrink()
    assert event.is_set()
    allocator.release(low)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda a: a.prepare_for_shrink(8),
            r"new_capacity=8 is invalid: must be an integer in \[0, 7\]",
        ),
        (lambda a: a.prepare_for_shrink(-1), r"new_capacity=-1 is invalid"),
        (lambda a: a.expand(8), r"new_capacity=8 is invalid: must be an integer >= 9"),
        (lambda a: a.allocate_multiple(-2), r"count=-2 is invalid: must be an integer >= 0"),
        (lambda a: a.expand(True), r"new_capacity=True is invalid"),
    ],
)
def test_bad_arguments_name_the_argument_and_change_nothing(call, message):
    allocator = SlotAllocator(8)
    allocator.allocate_multiple(3)
    with pytest.raises(ArgumentError, match=message):
        call(allocator)
    assert (allocator.capacity, allocator.target_capacity, allocator.num_free_slots) == (8, 8, 5)


def test_state_errors():
    with pytest.raises(ArgumentError, match="capacity=-1"):
        SlotAllocator(-1)
    allocator = SlotAllocator(4)
    with pytest.raises(LogicError, match="without prepare_for_shrink"):
        allocator.finish_shrink()
    allocator.prepare_for_shrink(2)
    with pytest.raises(LogicError, match="already in progress"):
        allocator.prepare_for_shrink(1)
    with pytest.raises(LogicError, match="while a shrink"):
        allocator.expand(10)


class AllocatorModel(RuleBasedStateMachine):
    """Random allocate/release/shrink/expand against a set-based model."""

    def __init__(self):
        super().__init__()
        self.allocator = SlotAllocator(12)
        self.capacity = 12
        self.target = 12
        self.held = {}  # slot id -> Slot
        self.ever_issued = set()

    def _model_free(self):
        ever = {i for i in self.ever_issued if i < self.capacity}
        fresh = max(0, self.target - max(ever, default=-1) - 1) if ever else self.target
        recycled = {i for i in ever if i < self.target and i not in self.held}
        return len(recycled) + fresh

    @rule()
    def allocate(self):
        if self.allocator.num_free_slots == 0:
            try:
                self.allocator.allocate()
            except OutOfPagesError:
                return
            raise AssertionError("allocate succeeded with no free slot")
        slot = self.allocator.allocate()
        assert slot.slot_id not in self.held, f"id {slot.slot_id} handed out twice"
        assert 0 <= slot.slot_id < self.target
        self.held[slot.slot_id] = slot
        self.ever_issued.add(slot.slot_id)

    @rule(count=st.integers(0, 6))
    def allocate_multiple(self, count):
        free = self.allocator.num_free_slots
        if count > free:
            try:
                self.allocator.allocate_multiple(count)
            except OutOfPagesError:
                assert self.allocator.num_free_slots == free
                return
            raise AssertionError("allocate_multiple over-allocated")
        for slot in self.allocator.allocate_multiple(count):
            assert slot.slot_id not in self.held
            self.held[slot.slot_id] = slot
            self.ever_issued.add(slot.slot_id)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data):
        slot_id = data.draw(st.sampled_from(sorted(self.held)))
        self.allocator.release(self.held.pop(slot_id))

    @precondition(lambda self: self.target == self.capacity and self.capacity > 0)
    @rule(data=st.data())
    def prepare_for_shrink(self, data):
        n = data.draw(st.integers(0, self.capacity - 1))
        self.allocator.prepare_for_shrink(n)
        self.target = n

    @precondition(lambda self: self.target < self.capacity)
    @rule()
    def finish_shrink(self):
        blocking = sorted(i for i in self.held if i >= self.target)
        if blocking:
            try:
                self.allocator.finish_shrink()
            except LogicError:
                assert self.allocator.get_slots_blocking_shrink() == blocking
                return
            raise AssertionError("finish_shrink succeeded with occupied ids above the target")
        assert self.allocator.finish_shrink()
        self.capacity = self.target
        self.ever_issued = {i for i in self.ever_issued if i < self.capacity}

    @precondition(lambda self: self.target < self.capacity)
    @rule()
    def cancel_shrink(self):
        self.allocator.cancel_shrink()
        self.target = self.capacity

    @precondition(lambda self: self.target == self.capacity)
    @rule(grow=st.integers(1, 8))
    def expand(self, grow):
        self.allocator.expand(self.capacity + grow)
        self.capacity = self.target = self.capacity + grow

    @invariant()
    def accounting(self):
        a = self.allocator
        assert (
            a.num_free_slots
            + a.num_overflow_slots
            + a.num_occupied_slots
            - max(0, a.target_capacity - a.num_active_slots)
            == a.num_active_slots
        ), "recycled + overflow + occupied != num_active_slots"
        assert a.num_occupied_slots == len(self.held)
        assert (a.capacity, a.target_capacity) == (self.capacity, self.target)
        assert a.num_free_slots == self._model_free()
        a.check_invariants()


AllocatorModel.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestAllocatorModel = AllocatorModel.TestCase


def test_release_uses_the_slots_own_ready_event():
    allocator = SlotAllocator(2)
    slot = allocator.allocate()
    slot.ready_event = threading.Event()  # the owner's last use, still running
    allocator.release(slot)
    handed_back = allocator.allocate()  # recycled first, its event still to be waited on
    assert handed_back.slot_id == 0 and handed_back.ready_event is slot.ready_event


@pytest.mark.parametrize("shrinking", [False, True])
def test_a_finished_event_is_dropped_on_release_and_a_running_one_kept(shrinking):
    # The owners' own events, in one batch: the usual path (no event given, no shrink) and the
    # general one (a shrink scheduled below an id) must agree.
    allocator = SlotAllocator(8)
    slots = allocator.allocate_multiple(4)
    done, running = threading.Event(), threading.Event()
    done.set()
    slots[1].ready_event, slots[2].ready_event = done, running
    if shrinking:
        allocator.prepare_for_shrink(3)  # id 3 goes to overflow
    allocator.release_multiple(slots)
    assert [slot.ready_event for slot in slots] == [None, None, running, None]
    assert allocator.num_overflow_slots == (1 if shrinking else 0)
    again = allocator.allocate_multiple(3)  # recycled in release order, whatever the events
    assert [slot.slot_id for slot in again] == [0, 1, 2]


def test_is_occupied_bounds():
    allocator = SlotAllocator(3)
    allocator.allocate_multiple(3)
    assert allocator.is_occupied(2)
    assert not allocator.is_occupied(3)
    assert not allocator.is_occupied(-1)
    assert allocator.occupied_at_or_above(3) == []
    assert allocator.occupied_at_or_above(1) == [1, 2]


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda a: setattr(a, "_num_occupied", 1), "occupied count"),
        (lambda a: a._recycled.append(a._recycled[0]), "free twice"),
        (lambda a: a._recycled.append(a._slots[0]), "both free and occupied"),
        (lambda a: setattr(a, "_num_active", 5), "high-water mark"),
        (lambda a: a._overflow.append(a._slots[1]), "overflow id is outside"),
    ],
)
def test_invariant_check_detects_corruption(corrupt, message):
    allocator = SlotAllocator(8)
    slots = allocator.allocate_multiple(4)
    allocator.release(slots[2])
    corrupt(allocator)
    with pytest.raises(CorruptedError, match=message):
        allocator.check_invariants()


def test_handles_made_up_front_hand_out_the_same_ids_and_pass_the_checks():
    """`make_handles` (the manager's first level) changes no id any call hands out."""
    eager, lazy = SlotAllocator(64), SlotAllocator(64)
    eager.make_handles(64)
    eager.check_invariants()
    assert eager.num_active_slots == 0 and eager.num_free_slots == 64
    held: dict[int, list] = {id(eager): [], id(lazy): []}

    def allocate(allocator, count):
        slots = allocator.allocate_multiple(count)
        held[id(allocator)] += slots
        return [slot.slot_id for slot in slots]

    def release(allocator, keep):
        mine = held[id(allocator)]
        allocator.release_multiple([slot for slot in mine if not keep(slot.slot_id)])
        held[id(allocator)] = [slot for slot in mine if keep(slot.slot_id)]

    steps = [
        lambda a: allocate(a, 10),
        lambda a: release(a, lambda i: not 3 <= i < 7),
        lambda a: allocate(a, 20),
        lambda a: release(a, lambda i: i < 16),
        lambda a: a.prepare_for_shrink(16),
        lambda a: a.finish_shrink(),
        lambda a: a.expand(64),
        lambda a: allocate(a, 40),
    ]
    for step in steps:
        assert step(eager) == step(lazy)
        eager.check_invariants()
    assert eager.capacity == 64 and eager.num_free_slots == lazy.num_free_slots == 8
    # The check bites: a handle above the high-water mark must be free.
    eager.make_handles(64)
    eager._slots[-1].released = 0
    with pytest.raises(CorruptedError, match="above the high-water mark is occupied"):
        eager.check_invariants()

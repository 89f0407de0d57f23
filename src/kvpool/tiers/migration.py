"""Migration: moving pages between levels (or inside one) by batched copies, and staging bytes in
RAM so that reads that can fail happen before anything changes."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

from kvpool.config import CacheTier
from kvpool.errors import CorruptedError, StorageError
from kvpool.records import Page
from kvpool.storage.memory import HostMemory
from kvpool.storage.pools import PoolGroup
from kvpool.storage.slots import wait_before
from kvpool.tiers.ownership import Ownership
from kvpool.tiers.state import StorageState


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


NOTHING_STAGED = Staged()


class Migration:
    """Copies of pages between slots; a batch moves whole or not at all. Where a page lands it
    is queued or not as its owners say (`Ownership.settle`)."""

    def __init__(self, state: StorageState, owners: Ownership) -> None:
        self._state = state
        self._owners = owners

    def migrate(self, pages: Sequence[Page], level: int, staged: Staged = NOTHING_STAGED) -> None:
        """Move pages (any levels, one pool group each) to `level`, copying their bytes in
        batches (from their RAM copies where `staged` has them). The destination must have free
        slots. On a copy error the failing batch does not move: the error is raised, its
        sources stay valid and its destination slots are released."""
        batches: dict[tuple[int, int], list[Page]] = {}
        for page in pages:
            if page.level != level:
                batches.setdefault((page.level, page.pool_group), []).append(page)
        for (source_level, pool_group), batch in batches.items():
            self.migrate_batch(batch, source_level, level, pool_group, staged)

    def migrate_batch(
        self,
        batch: list[Page],
        source_level: int,
        level: int,
        pool_group: int,
        staged: Staged = NOTHING_STAGED,
    ) -> None:
        allocator = self._state.levels[level].pool_groups[pool_group].allocator
        slots = allocator.allocate_multiple(len(batch))
        source_group = self._state.levels[source_level].pool_groups[pool_group]
        target_group = self._state.levels[level].pool_groups[pool_group]
        # The previous copy into or out of a slot is done before this one touches it: on the
        # GPU by the copy stream's order, on the host by waiting.
        on_device = source_group.on_device or target_group.on_device
        for slot in slots:
            wait_before(slot.ready_event, on_device)
        for page in batch:
            assert page.slot is not None
            wait_before(page.slot.ready_event, on_device)
        if staged.slot_of and staged.has(batch[0]):
            copy_from, slot_of = staged.groups[pool_group], staged.slot_of
            pairs = [
                (slot_of[id(page)], slot.slot_id) for page, slot in zip(batch, slots, strict=True)
            ]
        else:
            copy_from = source_group
            pairs = [(page.slot_id, slot.slot_id) for page, slot in zip(batch, slots, strict=True)]
        started = time.perf_counter()
        try:
            event = self._state.copier.copy(copy_from, target_group, pairs)
            event.check()
        except BaseException:  # (an interrupt in an inline copy too)
            allocator.release_multiple(slots)
            raise
        self._state.copy_seconds += time.perf_counter() - started
        self._state.copy_bytes += len(batch) * sum(source_group.slot_sizes)
        source_pages, target_pages = (
            self._state.pages[source_level][pool_group],
            self._state.pages[level][pool_group],
        )
        queued = [page for page in batch if page.queued]
        if queued:
            self._state.queues[source_level][pool_group].remove_all(queued)
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
        if self._state.events is not None:
            moved = tuple(slot.slot_id for slot in old_slots), tuple(slot.slot_id for slot in slots)
            self._state.events.append(("move", source_level, level, pool_group, *moved))
        evictable = []  # `settle` each page, queueing in one batch
        for page in batch:
            if self._owners.is_evictable(page):
                evictable.append(page)
            else:
                self._owners.settle(page)
        self._state.queues[level][pool_group].push_all(evictable)
        if source_level != level:
            if self._state.kv_events is not None:
                self._state.kv_events.moved(batch, source_level, level)
            self._state.num_moved[level] += len(batch)
            self._state.bytes_moved[level] += len(batch) * sum(source_group.slot_sizes)
        persist = self._state.persist
        if persist is not None and level == persist.level:  # (last: the batch has moved)
            persist.stored(batch)  # (their bytes are written: the committed ones get records)

    def read_page(self, page: Page) -> bytes:
        """A copy of the page's bytes, pool by pool (`StorageError` if a disk read fails)."""
        assert page.slot is not None
        wait_before(page.slot.ready_event, False)  # (the CPU reads it)
        group, slot = self._state.levels[page.level].pool_groups[page.pool_group], page.slot.slot_id
        return b"".join(
            memory.read(slot * size, size).data
            for memory, size in zip(group.memories, group.slot_sizes, strict=True)
        )

    def read_buffer(self, page: Page, pool: int, offset: int, out: np.ndarray) -> None:
        """Copy one buffer of the page's slot (pool `pool`, `offset` bytes into its slot) into
        `out`, from the level the page is on (`StorageError` if a disk read fails)."""
        assert page.slot is not None
        wait_before(page.slot.ready_event, False)  # (the CPU reads it)
        group = self._state.levels[page.level].pool_groups[page.pool_group]
        size = group.slot_sizes[pool]
        group.memories[pool].readinto(page.slot.slot_id * size + offset, out)

    def write_page(self, page: Page, payload: bytes | memoryview) -> None:
        """Fill the page's slot with `payload`, pool by pool (as `read_page` returns it)."""
        assert page.slot is not None
        group, slot = self._state.levels[page.level].pool_groups[page.pool_group], page.slot.slot_id
        source = np.frombuffer(payload, dtype=np.uint8)
        offset = 0
        for memory, size in zip(group.memories, group.slot_sizes, strict=True):
            memory.write(slot * size, source[offset : offset + size])
            offset += size

    def stage(self, pages: Sequence[Page], every: bool = False) -> Staged:
        """Read the bytes of those `pages` that live on a disk level (or of all of them, with
        `every`) into RAM. A failed read raises `StorageError` with nothing changed."""
        wanted = [
            page for page in pages if every or self._state.levels[page.level].tier is CacheTier.DISK
        ]
        if not wanted:
            return NOTHING_STAGED
        staged = Staged()
        batches: dict[tuple[int, int], list[Page]] = {}
        for page in wanted:
            batches.setdefault((page.level, page.pool_group), []).append(page)
        sizes = Counter(page.pool_group for page in wanted)
        try:
            for pool_group, count in sizes.items():
                staged.groups[pool_group] = PoolGroup(
                    self._state.levels[0].pool_groups[pool_group].slot_sizes,
                    count,
                    lambda pool, size: HostMemory(size),
                )
            taken = Counter[int]()
            for (level, pool_group), batch in batches.items():
                first = taken[pool_group]
                taken[pool_group] += len(batch)
                pairs = [(page.slot_id, first + i) for i, page in enumerate(batch)]
                for page in batch:  # (its last copy in is done: the CPU may read it next)
                    assert page.slot is not None
                    wait_before(page.slot.ready_event, False)
                event = self._state.copier.copy(
                    self._state.levels[level].pool_groups[pool_group],
                    staged.groups[pool_group],
                    pairs,
                )
                event.check()
                event.wait()  # (the staged bytes are read by the CPU or a later copy)
                for i, page in enumerate(batch):
                    staged.slot_of[id(page)] = first + i
        except BaseException:
            staged.close()
            raise
        return staged

    def release_slot(self, page: Page) -> None:
        """Take a (staged) page out of its slot; `_place` gives it a new one."""
        assert page.slot is not None and not page.queued
        del self._state.pages[page.level][page.pool_group][page.slot_id]
        self._state.levels[page.level].pool_groups[page.pool_group].allocator.release(page.slot)
        page.slot = None

    def place(self, page: Page, levels: Sequence[int], staged: Staged) -> None:
        """Write a staged page into a free slot: of the first of `levels` with one, else of any
        level, trying the next free slot when a write fails."""
        source, source_slot = staged.groups[page.pool_group], staged.slot_of[id(page)]
        failure: BaseException | None = None
        for level in dict.fromkeys([*levels, *range(len(self._state.levels))]):
            group = self._state.levels[level].pool_groups[page.pool_group]
            if not group.allocator.num_free_slots:
                continue
            slot = group.allocator.allocate()
            wait_before(slot.ready_event, group.on_device)
            try:
                self._state.copier.copy(source, group, [(source_slot, slot.slot_id)]).check()
            except StorageError as error:
                group.allocator.release(slot)
                failure = error
                continue
            if self._state.kv_events is not None and page.level != level:
                self._state.kv_events.moved((page,), page.level, level)
            page.slot, page.level = slot, level
            self._state.pages[level][page.pool_group][slot.slot_id] = page
            self._owners.settle(page)
            persist = self._state.persist
            if persist is not None and level == persist.level:
                persist.stored((page,))
            return
        raise CorruptedError(
            f"no level could take staged {page} (last write error: {failure}): its KV is lost"
        )

    def copy_pages(
        self, pairs: Iterable[tuple[Page, Page]], staged: Staged = NOTHING_STAGED
    ) -> None:
        """Copy each source page's bytes (from its RAM copy where `staged` has it) into its
        destination page (any levels)."""
        batches: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
        sources: dict[tuple[int, int, int], PoolGroup] = {}
        for source, destination in pairs:
            assert source.pool_group == destination.pool_group
            pool_group = source.pool_group
            on_device = (
                self._state.levels[source.level].pool_groups[pool_group].on_device
                or self._state.levels[destination.level].pool_groups[pool_group].on_device
            )
            for page in (source, destination):
                if page.slot is not None:
                    wait_before(page.slot.ready_event, on_device)
            if staged.has(source):
                key = (-1, destination.level, pool_group)
                sources[key] = staged.groups[pool_group]
                slot = staged.slot_of[id(source)]
            else:
                key = (source.level, destination.level, pool_group)
                sources[key] = self._state.levels[source.level].pool_groups[pool_group]
                slot = source.slot_id
            batches.setdefault(key, []).append((slot, destination.slot_id))
        events = [
            self._state.copier.copy(
                sources[key], self._state.levels[key[1]].pool_groups[key[2]], slot_pairs
            )
            for key, slot_pairs in batches.items()
        ]
        for event in events:
            event.check()

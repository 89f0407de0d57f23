"""Pools of one cache level: slot counts from quota and ratio, and pool-group shrink/expand.

Quotas are spent in *grains* of `granularity` bytes, per pool (each pool's bytes are rounded up to
whole grains), as the reference does for its physical-memory chunks. A level never uses more than
its quota: the budget is ``quota // granularity`` grains.
"""

from __future__ import annotations

import errno
import functools
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

from kvpool.config import CacheTier
from kvpool.errors import ArgumentError, ConfigError, LogicError, StorageError
from kvpool.storage.device_memory import DeviceMemory
from kvpool.storage.memory import DiskMemory, HostMemory, Memory
from kvpool.storage.shared import SharedHostMemory, shared_pool_file
from kvpool.storage.slots import SlotAllocator

MiB = 1 << 20
GiB = 1 << 30
HOST_GRANULARITY = 2 * MiB
DISK_GRANULARITY = 2 * MiB


def gpu_granularity(quota: int) -> int:
    """2 MiB for quotas under 2 GiB, doubling with each doubling of the quota, at most 32 MiB."""
    steps = math.floor(math.log2(quota / GiB)) if quota > 0 else 0
    return (2 * MiB) << min(4, max(0, steps))


def default_granularity(tier: CacheTier, quota: int) -> int:
    if tier is CacheTier.GPU:
        return gpu_granularity(quota)
    return HOST_GRANULARITY if tier is CacheTier.HOST else DISK_GRANULARITY


def grains_for_slots(num_slots: int, slot_sizes: Sequence[int], granularity: int) -> int:
    """Grains `num_slots` slots take: each pool rounded up to whole grains."""
    return sum(-(-num_slots * size // granularity) for size in slot_sizes)


def slots_for_grains(grains: int, slot_sizes: Sequence[int], granularity: int) -> int:
    """The most slots whose pools fit in `grains` grains (binary search)."""
    if grains <= 0:
        return 0
    slot_bytes = sum(slot_sizes)
    # Rounding costs each pool less than one grain, which bounds the answer from both sides.
    low = max(0, (grains - len(slot_sizes)) * granularity // slot_bytes)
    high = grains * granularity // slot_bytes
    while low < high:
        mid = (low + high + 1) // 2
        if grains_for_slots(mid, slot_sizes, granularity) <= grains:
            low = mid
        else:
            high = mid - 1
    return low


def min_quota(
    slot_sizes: Sequence[Sequence[int]], min_slots: Sequence[int], granularity: int
) -> int:
    """Bytes needed to give every pool group its floor."""
    grains = sum(
        grains_for_slots(m, sizes, granularity)
        for sizes, m in zip(slot_sizes, min_slots, strict=True)
    )
    return grains * granularity


def slot_counts_from_ratio(
    quota: int,
    slot_sizes: Sequence[Sequence[int]],
    ratio: Sequence[float],
    granularity: int,
    min_slots: Sequence[int],
    quota_name: str = "quota",
) -> list[int]:
    """Slot count per pool group: split the quota's grains by byte `ratio`, no group below its
    `min_slots`, then spend leftover grains wherever another slot fits.

    Groups are served in ascending ratio order, each getting its rounded (half up) share of what
    is left, so the shares add up to the budget exactly. A group whose share gives no more than
    its floor is pinned at the floor and the rest is split again among the others. Leftover
    grains (from per-pool rounding) go to groups in descending ratio order.
    """
    needed = min_quota(slot_sizes, min_slots, granularity)
    budget = quota // granularity
    if budget * granularity < needed:
        raise ConfigError(
            f"{quota_name}={quota} is invalid: must be at least {needed} bytes, the minimum quota "
            f"that holds every pool group's floor of {list(min_slots)} slots "
            f"(granularity {granularity} bytes)"
        )
    groups = range(len(slot_sizes))
    counts = [0] * len(slot_sizes)
    active = list(groups)
    remaining = budget
    while active:
        order = sorted(active, key=lambda g: (ratio[g], g))
        left, left_ratio = remaining, math.fsum(ratio[g] for g in active)
        tentative = {}
        for position, g in enumerate(order):
            last = position == len(order) - 1
            share = left if last else min(left, math.floor(left * ratio[g] / left_ratio + 0.5))
            left -= share
            left_ratio -= ratio[g]
            tentative[g] = slots_for_grains(share, slot_sizes[g], granularity)
        pinned = [g for g in active if tentative[g] <= min_slots[g]]
        if not pinned:
            for g in active:
                counts[g] = tentative[g]
            break
        for g in pinned:
            counts[g] = min_slots[g]
            remaining -= grains_for_slots(min_slots[g], slot_sizes[g], granularity)
            active.remove(g)
    leftover = budget - sum(grains_for_slots(counts[g], slot_sizes[g], granularity) for g in groups)
    for g in sorted(groups, key=lambda g: (-ratio[g], g)):
        used = grains_for_slots(counts[g], slot_sizes[g], granularity)
        counts[g] = slots_for_grains(used + leftover, slot_sizes[g], granularity)
        leftover -= grains_for_slots(counts[g], slot_sizes[g], granularity) - used
    return counts


MemoryFactory = Callable[[int, int], Memory]
"""Makes one pool's memory from (pool index, size in bytes)."""


class PoolGroup:
    """The pools of one slot layout at one level: one memory per pool, one slot allocator."""

    def __init__(
        self,
        slot_sizes: Sequence[int],
        num_slots: int,
        make_memory: MemoryFactory,
    ) -> None:
        self.slot_sizes = tuple(slot_sizes)
        self.memories: list[Memory] = []
        try:
            for pool, size in enumerate(self.slot_sizes):
                memory = make_memory(pool, num_slots * size)
                if isinstance(memory, HostMemory):
                    memory.pin_unit = size  # (registered pieces hold whole slots)
                self.memories.append(memory)
        except BaseException:
            self.close()
            raise
        self.allocator = SlotAllocator(num_slots)

    @property
    def num_slots(self) -> int:
        return self.allocator.capacity

    @property
    def on_device(self) -> bool:
        """Whether its memory is CUDA memory (its slots' users are ordered on the GPU)."""
        memory = self.memories[0] if self.memories else None
        return isinstance(memory, DeviceMemory) and memory.is_cuda

    def pool_view(self, pool: int) -> Any:
        """Pool `pool` as a writable uint8 array [num_slots, slot_size] over its real memory
        (numpy for host memory, a torch tensor for CUDA memory). Re-fetch after a resize."""
        memory, size = self.memories[pool], self.slot_sizes[pool]
        nbytes = self.num_slots * size
        if isinstance(memory, DeviceMemory):
            if memory.is_cuda:
                return memory.tensor[:nbytes].view(self.num_slots, size)
            memory = memory.host
        if not isinstance(memory, HostMemory):
            raise ArgumentError(f"pool={pool} is invalid: {memory.kind} memory has no view")
        return memory.array[:nbytes].reshape(self.num_slots, size)

    def shrink(self, new_num_slots: int) -> None:
        """Shrink to `new_num_slots` slots. No id at or above it may be occupied: either none was
        ever issued (the fast path), or the caller emptied that range first (possibly after its
        own `prepare_for_shrink`). Refused with `LogicError`, nothing changed, otherwise."""
        allocator = self.allocator
        if allocator.shrink_in_progress and allocator.target_capacity != new_num_slots:
            raise LogicError(
                f"a shrink to {allocator.target_capacity} slots is in progress, not to {new_num_slots}"
            )
        if not allocator.shrink_in_progress:
            if not 0 <= new_num_slots < allocator.capacity:
                raise ArgumentError(
                    f"new_num_slots={new_num_slots} is invalid: must be in [0, {allocator.capacity})"
                )
            blocking = allocator.occupied_at_or_above(new_num_slots)
            if blocking:
                raise LogicError(
                    f"cannot shrink to {new_num_slots} slots: {len(blocking)} slot(s) at or above it "
                    f"are occupied (first {blocking[0]}); move their pages first"
                )
            allocator.prepare_for_shrink(new_num_slots)
        allocator.finish_shrink()
        for memory, size in zip(self.memories, self.slot_sizes, strict=True):
            memory.resize(new_num_slots * size)

    def expand(self, new_num_slots: int) -> None:
        """Grow to `new_num_slots` slots: memory first (a failure rolls back), then the allocator."""
        old = self.num_slots
        if self.allocator.shrink_in_progress:
            raise LogicError("cannot expand a pool group while a shrink is in progress")
        if new_num_slots <= old:
            raise ArgumentError(f"new_num_slots={new_num_slots} is invalid: must be > {old}")
        grown: list[Memory] = []
        try:
            for memory, size in zip(self.memories, self.slot_sizes, strict=True):
                memory.resize(new_num_slots * size)
                grown.append(memory)
        except BaseException:
            for memory, size in zip(grown, self.slot_sizes, strict=False):
                memory.resize(old * size)
            raise
        self.allocator.expand(new_num_slots)

    def close(self) -> None:
        for memory in self.memories:
            memory.close()


class LevelStorage:
    """All pool groups of one cache level, sized from the level's quota and a byte ratio."""

    def __init__(
        self,
        tier: CacheTier,
        quota: int,
        slot_sizes: Sequence[Sequence[int]],
        ratio: Sequence[float],
        min_slots: Sequence[int],
        *,
        granularity: int | None = None,
        disk_path: str | os.PathLike[str] | None = None,
        quota_name: str = "quota",
        shared_dir: str | None = None,
        shared_by_fd: bool = False,
    ) -> None:
        if len(ratio) != len(slot_sizes) or len(min_slots) != len(slot_sizes):
            raise ArgumentError(
                f"ratio and min_slots must have one entry per pool group ({len(slot_sizes)}); "
                f"got {len(ratio)} and {len(min_slots)}"
            )
        if tier is CacheTier.DISK and disk_path is None:
            raise ArgumentError("disk_path=None is invalid: a disk level needs a directory")
        self.tier = tier
        self.quota = quota
        self.granularity = granularity or default_granularity(tier, quota)
        self.min_slots = list(min_slots)
        self._disk_path = disk_path
        self._shared_dir = shared_dir
        self._shared_by_fd = shared_by_fd
        counts = slot_counts_from_ratio(
            quota, slot_sizes, ratio, self.granularity, min_slots, quota_name
        )
        self.pool_groups: list[PoolGroup] = []
        try:
            for group, (sizes, count) in enumerate(zip(slot_sizes, counts, strict=True)):
                make = functools.partial(self._make_memory, group)
                self.pool_groups.append(PoolGroup(sizes, count, make))
        except BaseException as error:
            self.close()
            if not isinstance(error, StorageError):
                raise
            # Name the setting to change: the quota, or the directory of a disk level.
            setting = (
                f"{quota_name.removesuffix('.quota')}.path={os.fspath(disk_path)!r}"
                if disk_path is not None and error.errno not in (errno.ENOSPC, errno.EFBIG)
                else f"{quota_name}={quota}"
            )
            raise StorageError(error.errno, f"{setting}: {error.strerror}") from error

    def _make_memory(self, pool_group: int, pool: int, size: int) -> Memory:
        # A pool never outgrows its level's quota, so host memory reserves that much address space.
        reserve = max(size, self.quota)
        if self._shared_dir is not None:
            path = os.path.join(self._shared_dir, shared_pool_file(pool_group, pool))
            return SharedHostMemory(path, size, reserve)
        if self._shared_by_fd:
            name = f"kvpool-{shared_pool_file(pool_group, pool)}"
            return SharedHostMemory(None, size, reserve, name)
        if self.tier is CacheTier.GPU:
            return DeviceMemory(size, reserve)
        if self.tier is CacheTier.HOST:
            return HostMemory(size, reserve)
        assert self._disk_path is not None
        return DiskMemory(self._disk_path, size)

    @property
    def slot_counts(self) -> list[int]:
        return [group.num_slots for group in self.pool_groups]

    def grains_used(self, pool_group: int, num_slots: int | None = None) -> int:
        group = self.pool_groups[pool_group]
        count = group.num_slots if num_slots is None else num_slots
        return grains_for_slots(count, group.slot_sizes, self.granularity)

    @property
    def used_bytes(self) -> int:
        """Bytes the pools take, each rounded up to whole grains."""
        return sum(self.grains_used(g) for g in range(len(self.pool_groups))) * self.granularity

    @property
    def ratio(self) -> list[float]:
        """Current byte share of each pool group."""
        used = [self.grains_used(g) for g in range(len(self.pool_groups))]
        total = sum(used)
        return [u / total if total else 0.0 for u in used]

    def shrink_pool_group(self, pool_group: int, new_num_slots: int) -> None:
        """Shrink one group (never below its floor); see `PoolGroup.shrink`."""
        floor = self.min_slots[pool_group]
        if new_num_slots < floor:
            raise ArgumentError(
                f"new_num_slots={new_num_slots} is invalid: must be >= pool group {pool_group}'s floor {floor}"
            )
        self.pool_groups[pool_group].shrink(new_num_slots)

    def expand_pool_group(self, pool_group: int, new_num_slots: int) -> None:
        """Grow one group, within the level's quota; see `PoolGroup.expand`."""
        budget = self.quota // self.granularity
        others = sum(self.grains_used(g) for g in range(len(self.pool_groups)) if g != pool_group)
        needed = others + self.grains_used(pool_group, new_num_slots)
        if needed > budget:
            raise ArgumentError(
                f"new_num_slots={new_num_slots} is invalid: pool group {pool_group} would need "
                f"{needed * self.granularity} bytes in all, over the level's quota {self.quota}"
            )
        self.pool_groups[pool_group].expand(new_num_slots)

    def close(self) -> None:
        for group in self.pool_groups:
            group.close()

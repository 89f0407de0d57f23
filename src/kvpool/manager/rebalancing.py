"""Rebalancing: moving a level's bytes between pool groups as demand shifts (`need_adjustment`
then `adjust()`, or `adjust_cache_level` directly), and changing a level's quota (`resize`)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import SupportsIndex

from kvpool.cache import KVCacheStatus
from kvpool.errors import ConfigError, LogicError, OutOfPagesError
from kvpool.manager.core import ManagerCore
from kvpool.storage.pools import slot_counts_from_ratio
from kvpool.validation import (
    check_int,
    check_real,
    check_sequence,
    fail,
)


class Rebalancing(ManagerCore):
    """The split of each level between pool groups, and each level's size."""

    @property
    def need_adjustment(self) -> bool:
        """True when enough requests were sampled, the cooldown passed and some level's split
        between pool groups is off its target by more than the threshold. Cheap: read it
        between engine steps, then call `adjust()`."""
        if self._closed or not self.rebalancer.gates_open():
            return False
        return any(self._level_needs_adjustment(level) for level in range(len(self._levels)))

    def _level_needs_adjustment(self, level: int) -> bool:
        target = self._constrained_target(level)
        return self.rebalancer.mismatch(target, self._levels[level].ratio)

    def _constrained_target(self, level: int) -> list[float] | None:
        """The level's target ratio as it can actually be met: slot counts with the floors
        applied, back to bytes (cached until the target or the quota changes)."""
        target = self.rebalancer.target(level)
        if target is None:
            return None
        storage = self._levels[level]
        cached = self._constrained.get(level)
        if cached is not None and cached[0] is target and cached[1] == storage.quota:
            return cached[2]
        sizes = [group.slot_sizes for group in storage.pool_groups]
        counts = slot_counts_from_ratio(
            storage.quota, sizes, target, storage.granularity, self._min_slots
        )
        grains = [storage.grains_used(pg, n) for pg, n in enumerate(counts)]
        result = [g / sum(grains) for g in grains]
        self._constrained[level] = (target, storage.quota, result)
        return result

    def adjust(self) -> None:
        """Move memory between pool groups of every level whose split is off target. Requests
        may stay ACTIVE: their pages in a removed slot range move to other slots of the same
        level and their page tables are updated (re-fetch `page_view`, which may move too).
        Raises `OutOfPagesError`, with that level unchanged, if locked and held pages cannot
        fit the new split."""
        self._require_open()
        started = time.perf_counter()
        try:
            for level in range(len(self._levels)):
                target = self._constrained_target(level)
                if self.rebalancer.mismatch(target, self._levels[level].ratio):
                    assert target is not None
                    self.adjust_cache_level(level, target)
        finally:
            self.rebalancer.last_adjustment = self.rebalancer.clock()
        self._after_call()
        if self._counters.calls is not None:
            self._observe("adjust", started)

    def adjust_cache_level(
        self, level: SupportsIndex, ratio: Sequence[float], quota: SupportsIndex | None = None
    ) -> None:
        """Re-split one level (optionally with a new quota) by byte `ratio` per pool group:
        shrink the groups that lose slots first, then expand the others. A group keeps at
        least the slots of its pages that cannot leave the level (locked, or held at the last
        level), so the split moves toward the target as far as running requests allow."""
        level = self._level(level)
        storage = self._levels[level]
        count = len(storage.pool_groups)
        allowed = f"{count} finite weights >= 0, not all 0"
        weights = check_sequence("ratio", ratio, allowed)
        if len(weights) != count:
            fail("ratio", ratio, allowed)
        for i, weight in enumerate(weights):
            check_real(f"ratio[{i}]", weight, 0.0)
        top = max(weights)
        if not top > 0:
            fail("ratio", ratio, allowed)
        # (scaled by the largest first: the sum of huge finite weights would overflow)
        scaled = [w / top for w in weights]
        total = math.fsum(scaled)
        ratio = [w / total for w in scaled]
        quota = storage.quota if quota is None else check_int("quota", quota, 1)
        sizes = [group.slot_sizes for group in storage.pool_groups]
        staying = self._storage.resizing.pages_that_must_stay(level)
        floors = [max(floor, stay) for floor, stay in zip(self._min_slots, staying, strict=True)]
        try:
            counts = slot_counts_from_ratio(
                quota, sizes, ratio, storage.granularity, floors, "quota"
            )
        except ConfigError as error:
            raise OutOfPagesError(
                f"level {level}: the pages that must stay do not fit ({error}); nothing was changed"
            ) from None
        storage_counters = self._storage.state
        moved_before = storage_counters.bytes_relocated + sum(storage_counters.bytes_moved)
        started = time.perf_counter()
        try:
            adjusted = self._storage.resizing.adjust_cache_level(level, counts, quota)
        finally:  # even after an error: pages of running requests may have moved
            for cache in self._living.values():
                if cache.status is KVCacheStatus.ACTIVE:
                    cache.refresh_tables()
        if not adjusted:
            raise OutOfPagesError(
                f"level {level} cannot take slot counts {counts}: the held pages of a shrinking "
                "pool group find no room below; nothing was changed"
            )
        counters = self._counters
        counters.rebalances += 1
        counters.rebalance_seconds.observe(time.perf_counter() - started)
        moved_after = storage_counters.bytes_relocated + sum(storage_counters.bytes_moved)
        counters.rebalance_bytes += moved_after - moved_before
        if self._storage.state.events is not None:
            self._storage.state.events.append(("split", level, tuple(counts)))

    def resize(self, level: SupportsIndex, quota: SupportsIndex) -> bool:
        """Change a level's byte budget at run time, keeping its current split between pool
        groups. Every open request must be suspended. Shrinking pushes pages down a level (or
        drops cached ones at the last level) and compacts the rest; returns False, with nothing
        changed, when the pages that must stay (held pages at the last level) do not fit."""
        level = self._level(level)
        storage, quota = self._levels[level], check_int("quota", quota, 1)
        active = sum(1 for cache in self._living.values() if cache.status is KVCacheStatus.ACTIVE)
        if active:
            raise LogicError(f"resize() needs every KV cache suspended; {active} are active")
        sizes = [group.slot_sizes for group in storage.pool_groups]
        counts = slot_counts_from_ratio(
            quota, sizes, storage.ratio, storage.granularity, self._min_slots
        )
        if not self._storage.resizing.adjust_cache_level(level, counts, quota):
            return False
        self._after_call()
        return True

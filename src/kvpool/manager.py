"""KVCacheManager: owns the layout, every level's pools, the radix tree and the requests; the
only entry point users need."""

from __future__ import annotations

import copy
import itertools
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool import _debug
from kvpool.cache import CacheContext, KVCache, KVCacheStatus, PriorityCallback, RequestState
from kvpool.config import (
    CacheTier,
    DiskCacheTierConfig,
    KVCacheDesc,
    KVCacheManagerConfig,
    ReuseScope,
)
from kvpool.errors import ArgumentError, ConfigError, CorruptedError, LogicError, OutOfPagesError
from kvpool.layout import KVLayout
from kvpool.radix import RadixTree
from kvpool.rebalance import DemandEstimator
from kvpool.storage.pools import LevelStorage, slot_counts_from_ratio
from kvpool.tiers import StorageManager
from kvpool.tokens import Token, root_key
from kvpool.validation import (
    check_bool,
    check_callable,
    check_index,
    check_int,
    check_real,
    check_sequence,
    fail,
    token_list,
)

# The request shape that sizes pool groups when the config names none.
DEFAULT_REQUEST = KVCacheDesc(capacity=2049, history_length=2048)


@dataclass(frozen=True)
class StorageStatistics:
    """Slots of one pool group at one level. `available` = free + evictable."""

    slot_sizes: tuple[int, ...]
    total: int
    free: int
    evictable: int

    @property
    def available(self) -> int:
        return self.free + self.evictable

    @property
    def unavailable(self) -> int:
        return self.total - self.available


class KVCacheManager:
    """Paged, tiered KV-cache memory for one model."""

    def __init__(
        self, config: KVCacheManagerConfig, *, clock: Callable[[], float] | None = None
    ) -> None:
        """`clock` (seconds, default `time.monotonic`) times the rebalancing cooldown.

        Threads: the manager and its KV caches are driven from one thread (the engine's
        scheduler loop); nothing is locked. With `KVPOOL_DEBUG=1` a call from another thread
        than the first caller's raises `LogicError` (`transfer_to_current_thread()` hands the
        manager over on purpose)."""
        if not isinstance(config, KVCacheManagerConfig):
            fail("config", config, "a KVCacheManagerConfig")
        check_callable("clock", clock)
        config.validate()
        self._closed = False
        self._owner_thread: int | None = None
        self._config = copy.deepcopy(config)
        self.layout = KVLayout(self._config.layers, self._config.tokens_per_block)
        self._min_slots = self._floors()
        ratio = self._initial_ratio()
        slot_sizes = [group.slot_sizes for group in self.layout.pool_groups]
        self._levels: list[LevelStorage] = []
        try:
            for level, tier_config in enumerate(self._config.cache_tiers):
                self._levels.append(
                    LevelStorage(
                        tier_config.tier,
                        tier_config.quota,
                        slot_sizes,
                        ratio,
                        self._min_slots,
                        disk_path=tier_config.path
                        if isinstance(tier_config, DiskCacheTierConfig)
                        else None,
                        quota_name=f"cache_tiers[{level}].quota",
                    )
                )
        except BaseException:
            for storage in self._levels:
                storage.close()
            raise
        self._storage = StorageManager(self._levels)
        # Records for about as many blocks as the GPU level holds, made now rather than in the
        # engine's loop (like the slot handles and page records).
        self._tree = RadixTree(self.layout, spare_blocks=max(self._levels[0].slot_counts))
        self._storage.on_drop = self._tree.remove_pages
        self.rebalancer = DemandEstimator(self._config, self.layout, clock or time.monotonic)
        self._constrained: dict[int, tuple[object, int, list[float]]] = {}
        self._living: dict[int, KVCache] = {}
        self._ids = itertools.count()
        self._context = CacheContext(
            layout=self.layout,
            storage=self._storage,
            tree=self._tree,
            max_util_for_resume=self._config.max_util_for_resume,
            on_close=self._forget,
            check=self._after_call,
            check_thread=self._check_thread,
        )

    def _floors(self) -> list[int]:
        """Per pool group: the slots a request needs to make progress, raised to what every
        constraint batch needs at once."""
        floors = self.layout.min_slots()
        for batch in self._config.constraints:
            floors = [
                max(f, n) for f, n in zip(floors, self.layout.slots_for_batch(batch), strict=True)
            ]
        return floors

    def _initial_ratio(self) -> list[float]:
        """Byte share per pool group: `initial_pool_ratio`, else the typical step's need, else
        the constraint floors, else a default request shape."""
        config, layout = self._config, self.layout
        if config.initial_pool_ratio is not None:
            return layout.pool_group_ratio(config.initial_pool_ratio)
        for slots in (
            layout.slots_for_batch(config.typical_step) if config.typical_step else None,
            self._min_slots if config.constraints else None,
        ):
            if slots is not None and any(slots):
                need = [
                    n * group.slot_bytes for n, group in zip(slots, layout.pool_groups, strict=True)
                ]
                return [b / sum(need) for b in need]
        return layout.request_byte_ratio(DEFAULT_REQUEST.capacity, DEFAULT_REQUEST.history_length)

    # -- layout ----------------------------------------------------------------------------------

    @property
    def config(self) -> KVCacheManagerConfig:
        """A copy of the configuration this manager was built from."""
        return copy.deepcopy(self._config)

    @property
    def tokens_per_block(self) -> int:
        return self._config.tokens_per_block

    @property
    def num_levels(self) -> int:
        return len(self._levels)

    @property
    def num_pool_groups(self) -> int:
        return self.layout.num_pool_groups

    @property
    def min_slots(self) -> list[int]:
        """Per pool group, the floor no level goes below."""
        return list(self._min_slots)

    def get_layer_group_id(self, layer_id: int) -> int:
        group = self.layout.layer_group_of.get(layer_id) if type(layer_id) is int else None
        if group is None:
            fail("layer_id", layer_id, f"one of {sorted(self.layout.layer_group_of)}")
        return group

    def get_pool_group_index(self, layer_group_id: int) -> int:
        check_index("layer_group_id", layer_group_id, self.layout.num_layer_groups)
        return self.layout.pool_group_of[layer_group_id]

    # -- levels ----------------------------------------------------------------------------------

    def level_storage(self, level: int) -> LevelStorage:
        self._require_open()
        return self._levels[check_index("level", level, len(self._levels))]

    def get_tier(self, level: int) -> CacheTier:
        return self.level_storage(level).tier

    def get_quota(self, level: int) -> int:
        """The level's byte budget; its pools use at most this much."""
        return self.level_storage(level).quota

    def resize(self, level: int, quota: int) -> bool:
        """Change a level's byte budget at run time, keeping its current split between pool
        groups. Every open request must be suspended. Shrinking pushes pages down a level (or
        drops cached ones at the last level) and compacts the rest; returns False, with nothing
        changed, when the pages that must stay (held pages at the last level) do not fit."""
        storage = self.level_storage(level)
        check_int("quota", quota, 1)
        active = sum(1 for cache in self._living.values() if cache.status is KVCacheStatus.ACTIVE)
        if active:
            raise LogicError(f"resize() needs every KV cache suspended; {active} are active")
        sizes = [group.slot_sizes for group in storage.pool_groups]
        counts = slot_counts_from_ratio(
            quota, sizes, storage.ratio, storage.granularity, self._min_slots
        )
        if not self._storage.adjust_cache_level(level, counts, quota):
            return False
        self._after_call()
        return True

    def get_slot_counts(self, level: int) -> list[int]:
        """Slots per pool group at `level`."""
        return self.level_storage(level).slot_counts

    def page_view(self, layer_id: int, role: str) -> Any:
        """Writable uint8 array [num_pages, page_bytes] over one buffer's GPU-level memory
        (numpy; a torch tensor for CUDA memory). Rows are what `get_page_indices` returns.
        Re-fetch after anything that resizes pools."""
        placement = self.layout.placement(layer_id, role)
        pool = self.level_storage(0).pool_groups[placement.pool_group].pool_view(placement.pool)
        return pool.reshape(-1, placement.size)

    # -- requests --------------------------------------------------------------------------------

    def create_kv_cache(
        self,
        reuse_scope: ReuseScope | None = None,
        input_tokens: Sequence[Token] | None = None,
        id: int | None = None,
        priority_callback: PriorityCallback | None = None,
        exclude_from_stats: bool = False,
    ) -> KVCache:
        """A new request, SUSPENDED, already holding the longest reusable prefix of
        `input_tokens` (`num_committed_tokens == history_length == capacity ==` its length).
        Leave out the prompt tokens that must be recomputed (at least the last one).
        `exclude_from_stats` marks warm-up or padding requests: they never feed rebalancing."""
        self._require_open()
        scope_key = root_key(reuse_scope)
        if id is None:
            id = next(self._ids)
            while id in self._living:
                id = next(self._ids)
        elif type(id) is not int:
            fail("id", id, "an int or None")
        elif id in self._living:
            raise ArgumentError(f"id={id} is invalid: must not be the id of an open KV cache")
        check_callable("priority_callback", priority_callback)
        check_bool("exclude_from_stats", exclude_from_stats)
        tokens = [] if input_tokens is None else token_list("input_tokens", input_tokens)
        match = self._tree.match(scope_key, tokens, self._config.enable_partial_reuse)
        cache = KVCache(self._context, id, scope_key, priority_callback, exclude_from_stats)
        if match.num_tokens:
            cache.adopt_match(match, tokens)
        self._living[id] = cache
        self._after_call()
        return cache

    def probe_reuse(self, reuse_scope: ReuseScope | None, input_tokens: Sequence[Token]) -> int:
        """How many tokens of `input_tokens` a new request would reuse now (holds nothing)."""
        self._require_open()
        scope_key = root_key(reuse_scope)
        tokens = token_list("input_tokens", input_tokens)
        return self._tree.match(scope_key, tokens, self._config.enable_partial_reuse).num_tokens

    @property
    def num_open_kv_caches(self) -> int:
        return len(self._living)

    def _forget(self, cache: RequestState) -> None:
        del self._living[cache.id]
        capacity, history = cache.mean_shape
        if not cache.exclude_from_stats and capacity > 0:
            self.rebalancer.sample(capacity, history, cache.reused_length)

    # -- rebalancing -----------------------------------------------------------------------------

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
        try:
            for level in range(len(self._levels)):
                target = self._constrained_target(level)
                if self.rebalancer.mismatch(target, self._levels[level].ratio):
                    assert target is not None
                    self.adjust_cache_level(level, target)
        finally:
            self.rebalancer.last_adjustment = self.rebalancer.clock()
        self._after_call()

    def adjust_cache_level(
        self, level: int, ratio: Sequence[float], quota: int | None = None
    ) -> None:
        """Re-split one level (optionally with a new quota) by byte `ratio` per pool group:
        shrink the groups that lose slots first, then expand the others. A group keeps at
        least the slots of its pages that cannot leave the level (locked, or held at the last
        level), so the split moves toward the target as far as running requests allow."""
        storage = self.level_storage(level)
        count = len(storage.pool_groups)
        allowed = f"{count} finite weights >= 0 with a positive, finite sum"
        weights = check_sequence("ratio", ratio, allowed)
        if len(weights) != count:
            fail("ratio", ratio, allowed)
        for i, weight in enumerate(weights):
            check_real(f"ratio[{i}]", weight, 0.0)
        if not 0 < math.fsum(weights) < math.inf:
            fail("ratio", ratio, allowed)
        ratio = [w / math.fsum(weights) for w in weights]
        quota = storage.quota if quota is None else check_int("quota", quota, 1)
        sizes = [group.slot_sizes for group in storage.pool_groups]
        staying = self._storage.pages_that_must_stay(level)
        floors = [max(floor, stay) for floor, stay in zip(self._min_slots, staying, strict=True)]
        try:
            counts = slot_counts_from_ratio(
                quota, sizes, ratio, storage.granularity, floors, "quota"
            )
        except ConfigError as error:
            raise OutOfPagesError(
                f"level {level}: the pages that must stay do not fit ({error}); nothing was changed"
            ) from None
        try:
            adjusted = self._storage.adjust_cache_level(level, counts, quota)
        finally:  # even after an error: pages of running requests may have moved
            for cache in self._living.values():
                if cache.status is KVCacheStatus.ACTIVE:
                    cache.refresh_tables()
        if not adjusted:
            raise OutOfPagesError(
                f"level {level} cannot take slot counts {counts}: the held pages of a shrinking "
                "pool group find no room below; nothing was changed"
            )

    def get_storage_statistics(self, level: int) -> list[StorageStatistics]:
        """Per pool group at `level`: slot sizes, total, free, evictable, available, unavailable."""
        storage = self.level_storage(level)
        return [
            StorageStatistics(
                slot_sizes=group.slot_sizes,
                total=group.num_slots,
                free=group.allocator.num_free_slots,
                evictable=self._storage.num_evictable(level, index),
            )
            for index, group in enumerate(storage.pool_groups)
        ]

    @property
    def num_dropped_pages(self) -> int:
        """Committed pages evicted from the last level so far (their KV is gone)."""
        return self._storage.num_dropped

    @property
    def num_moved_pages(self) -> list[int]:
        """Pages that arrived at each level so far (eviction down, bringing up, prefetch)."""
        return self._storage.num_moved

    def clear_reusable_blocks(self) -> None:
        """Forget every cached block (refused while requests are open)."""
        self._require_open()
        self._refuse_with_open_caches("clear_reusable_blocks")
        for page in self._tree.clear():
            self._storage.settle(page)
        self._after_call()

    def shutdown(self) -> None:
        """Release all memory (idempotent; refused while requests are open)."""
        if self._closed:
            return
        self._refuse_with_open_caches("shutdown")
        for page in self._tree.clear():
            self._storage.settle(page)
        self._storage.close()
        self._levels = []
        self._closed = True

    def _refuse_with_open_caches(self, operation: str) -> None:
        if self._living:
            raise LogicError(
                f"{operation}() with {len(self._living)} KV cache(s) still open; close them first"
            )

    # -- consistency -----------------------------------------------------------------------------

    def _after_call(self) -> None:
        if _debug.DEBUG:
            self._check_thread()
            self.check_invariants()

    def transfer_to_current_thread(self) -> None:
        """Make the calling thread the one that drives this manager (see the constructor)."""
        self._owner_thread = threading.get_ident()

    def _check_thread(self) -> None:
        """Debug mode: refuse a call from a thread other than the manager's."""
        me = threading.get_ident()
        if self._owner_thread is None:
            self._owner_thread = me
        elif self._owner_thread != me:
            raise LogicError(
                f"the KV-cache manager was called from thread {threading.current_thread().name} "
                f"(id {me}) but is driven by thread id {self._owner_thread}: call it from one "
                "thread only (or hand it over with transfer_to_current_thread())"
            )

    def check_invariants(self) -> None:
        """Raise `CorruptedError` unless slots, page owners, queues and tree links agree."""
        problems: list[str] = []
        storage, tree = self._storage, self._tree
        locks: dict[int, int] = {}
        holds: dict[int, int] = {}
        pages: dict[int, Any] = {}
        for cache in self._living.values():
            active = cache.status is KVCacheStatus.ACTIVE
            for g in range(self.layout.num_layer_groups):
                table = cache.get_base_page_indices(g)
                for index, page in enumerate(cache.pages(g)):
                    if page is not None:
                        pages[id(page)] = page
                        counts = locks if active else holds
                        counts[id(page)] = counts.get(id(page), 0) + 1
                    if not active:
                        continue  # a suspended request's table is refreshed on resume
                    expected = -1 if page is None else page.slot_id
                    if table[index] != expected:
                        problems.append(
                            f"cache {cache.id} group {g} block {index}: table {table[index]} != {expected}"
                        )
                    if page is not None and page.level != 0:
                        problems.append(f"cache {cache.id} is active but {page} is not on the GPU")
            for _, index, page in cache._deferred:
                if index < 0:
                    pages[id(page)] = page
                    holds[id(page)] = holds.get(id(page), 0) + 1
        tpb = self.layout.tokens_per_block
        for block in [*tree.roots.values(), *tree.blocks()]:
            partial = sum(1 for child in block.children if child.num_tokens < tpb)
            if partial != block.num_partial_children:
                problems.append(
                    f"{block}: counts {block.num_partial_children} partial children, has {partial}"
                )
        in_tree = list(tree.blocks())
        if len(in_tree) != len(tree.index) or any(
            tree.index.get(block.key) is not block for block in in_tree
        ):
            problems.append("the tree's key index does not match its blocks")
        for block in in_tree:
            if (
                not block.in_tree
                or block.parent is None
                or block.parent.child(block.key) is not block
            ):
                problems.append(f"{block}: broken parent link")
            for g, page in enumerate(block):
                if page is not None:
                    pages[id(page)] = page
                    if page.block is not block or page.layer_group != g:
                        problems.append(f"{page} is not linked back to {block}")
        for queues in storage.queues:
            for queue in queues:
                queue.check_invariants()
                for page in queue:
                    pages[id(page)] = page
        used: dict[tuple[int, int], set[int]] = {}
        for key, page in pages.items():
            if page.slot is None:
                problems.append(f"{page} is referenced but freed")
                continue
            if (page.locks, page.holds) != (locks.get(key, 0), holds.get(key, 0)):
                problems.append(
                    f"{page}: owners counted {locks.get(key, 0)} locks, {holds.get(key, 0)} holds"
                )
            if page.queued != storage.is_evictable(page):
                problems.append(
                    f"{page}: queued {page.queued} but evictable {storage.is_evictable(page)}"
                )
            if not page.locks and not page.holds and page.block is None:
                problems.append(f"{page}: nobody owns it and it is not cached")
            if storage.pages[page.level][page.pool_group].get(page.slot_id) is not page:
                problems.append(f"{page} is missing from the slot registry")
            slots = used.setdefault((page.level, page.pool_group), set())
            if page.slot_id in slots:
                problems.append(
                    f"slot {page.slot_id} of pool group {page.pool_group} has two pages"
                )
            slots.add(page.slot_id)
        for level, level_storage in enumerate(storage.levels):
            for pg, group in enumerate(level_storage.pool_groups):
                group.allocator.check_invariants()
                occupied = group.allocator.num_occupied_slots
                if occupied != len(storage.pages[level][pg]):
                    problems.append(f"level {level} pool group {pg}: slot registry out of date")
                if occupied != len(used.get((level, pg), ())):
                    problems.append(
                        f"level {level} pool group {pg}: {occupied} slots occupied, {len(used.get((level, pg), ()))} pages"
                    )
                queued = sum(
                    1
                    for p in pages.values()
                    if p.queued and p.level == level and p.pool_group == pg
                )
                if queued != len(storage.queues[level][pg]):
                    problems.append(f"level {level} pool group {pg}: queue length mismatch")
        if problems:
            raise CorruptedError("; ".join(problems[:10]))

    def _require_open(self) -> None:
        if self._closed:
            raise LogicError("the manager was shut down")
        if _debug.DEBUG:
            self._check_thread()

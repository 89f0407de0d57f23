"""The manager's core: building the layout, the levels, the storage manager and the tree from a
config, and the queries about them (layout, levels, page views, statistics, consistency)."""

from __future__ import annotations

import copy
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, SupportsIndex

from kvpool import _debug
from kvpool.cache import CacheContext, CacheParts, KVCache, RequestState
from kvpool.cache.timed import TimedKVCache
from kvpool.config import (
    CacheTier,
    KVCacheDesc,
    KVCacheManagerConfig,
    KVEventsConfig,
)
from kvpool.errors import LogicError
from kvpool.events.log import KVEventLog
from kvpool.events.naming import MEDIA
from kvpool.events.publisher import KVEventPublisher
from kvpool.eviction import ClassedQueue
from kvpool.layout import KVLayout
from kvpool.manager.invariants import check_invariants
from kvpool.manager.levels import build_levels, start_disk_level
from kvpool.manager.recovery import DiskRecovery
from kvpool.policies import CLASSES, EvictionPolicy, make_policy
from kvpool.radix import RadixTree, lost_block
from kvpool.rebalance import DemandEstimator
from kvpool.records import LostBlock, Page
from kvpool.remote import RemoteStatistics, RemoteTier
from kvpool.stats import Counters, LatencyHistogram, ManagerStats, PoolGroupUsage
from kvpool.storage.memory import HostMemory
from kvpool.storage.pools import LevelStorage
from kvpool.tiers import StorageManager
from kvpool.tiers.persistence import DiskRecords
from kvpool.validation import check_bool, check_callable, check_index, fail

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


class ManagerCore:
    """Construction and queries (the requests and rebalancing parts build on it)."""

    def __init__(
        self, config: KVCacheManagerConfig, *, clock: Callable[[], float] | None = None
    ) -> None:
        """`clock` (seconds, default `time.monotonic`) times the rebalancing cooldown: the one
        input of the manager that is not a call, read only by `need_adjustment` (a hint; the
        decision is the engine's call of `adjust()`). Every decision inside a call (hits,
        evictions, the policy's picks, slot ids, moves) depends on the calls alone. Ranks agree
        on the cooldown through `kvpool.distributed.Agreement`; a replay passes its trace time.

        Threads: the manager and its KV caches are driven from one thread (the engine's
        scheduler loop); nothing is locked. With `KVPOOL_DEBUG=1` a call from another thread
        than the first caller's raises `LogicError` (`transfer_to_current_thread()` hands the
        manager over on purpose)."""
        if not isinstance(config, KVCacheManagerConfig):
            fail("config", config, "a KVCacheManagerConfig")
        check_callable("clock", clock)
        config.validate()
        self._closed = False
        self._checks = _debug.DEBUG  # (read once: a field per call, not a module lookup)
        self._owner_thread: int | None = None
        self._config = copy.deepcopy(config)
        self.layout = KVLayout(self._config.layers, self._config.tokens_per_block)
        self._min_slots = self._floors()
        ratio = self._initial_ratio()
        self._levels: list[LevelStorage] = build_levels(
            self._config, self.layout, ratio, self._min_slots
        )
        self._storage = StorageManager(self._levels)
        if self._levels[0].pool_groups[0].on_device:  # host levels pinned for the GPU's copies
            for storage in self._levels[1:]:
                for group in storage.pool_groups:
                    for memory in group.memories:
                        if isinstance(memory, HostMemory):
                            memory.pin()
        self._tree = RadixTree(self.layout)
        self._storage.state.on_drop = self._tree.remove_pages
        # The first level's records, up front: it fills in the engine's loop (section 7).
        self._tree.make_spare_blocks(self._storage.state.make_records(0))
        self._clock = clock or time.monotonic
        # The policy decides what the last level drops; what it keeps stays cached somewhere
        # in every level together, so its horizon is the blocks of all levels.
        capacity = sum(max(level.slot_counts) for level in self._levels)
        policy = make_policy(self._config.eviction_policy, capacity)
        self._policy: EvictionPolicy | None = None if policy.name == "lru" else policy
        if self._policy is not None:  # (no page is queued yet)
            queues = self._storage.state.queues[self._storage.state.last_level]
            queues[:] = [ClassedQueue(self._policy, CLASSES) for _ in queues]
        self._remote: RemoteTier | None = None
        if self._config.remote_tier is not None:
            try:
                self._remote = RemoteTier(self._config.remote_tier, self.layout)
                self._tree.placement_blocks = self._remote.placement_blocks
            except BaseException:
                self._storage.close()
                raise
        if self._remote is not None or self._policy is not None:
            self._storage.state.on_drop = self._drop
        self._kv_events: KVEventLog | None = None
        self._publisher: KVEventPublisher | None = None
        if self._config.kv_events is not None:
            self._start_kv_events(self._config.kv_events)
        self._persist, self._disk_recovery = self._start_disk_level()
        self.rebalancer = DemandEstimator(self._config, self.layout, self._clock)
        self._constrained: dict[int, tuple[object, int, list[float]]] = {}
        self._living: dict[int, KVCache] = {}
        self._ids = itertools.count()
        self._level_names = [level.tier.name for level in self._levels]
        self._counters = Counters(hit_tokens_by_level=[0] * len(self._levels))
        self._cache_class: type[KVCache] = KVCache
        self._context = CacheContext(
            layout=self.layout,
            state=self._storage.state,
            owners=self._storage.owners,
            allocation=self._storage.allocation,
            migration=self._storage.migration,
            tree=self._tree,
            max_util_for_resume=self._config.max_util_for_resume,
            on_close=self._forget,
            check=self._after_call,
            check_thread=self._check_thread,
            remote=self._remote,
            counters=self._counters,
            policy=self._policy,
        )
        self._cache_parts = CacheParts(self._context)

    def _start_disk_level(self) -> tuple[DiskRecords | None, DiskRecovery | None]:
        """A persistent disk level's blocks found again, its records kept from now on (a
        method: compiled, `__init__` would read `_kv_events` as the None it starts as)."""
        try:
            return start_disk_level(
                self._levels, self._tree, self._storage, self._policy, self._kv_events
            )
        except BaseException:
            if self._publisher is not None:
                self._publisher.close()
            if self._remote is not None:
                self._remote.close()
            self._storage.close()
            raise

    def _drop(self, pages: Sequence[Page]) -> Sequence[Page]:
        """The tree's `remove_pages`, telling the eviction policy (last level) and the remote
        tier: the dropped pages of committed full blocks (any level), and of the blocks that
        lose their reuse with them, are written to the remote tier before their slots go."""
        policy, last = self._policy, self._storage.state.last_level
        if policy is None or not pages or pages[0].level != last:
            return self._remove_pages(pages)
        blocks = [page.block for page in pages if page.block is not None]
        parents = [block.parent for block in blocks]
        orphans = self._remove_pages(pages)
        policy.dropped(blocks, parents)
        return orphans

    def _remove_pages(self, pages: Sequence[Page]) -> Sequence[Page]:
        """`RadixTree.remove_pages`, writing what is lost to the remote tier if there is one."""
        if self._remote is None:
            return self._tree.remove_pages(pages)
        tpb = self.tokens_per_block
        items: list[tuple[LostBlock, Page]] = []
        for page in pages:
            block = page.block
            if block is not None and block.num_tokens == tpb:
                lost = lost_block(block, tpb)
                assert lost is not None
                items.append((lost, page))
        lost_blocks: list[LostBlock | None] = []
        orphans = self._tree.remove_pages(pages, lost_blocks)
        if orphans:
            dropped = {id(page) for page in pages}  # (written above, or not at all)
            items += [
                (lost, page)
                for lost, page in zip(lost_blocks, orphans, strict=True)
                if lost is not None and id(page) not in dropped
            ]
        if items:
            self._write_remote(items)
        return orphans

    def _write_remote(self, items: list[tuple[LostBlock, Page]]) -> int:
        """Queue pages of committed full blocks for the remote tier; how many were queued."""
        assert self._remote is not None
        queued = self._remote.write_back(items, self._storage.migration.read_page)
        if self._kv_events is not None and queued:
            self._kv_events.written_remote([(items[i][0], items[i][1].layer_group) for i in queued])
        return len(queued)

    def _start_kv_events(self, config: KVEventsConfig) -> None:
        from kvpool.events.publisher import KVEventPublisher

        media = [MEDIA[level.tier] for level in self._levels]
        try:
            self._publisher = KVEventPublisher(config)
        except BaseException:
            if self._remote is not None:
                self._remote.close()
            self._storage.close()
            raise
        self._kv_events = KVEventLog(self.tokens_per_block, media, self._publisher.publish)
        self._storage.state.kv_events = self._tree.kv_events = self._kv_events

    def flush_kv_events(self) -> None:
        """Publish the KV events recorded since the last call as one batch (call it once per
        engine step; a no-op without `kv_events`)."""
        if self._kv_events is not None:
            self._kv_events.flush()

    @property
    def kv_event_endpoints(self) -> tuple[str, str | None] | None:
        """The addresses the KV event sockets are bound to (PUB, replay ROUTER), or None."""
        if self._publisher is None:
            return None
        return self._publisher.endpoint, self._publisher.replay_endpoint

    def _forget(self, cache: RequestState) -> None:
        del self._living[cache.id]
        capacity, history = cache.mean_shape
        if not cache.exclude_from_stats and capacity > 0:
            self.rebalancer.sample(capacity, history, cache.reused_length)

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

    def get_layer_group_id(self, layer_id: SupportsIndex) -> int:
        group = self.layout.layer_group_of.get(layer_id) if type(layer_id) is int else None
        if group is None:
            fail("layer_id", layer_id, f"one of {sorted(self.layout.layer_group_of)}")
        return group

    def get_pool_group_index(self, layer_group_id: SupportsIndex) -> int:
        check_index("layer_group_id", layer_group_id, self.layout.num_layer_groups)
        return self.layout.pool_group_of[layer_group_id]

    def level_storage(self, level: SupportsIndex) -> LevelStorage:
        return self._levels[self._level(level)]

    def _level(self, level: object) -> int:
        """`level` checked (the manager must be open)."""
        self._require_open()
        return check_index("level", level, len(self._levels))

    def get_tier(self, level: SupportsIndex) -> CacheTier:
        return self.level_storage(level).tier

    def get_quota(self, level: SupportsIndex) -> int:
        """The level's byte budget; its pools use at most this much."""
        return self.level_storage(level).quota

    def get_slot_counts(self, level: SupportsIndex) -> list[int]:
        """Slots per pool group at `level`."""
        return self.level_storage(level).slot_counts

    def page_view(self, layer_id: SupportsIndex, role: object) -> Any:
        """Writable uint8 array [num_pages, page_bytes] over one buffer's GPU-level memory
        (numpy; a torch tensor for CUDA memory). Rows are what `get_page_indices` returns.
        Re-fetch after anything that resizes pools."""
        placement = self.layout.placement(layer_id, role)
        pool = self.level_storage(0).pool_groups[placement.pool_group].pool_view(placement.pool)
        return pool.reshape(-1, placement.size)

    def get_storage_statistics(self, level: SupportsIndex) -> list[StorageStatistics]:
        """Per pool group at `level`: slot sizes, total, free, evictable, available, unavailable."""
        level = self._level(level)
        storage = self._levels[level]
        return [
            StorageStatistics(
                slot_sizes=group.slot_sizes,
                total=group.num_slots,
                free=group.allocator.num_free_slots,
                evictable=self._storage.state.num_evictable(level, index),
            )
            for index, group in enumerate(storage.pool_groups)
        ]

    @property
    def num_dropped_pages(self) -> int:
        """Committed pages evicted from the last level so far (their KV is gone)."""
        return self._storage.state.num_dropped

    def stats(self) -> ManagerStats:
        """A snapshot of memory use per level and pool group, prefix-cache queries and hits by
        serving level, page traffic, suspensions, rebalances and (after `time_calls()`) call
        latencies. O(levels x pool groups); reads counters only, so a metrics thread may call
        it while the engine runs (figures from different instants, each consistent)."""
        storage, counters = self._storage, self._counters
        usage = []
        for level, level_storage in enumerate(self._levels):
            for index, group in enumerate(level_storage.pool_groups):
                free = group.allocator.num_free_slots
                usage.append(
                    PoolGroupUsage(
                        level,
                        level_storage.tier.name,
                        index,
                        group.num_slots,
                        group.num_slots - free,
                        storage.state.num_evictable(level, index),
                        sum(group.slot_sizes),
                    )
                )
        remote = self.remote_statistics()
        calls = dict(counters.calls or {})
        return ManagerStats(
            pool_groups=usage,
            level_names=list(self._level_names),
            requests=counters.requests,
            query_tokens=counters.query_tokens,
            hit_tokens_by_level=list(counters.hit_tokens_by_level),
            remote_hit_tokens=0 if remote is None else remote.hit_tokens,
            dropped_pages_by_level=list(storage.state.num_dropped_at),
            moved_pages_to_level=list(storage.state.num_moved),
            moved_bytes_to_level=list(storage.state.bytes_moved),
            swapped_pages=storage.state.num_swapped,
            copy_bytes=storage.state.copy_bytes,
            copy_seconds=storage.state.copy_seconds,
            suspensions=counters.suspensions,
            resumes=counters.resumes,
            failed_resumes=counters.failed_resumes,
            forks=counters.forks,
            copy_on_write_pages=counters.copy_on_write_pages,
            rebalances=counters.rebalances,
            rebalance_bytes=counters.rebalance_bytes,
            rebalance_seconds=counters.rebalance_seconds.copy(),
            calls={name: histogram.copy() for name, histogram in calls.items()},
            remote=remote,
        )

    def time_calls(self, on: object = True) -> None:
        """Time the hot calls (create_kv_cache, probe_reuse, adjust, and resume, suspend,
        resize, commit, prefetch, close of requests created from now on) into `stats().calls`.
        Off by default: then they cost nothing."""
        check_bool("on", on)
        if on:
            if self._counters.calls is None:
                self._counters.calls = {}
            self._cache_class = TimedKVCache
        else:
            self._counters.calls = None
            self._cache_class = KVCache

    def _observe(self, name: str, started: float) -> None:
        calls = self._counters.calls
        if calls is not None:
            calls.setdefault(name, LatencyHistogram()).observe(time.perf_counter() - started)

    def remote_statistics(self) -> RemoteStatistics | None:
        """Counters of the remote tier (None without one): lookups, hits from other
        instances, values gone or corrupt, failed and skipped calls, writes."""
        return None if self._remote is None else self._remote.statistics

    def flush_remote_writes(self, timeout: float | None = 10.0) -> bool:
        """Wait until the blocks queued for the remote tier are written (or failed); False
        when `timeout` seconds pass first. True at once without a remote tier."""
        return True if self._remote is None else self._remote.flush(timeout)

    def record_decisions(self, on: object = True) -> None:
        """Start (or stop) recording the decisions replicated managers must agree on and that
        their return values and statistics do not show: which prefix each new request reused,
        which pages eviction dropped or moved (by slot id), each re-split. For
        `kvpool.distributed`'s divergence check; off by default (it then costs nothing)."""
        check_bool("on", on)
        self._storage.state.events = [] if on else None

    def note_decision(self, *decision: object) -> None:
        """Add a decision taken outside the manager (an agreed rebalance) to the record, in
        order with the manager's own (nothing when not recording)."""
        if self._storage.state.events is not None:
            self._storage.state.events.append(decision)

    def take_decisions(self) -> list[tuple[object, ...]]:
        """The decisions recorded since the last call (see `record_decisions`), oldest first."""
        events = self._storage.state.events
        if events is None:
            return []
        self._storage.state.events = []
        return events

    @property
    def num_moved_pages(self) -> list[int]:
        """Pages that arrived at each level so far (eviction down, bringing up, prefetch)."""
        return list(self._storage.state.num_moved)

    def _after_call(self) -> None:
        if self._checks:
            self._check_thread()
            self.check_invariants()

    @property
    def on_device(self) -> bool:
        """Whether the GPU level is CUDA memory (else host memory stands in for it)."""
        return self._levels[0].pool_groups[0].on_device

    def set_engine_stream(self, stream: Any) -> None:
        """The CUDA stream the engine's kernels run on, which kvpool's copies are ordered with
        (the engine guide): a copy waits for the work queued on it before the call, and its
        later work waits for the copy. None (the default): the stream current in the calling
        thread at each call. `LogicError` without a CUDA level (nothing to order)."""
        if not self.on_device:
            raise LogicError("set_engine_stream: the GPU level is host memory (no CUDA device)")
        self._storage.state.copier.order.engine_stream = stream

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
        check_invariants(self.layout, self._storage, self._tree, self._living.values())

    def _require_open(self) -> None:
        if self._closed:
            raise LogicError("the manager was shut down")
        if self._checks:
            self._check_thread()

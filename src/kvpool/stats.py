"""What a manager has done, as plain numbers: `KVCacheManager.stats()` returns a `ManagerStats`
snapshot that engines can log and that `kvpool.metrics` exports to Prometheus.

The counters are kept where the work happens (integer additions on the engine's thread, no
per-token work); call latencies are timed only after `KVCacheManager.time_calls()`.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

from kvpool.remote import RemoteStatistics

# Upper bounds (seconds) of the latency buckets: 1 us to 10 s, 1-2-5 steps.
LATENCY_BOUNDS: tuple[float, ...] = tuple(
    float(f"{m}e{e}") for e in range(-6, 1) for m in (1, 2, 5)
) + (10.0,)


@dataclass
class LatencyHistogram:
    """Counts of durations per bucket (`LATENCY_BOUNDS`, then one for longer ones)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BOUNDS) + 1))
    total_seconds: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(LATENCY_BOUNDS, seconds)] += 1
        self.total_seconds += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def copy(self) -> LatencyHistogram:
        return LatencyHistogram(list(self.counts), self.total_seconds)


@dataclass
class Counters:
    """The manager's running counters (the storage manager keeps the page-traffic ones)."""

    requests: int = 0  # create_kv_cache calls
    query_tokens: int = 0  # tokens they passed (the prompts' reusable part)
    hit_tokens_by_level: list[int] = field(default_factory=list)  # reused, by coldest level
    suspensions: int = 0
    resumes: int = 0  # resume() calls that returned True (from SUSPENDED)
    failed_resumes: int = 0
    forks: int = 0  # fork_kv_cache calls
    copy_on_write_pages: int = 0  # shared pages copied by prepare_write
    rebalances: int = 0  # adjust_cache_level calls carried out (by adjust() or the engine)
    rebalance_bytes: int = 0  # bytes they moved (inside the level or down)
    rebalance_seconds: LatencyHistogram = field(default_factory=LatencyHistogram)
    calls: dict[str, LatencyHistogram] | None = None  # per call name, while timing


@dataclass(frozen=True)
class PoolGroupUsage:
    """One pool group at one level."""

    level: int
    tier: str  # GPU, HOST or DISK
    pool_group: int
    slots: int
    used_slots: int  # held by requests or caching reusable blocks
    evictable_slots: int  # cached pages nobody holds (the room eviction can make)
    slot_bytes: int

    @property
    def usage(self) -> float:
        """Fraction of the slots in use (0 to 1)."""
        return self.used_slots / self.slots if self.slots else 0.0


@dataclass(frozen=True)
class ManagerStats:
    """A snapshot of a manager's memory and traffic (`KVCacheManager.stats()`)."""

    pool_groups: list[PoolGroupUsage]
    level_names: list[str]
    requests: int
    query_tokens: int  # tokens passed to create_kv_cache (vLLM's prefix-cache "queries")
    hit_tokens_by_level: list[int]  # reused tokens served from each level (coldest page)
    remote_hit_tokens: int  # reused tokens fetched from the remote tier
    dropped_pages_by_level: list[int]  # cached pages evicted out of the local levels
    moved_pages_to_level: list[int]  # pages copied into each level from another one
    moved_bytes_to_level: list[int]
    swapped_pages: int  # pages brought up through RAM when every level was full
    copy_bytes: int  # bytes copied by page moves (between and inside levels)
    copy_seconds: float  # time spent in those copies
    suspensions: int
    resumes: int
    failed_resumes: int
    forks: int  # requests forked from another (fork_kv_cache)
    copy_on_write_pages: int  # pages a fork shared, copied before a write (prepare_write)
    rebalances: int
    rebalance_bytes: int
    rebalance_seconds: LatencyHistogram
    calls: dict[str, LatencyHistogram]  # per call, after `time_calls()`; else empty
    remote: RemoteStatistics | None

    @property
    def hit_tokens(self) -> int:
        return sum(self.hit_tokens_by_level) + self.remote_hit_tokens


__all__ = ["LATENCY_BOUNDS", "Counters", "LatencyHistogram", "ManagerStats", "PoolGroupUsage"]

"""Eviction policies: which cached blocks the manager lets go first.

The mechanism is fixed: per (level, pool group) an eviction queue, lowest priority first, then
least recently released (`eviction.py`); the engine's `priority_callback` sets a block's
priority when it is committed. A policy (`KVCacheManagerConfig.eviction_policy`) decides on top
of that, through these hooks (each O(1) or O(blocks touched) per call for `lru`; `age` adds a
walk over the cached blocks and its ghosts every eighth of a capacity of inserted blocks, O(1)
per inserted block amortized):

- `used(blocks, now)`: a new request reused these blocks (a prefix match);
- `inserted(blocks, now)`: a request committed these new blocks;
- `dropped(blocks)`: these blocks' pages left the last level (their KV is gone);
- `release_priority(now, oldest_age)`: when a request closes, the priority its default-priority
  pages are queued with (None: leave them), given the age of the oldest default-priority block
  at the last level.

`lru` is the queue alone. `age` learns, online, how likely a block is to be used again within a
horizon given how long it has gone unused (a hazard per age bin: reuses of cached leaves and of
recently dropped blocks remembered as ghosts, over the sampled time blocks spent at each age)
and queues a closing request's pages as transient (evicted before the others) when a fresh
block is less likely to be used soon than the oldest one, as on conversation traces where turns come back after a minute or
two rather than at once: LRU, which keeps every block about capacity / inflow seconds, drops
most of them just before their next turn. See `benchmarks/eviction_study.py` and the README for
what it reaches and where it still falls short.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

from kvpool.config import EVICTION_POLICIES
from kvpool.errors import ConfigError
from kvpool.records import DEFAULT_PRIORITY, Block

TRANSIENT_PRIORITY = DEFAULT_PRIORITY - 1


class EvictionPolicy:
    """LRU: the eviction queue's own order (every hook a no-op)."""

    name = "lru"

    def used(self, blocks: Sequence[Block], now: float) -> None:
        pass

    def inserted(self, blocks: Sequence[Block], now: float) -> None:
        pass

    def dropped(self, blocks: Sequence[Block]) -> None:
        pass

    def release_priority(self, now: float, oldest_age: float | None) -> int | None:
        return None


class AgePolicy(EvictionPolicy):
    """Transient admission by a learned reuse hazard over block ages (module docstring).

    The hazard per age bin is reuses seen at that age over the time blocks spent at that age
    (exposure), counting eviction candidates only: cached leaves and the ghosts of dropped
    blocks. Exposure is sampled: every eighth of a capacity's worth of inserted blocks, each
    leaf's and ghost's age adds a sample period to its bin (an O(capacity) walk every
    capacity / 8 insertions: O(1) per inserted block, amortized)."""

    name = "age"

    def __init__(
        self,
        capacity_blocks: int,
        leaf_times: Callable[[], Iterable[float]] = tuple,
        horizon_factor: float = 1.0,
        bins: int = 48,
        ghosts_per_block: int = 4,
        fade: float = 0.7,
    ) -> None:
        self.capacity = capacity_blocks
        self.leaf_times = leaf_times  # last-use times of the cached leaf blocks
        self.horizon_factor = horizon_factor
        self.bins = bins
        self.ghost_limit = ghosts_per_block * capacity_blocks
        self.fade = fade ** (1 / 8)  # per sample: `fade` per capacity's worth of inserted blocks
        self.ghosts: dict[bytes, float] = {}  # dropped block key -> its last use
        self.events = [0.0] * bins  # reuses per age bin
        self.exposure = [0.0] * bins  # seconds spent in each age bin
        self.start: float | None = None
        self.inserts = 0
        self.width = 0.0  # seconds per bin, once the inflow rate is known
        self.horizon = 0.0
        self.period = 0.0  # seconds between exposure samples
        self._next_sample = math.inf
        self._scores: list[float] | None = None

    # -- hooks -----------------------------------------------------------------------------------

    def used(self, blocks: Sequence[Block], now: float) -> None:
        if blocks:
            deepest = blocks[-1]
            if deepest.kids is None and deepest.used_at:  # a cached leaf reused
                self._reused(now - deepest.used_at)
            for block in blocks:
                block.used_at = now

    def inserted(self, blocks: Sequence[Block], now: float) -> None:
        if self.start is None:
            self.start = now
        ghosts = self.ghosts
        for block in blocks:
            used = ghosts.pop(block.key, None)
            if used is not None:
                self._reused(now - used)
            block.used_at = now
        self.inserts += len(blocks)
        if not self.width and self.inserts >= self.capacity and now > self.start:
            rate = self.inserts / (now - self.start)  # blocks per second
            self.width = self.ghost_limit / rate / self.bins
            self.horizon = self.horizon_factor * self.capacity / rate
            self.period = self.capacity / rate / 8
            self._next_sample = now
        if now >= self._next_sample:
            self._sample(now)

    def dropped(self, blocks: Sequence[Block]) -> None:
        ghosts = self.ghosts
        for block in blocks:
            if block.used_at:
                ghosts[block.key] = block.used_at
        while len(ghosts) > self.ghost_limit:  # forget the oldest
            del ghosts[next(iter(ghosts))]

    def release_priority(self, now: float, oldest_age: float | None) -> int | None:
        if not self.width or oldest_age is None:
            return None
        scores = self._score_table()
        fresh, oldest = scores[0], self._score(scores, oldest_age)
        return TRANSIENT_PRIORITY if fresh < oldest else DEFAULT_PRIORITY

    # -- the hazard ------------------------------------------------------------------------------

    def _reused(self, age: float) -> None:
        if self.width:
            b = int(age / self.width)
            if b < self.bins:
                self.events[b] += 1
                self._scores = None

    def _sample(self, now: float) -> None:
        fade, width, bins, period = self.fade, self.width, self.bins, self.period
        self.events = [e * fade for e in self.events]
        exposure = [e * fade for e in self.exposure]
        for times in (self.leaf_times(), self.ghosts.values()):
            for used in times:
                b = int((now - used) / width)
                if b < bins:
                    exposure[b] += period
        self.exposure = exposure
        self._next_sample = now + period
        self._scores = None

    def _score_table(self) -> list[float]:
        """Per age bin: P(used again within the horizon | unused that long)."""
        if self._scores is None:
            hazard = [
                e / x if x > 0 else 0.0 for e, x in zip(self.events, self.exposure, strict=True)
            ]
            span = max(1, int(self.horizon / self.width))
            self._scores = [
                1 - math.exp(-sum(hazard[b : b + span]) * self.width) for b in range(self.bins)
            ]
        return self._scores

    def _score(self, scores: list[float], age: float) -> float:
        b = int(age / self.width)
        return scores[b] if b < self.bins else 0.0


def make_policy(
    name: str, capacity_blocks: int, leaf_times: Callable[[], Iterable[float]] = tuple
) -> EvictionPolicy:
    """The policy `name` for a last level of `capacity_blocks` blocks; `leaf_times` gives the
    last-use times of the cached leaf blocks (for `age`)."""
    if name == "lru":
        return EvictionPolicy()
    if name == "age":
        return AgePolicy(capacity_blocks, leaf_times)
    raise ConfigError(
        f"eviction_policy={name!r} is invalid: must be one of {list(EVICTION_POLICIES)}"
    )


__all__ = ["EVICTION_POLICIES", "TRANSIENT_PRIORITY", "AgePolicy", "EvictionPolicy", "make_policy"]

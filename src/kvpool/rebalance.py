"""Demand estimate for pool rebalancing: what byte split between pool groups the workload needs.

Closed requests feed bias-corrected moving averages of their squared mean capacity, squared mean
history length and reused prefix length (squares, because long requests live longer but are
sampled once: the root mean square weighs them back). Every `update_interval` samples these
become target byte ratios: the GPU level is sized for the blocks a typical request needs per
layer group (stale window blocks excluded), colder levels for the reused prefixes they keep.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from kvpool.config import KVCacheManagerConfig
from kvpool.layout import KVLayout


class MovingAverage:
    """EMA with bias correction: the first sample is taken exactly, early ones average like a
    cumulative mean, and it tends to an EMA over about 1 / (1 - decay) samples."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.weight = 0.0
        self.value = 0.0

    def update(self, sample: float) -> None:
        self.weight = 1.0 + self.decay * self.weight
        self.value += (sample - self.value) / self.weight


class DemandEstimator:
    """Samples closed requests and keeps target byte ratios per pool group."""

    def __init__(
        self, config: KVCacheManagerConfig, layout: KVLayout, clock: Callable[[], float]
    ) -> None:
        decay = config.rebalance_moving_average_decay
        self.layout = layout
        self.clock = clock
        self.min_samples = config.rebalance_min_sampled_kv_caches
        self.cooldown = config.rebalance_cooldown_secs
        self.update_interval = config.rebalance_target_ratio_update_interval
        self.threshold = config.rebalance_ratio_threshold
        self.sqr_capacity = MovingAverage(decay)
        self.sqr_history = MovingAverage(decay)
        self.reused = MovingAverage(decay)
        self.num_sampled = 0
        self._since_update = 0
        self.gpu_target: list[float] | None = None  # byte ratio per pool group
        self.cold_target: list[float] | None = None
        self.last_adjustment = clock()

    def sample(self, mean_capacity: float, mean_history: float, reused_length: int) -> None:
        """One closed request's shape."""
        self.sqr_capacity.update(mean_capacity * mean_capacity)
        self.sqr_history.update(mean_history * mean_history)
        self.reused.update(reused_length)
        self.num_sampled += 1
        self._since_update += 1
        if self._since_update >= self.update_interval:
            self._since_update = 0
            self.update_targets()

    def update_targets(self) -> None:
        capacity = round(math.sqrt(self.sqr_capacity.value))
        history = min(round(math.sqrt(self.sqr_history.value)), capacity)
        if capacity > 0:
            self.gpu_target = self.layout.request_byte_ratio(capacity, history)
        reused = round(self.reused.value)
        if reused > 0:
            self.cold_target = self.layout.request_byte_ratio(reused, reused)

    def target(self, level: int) -> list[float] | None:
        return self.gpu_target if level == 0 else self.cold_target

    def gates_open(self) -> bool:
        """Enough samples and the cooldown passed."""
        return (
            self.num_sampled >= self.min_samples
            and self.clock() - self.last_adjustment >= self.cooldown
        )

    def mismatch(self, target: Sequence[float] | None, current: Sequence[float]) -> bool:
        """Some pool group's target/current share leaves the open interval (1/t, t)."""
        if target is None:
            return False
        t = self.threshold
        for want, have in zip(target, current, strict=True):
            if have <= 0.0:
                if want > 0.0:
                    return True
                continue
            if not 1.0 / t < want / have < t:
                return True
        return False

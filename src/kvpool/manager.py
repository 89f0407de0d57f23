"""KVCacheManager: owns the layout and every cache level's pools; the entry point users need.

This is the foundation part: validation, layout, initial sizing of every level and page views.
Requests, reuse, tiers and rebalancing build on it.
"""

from __future__ import annotations

import copy
from typing import Any

from kvpool.config import CacheTier, DiskCacheTierConfig, KVCacheDesc, KVCacheManagerConfig
from kvpool.errors import ArgumentError, LogicError
from kvpool.layout import KVLayout
from kvpool.storage.pools import LevelStorage

# The request shape that sizes pool groups when the config names none.
DEFAULT_REQUEST = KVCacheDesc(capacity=2049, history_length=2048)


class KVCacheManager:
    """Paged, tiered KV-cache memory for one model."""

    def __init__(self, config: KVCacheManagerConfig) -> None:
        config.validate()
        self._closed = False
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
            self.shutdown()
            raise

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
        try:
            return self.layout.layer_group_of[layer_id]
        except (KeyError, TypeError):
            raise ArgumentError(
                f"layer_id={layer_id!r} is invalid: must be one of {sorted(self.layout.layer_group_of)}"
            ) from None

    def get_pool_group_index(self, layer_group_id: int) -> int:
        if (
            not isinstance(layer_group_id, int)
            or not 0 <= layer_group_id < self.layout.num_layer_groups
        ):
            raise ArgumentError(
                f"layer_group_id={layer_group_id!r} is invalid: must be in "
                f"[0, {self.layout.num_layer_groups})"
            )
        return self.layout.pool_group_of[layer_group_id]

    # -- levels ----------------------------------------------------------------------------------

    def level_storage(self, level: int) -> LevelStorage:
        self._require_open()
        if not isinstance(level, int) or not 0 <= level < len(self._levels):
            raise ArgumentError(f"level={level!r} is invalid: must be in [0, {len(self._levels)})")
        return self._levels[level]

    def get_tier(self, level: int) -> CacheTier:
        return self.level_storage(level).tier

    def get_quota(self, level: int) -> int:
        """The level's byte budget; its pools use at most this much."""
        return self.level_storage(level).quota

    def get_slot_counts(self, level: int) -> list[int]:
        """Slots per pool group at `level`."""
        return self.level_storage(level).slot_counts

    def page_view(self, layer_id: int, role: str) -> Any:
        """Writable uint8 array [num_pages, page_bytes] over one buffer's GPU-level memory
        (numpy; a torch tensor for CUDA memory). Rows are what `get_page_indices` returns.
        Re-fetch after anything that resizes pools."""
        try:
            placement = self.layout.buffers[layer_id, role]
        except (KeyError, TypeError):
            raise ArgumentError(
                f"(layer_id, role)=({layer_id!r}, {role!r}) is invalid: must name a configured buffer"
            ) from None
        pool = self.level_storage(0).pool_groups[placement.pool_group].pool_view(placement.pool)
        return pool.reshape(-1, placement.size)

    def shutdown(self) -> None:
        """Release every level's memory (idempotent)."""
        for level in self._levels:
            level.close()
        self._levels = []
        self._closed = True

    def _require_open(self) -> None:
        if self._closed:
            raise LogicError("the manager was shut down")

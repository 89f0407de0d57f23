"""The levels a manager is built on: one `LevelStorage` per cache tier of its config (a disk tier
with a `persistent_id` in a persistent disk level's named files), and the start of a persistent
disk level: its blocks found again (`kvpool.manager.recovery`), its records kept from then on
(`kvpool.tiers.persistence`)."""

from __future__ import annotations

from collections.abc import Sequence

from kvpool import _debug
from kvpool.config import DiskCacheTierConfig, KVCacheManagerConfig
from kvpool.events.log import KVEventLog
from kvpool.layout import KVLayout
from kvpool.manager.invariants import check_invariants
from kvpool.manager.recovery import DiskRecovery, disk_identity, recover
from kvpool.policies import EvictionPolicy
from kvpool.radix import RadixTree
from kvpool.storage.persistent import PersistentLevelStorage
from kvpool.storage.pools import LevelStorage
from kvpool.tiers import StorageManager
from kvpool.tiers.persistence import DiskRecords, label_bytes


def build_levels(
    config: KVCacheManagerConfig,
    layout: KVLayout,
    ratio: Sequence[float],
    min_slots: Sequence[int],
) -> list[LevelStorage]:
    """Every level's pools, split by `ratio` with `min_slots` floors (on a failure, the levels
    made so far are closed)."""
    slot_sizes = [group.slot_sizes for group in layout.pool_groups]
    levels: list[LevelStorage] = []
    try:
        for level, tier_config in enumerate(config.cache_tiers):
            quota_name = f"cache_tiers[{level}].quota"
            if isinstance(tier_config, DiskCacheTierConfig) and tier_config.persistent_id:
                levels.append(
                    PersistentLevelStorage(
                        tier_config.quota,
                        slot_sizes,
                        ratio,
                        min_slots,
                        path=tier_config.path,
                        identity=disk_identity(tier_config.persistent_id, layout),
                        label_bytes=label_bytes(config.tokens_per_block),
                        quota_name=quota_name,
                    )
                )
                continue
            levels.append(
                LevelStorage(
                    tier_config.tier,
                    tier_config.quota,
                    slot_sizes,
                    ratio,
                    min_slots,
                    disk_path=tier_config.path
                    if isinstance(tier_config, DiskCacheTierConfig)
                    else None,
                    quota_name=quota_name,
                    shared_dir=getattr(tier_config, "shared_dir", None),  # (GPU level)
                    shared_by_fd=getattr(tier_config, "shared_by_fd", False),
                )
            )
    except BaseException:
        for storage in levels:
            storage.close()
        raise
    return levels


def start_disk_level(
    levels: Sequence[LevelStorage],
    tree: RadixTree,
    storage: StorageManager,
    policy: EvictionPolicy | None,
    kv_events: KVEventLog | None,
) -> tuple[DiskRecords | None, DiskRecovery | None]:
    """For a persistent disk level (the last level, if any): its blocks put back into `tree`,
    then its records kept as pages arrive there. (None, None) without one."""
    last = levels[-1]
    if not isinstance(last, PersistentLevelStorage):
        return None, None
    records = DiskRecords(len(levels) - 1, last.persistent)
    recovery = recover(tree.layout, tree, storage, records, policy, kv_events)
    storage.state.persist = records
    if _debug.DEBUG:
        check_invariants(tree.layout, storage, tree, ())
    return records, recovery


__all__ = ["build_levels", "start_disk_level"]

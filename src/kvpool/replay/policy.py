"""Eviction policies for replays, expressed through the manager's public priority hooks.

`lru` is the manager's own order: lowest priority first, then least recently released (every
block gets the default priority). More policies come with the eviction-policy work; a name is
offered only when it changes behaviour."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.cache import KVCache
from kvpool.errors import ArgumentError
from kvpool.manager import KVCacheManager
from kvpool.records import DEFAULT_PRIORITY


@dataclass(frozen=True)
class EvictionPolicy:
    """How replayed requests prioritize their blocks for eviction."""

    name: str
    manager_policy: str = "lru"  # the manager's eviction policy (KVCacheManagerConfig)

    def priority(self, ordinal: int, layer_group: int) -> int:
        return DEFAULT_PRIORITY

    def on_reuse(self, manager: KVCacheManager, cache: KVCache) -> None:
        """Called when a request was created with a reused prefix."""


POLICIES = {"lru": EvictionPolicy("lru"), "age": EvictionPolicy("age", manager_policy="age")}
"""The policies a replay can use, by name (only those that behave differently are offered)."""

OFFLINE_OPTIMUM = "belady"
"""Prefix-cache mode only: the offline optimum, a reference line (it knows the future)."""


def policy_for(policy: str | EvictionPolicy) -> EvictionPolicy:
    if isinstance(policy, EvictionPolicy):
        return policy
    try:
        return POLICIES[policy]
    except KeyError:
        raise ArgumentError(
            f"policy={policy!r} is invalid: must be one of {sorted(POLICIES)}"
        ) from None

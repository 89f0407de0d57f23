"""Eviction policies for replays, expressed through the manager's public priority hooks.

Every block gets the default priority; the name picks the manager's eviction policy
(`kvpool.policies`: `hazard`, the default, `lru`, `lfu`)."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.cache import KVCache
from kvpool.config import EVICTION_POLICIES
from kvpool.errors import ArgumentError
from kvpool.manager import KVCacheManager
from kvpool.records import DEFAULT_PRIORITY


@dataclass(frozen=True)
class EvictionPolicy:
    """How replayed requests prioritize their blocks for eviction."""

    name: str
    manager_policy: str  # the manager's eviction policy (KVCacheManagerConfig)

    def priority(self, ordinal: int, layer_group: int) -> int:
        return DEFAULT_PRIORITY

    def on_reuse(self, manager: KVCacheManager, cache: KVCache) -> None:
        """Called when a request was created with a reused prefix."""


POLICIES = {name: EvictionPolicy(name, name) for name in EVICTION_POLICIES}
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

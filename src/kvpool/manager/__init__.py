"""The KV-cache manager: `KVCacheManager` and its statistics record."""

from kvpool.manager.core import StorageStatistics
from kvpool.manager.manager import KVCacheManager

__all__ = ["KVCacheManager", "StorageStatistics"]

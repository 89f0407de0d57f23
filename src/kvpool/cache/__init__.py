"""A request's KV cache: `KVCache` and what it needs from its manager."""

from kvpool.cache.kvcache import CacheParts, KVCache
from kvpool.cache.state import (
    GPU_LEVEL,
    CacheContext,
    KVCacheStatus,
    PriorityCallback,
    RequestState,
)

__all__ = [
    "GPU_LEVEL",
    "CacheContext",
    "CacheParts",
    "KVCache",
    "KVCacheStatus",
    "PriorityCallback",
    "RequestState",
]

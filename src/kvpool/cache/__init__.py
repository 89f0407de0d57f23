"""A request's KV cache: `KVCache` and what it needs from its manager."""

from kvpool.cache.kvcache import KVCache
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
    "KVCache",
    "KVCacheStatus",
    "PriorityCallback",
    "RequestState",
]

"""kvpool: a paged, tiered KV-cache manager for LLM inference engines."""

from kvpool.cache import KVCache, KVCacheStatus
from kvpool.config import (
    AttentionLayerConfig,
    BatchDesc,
    BufferConfig,
    CacheTier,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheDesc,
    KVCacheManagerConfig,
    KVEventsConfig,
    RemoteCacheTierConfig,
    ReuseScope,
    SsmLayerConfig,
)
from kvpool.errors import (
    ArgumentError,
    ConfigError,
    CorruptedError,
    DivergenceError,
    KVPoolError,
    LogicError,
    OutOfPagesError,
    StorageError,
)
from kvpool.manager import KVCacheManager, StorageStatistics

__version__ = "0.1.0"

__all__ = [
    "ArgumentError",
    "AttentionLayerConfig",
    "BatchDesc",
    "BufferConfig",
    "CacheTier",
    "ConfigError",
    "CorruptedError",
    "DiskCacheTierConfig",
    "DivergenceError",
    "GpuCacheTierConfig",
    "HostCacheTierConfig",
    "KVCache",
    "KVCacheDesc",
    "KVCacheManager",
    "KVCacheManagerConfig",
    "KVCacheStatus",
    "KVEventsConfig",
    "KVPoolError",
    "LogicError",
    "OutOfPagesError",
    "RemoteCacheTierConfig",
    "ReuseScope",
    "SsmLayerConfig",
    "StorageError",
    "StorageStatistics",
    "__version__",
]

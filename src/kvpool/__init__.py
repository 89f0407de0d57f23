"""kvpool: a paged, tiered KV-cache manager for LLM inference engines."""

from kvpool import _backends

_backends.select()  # before any module of the core is imported: it decides where they load from

# ruff: noqa: E402
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


def backend() -> str:
    """The backend that runs the core: `native` (compiled) or `python` (the reference). Set by
    `KVPOOL_BACKEND` before kvpool is imported; `backend_info()` says why a native request
    fell back."""
    return _backends.select().name


def backend_info() -> _backends.BackendInfo:
    """The backend that runs, the one asked for, and why they differ."""
    return _backends.select()


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
    "backend",
    "backend_info",
]

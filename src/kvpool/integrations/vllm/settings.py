"""What the connector is told: `kv_connector_extra_config` checked key by key, the page format
that both sides derive from vLLM's KV-cache config, and the kvpool manager built from both.

Keys of `kv_connector_extra_config` (all optional):

| key | meaning | default |
|---|---|---|
| `host_bytes` | host memory for kvpool's first level (shared with vLLM's workers) | 1 GiB |
| `disk_bytes`, `disk_path` | a disk level below it (both or neither) | none |
| `remote_url` | a Valkey/Redis server shared by engines (`valkey://host:port`) | none |
| `remote_namespace` | separates tenants on one server | `""` |
| `remote_timeout_ms` | bound on every call to the server | 500 |
| `eviction_policy` | `hazard`, `lru` or `lfu` | `hazard` |
| `model_id` | the model's identity in keys that outlive the process, in place of the one computed from its config and weights (`identity.py`) | computed |
| `kv_events_endpoint` | ZMQ endpoint publishing kvpool's KV events | none |
| `stats_path` | a file the scheduler side keeps its counters in (JSON, rewritten as they change) | none |
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from kvpool.config import (
    EVICTION_POLICIES,
    AttentionLayerConfig,
    BufferConfig,
    CacheTierConfig,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    KVCacheManagerConfig,
    KVEventsConfig,
    RemoteCacheTierConfig,
)
from kvpool.errors import ConfigError

GiB = 1 << 30
EXTRA_CONFIG_KEYS = (
    "host_bytes",
    "disk_bytes",
    "disk_path",
    "remote_url",
    "remote_namespace",
    "remote_timeout_ms",
    "eviction_policy",
    "model_id",
    "kv_events_endpoint",
    "stats_path",
)


def _fail(key: str, value: object, allowed: str) -> None:
    raise ConfigError(f"kv_connector_extra_config[{key!r}]={value!r} is invalid: must be {allowed}")


def _int(extra: dict[str, Any], key: str, default: int, minimum: int) -> int:
    value = extra.get(key, default)
    if type(value) is not int or value < minimum:
        _fail(key, value, f"an integer >= {minimum}")
    return int(value)


def _str(extra: dict[str, Any], key: str, default: str | None) -> str | None:
    value = extra.get(key, default)
    if value is not None and not isinstance(value, str):
        _fail(key, value, "a string")
    return value


@dataclass(frozen=True)
class ConnectorSettings:
    """`kv_connector_extra_config`, checked (the module docstring lists the keys)."""

    host_bytes: int = GiB
    disk_bytes: int = 0
    disk_path: str | None = None
    remote_url: str | None = None
    remote_namespace: str = ""
    remote_timeout_ms: int = 500
    eviction_policy: str = EVICTION_POLICIES[0]
    model_id: str | None = None
    kv_events_endpoint: str | None = None
    stats_path: str | None = None

    @classmethod
    def parse(cls, extra: object) -> ConnectorSettings:
        """`ConfigError` naming the first bad key, before anything is built."""
        if extra is None:
            extra = {}
        if not isinstance(extra, dict):
            raise ConfigError(f"kv_connector_extra_config={extra!r} is invalid: must be a dict")
        if "shared_dir" in extra:
            _fail(
                "shared_dir",
                extra["shared_dir"],
                "left out: kvpool's host level is anonymous shared memory handed to vLLM's "
                "workers by file descriptor (no file in /dev/shm)",
            )
        unknown = sorted(str(key) for key in extra if key not in EXTRA_CONFIG_KEYS)
        if unknown:
            _fail(
                unknown[0], extra[unknown[0]], f"left out: the keys are {list(EXTRA_CONFIG_KEYS)}"
            )
        disk_bytes = _int(extra, "disk_bytes", 0, 0)
        disk_path = _str(extra, "disk_path", None)
        if disk_bytes and (disk_path is None or not os.path.isdir(disk_path)):
            _fail("disk_path", disk_path, "an existing directory when disk_bytes > 0")
        if disk_path is not None and not disk_bytes:
            _fail("disk_bytes", disk_bytes, "> 0 when disk_path is set")
        policy = extra.get("eviction_policy", EVICTION_POLICIES[0])
        if policy not in EVICTION_POLICIES:
            _fail("eviction_policy", policy, f"one of {list(EVICTION_POLICIES)}")
        model_id = _str(extra, "model_id", None)
        if model_id is not None and not model_id.strip():
            _fail("model_id", model_id, "a non-empty string")
        settings = cls(
            host_bytes=_int(extra, "host_bytes", GiB, 1),
            disk_bytes=disk_bytes,
            disk_path=disk_path,
            remote_url=_str(extra, "remote_url", None),
            remote_namespace=_str(extra, "remote_namespace", "") or "",
            remote_timeout_ms=_int(extra, "remote_timeout_ms", 500, 1),
            eviction_policy=str(policy),
            model_id=model_id,
            kv_events_endpoint=_str(extra, "kv_events_endpoint", None),
            stats_path=_str(extra, "stats_path", None),
        )
        if settings.remote_url is not None:
            try:
                settings.remote_tier("model").validate("remote_url")
            except ConfigError as error:
                _fail("remote_url", settings.remote_url, f"a server URL ({error})")
        return settings

    def remote_tier(self, model_id: str) -> RemoteCacheTierConfig:
        assert self.remote_url is not None
        return RemoteCacheTierConfig(
            url=self.remote_url,
            namespace=self.remote_namespace,
            model_id=model_id,
            timeout_ms=self.remote_timeout_ms,
            tolerate_unavailable=True,  # a dead server costs hits, never the engine
        )


@dataclass(frozen=True)
class PageFormat:
    """How one vLLM block of every layer is laid out in a kvpool page.

    A page holds, per layer, a `"k"` and a `"v"` buffer of [heads, block_size, head_size]
    elements of the KV cache's dtype, where `heads` counts the KV heads of all tensor-parallel
    ranks: rank r reads and writes heads [r * local_heads, (r + 1) * local_heads)."""

    layer_names: tuple[str, ...]
    block_size: int
    local_heads: int
    head_size: int
    itemsize: int
    tp_rank: int
    tp_size: int

    @property
    def heads(self) -> int:
        return self.local_heads * self.tp_size

    @property
    def buffer_bytes(self) -> int:
        return self.heads * self.block_size * self.head_size * self.itemsize

    @classmethod
    def from_vllm(cls, vllm_config: Any, kv_cache_config: Any) -> PageFormat:
        """Refuses, naming what, every KV-cache config it cannot hold exactly."""
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        groups = list(kv_cache_config.kv_cache_groups)
        if len(groups) != 1:
            raise ConfigError(
                f"KVPoolConnector supports models with one KV-cache group; this one has "
                f"{len(groups)} ({', '.join(type(g.kv_cache_spec).__name__ for g in groups)}): "
                "several KV-cache groups (vLLM's hybrid allocator) are not supported yet"
            )
        spec = groups[0].kv_cache_spec
        if type(spec) is not FullAttentionSpec:
            raise ConfigError(
                f"KVPoolConnector supports full attention only; this model's KV cache is "
                f"{type(spec).__name__}"
            )
        if spec.head_size_v != spec.head_size or str(spec.kv_quant_mode.name) != "NONE":
            raise ConfigError(
                "KVPoolConnector supports K and V of one head size, unquantized; this model has "
                f"head_size={spec.head_size}, head_size_v={spec.head_size_v}, "
                f"kv_quant_mode={spec.kv_quant_mode.name}"
            )
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size != 1:
            raise ConfigError(
                "KVPoolConnector supports pipeline_parallel_size=1 only; this engine has "
                f"{parallel.pipeline_parallel_size}"
            )
        tp_rank = 0
        if parallel.tensor_parallel_size > 1:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            try:
                tp_rank = get_tensor_model_parallel_rank()
            except (AssertionError, AttributeError):
                tp_rank = 0  # (the scheduler's process: it has no rank and needs none)
        return cls(
            layer_names=tuple(groups[0].layer_names),
            block_size=int(spec.block_size),
            local_heads=int(spec.num_kv_heads),
            head_size=int(spec.head_size),
            itemsize=int(spec.dtype.itemsize),
            tp_rank=tp_rank,
            tp_size=int(parallel.tensor_parallel_size),
        )

    def manager_config(self, settings: ConnectorSettings, model_id: str) -> KVCacheManagerConfig:
        """kvpool's manager: level 0 in host memory shared with the workers (by file
        descriptor), then disk, then the remote tier. `model_id`: the model's identity."""
        tiers: list[CacheTierConfig] = [GpuCacheTierConfig(settings.host_bytes, shared_by_fd=True)]
        if settings.disk_bytes:
            assert settings.disk_path is not None
            tiers.append(DiskCacheTierConfig(settings.disk_bytes, settings.disk_path))
        size = self.buffer_bytes
        layers = [
            AttentionLayerConfig(i, [BufferConfig("k", size), BufferConfig("v", size)])
            for i in range(len(self.layer_names))
        ]
        events = None
        if settings.kv_events_endpoint is not None:
            events = KVEventsConfig(endpoint=settings.kv_events_endpoint)
        remote = None if settings.remote_url is None else settings.remote_tier(model_id)
        return KVCacheManagerConfig(
            tokens_per_block=self.block_size,
            cache_tiers=tiers,
            layers=layers,
            enable_partial_reuse=False,  # vLLM takes whole blocks only
            remote_tier=remote,
            kv_events=events,
            eviction_policy=settings.eviction_policy,
            max_util_for_resume=1.0,
        )


__all__ = ["EXTRA_CONFIG_KEYS", "ConnectorSettings", "PageFormat"]

"""What the backend is told: SGLang's `--hicache-storage-backend-extra-config`, checked key by
key before anything is built.

| key | meaning | default |
|---|---|---|
| `staging_bytes` | kvpool's first level: host memory pages pass through between SGLang's host pool and the levels below (pages read recently stay there) | 256 MiB |
| `host_bytes` | a host-memory level below it | none |
| `disk_bytes`, `disk_path` | a disk level (both or neither); each SGLang process (its tensor-, pipeline- and data-parallel rank) keeps its files in a directory of its own below `disk_path` | none |
| `disk_persist` | the disk level outlives the process: a restarted server of the same model identity finds its pages again, each checked | `true` |
| `remote_url` | a Valkey/Redis server shared by servers (`valkey://host:port`) | none |
| `remote_namespace` | separates tenants on one server | `""` |
| `remote_timeout_ms` | bound on every call to the server (past it: a miss) | 500 |
| `eviction_policy` | `hazard`, `lru` or `lfu` | `hazard` |
| `model_id` | the model's identity in keys, in place of the one computed from SGLang's model path (its config and weights when it is a local directory) | computed |
| `timeout_ms` | how long a call waits for another thread's call on the backend (past it: a miss, or a write not done) | 5000 |
| `pool_shares` | a hybrid model's pools (`kv`, and `swa` or `mamba`) each have levels of their own: the share of `staging_bytes`, `host_bytes` and `disk_bytes` each pool gets, as relative weights naming every pool (`{"kv": 3, "mamba": 1}`) | in proportion to one stored page of each pool (each pool holds as many pages) |

SGLang's own keys (`backend_name`, `module_path`, `class_name`, `interface_v1`) are left alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvpool.config import EVICTION_POLICIES, RemoteCacheTierConfig
from kvpool.errors import ConfigError
from kvpool.integrations.extra_config import ExtraConfig

_EXTRA = ExtraConfig("hicache_storage_backend_extra_config")
_fail = _EXTRA.fail
_int = _EXTRA.integer
_str = _EXTRA.string

MiB = 1 << 20
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size")
KEYS = (
    "staging_bytes",
    "host_bytes",
    "disk_bytes",
    "disk_path",
    "disk_persist",
    "remote_url",
    "remote_namespace",
    "remote_timeout_ms",
    "eviction_policy",
    "model_id",
    "timeout_ms",
    "pool_shares",
)


@dataclass(frozen=True)
class BackendSettings:
    """The extra config, checked (the module docstring lists the keys)."""

    staging_bytes: int = 256 * MiB
    host_bytes: int = 0
    disk_bytes: int = 0
    disk_path: str | None = None
    disk_persist: bool = True
    remote_url: str | None = None
    remote_namespace: str = ""
    remote_timeout_ms: int = 500
    eviction_policy: str = EVICTION_POLICIES[0]
    model_id: str | None = None
    timeout_ms: int = 5000
    pool_shares: tuple[tuple[str, float], ...] | None = None  # (checked against the pools later)

    @classmethod
    def parse(cls, extra: object) -> BackendSettings:
        """`ConfigError` naming the first bad key."""
        if extra is None:
            extra = {}
        if not isinstance(extra, dict):
            raise ConfigError(
                f"hicache_storage_backend_extra_config={extra!r} is invalid: must be a dict"
            )
        unknown = sorted(str(k) for k in extra if k not in KEYS and k not in SGLANG_KEYS)
        if unknown:
            _fail(unknown[0], extra[unknown[0]], f"left out: kvpool's keys are {list(KEYS)}")
        disk_bytes = _int(extra, "disk_bytes", 0, 0)
        disk_path = _str(extra, "disk_path", None)
        if disk_bytes and (disk_path is None or not os.path.isdir(disk_path)):
            _fail("disk_path", disk_path, "an existing directory when disk_bytes > 0")
        if disk_path is not None and not disk_bytes:
            _fail("disk_bytes", disk_bytes, "> 0 when disk_path is set")
        persist = extra.get("disk_persist", True)
        if type(persist) is not bool:
            _fail("disk_persist", persist, "true or false")
        policy = extra.get("eviction_policy", EVICTION_POLICIES[0])
        if policy not in EVICTION_POLICIES:
            _fail("eviction_policy", policy, f"one of {list(EVICTION_POLICIES)}")
        model_id = _str(extra, "model_id", None)
        if model_id is not None and not model_id.strip():
            _fail("model_id", model_id, "a non-empty string")
        shares = extra.get("pool_shares")
        if shares is not None and (
            not isinstance(shares, dict)
            or not shares
            or not all(
                isinstance(k, str) and type(v) in (int, float) and v > 0 for k, v in shares.items()
            )
        ):
            _fail("pool_shares", shares, 'a dict of pool names to weights > 0 ({"kv": 3, ...})')
        settings = cls(
            staging_bytes=_int(extra, "staging_bytes", 256 * MiB, 1),
            host_bytes=_int(extra, "host_bytes", 0, 0),
            disk_bytes=disk_bytes,
            disk_path=disk_path,
            disk_persist=bool(persist),
            remote_url=_str(extra, "remote_url", None),
            remote_namespace=_str(extra, "remote_namespace", "") or "",
            remote_timeout_ms=_int(extra, "remote_timeout_ms", 500, 1),
            eviction_policy=str(policy),
            model_id=model_id,
            timeout_ms=_int(extra, "timeout_ms", 5000, 1),
            pool_shares=None
            if shares is None
            else tuple(sorted((str(k), float(v)) for k, v in shares.items())),
        )
        if settings.remote_url is not None:
            try:
                settings.remote_tier("model", 0).validate("remote_url")
            except ConfigError as error:
                _fail("remote_url", settings.remote_url, f"a server URL ({error})")
        return settings

    def remote_tier(self, model_id: str, shard: int) -> RemoteCacheTierConfig:
        assert self.remote_url is not None
        return RemoteCacheTierConfig(
            url=self.remote_url,
            namespace=self.remote_namespace,
            model_id=model_id,
            timeout_ms=self.remote_timeout_ms,
            tolerate_unavailable=True,  # a dead server costs hits, never the server
            shard=shard,
            placement_tokens=None,  # (every page is a chain of its own)
        )


__all__ = ["KEYS", "BackendSettings"]

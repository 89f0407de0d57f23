"""What `kvpool serve` is told: its flags, checked (naming the first bad one), and the manager
it builds for the first engine's layout."""

from __future__ import annotations

import dataclasses
import grp
import os

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
from kvpool.node import protocol as p


@dataclasses.dataclass(frozen=True)
class DaemonSettings:
    """What `kvpool serve` is told (its flags); `check()` names the first bad one."""

    socket: str
    host_bytes: int = 1 << 30
    disk_bytes: int = 0
    disk_path: str | None = None
    disk_persist: bool = False
    remote_url: str | None = None
    remote_namespace: str = ""
    remote_timeout_ms: int = 500
    eviction_policy: str = EVICTION_POLICIES[0]
    kv_events_endpoint: str | None = None
    metrics_port: int | None = None
    group: str | None = None  # a group whose members may connect too (socket mode 0660)
    io_timeout_s: float = 0.5
    release_grace_s: float = 2.0
    max_clients: int = 64
    max_handles: int = 4096  # pages-holding requests per engine
    max_waiting: int = 64  # lookups per engine waiting for I/O
    busy_poll_s: float = 0.0002  # after a message, poll this long before sleeping

    def check(self) -> None:
        def fail(flag: str, value: object, allowed: str) -> None:
            raise ConfigError(f"--{flag}={value!r} is invalid: must be {allowed}")

        directory = os.path.dirname(self.socket) or "."
        if not os.path.isabs(self.socket) or len(self.socket.encode()) > 107:
            fail("socket", self.socket, "an absolute path of at most 107 bytes")
        if not os.path.isdir(directory):
            fail("socket", self.socket, f"in an existing directory ({directory} is none)")
        if self.host_bytes < 1:
            fail("host-bytes", self.host_bytes, ">= 1")
        if self.disk_bytes < 0:
            fail("disk-bytes", self.disk_bytes, ">= 0")
        if self.disk_bytes and (self.disk_path is None or not os.path.isdir(self.disk_path)):
            fail("disk-path", self.disk_path, "an existing directory when --disk-bytes > 0")
        if self.disk_path is not None and not self.disk_bytes:
            fail("disk-bytes", self.disk_bytes, "> 0 when --disk-path is set")
        if self.disk_persist and not self.disk_bytes:
            fail("disk-persist", True, "left out without a disk level")
        if self.eviction_policy not in EVICTION_POLICIES:
            fail("eviction-policy", self.eviction_policy, f"one of {list(EVICTION_POLICIES)}")
        if self.remote_timeout_ms < 1:
            fail("remote-timeout-ms", self.remote_timeout_ms, ">= 1")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            fail("metrics-port", self.metrics_port, "a port in [0, 65535]")
        if not 0.001 <= self.io_timeout_s <= 60:
            fail("io-timeout-ms", int(self.io_timeout_s * 1000), "in [1, 60000]")
        if not 0 <= self.release_grace_s <= 600:
            fail("release-grace-ms", int(self.release_grace_s * 1000), "in [0, 600000]")
        for flag, value in (("max-clients", self.max_clients), ("max-handles", self.max_handles)):
            if value < 1:
                fail(flag, value, ">= 1")
        if self.max_waiting < 0:
            fail("max-waiting", self.max_waiting, ">= 0")
        if not 0 <= self.busy_poll_s <= 0.1:
            fail("busy-poll-us", round(self.busy_poll_s * 1e6), "in [0, 100000]")
        if self.group is not None:
            self.group_id()
        if self.remote_url is not None:
            try:
                self.remote_tier().validate("remote_url")
            except ConfigError as error:
                fail("remote-url", self.remote_url, f"a server URL ({error})")

    def group_id(self) -> int | None:
        if self.group is None:
            return None
        try:
            return int(self.group) if self.group.isdigit() else grp.getgrnam(self.group).gr_gid
        except KeyError:
            raise ConfigError(f"--group={self.group!r} is invalid: no such group") from None

    def remote_tier(self) -> RemoteCacheTierConfig:
        assert self.remote_url is not None
        return RemoteCacheTierConfig(
            url=self.remote_url,
            namespace=self.remote_namespace,
            model_id="kvpool-node",  # (each key's scope carries its engine's model identity)
            timeout_ms=self.remote_timeout_ms,
            tolerate_unavailable=True,
        )

    def manager_config(self, hello: p.Hello) -> KVCacheManagerConfig:
        """The manager for the first engine's layout (`engine_manager_config`)."""
        layers = [
            AttentionLayerConfig(
                layer.layer_id,
                [BufferConfig(name, size) for name, size in layer.buffers],
                sliding_window_size=layer.window,
            )
            for layer in hello.layers
        ]
        return engine_manager_config(
            hello.tokens_per_block,
            layers,
            host_bytes=self.host_bytes,
            disk_bytes=self.disk_bytes,
            disk_path=self.disk_path,
            persistent_id="kvpool-node" if self.disk_persist else None,
            remote=None if self.remote_url is None else self.remote_tier(),
            kv_events_endpoint=self.kv_events_endpoint,
            eviction_policy=self.eviction_policy,
        )


def engine_manager_config(
    tokens_per_block: int,
    layers: list[AttentionLayerConfig],
    *,
    host_bytes: int,
    disk_bytes: int,
    disk_path: str | None,
    persistent_id: str | None,
    remote: RemoteCacheTierConfig | None,
    kv_events_endpoint: str | None,
    eviction_policy: str,
) -> KVCacheManagerConfig:
    """The manager that serves an engine's copies, a connector's own or a node daemon's:
    level 0 in host memory shared with the engine's workers by file descriptor, then disk,
    then the remote tier; whole blocks only (engines load whole blocks)."""
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(host_bytes, shared_by_fd=True)]
    if disk_bytes:
        assert disk_path is not None
        tiers.append(DiskCacheTierConfig(disk_bytes, disk_path, persistent_id))
    events = None if kv_events_endpoint is None else KVEventsConfig(endpoint=kv_events_endpoint)
    return KVCacheManagerConfig(
        tokens_per_block=tokens_per_block,
        cache_tiers=tiers,
        layers=layers,
        enable_partial_reuse=False,
        remote_tier=remote,
        kv_events=events,
        eviction_policy=eviction_policy,
        max_util_for_resume=1.0,
    )


__all__ = ["DaemonSettings", "engine_manager_config"]

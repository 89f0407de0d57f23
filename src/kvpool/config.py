"""Configuration dataclasses and their validation.

`KVCacheManagerConfig.validate()` checks everything a manager relies on before any memory is
touched; each error names the offending field (as a path such as ``layers[2].buffers[0].size``),
the bad value and the allowed range.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, NamedTuple, NoReturn
from urllib.parse import urlsplit

from kvpool.errors import ConfigError
from kvpool.lifecycles import AttentionLifeCycle, SsmLifeCycle
from kvpool.validation import check_bool, check_int, check_sequence, fail
from kvpool.validation import is_int as _is_int
from kvpool.validation import is_real as _is_real


class CacheTier(IntEnum):
    """Kinds of cache level, warm to cold; a config lists its tiers in this order."""

    GPU = 0
    HOST = 1
    DISK = 2


@dataclass(frozen=True)
class BufferConfig:
    """One per-block byte region of a layer (e.g. its keys), `size` bytes per token block."""

    role: str
    size: int


@dataclass(frozen=True)
class AttentionLayerConfig:
    """An attention layer: full attention, or a sliding window of `sliding_window_size` tokens
    that always keeps its first `num_sink_tokens` tokens."""

    layer_id: int
    buffers: Sequence[BufferConfig]
    sliding_window_size: int | None = None
    num_sink_tokens: int | None = None

    def life_cycle(self, tokens_per_block: int) -> AttentionLifeCycle:
        """When this layer's blocks stop being needed (sinks counted in whole blocks)."""
        sinks = self.num_sink_tokens or 0
        return AttentionLifeCycle(self.sliding_window_size, -(-sinks // tokens_per_block))


@dataclass(frozen=True)
class SsmLayerConfig:
    """A recurrent (SSM) layer: one state slot per request instead of one page per block."""

    layer_id: int
    buffers: Sequence[BufferConfig]

    def life_cycle(self, tokens_per_block: int) -> SsmLifeCycle:
        return SsmLifeCycle()


LayerConfig = AttentionLayerConfig | SsmLayerConfig


@dataclass(frozen=True)
class GpuCacheTierConfig:
    """Level 0: accelerator memory, `quota` bytes.

    `shared_dir`: keep level 0 in host memory instead, one file per pool in this existing
    directory (a RAM file system: /dev/shm), which other processes map by name
    (`kvpool.storage.memory.map_shared`). For engines whose workers copy KV in and out of
    kvpool's pages in other processes (the vLLM connector). The files go with the manager.

    `shared_by_fd`: the same in anonymous shared memory (memfd), no file in any directory:
    other processes open it through `/proc/<pid>/fd/<fd>` (`KVCacheManager.shared_memory()`),
    and the kernel frees it when the last process holding it ends, however it ends."""

    quota: int
    shared_dir: str | None = None
    shared_by_fd: bool = False

    @property
    def tier(self) -> CacheTier:
        return CacheTier.GPU


@dataclass(frozen=True)
class HostCacheTierConfig:
    """Host RAM, `quota` bytes."""

    quota: int

    @property
    def tier(self) -> CacheTier:
        return CacheTier.HOST


@dataclass(frozen=True)
class DiskCacheTierConfig:
    """A disk level of `quota` bytes in directory `path`, gone with the process; or, with a
    `persistent_id` (a non-empty string: the model's identity digest, whatever changes the KV
    bytes), kept in named files there (`kvpool-disk.pg<N>.kvp`) in which a later manager with
    the same id and layout finds the blocks again (`KVCacheManager.disk_recovery`; Design: "A
    persistent disk level"). One manager at a time owns them (an exclusive `flock`)."""

    quota: int
    path: str
    persistent_id: str | None = None

    @property
    def tier(self) -> CacheTier:
        return CacheTier.DISK


CacheTierConfig = GpuCacheTierConfig | HostCacheTierConfig | DiskCacheTierConfig

REMOTE_SCHEMES = ("valkey", "valkeys", "redis", "rediss")
EVICTION_POLICIES = ("hazard", "lru", "lfu")  # (kvpool.policies; the first is the default)


def redact_url(url: object) -> object:
    """`url` as errors, logs and reports may show it: whatever stands between the scheme and
    the last '@' (a user and a password) replaced by '***'; anything else as it is."""
    if not isinstance(url, str) or "@" not in url:
        return url
    scheme, separator, rest = url.partition("://")
    host = rest.rpartition("@")[2] if separator else url.rpartition("@")[2]
    return f"{scheme}://***@{host}" if separator else f"***@{host}"


def _is_remote_url(url: object) -> bool:
    if not isinstance(url, str):
        return False
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError on a bad port)
    except ValueError:
        return False
    database = parts.path.strip("/")
    return (
        parts.scheme.lower() in REMOTE_SCHEMES
        and bool(parts.hostname)
        and (not database or database.isdigit())
    )


@dataclass(frozen=True)
class RemoteCacheTierConfig:
    """A shared tier on a Valkey (or Redis) server or cluster, below the local levels.

    `url`: ``valkey://[user:password@]host:port[/db]`` (``valkeys://`` for TLS), or a list of
    such URLs naming nodes of a cluster (`cluster=True` makes a single URL a cluster seed). A
    password missing from the URL is read from the environment variable `password_env`.
    `namespace` and `model_id` separate tenants and models (with the layout's fingerprint, they
    make the key prefix). `timeout_ms` bounds every call to the server; `tolerate_unavailable`
    starts in degraded mode (with a warning) instead of failing when the server is down.
    `max_pending_writes` bounds the blocks waiting to be written back (more are dropped, and
    counted); `max_lookup_blocks` bounds the blocks one lookup asks about. `shard` says which
    part of the model's KV this manager holds: under tensor parallelism, the rank (ranks hold
    different KV heads in pages of the same layout; managers of different shards never share
    values; `kvpool.distributed.Agreement` refuses a mismatch).

    `placement_tokens`: on a cluster, the blocks of a prompt's first `placement_tokens` tokens
    live with its first block, the rest with the block there (hash tags in the keys), so a
    failed node costs only the prompts it holds. 0: whole chains with their first block; None:
    each block on its own. Instances sharing a tier must agree (see the remote-tier guide).
    """

    url: str | Sequence[str]
    namespace: str = ""
    model_id: str = ""
    cluster: bool = False
    password_env: str = "KVPOOL_REMOTE_PASSWORD"
    timeout_ms: int = 500
    tolerate_unavailable: bool = False
    max_pending_writes: int = 4096
    max_lookup_blocks: int = 256
    reconnect_min_ms: int = 100
    reconnect_max_ms: int = 10_000
    shard: int = 0
    placement_tokens: int | None = 512

    @property
    def urls(self) -> list[str]:
        return [self.url] if isinstance(self.url, str) else list(self.url)

    def __repr__(self) -> str:  # (configs get printed and logged: never with a password)
        shown = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        url = self.url
        shown["url"] = (
            [redact_url(u) for u in url] if isinstance(url, list | tuple) else redact_url(url)
        )
        return f"RemoteCacheTierConfig({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    def validate(self, name: str = "remote_tier") -> None:
        urls = self.url if isinstance(self.url, list | tuple) else [self.url]
        if not urls:
            _fail(f"{name}.url", self.url, "a URL or a non-empty list of URLs")
        for i, url in enumerate(urls):
            field_name = f"{name}.url" if isinstance(self.url, str) else f"{name}.url[{i}]"
            if not _is_remote_url(url):
                allowed = f"a URL {'|'.join(REMOTE_SCHEMES)}://host:port[/db]"
                _fail(field_name, redact_url(url), allowed)
        for field_name in ("namespace", "model_id", "password_env"):
            if not isinstance(getattr(self, field_name), str):
                _fail(f"{name}.{field_name}", getattr(self, field_name), "a string")
        check_bool(f"{name}.cluster", self.cluster, ConfigError)
        check_bool(f"{name}.tolerate_unavailable", self.tolerate_unavailable, ConfigError)
        for field_name in ("timeout_ms", "max_pending_writes", "max_lookup_blocks"):
            _positive_int(f"{name}.{field_name}", getattr(self, field_name))
        _positive_int(f"{name}.reconnect_min_ms", self.reconnect_min_ms)
        check_int(f"{name}.shard", self.shard, 0, None, ConfigError)
        if self.placement_tokens is not None:
            check_int(f"{name}.placement_tokens", self.placement_tokens, 0, None, ConfigError)
        check_int(
            f"{name}.reconnect_max_ms",
            self.reconnect_max_ms,
            self.reconnect_min_ms,
            None,
            ConfigError,
        )


@dataclass(frozen=True)
class KVEventsConfig:
    """Publish KV events (blocks stored and removed per medium) for KV-aware routers, over ZMQ
    in vLLM's wire format (`kvpool.events`; needs the `events` extra).

    `endpoint`: the PUB socket's address, bound (``tcp://*:5557``; port 0 picks a free one).
    `replay_endpoint`: a ROUTER socket's address for replays of the last `buffer_steps`
    batches, or None. `topic`: the first frame of every message. `hwm`: the PUB socket's
    high-water mark. `data_parallel_rank`: stamped on every batch. `max_queue_batches`: batches
    waiting for the publisher's thread before the engine waits for it.
    """

    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    hwm: int = 100_000
    data_parallel_rank: int = 0
    max_queue_batches: int = 100_000

    def validate(self, name: str = "kv_events") -> None:
        for field_name in ("endpoint", "replay_endpoint"):
            value = getattr(self, field_name)
            if value is None and field_name == "replay_endpoint":
                continue
            if not isinstance(value, str) or "://" not in value:
                _fail(f"{name}.{field_name}", value, "a ZMQ address like tcp://*:5557")
        if not isinstance(self.topic, str):
            _fail(f"{name}.topic", self.topic, "a string")
        for field_name in ("buffer_steps", "hwm", "max_queue_batches"):
            _positive_int(f"{name}.{field_name}", getattr(self, field_name))
        check_int(f"{name}.data_parallel_rank", self.data_parallel_rank, 0, None, ConfigError)


class ReuseScope(NamedTuple):
    """Requests reuse each other's blocks only within the same scope (LoRA adapter, salt)."""

    lora_id: int | None = None
    salt: int | bytes | str | None = None


@dataclass(frozen=True)
class KVCacheDesc:
    """The shape of one request: `capacity` tokens reserved, `history_length` already computed."""

    capacity: int
    history_length: int


@dataclass(frozen=True)
class BatchDesc:
    """A batch of requests that run together; the first `system_prompt_length` tokens of every
    request are a shared prompt (its full blocks are counted once)."""

    kv_caches: Sequence[KVCacheDesc]
    system_prompt_length: int = 0


@dataclass
class KVCacheManagerConfig:
    """Everything a `KVCacheManager` needs to lay out and size its memory."""

    tokens_per_block: int
    cache_tiers: Sequence[CacheTierConfig]
    layers: Sequence[LayerConfig]
    max_util_for_resume: float = 0.97
    enable_partial_reuse: bool = True
    initial_pool_ratio: Sequence[float] | None = None
    typical_step: BatchDesc | None = None
    constraints: Sequence[BatchDesc] = field(default_factory=tuple)
    rebalance_min_sampled_kv_caches: int = 2000
    rebalance_cooldown_secs: float = 120.0
    rebalance_target_ratio_update_interval: int = 100
    rebalance_ratio_threshold: float = 1.25
    rebalance_moving_average_decay: float = 0.9999
    remote_tier: RemoteCacheTierConfig | None = None
    kv_events: KVEventsConfig | None = None
    eviction_policy: str = EVICTION_POLICIES[0]
    lookahead_threads: int = 4  # threads doing `look_ahead`'s I/O (started on first use)

    def validate(self) -> None:
        """Raise `ConfigError` naming the first invalid field; return None when all is valid."""
        _positive_int("tokens_per_block", self.tokens_per_block)
        self._validate_tiers()
        self._validate_layers()
        self._validate_ratio()
        if self.typical_step is not None:
            _validate_batch("typical_step", self.typical_step)
        constraints = _sequence("constraints", self.constraints, "a sequence of BatchDesc")
        for i, batch in enumerate(constraints):
            _validate_batch(f"constraints[{i}]", batch)
        self._validate_rebalance()
        _positive_int("lookahead_threads", self.lookahead_threads)
        util = self.max_util_for_resume
        if not _is_real(util) or math.isnan(util) or not 0.0 < util <= 1.0:
            _fail("max_util_for_resume", util, "a number in (0, 1]")
        check_bool("enable_partial_reuse", self.enable_partial_reuse, ConfigError)
        if self.remote_tier is not None:
            if not isinstance(self.remote_tier, RemoteCacheTierConfig):
                _fail("remote_tier", self.remote_tier, "a RemoteCacheTierConfig or None")
            self.remote_tier.validate()
        if self.eviction_policy not in EVICTION_POLICIES:
            _fail("eviction_policy", self.eviction_policy, f"one of {list(EVICTION_POLICIES)}")
        if self.kv_events is not None:
            if not isinstance(self.kv_events, KVEventsConfig):
                _fail("kv_events", self.kv_events, "a KVEventsConfig or None")
            self.kv_events.validate()

    def _validate_tiers(self) -> None:
        allowed = "a non-empty list starting with the GPU tier"
        tiers = _sequence("cache_tiers", self.cache_tiers, allowed)
        if not tiers:
            _fail("cache_tiers", tiers, allowed)
        previous: CacheTier | None = None
        for i, tier_config in enumerate(tiers):
            name = f"cache_tiers[{i}]"
            if not isinstance(
                tier_config, GpuCacheTierConfig | HostCacheTierConfig | DiskCacheTierConfig
            ):
                _fail(
                    name,
                    tier_config,
                    "a GpuCacheTierConfig, HostCacheTierConfig or DiskCacheTierConfig",
                )
            tier = tier_config.tier
            if i == 0 and tier is not CacheTier.GPU:
                _fail(name, tier_config, "a GpuCacheTierConfig (the first level is GPU memory)")
            if previous is not None and tier <= previous:
                _fail(name, tier_config, "tiers ordered GPU, host, disk with at most one of each")
            previous = tier
            _positive_int(f"{name}.quota", tier_config.quota)
            shared = getattr(tier_config, "shared_dir", None)
            if shared is not None and not (isinstance(shared, str) and os.path.isdir(shared)):
                _fail(f"{name}.shared_dir", shared, "None or an existing directory")
            by_fd = getattr(tier_config, "shared_by_fd", False)
            if type(by_fd) is not bool or (by_fd and shared is not None):
                _fail(f"{name}.shared_by_fd", by_fd, "a bool, and False when shared_dir is set")
            if isinstance(tier_config, DiskCacheTierConfig) and not (
                isinstance(tier_config.path, str | os.PathLike) and os.path.isdir(tier_config.path)
            ):
                _fail(f"{name}.path", tier_config.path, "an existing directory")
            persistent_id = getattr(tier_config, "persistent_id", None)
            if persistent_id is not None and not (isinstance(persistent_id, str) and persistent_id):
                allowed = (
                    "None (unlinked files) or a non-empty string (the model's identity digest)"
                )
                _fail(f"{name}.persistent_id", persistent_id, allowed)

    def _validate_layers(self) -> None:
        allowed = "a non-empty list of layer configs"
        layers = _sequence("layers", self.layers, allowed)
        if not layers:
            _fail("layers", layers, allowed)
        seen_ids: dict[int, int] = {}
        for i, layer in enumerate(layers):
            name = f"layers[{i}]"
            if not isinstance(layer, AttentionLayerConfig | SsmLayerConfig):
                _fail(name, layer, "an AttentionLayerConfig or SsmLayerConfig")
            if not _is_int(layer.layer_id) or layer.layer_id < 0:
                _fail(f"{name}.layer_id", layer.layer_id, "an integer >= 0")
            if layer.layer_id in seen_ids:
                _fail(
                    f"{name}.layer_id",
                    layer.layer_id,
                    f"unique (layers[{seen_ids[layer.layer_id]}] has the same id)",
                )
            seen_ids[layer.layer_id] = i
            buffers = _sequence(
                f"{name}.buffers", layer.buffers, "a non-empty list of BufferConfig"
            )
            if not buffers:
                _fail(f"{name}.buffers", buffers, "a non-empty list of BufferConfig")
            roles: dict[str, int] = {}
            for j, buffer in enumerate(buffers):
                bname = f"{name}.buffers[{j}]"
                if not isinstance(buffer, BufferConfig):
                    _fail(bname, buffer, "a BufferConfig")
                if not isinstance(buffer.role, str) or not buffer.role:
                    _fail(f"{bname}.role", buffer.role, "a non-empty string")
                if buffer.role in roles:
                    _fail(
                        f"{bname}.role",
                        buffer.role,
                        f"unique within the layer ({name}.buffers[{roles[buffer.role]}] has it)",
                    )
                roles[buffer.role] = j
                _positive_int(f"{bname}.size", buffer.size)
            if isinstance(layer, AttentionLayerConfig):
                window, sinks = layer.sliding_window_size, layer.num_sink_tokens
                if window is not None:
                    _positive_int(f"{name}.sliding_window_size", window)
                if sinks is not None:
                    if not _is_int(sinks) or sinks < 0:
                        _fail(f"{name}.num_sink_tokens", sinks, "an integer >= 0")
                    if sinks > 0 and window is None:
                        _fail(
                            f"{name}.num_sink_tokens",
                            sinks,
                            "0 or None when sliding_window_size is None (sinks need a window)",
                        )

    def _validate_ratio(self) -> None:
        if self.initial_pool_ratio is None:
            return
        tpb = self.tokens_per_block
        expected = len({layer.life_cycle(tpb) for layer in self.layers})
        allowed = f"one weight per layer group ({expected} values)"
        ratio = _sequence("initial_pool_ratio", self.initial_pool_ratio, allowed)
        if len(ratio) != expected:
            _fail(
                "initial_pool_ratio",
                ratio,
                f"one weight per layer group ({expected} values, got {len(ratio)})",
            )
        for i, weight in enumerate(ratio):
            if not _is_real(weight) or not math.isfinite(weight) or weight <= 0:
                _fail(f"initial_pool_ratio[{i}]", weight, "a finite number > 0")
        top = max(ratio)  # (the sum of huge weights scaled down first: fsum would overflow)
        total = math.fsum(w / top for w in ratio) * top
        if abs(total - 1.0) > 1e-6:
            _fail("initial_pool_ratio", ratio, f"weights summing to 1 (they sum to {total})")

    def _validate_rebalance(self) -> None:
        n = self.rebalance_min_sampled_kv_caches
        if not _is_int(n) or n < 0:
            _fail("rebalance_min_sampled_kv_caches", n, "an integer >= 0")
        secs = self.rebalance_cooldown_secs
        if not _is_real(secs) or not math.isfinite(secs) or secs < 0:
            _fail("rebalance_cooldown_secs", secs, "a finite number >= 0")
        _positive_int(
            "rebalance_target_ratio_update_interval", self.rebalance_target_ratio_update_interval
        )
        t = self.rebalance_ratio_threshold
        if not _is_real(t) or not math.isfinite(t) or t <= 1.0:
            _fail("rebalance_ratio_threshold", t, "a finite number > 1")
        decay = self.rebalance_moving_average_decay
        if not _is_real(decay) or not 0.0 < decay < 1.0:
            _fail("rebalance_moving_average_decay", decay, "a number in the open interval (0, 1)")


def _validate_batch(name: str, batch: BatchDesc) -> None:
    if not isinstance(batch, BatchDesc):
        _fail(name, batch, "a BatchDesc")
    if not _is_int(batch.system_prompt_length) or batch.system_prompt_length < 0:
        _fail(f"{name}.system_prompt_length", batch.system_prompt_length, "an integer >= 0")
    caches = _sequence(f"{name}.kv_caches", batch.kv_caches, "a sequence of KVCacheDesc")
    for i, desc in enumerate(caches):
        dname = f"{name}.kv_caches[{i}]"
        if not isinstance(desc, KVCacheDesc):
            _fail(dname, desc, "a KVCacheDesc")
        if not _is_int(desc.capacity) or desc.capacity < 0:
            _fail(f"{dname}.capacity", desc.capacity, "an integer >= 0")
        if not _is_int(desc.history_length) or not 0 <= desc.history_length <= desc.capacity:
            _fail(
                f"{dname}.history_length",
                desc.history_length,
                f"an integer in [0, {desc.capacity}]",
            )


def _sequence(name: str, value: object, allowed: str) -> list[Any]:
    return check_sequence(name, value, allowed, ConfigError)


def _positive_int(name: str, value: object) -> None:
    check_int(name, value, 1, error=ConfigError)


def _fail(name: str, value: object, allowed: str) -> NoReturn:
    fail(name, value, allowed, ConfigError)

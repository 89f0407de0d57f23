"""What the connector is told: `kv_connector_extra_config` checked key by key, the page format
that both sides derive from vLLM's KV-cache config, and the kvpool manager built from both.

Keys of `kv_connector_extra_config` (all optional):

| key | meaning | default |
|---|---|---|
| `host_bytes` | host memory for kvpool's first level (shared with vLLM's workers) | 1 GiB |
| `disk_bytes`, `disk_path` | a disk level below it (both or neither) | none |
| `disk_persist` | the disk level outlives the engine: a restarted engine of the same model identity finds its pages again, each checked (one engine per `disk_path`) | `false` |
| `remote_url` | a Valkey/Redis server shared by engines (`valkey://host:port`) | none |
| `remote_namespace` | separates tenants on one server | `""` |
| `remote_timeout_ms` | bound on every call to the server | 500 |
| `eviction_policy` | `hazard`, `lru` or `lfu` | `hazard` |
| `model_id` | the model's identity in keys that outlive the process, in place of the one computed from its config and weights (`identity.py`) | computed |
| `kv_events_endpoint` | ZMQ endpoint publishing kvpool's KV events | none |
| `stats_path` | a file the scheduler side keeps its counters in (JSON, rewritten as they change) | none |
| `async_lookups` | a lookup that needs disk or the remote tier answers vLLM "not yet" while its I/O runs off the scheduler's thread (`lookups.py`); `false`: it reads inside the scheduler's step | `true` |
| `node_cache` | `unix:///path/to.sock`: a `kvpool serve` daemon's socket; its one manager serves every engine on the node (the levels are the daemon's flags, not these keys) | none |
| `node_timeout_ms` | bound on every call to the node daemon (past it: a miss, no save; reconnects by itself) | 100 |
| `node_poll_us` | the scheduler's thread polls this long for the daemon's reply before it sleeps (no wake-up on a round trip; it stops while replies take longer); 0: never | 300 |
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, NoReturn

from kvpool.config import (
    EVICTION_POLICIES,
    AttentionLayerConfig,
    BufferConfig,
    KVCacheManagerConfig,
    RemoteCacheTierConfig,
)
from kvpool.errors import ConfigError
from kvpool.integrations.extra_config import ExtraConfig
from kvpool.layout import KVLayout
from kvpool.node.protocol import socket_path
from kvpool.node.settings import engine_manager_config

_EXTRA = ExtraConfig("kv_connector_extra_config")
_fail = _EXTRA.fail
_int = _EXTRA.integer
_bool = _EXTRA.flag
_str = _EXTRA.string

GiB = 1 << 30
# the daemon's flags set these in node mode (`kvpool serve --help`)
DAEMON_KEYS = (
    "host_bytes",
    "disk_bytes",
    "disk_path",
    "disk_persist",
    "remote_url",
    "remote_namespace",
    "remote_timeout_ms",
    "eviction_policy",
    "kv_events_endpoint",
)
EXTRA_CONFIG_KEYS = (
    *DAEMON_KEYS,
    "model_id",
    "stats_path",
    "async_lookups",
    "node_cache",
    "node_timeout_ms",
    "node_poll_us",
)


@dataclass(frozen=True)
class ConnectorSettings:
    """`kv_connector_extra_config`, checked (the module docstring lists the keys)."""

    host_bytes: int = GiB
    disk_bytes: int = 0
    disk_path: str | None = None
    disk_persist: bool = False
    remote_url: str | None = None
    remote_namespace: str = ""
    remote_timeout_ms: int = 500
    eviction_policy: str = EVICTION_POLICIES[0]
    model_id: str | None = None
    kv_events_endpoint: str | None = None
    stats_path: str | None = None
    async_lookups: bool = True
    node_cache: str | None = None  # the daemon's socket path (from its unix:// URL)
    node_timeout_ms: int = 100
    node_poll_us: int = 300

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
        node_cache = None
        if "node_cache" in extra:
            try:
                node_cache = socket_path(extra["node_cache"])
            except ConfigError:
                _fail(
                    "node_cache",
                    extra["node_cache"],
                    "unix:///absolute/path/to.sock, at most 107 bytes (a `kvpool serve` "
                    "daemon's socket on this node)",
                )
            for key in DAEMON_KEYS:
                if key in extra:
                    _fail(
                        key,
                        extra[key],
                        "left out with node_cache: the node daemon's levels are its own "
                        f"(kvpool serve --{key.replace('_', '-')})",
                    )
        else:
            for key in ("node_timeout_ms", "node_poll_us"):
                if key in extra:
                    _fail(key, extra[key], "left out without node_cache")
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
        disk_persist = _bool(extra, "disk_persist", False)
        if disk_persist and not disk_bytes:
            _fail(
                "disk_persist", disk_persist, "false without a disk level (disk_bytes, disk_path)"
            )
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
            disk_persist=disk_persist,
            remote_url=_str(extra, "remote_url", None),
            remote_namespace=_str(extra, "remote_namespace", "") or "",
            remote_timeout_ms=_int(extra, "remote_timeout_ms", 500, 1),
            eviction_policy=str(policy),
            model_id=model_id,
            kv_events_endpoint=_str(extra, "kv_events_endpoint", None),
            stats_path=_str(extra, "stats_path", None),
            async_lookups=_bool(extra, "async_lookups", True),
            node_cache=node_cache,
            node_timeout_ms=_int(extra, "node_timeout_ms", 100, 1),
            node_poll_us=_int(extra, "node_poll_us", 300, 0),
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


# Why each vLLM KV-cache spec kvpool cannot hold is refused (by class name; a subclass of a
# supported spec is refused unless listed as supported: its blocks mean something else).
REFUSED_SPECS = {
    "MambaSpec": "a Mamba/SSM layer's state (conv and SSM tensors in blocks of vLLM's own "
    "layout, per mamba_cache_mode) is not mapped to kvpool's SSM snapshots",
    "MLAAttentionSpec": "MLA caches one latent vector per token, not K and V per head",
    "SlidingWindowMLASpec": "MLA caches one latent vector per token, not K and V per head",
    "HiddenStateCacheSpec": "hidden states, not K and V per head",
    "ChunkedLocalAttentionSpec": "a chunked-local layer keeps only its current chunk's "
    "blocks, which no kvpool life cycle describes (a sliding window keeps the last tokens)",
    "SinkFullAttentionSpec": "its sink blocks hold learned KV, not the KV of the prompt's tokens",
    "RSWASpec": "reference sliding window attention drops a gap between the prompt and the "
    "window, which no kvpool life cycle describes",
    "CrossAttentionSpec": "cross-attention KV comes from the encoder's input, not the tokens",
    "EncoderOnlyAttentionSpec": "encoder-only KV is not kept between steps",
    "CircularBufferSpec": "a ring buffer per request is scratch, not prefix KV",
    "UniformTypeKVCacheSpecs": "its layers have different page formats, and vLLM's scheduler "
    "sees only one of them",
}
SUPPORTED_SPECS = ("FullAttentionSpec", "SlidingWindowSpec")
NULL_BLOCK_ID = 0  # vLLM's null block (BlockPool.null_block: the first block, never allocated)


@dataclass(frozen=True)
class GroupFormat:
    """One vLLM KV-cache group: its layers share block ids (one block table). Per layer, a
    page holds a `"k"` and a `"v"` buffer of [heads, block_size, head_size] elements of the
    KV cache's dtype (`heads`: every tensor-parallel rank's). `window`: None for full
    attention; else the tokens a sliding window keeps (vLLM's sliding window and its extra
    retained tokens): kvpool's life cycle for the group, which keeps the same blocks."""

    layer_names: tuple[str, ...]
    local_heads: int
    head_size: int
    itemsize: int
    window: int | None = None

    def __str__(self) -> str:
        kind = "full attention" if self.window is None else f"sliding window {self.window}"
        return f"{kind} ({len(self.layer_names)} layers)"


@dataclass(frozen=True)
class PageFormat:
    """How one vLLM block of every layer is laid out in kvpool's pages, per vLLM KV-cache
    group (`groups`, in vLLM's order). Each vLLM layer is one kvpool layer (ids in group
    order); kvpool puts layers of equal life cycles in one layer group, so vLLM groups of one
    spec (vLLM splits a 5:1 model's sliding layers into five groups) share kvpool pages, one
    page per block holding all their layers. Rank r of `tp_size` reads and writes heads
    [r * local_heads, (r + 1) * local_heads) of every buffer."""

    groups: tuple[GroupFormat, ...]
    block_size: int
    tp_rank: int
    tp_size: int

    @classmethod
    def single(
        cls,
        layer_names: tuple[str, ...],
        block_size: int,
        local_heads: int,
        head_size: int,
        itemsize: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        window: int | None = None,
    ) -> PageFormat:
        """One KV-cache group."""
        group = GroupFormat(tuple(layer_names), local_heads, head_size, itemsize, window)
        return cls((group,), block_size, tp_rank, tp_size)

    def heads(self, group: int) -> int:
        return self.groups[group].local_heads * self.tp_size

    def buffer_bytes(self, group: int) -> int:
        """Bytes of one buffer (K or V of one layer) of one block, all ranks' heads."""
        g = self.groups[group]
        return self.heads(group) * self.block_size * g.head_size * g.itemsize

    @property
    def windowed(self) -> bool:
        """Whether some group is a sliding window (vLLM frees its blocks as it decodes)."""
        return any(g.window is not None for g in self.groups)

    def layer_ids(self, group: int) -> range:
        """kvpool's layer ids of a group's layers."""
        start = sum(len(g.layer_names) for g in self.groups[:group])
        return range(start, start + len(self.groups[group].layer_names))

    @classmethod
    def from_vllm(cls, vllm_config: Any, kv_cache_config: Any) -> PageFormat:
        """Refuses, naming what and why, every KV-cache config it cannot hold exactly."""
        groups = list(kv_cache_config.kv_cache_groups)
        if not groups:
            raise ConfigError("KVPoolConnector needs a model with a KV cache; this one has none")
        formats = [_group_format(i, group) for i, group in enumerate(groups)]
        block_sizes = sorted({int(group.kv_cache_spec.block_size) for group in groups})
        if len(block_sizes) != 1:
            raise ConfigError(
                "KVPoolConnector needs one block size for every KV-cache group (a kvpool page "
                f"holds one block of every layer); this model's groups have {block_sizes}"
            )
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size != 1:
            raise ConfigError(
                "KVPoolConnector supports pipeline_parallel_size=1 only; this engine has "
                f"{parallel.pipeline_parallel_size}"
            )
        for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
            size = getattr(parallel, name, 1)
            if size != 1:
                raise ConfigError(
                    f"KVPoolConnector supports {name}=1 only (a rank then holds some of a "
                    f"block's tokens); this engine has {size}"
                )
        tp_rank = 0
        if parallel.tensor_parallel_size > 1:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            try:
                tp_rank = get_tensor_model_parallel_rank()
            except (AssertionError, AttributeError):
                tp_rank = 0  # (the scheduler's process: it has no rank and needs none)
        return cls(
            groups=tuple(formats),
            block_size=block_sizes[0],
            tp_rank=tp_rank,
            tp_size=int(parallel.tensor_parallel_size),
        )

    def manager_config(self, settings: ConnectorSettings, model_id: str) -> KVCacheManagerConfig:
        """kvpool's manager (`engine_manager_config`): one attention layer per vLLM layer,
        with its group's life cycle. `model_id`: the model's identity."""
        layers = []
        for g, group in enumerate(self.groups):
            size = self.buffer_bytes(g)
            buffers = [BufferConfig("k", size), BufferConfig("v", size)]
            layers += [
                AttentionLayerConfig(layer_id, buffers, sliding_window_size=group.window)
                for layer_id in self.layer_ids(g)
            ]
        return engine_manager_config(
            self.block_size,
            layers,
            host_bytes=settings.host_bytes,
            disk_bytes=settings.disk_bytes,
            disk_path=settings.disk_path,
            persistent_id=(model_id or None) if settings.disk_persist else None,
            remote=None if settings.remote_url is None else settings.remote_tier(model_id),
            kv_events_endpoint=settings.kv_events_endpoint,
            eviction_policy=settings.eviction_policy,
        )

    def layer_groups(self, layout: KVLayout) -> list[int]:
        """kvpool's layer group of each vLLM group (its pages' slot ids)."""
        return [layout.layer_group_of[self.layer_ids(g)[0]] for g in range(len(self.groups))]


def _group_format(index: int, group: Any) -> GroupFormat:
    """One vLLM KV-cache group's format, or a `ConfigError` naming the group and why."""
    spec = group.kv_cache_spec
    kind = type(spec).__name__
    names = list(group.layer_names)
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")

    def refuse(why: str) -> NoReturn:
        raise ConfigError(
            f"KVPoolConnector cannot hold KV-cache group {index} ({kind}: {shown}): {why}"
        )

    if kind not in SUPPORTED_SPECS:
        refuse(REFUSED_SPECS.get(kind, f"kvpool holds {' and '.join(SUPPORTED_SPECS)} only"))
    if getattr(group, "host_resident", False) or not getattr(group, "enable_kv_transfer", True):
        refuse("the group is not part of the KV state a connector transfers")
    quant = getattr(getattr(spec, "kv_quant_mode", None), "name", "NONE")
    if spec.head_size_v != spec.head_size or quant != "NONE":
        refuse(
            "kvpool holds K and V of one head size, unquantized; this group has "
            f"head_size={spec.head_size}, head_size_v={spec.head_size_v}, kv_quant_mode={quant}"
        )
    packed = {
        "page_size_padded": getattr(spec, "page_size_padded", None),
        "num_head_slots": getattr(spec, "num_head_slots", None),
        "state_content_bytes": getattr(spec, "state_content_bytes", None),
    }
    packed = {k: v for k, v in packed.items() if v is not None}
    if getattr(spec, "tokens_per_state", 1) != 1:
        packed["tokens_per_state"] = spec.tokens_per_state
    if packed:
        refuse(f"kvpool holds dense pages of K and V per head; this group's pages are {packed}")
    window = None
    if kind == "SlidingWindowSpec":
        window = int(spec.sliding_window) + int(getattr(spec, "extra_retained_tokens", 0) or 0)
    return GroupFormat(
        layer_names=tuple(names),
        local_heads=int(spec.num_kv_heads),
        head_size=int(spec.head_size),
        itemsize=int(spec.dtype.itemsize),
        window=window,
    )


__all__ = ["EXTRA_CONFIG_KEYS", "NULL_BLOCK_ID", "ConnectorSettings", "GroupFormat", "PageFormat"]

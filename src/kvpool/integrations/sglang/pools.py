"""One SGLang host pool stored by a kvpool manager (`StoredPool`): its namespace and tokens,
its manager's config, and the copies of one page between SGLang's host pool and the manager.

Each page is one block of one token (a digest of the page's key and the pool's namespace) in
one buffer of one layer: the page's bytes in canonical order, then a tag of `TAG_BYTES`
naming its key. A page is read where it lies (`KVCache.read_committed`: SGLang's host pool is
the cache above, so bringing it up to the staging level would cost a copy and an eviction for
nothing) and written into the staging level, which moves it down as it fills.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import threading
from collections import Counter
from typing import Any

import numpy as np

from kvpool.config import (
    AttentionLayerConfig,
    BufferConfig,
    CacheTierConfig,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManagerConfig,
    ReuseScope,
)
from kvpool.errors import ConfigError
from kvpool.integrations.identity import ModelIdentity
from kvpool.integrations.sglang.identity import Shard
from kvpool.integrations.sglang.pages import TAG_BYTES, PageFormat, StateFormat
from kvpool.integrations.sglang.settings import BackendSettings
from kvpool.manager import KVCacheManager
from kvpool.storage.pools import HOST_GRANULARITY as GRAIN  # (a level's quota is spent in grains)

log = logging.getLogger("kvpool.sglang")

ROLE = "page"  # the one buffer of a manager's one layer: a whole SGLang page, then its tag
KV = "kv"  # (SGLang's PoolName value of the KV pool)


class StoredPool:
    """One SGLang host pool and the kvpool manager storing its pages: one block of one token
    per page key, one buffer of one layer (the page, then its tag)."""

    def __init__(
        self, name: str, host_pool: Any, page: PageFormat | StateFormat, shard: Shard
    ) -> None:
        self.name, self.host_pool, self.page, self.shard = name, host_pool, page, shard
        self.manager: KVCacheManager | None = None
        self.identity: ModelIdentity | None = None
        self.salt = b""
        self.scope: ReuseScope | None = None
        self.level_names: list[str] = []
        self.lock = threading.Lock()
        self.counters: Counter[str] = Counter()
        self.row = np.empty(page.nbytes + TAG_BYTES, dtype=np.uint8)  # (one page, under lock)
        self.scratch = page.stored(self.row)

    def build(
        self,
        budget: dict[str, int],
        settings: BackendSettings,
        storage_config: Any,
        shard: Shard,
        model: ModelIdentity,
    ) -> None:
        """Build the pool's manager with its `budget` of each level (`model`: the model's
        identity, the KV pool's; `shard`: this rank's)."""
        if self.identity is None:
            self.identity = pool_identity(model, self.name, self.page)
        self.salt = f"sglang|{self.identity.digest}|{self.shard.label}".encode()
        self.scope = ReuseScope(salt=self.salt)
        try:
            manager = KVCacheManager(manager_config(self, budget, settings, storage_config, shard))
        except ConfigError as error:
            raise ConfigError(f"pool {self.name} ({budget}): {error}") from error
        manager.transfer_to_current_thread()
        self.manager = manager
        self.level_names = ["staging"] + [name.lower() for name in manager.stats().level_names[1:]]
        recovery = manager.disk_recovery
        log.info(
            "kvpool: SGLang storage for %s, pool %s, shard %s, pages of %d bytes (%s, %s); "
            "levels %s %s%s%s",
            self.identity,
            self.name,
            self.shard.label,
            self.page.nbytes,
            self.page.kind,
            self.page.layout,
            self.level_names,
            budget,
            "" if settings.remote_url is None else ", remote",
            ""
            if recovery is None
            else f"; found on disk: {recovery.blocks} pages ({recovery.bytes_verified} bytes "
            f"checked), discarded {dict(recovery.discarded)}",
        )

    @property
    def value_bytes(self) -> int:
        return self.page.nbytes + TAG_BYTES

    def token(self, key: str) -> bytes:
        """The kvpool token of SGLang page `key` in this pool's namespace (its first
        `TAG_BYTES` are the stored page's tag)."""
        return hashlib.sha256(self.salt + b"\0" + key.encode()).digest()

    def read_one(self, manager: KVCacheManager, view: Any, key: str, target: Any) -> bool:
        """Page `key` into `target`. A local page is read where it lies (into the pool's
        scratch row, then checked): SGLang's host pool is the cache above, so bringing the page
        up to kvpool's staging level would cost a copy and an eviction for nothing. A page
        found on the remote tier is fetched into the staging level (and stays there for the
        next reader)."""
        token = self.token(key)
        cache = manager.create_kv_cache(self.scope, [token])
        try:
            if cache.num_committed_tokens < 1:
                self.counters["miss_pages"] += 1
                return False
            if cache.pending_remote_tokens:
                tier = "remote"
                if not cache.resume() or cache.num_committed_tokens < 1:
                    self.counters["miss_pages"] += 1
                    return False
                row = view[int(cache.get_page_indices(0, ROLE)[0])]
                stored = self.page.stored(row)
            else:
                tier = self.tier_of(cache)
                cache.read_committed(0, 0, ROLE, self.row)
                row, stored = self.row, self.scratch
            if bytes(row[self.page.nbytes :]) != token[:TAG_BYTES]:
                self.counters["corrupt_pages"] += 1
                log.warning(
                    "kvpool: the %s page stored for %s names another key: a miss", self.name, key
                )
                return False
            self.page.put(target, stored)
            self.counters[f"hit_{tier}"] += 1
            self.counters["read_bytes"] += self.page.nbytes
            return True
        finally:
            cache.close()

    def tier_of(self, cache: Any) -> str:
        """The level (its name) the page of a one-page request is on."""
        page = cache.pages(0)[0]
        return "staging" if page is None else self.level_names[page.level]

    def write_one(self, manager: KVCacheManager, view: Any, key: str, source: Any) -> bool:
        """Page `key` from `source` into a new staging page (through the pool's scratch row:
        the page in canonical order, then its tag), committed; a page stored already is left
        as it is."""
        token = self.token(key)
        cache = manager.create_kv_cache(self.scope, [token], remote=False)
        try:
            if cache.num_committed_tokens >= 1:
                self.counters["present_pages"] += 1
                return True
            if not (cache.resume() and cache.resize(1)):
                self.counters["no_room_pages"] += 1
                return False
            self.page.take(self.scratch, source)
            self.row[self.page.nbytes :] = np.frombuffer(token[:TAG_BYTES], dtype=np.uint8)
            view[int(cache.get_page_indices(0, ROLE)[0])] = self.row
            cache.commit([token])
            manager.write_remote(cache, 0)
            self.counters["stored_pages"] += 1
            self.counters["written_bytes"] += self.page.nbytes
            return True
        finally:
            cache.close()


def pool_identity(kv: ModelIdentity, name: str, page: PageFormat | StateFormat) -> ModelIdentity:
    """An extra pool's identity: the model's (the KV pool's) with the pool's name and format."""
    parts = page.identity_parts()
    digest = hashlib.sha256(b"kvpool-sglang-pool-1\0" + kv.digest.encode() + b"\0")
    digest.update(name.encode())
    for key in sorted(parts):
        digest.update(f"\0{key}={parts[key]!r}".encode())
    said = ", ".join(f"{k}={parts[k]}" for k in sorted(parts))
    return ModelIdentity(digest.hexdigest(), f"{kv.description}; pool {name}: {said}")


def manager_config(
    pool: StoredPool,
    budget: dict[str, int],
    s: BackendSettings,
    storage_config: Any,
    shard: Shard,
) -> KVCacheManagerConfig:
    """The config of `pool`'s manager: its share `budget` of each level's bytes (staging,
    host, disk), its own disk directory and remote namespace, one layer of one buffer."""
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(budget["staging_bytes"], shared_by_fd=True)]
    if s.host_bytes:
        tiers.append(HostCacheTierConfig(budget["host_bytes"]))
    if s.disk_bytes:
        assert s.disk_path is not None and pool.identity is not None
        config = storage_config  # (a directory per process and pool: one manager each)
        process = (
            f"{shard.label}-pp{config.pp_rank}of{config.pp_size}-dp{getattr(config, 'dp_rank', 0)}"
        )
        suffix = "" if pool.name == KV else f"-{pool.name}"
        path = os.path.join(s.disk_path, f"kvpool-sglang-{process}{suffix}")
        os.makedirs(path, exist_ok=True)
        persistent = f"{pool.identity.digest}|{pool.shard.label}" if s.disk_persist else None
        tiers.append(DiskCacheTierConfig(budget["disk_bytes"], path, persistent))
    remote = None
    if s.remote_url is not None:
        assert pool.identity is not None
        remote = s.remote_tier(pool.identity.digest, pool.shard.index)
    layer = AttentionLayerConfig(0, [BufferConfig(ROLE, pool.value_bytes)])
    return KVCacheManagerConfig(
        tokens_per_block=1,
        cache_tiers=tiers,
        layers=[layer],
        enable_partial_reuse=False,
        remote_tier=remote,
        eviction_policy=s.eviction_policy,
        max_util_for_resume=1.0,
    )


def pool_statistics(pool: StoredPool | None, extra: Counter[str]) -> dict[str, Any]:
    """A pool's counters (with `extra`), hits by tier, and its remote tier's own counters."""
    counters = dict(extra + (Counter() if pool is None else pool.counters))
    manager = None if pool is None else pool.manager
    remote = None if manager is None else manager.remote_statistics()
    by_tier = {
        name.removeprefix("hit_"): n for name, n in counters.items() if name.startswith("hit_")
    }
    return {
        "hit_pages_by_tier": by_tier,
        **{k: v for k, v in counters.items() if not k.startswith("hit_")},
        "remote": None if remote is None else dataclasses.asdict(remote),
    }


def level_budgets(
    pools: dict[str, StoredPool], settings: BackendSettings
) -> dict[str, dict[str, int]]:
    """Each pool's bytes of each level (`staging_bytes`, `host_bytes`, `disk_bytes`): every pool
    first gets the least a level of its own holds (one grain of `GRAIN` bytes, or its page
    rounded up to grains), the rest goes by weight: `pool_shares` (naming every pool), else one
    stored page of each (each pool holds about as many pages). `ConfigError` naming the key."""
    given = settings.pool_shares
    if given is None:
        weights = {name: float(pool.value_bytes) for name, pool in pools.items()}
    else:
        weights = dict(given)
        for name in sorted(set(pools) ^ set(weights)):
            raise ConfigError(
                f"hicache_storage_backend_extra_config['pool_shares']={weights!r} is invalid: "
                f"must name every pool SGLang registered ({sorted(pools)}), "
                f"{'not' if name in weights else 'and'} {name!r}"
            )
    budgets: dict[str, dict[str, int]] = {name: {} for name in pools}
    floors = {n: -(-p.value_bytes // GRAIN) * GRAIN for n, p in pools.items()}
    for key, total in [
        ("staging_bytes", settings.staging_bytes),
        ("host_bytes", settings.host_bytes),
        ("disk_bytes", settings.disk_bytes),
    ]:
        if not total:
            continue
        if len(pools) == 1:
            for name in pools:
                budgets[name][key] = total
            continue
        if total < sum(floors.values()):
            raise ConfigError(
                f"hicache_storage_backend_extra_config[{key!r}]={total} is invalid: must be at "
                f"least {sum(floors.values())} bytes, the least a level of each pool holds "
                f"({floors})"
            )
        rest, weight = total - sum(floors.values()), sum(weights.values())
        for name in pools:
            budgets[name][key] = floors[name] + int(rest * weights[name] / weight)
    return budgets

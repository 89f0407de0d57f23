"""`KVPoolHiCacheStorage`: SGLang's HiCache L3 storage on kvpool managers.

SGLang calls it from three of its cache controller's threads (the prefetch query, the prefetch
I/O and the write-back), with pages named by chained token hashes. Each SGLang page is one
kvpool block of one token: the token is a 32-byte digest of the page's key and this rank's
namespace (model identity, shard, pool), so kvpool's prefix tree holds every page as a chain of
its own (SGLang's key already names the page's whole prefix), and its levels, eviction policy,
persistent disk and shared tier hold it like any block. `batch_exists` asks for the pages in
order and stops at the first absent one, as SGLang's contract says.

Every host pool SGLang registers has a kvpool manager of its own (`_Pool`): the KV pool
(`register_mem_pool_host`, and again as `kv` through `register_mem_host_pool_v2`), and a
hybrid model's `swa` and `mamba` pools (`register_mem_host_pool_v2`), whose pages differ in
size; `staging_bytes`, `host_bytes` and `disk_bytes` are split between them (`pool_shares`).
The managers are built once SGLang says the pools are all registered
(`on_host_pools_registered`). Any other pool is refused by name when it is registered.

Reads and writes copy straight between SGLang's host pool (a strided view of the page, by
index: `batch_get_v1`/`batch_set_v1` and the `_v2` forms, or the flat page tensors of SGLang's
generic path) and kvpool's first level (`staging_bytes`): one copy each way, in the canonical
order of `pages.py`, whatever the host pool's layout. A stored value ends with a tag naming its
key and pool; a page whose tag differs is a miss (counted as corrupt), never bytes in SGLang's
pool. Every failure (a tier's error, a value failing a check, a timeout) is a miss or a write
not done; only arguments that break SGLang's contract (keys that are not strings, host indices
that are not `page_size` per key) raise, an `ArgumentError` naming them.

`batch_exists_v2` answers with SGLang's per-pool hit policies: `all_pages` (the pool's leading
run), `trailing_pages` (a prefix of n pages is restorable when the pool holds the last
`len(transfer.keys)` pages before n: a Mamba state, an SWA window); the usable prefix is the
longest one every pool can restore, and the restorable lengths are returned too, as SGLang's
controller intersects them over ranks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, PoolTransferResult

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
from kvpool.errors import ArgumentError, ConfigError, LogicError
from kvpool.integrations.identity import ModelIdentity
from kvpool.integrations.sglang.identity import Shard, rank_shard, sglang_identity, state_shard
from kvpool.integrations.sglang.pages import (
    TAG_BYTES,
    PageFormat,
    StateFormat,
    page_format,
    state_format,
)
from kvpool.integrations.sglang.settings import BackendSettings
from kvpool.manager import KVCacheManager
from kvpool.storage.pools import HOST_GRANULARITY as GRAIN  # (a level's quota is spent in grains)

log = logging.getLogger("kvpool.sglang")

ROLE = "page"  # the one buffer of a manager's one layer: a whole SGLang page, then its tag
KV, SWA, MAMBA = "kv", "swa", "mamba"  # the pools stored (SGLang's PoolName values)
EXTRA_POOLS = (SWA, MAMBA)
ALL_PAGES, TRAILING_PAGES = "all_pages", "trailing_pages"  # SGLang's PoolHitPolicy values


def _metrics_class() -> Any:
    try:
        from sglang.srt.observability.metrics_collector import StorageMetrics

        return StorageMetrics
    except ImportError:  # (metrics are optional in SGLang too)
        return None


def _value(name: Any) -> str:
    """An SGLang enum member's value (`PoolName.MAMBA`: "mamba"), or the string itself."""
    return str(getattr(name, "value", name))


class _Pool:
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

    @property
    def value_bytes(self) -> int:
        return self.page.nbytes + TAG_BYTES

    def token(self, key: str) -> bytes:
        """The kvpool token of SGLang page `key` in this pool's namespace (its first
        `TAG_BYTES` are the stored page's tag)."""
        return hashlib.sha256(self.salt + b"\0" + key.encode()).digest()


def _pool_identity(kv: ModelIdentity, name: str, page: PageFormat | StateFormat) -> ModelIdentity:
    """An extra pool's identity: the model's (the KV pool's) with the pool's name and format."""
    parts = page.identity_parts()
    digest = hashlib.sha256(b"kvpool-sglang-pool-1\0" + kv.digest.encode() + b"\0")
    digest.update(name.encode())
    for key in sorted(parts):
        digest.update(f"\0{key}={parts[key]!r}".encode())
    said = ", ".join(f"{k}={parts[k]}" for k in sorted(parts))
    return ModelIdentity(digest.hexdigest(), f"{kv.description}; pool {name}: {said}")


class KVPoolHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """SGLang's `dynamic` storage backend (module docstring; the guide: docs/guides/sglang.md).
    SGLang builds it with `(storage_config, kwargs)`, then calls `register_mem_pool_host` (the
    KV pool), `register_mem_host_pool_v2` for each pool of its host pool group (a hybrid
    model's extra pools), then `on_host_pools_registered`, where the managers are built."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        if storage_config is None:
            raise ConfigError(
                "storage_config=None is invalid: must be SGLang's HiCacheStorageConfig"
            )
        self.storage_config = storage_config
        self.settings = BackendSettings.parse(storage_config.extra_config)
        self.shard: Shard = rank_shard(storage_config)
        self.pools: dict[str, _Pool] = {}
        self.page: PageFormat | None = None  # (the KV pool's)
        self.identity: ModelIdentity | None = None  # (the model's: the KV pool's)
        self.mem_pool_host: Any = None
        self._built = False
        self._build_lock = threading.Lock()
        self.counters: Counter[str] = Counter()  # (calls before a KV pool is registered)
        self._metrics: dict[str, list[float]] = {
            "prefetch_pgs": [],
            "backup_pgs": [],
            "prefetch_bandwidth": [],
            "backup_bandwidth": [],
        }

    @property
    def manager(self) -> KVCacheManager | None:
        """The KV pool's manager (None before it is built and after `close`)."""
        pool = self.pools.get(KV)
        return None if pool is None else pool.manager

    @manager.setter
    def manager(self, manager: Any) -> None:
        self.pools[KV].manager = manager

    @property
    def _lock(self) -> threading.Lock:
        return self.pools[KV].lock

    # -- set-up -------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang's KV host pool: its page format and the model's identity (`ConfigError`
        naming what is not supported)."""
        if KV in self.pools:
            raise LogicError("register_mem_pool_host: a host pool is registered already")
        page = page_format(mem_pool_host)
        identity = sglang_identity(self.storage_config, page, self.settings.model_id)
        self.mem_pool_host, self.page, self.identity = mem_pool_host, page, identity
        pool = _Pool(KV, mem_pool_host, page, self.shard)
        pool.identity = identity
        self.pools[KV] = pool

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A pool of SGLang's host pool group: `kv` (the pool registered already), `swa` or
        `mamba`; any other pool, or one registered once the managers are built, is refused
        (a `ConfigError` naming it)."""
        name = _value(host_pool_name)
        kind = type(host_pool).__name__
        if name == KV and KV in self.pools and self.pools[KV].host_pool is host_pool:
            return
        if name != KV and name not in EXTRA_POOLS:
            raise ConfigError(
                f"host pool {name} ({kind}) is not supported: kvpool's SGLang backend stores "
                f"the pools {[KV, *EXTRA_POOLS]} (KV, sliding-window KV, Mamba state)"
            )
        if self._built:
            raise ConfigError(
                f"host pool {name} ({kind}) is registered after on_host_pools_registered: "
                "kvpool's SGLang backend has divided its levels between the pools already"
            )
        if name == KV:
            if KV in self.pools:
                raise ConfigError(
                    f"host pool kv ({kind}) is not the KV host pool registered with "
                    "register_mem_pool_host"
                )
            self.register_mem_pool_host(host_pool)
            return
        if name in self.pools:
            raise ConfigError(f"host pool {name} ({kind}) is registered twice")
        try:
            if name == MAMBA:
                page: PageFormat | StateFormat = state_format(host_pool)
                shard = state_shard(self.storage_config)  # (each rank's own heads, even MLA)
            else:
                page, shard = page_format(host_pool), self.shard
        except ConfigError as error:
            raise ConfigError(f"host pool {name} ({kind}) is not supported: {error}") from error
        self.pools[name] = _Pool(name, host_pool, page, shard)

    def on_host_pools_registered(self) -> None:
        """Every pool is registered: build a manager per pool, the levels' bytes split between
        them (`ConfigError` naming what does not fit)."""
        self._build()

    def _build(self) -> None:
        with self._build_lock:
            if self._built or KV not in self.pools:
                return
            self._weights()  # (checked even when there is one pool)
            s = self.settings
            splits = {
                key: self._split(key, total)
                for key, total in [
                    ("staging_bytes", s.staging_bytes),
                    ("host_bytes", s.host_bytes),
                    ("disk_bytes", s.disk_bytes),
                ]
                if total
            }
            try:
                for name, pool in self.pools.items():
                    self._build_pool(pool, {key: split[name] for key, split in splits.items()})
            finally:
                self._built = True  # (close() frees what was built)

    def _weights(self) -> dict[str, float]:
        """Each pool's weight in the split of the levels' bytes: `pool_shares` (naming every
        pool), else one stored page of each (each pool holds about as many pages)."""
        given = self.settings.pool_shares
        if given is None:
            return {name: float(pool.value_bytes) for name, pool in self.pools.items()}
        weights = dict(given)
        for name in sorted(set(self.pools) ^ set(weights)):
            raise ConfigError(
                f"hicache_storage_backend_extra_config['pool_shares']={weights!r} is invalid: "
                f"must name every pool SGLang registered ({sorted(self.pools)}), "
                f"{'not' if name in weights else 'and'} {name!r}"
            )
        return weights

    def _split(self, key: str, total: int) -> dict[str, int]:
        """`total` bytes of level `key` split between the pools: each first gets the least a
        level of its own holds (one grain of `GRAIN` bytes, or its page rounded up to grains),
        the rest goes by weight (`ConfigError` naming the key when `total` is short)."""
        if len(self.pools) == 1:
            return {name: total for name in self.pools}
        floors = {n: -(-p.value_bytes // GRAIN) * GRAIN for n, p in self.pools.items()}
        if total < sum(floors.values()):
            raise ConfigError(
                f"hicache_storage_backend_extra_config[{key!r}]={total} is invalid: must be at "
                f"least {sum(floors.values())} bytes, the least a level of each pool holds "
                f"({floors})"
            )
        weights = self._weights()
        rest, weight = total - sum(floors.values()), sum(weights.values())
        return {n: floors[n] + int(rest * weights[n] / weight) for n in self.pools}

    def _build_pool(self, pool: _Pool, budget: dict[str, int]) -> None:
        if pool.identity is None:
            assert self.identity is not None  # (the KV pool is registered)
            pool.identity = _pool_identity(self.identity, pool.name, pool.page)
        pool.salt = f"sglang|{pool.identity.digest}|{pool.shard.label}".encode()
        pool.scope = ReuseScope(salt=pool.salt)
        try:
            manager = KVCacheManager(self._manager_config(pool, budget))
        except ConfigError as error:
            raise ConfigError(f"pool {pool.name} ({budget}): {error}") from error
        manager.transfer_to_current_thread()
        pool.manager = manager
        pool.level_names = ["staging"] + [name.lower() for name in manager.stats().level_names[1:]]
        recovery = manager.disk_recovery
        log.info(
            "kvpool: SGLang storage for %s, pool %s, shard %s, pages of %d bytes (%s, %s); "
            "levels %s %s%s%s",
            pool.identity,
            pool.name,
            pool.shard.label,
            pool.page.nbytes,
            pool.page.kind,
            pool.page.layout,
            pool.level_names,
            budget,
            "" if self.settings.remote_url is None else ", remote",
            ""
            if recovery is None
            else f"; found on disk: {recovery.blocks} pages ({recovery.bytes_verified} bytes "
            f"checked), discarded {dict(recovery.discarded)}",
        )

    def _manager_config(self, pool: _Pool, budget: dict[str, int]) -> KVCacheManagerConfig:
        s = self.settings
        tiers: list[CacheTierConfig] = [
            GpuCacheTierConfig(budget["staging_bytes"], shared_by_fd=True)
        ]
        if s.host_bytes:
            tiers.append(HostCacheTierConfig(budget["host_bytes"]))
        if s.disk_bytes:
            assert s.disk_path is not None and pool.identity is not None
            config = self.storage_config  # (a directory per process and pool: one manager each)
            process = (
                f"{self.shard.label}-pp{config.pp_rank}of{config.pp_size}"
                f"-dp{getattr(config, 'dp_rank', 0)}"
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

    def _pool(self, name: str) -> _Pool | None:
        """The pool named `name`, its manager built (None when not registered: counted)."""
        if not self._built:
            self._build()  # (SGLang calls on_host_pools_registered first; a direct caller may not)
        pool = self.pools.get(name)
        if pool is None:
            self.counters["not_registered"] += 1
        return pool

    @contextmanager
    def _driving(self, pool: _Pool | None, operation: str) -> Iterator[KVCacheManager | None]:
        """The pool's manager, for this thread, while no other call runs on it; None when it
        is not built (or closed), or when `timeout_ms` passes first (counted)."""
        if pool is None or pool.manager is None:
            self.counters["not_registered"] += pool is not None
            yield None
            return
        if not pool.lock.acquire(timeout=self.settings.timeout_ms / 1000):
            pool.counters[f"{operation}_timeouts"] += 1
            log.warning(
                "kvpool: %s (%s) waited over %d ms: a miss",
                operation,
                pool.name,
                self.settings.timeout_ms,
            )
            yield None
            return
        try:
            if pool.manager is None:  # (closed meanwhile)
                self.counters["not_registered"] += 1
                yield None
                return
            pool.manager.transfer_to_current_thread()
            yield pool.manager
        finally:
            pool.lock.release()

    # -- the storage interface SGLang's controller calls ----------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many of `keys`, from the first, are stored (locally, then on the remote tier)."""
        _check_keys(keys)
        found = self._presence(self._pool(KV), keys, leading=True)
        return sum(found)

    def _presence(self, pool: _Pool | None, keys: Sequence[str], leading: bool) -> list[bool]:
        """Whether each of `keys` is stored in `pool` (`leading`: up to the first absent one,
        the rest False). A failure: none is."""
        found = [False] * len(keys)
        with self._driving(pool, "exists") as manager:
            if manager is None or pool is None:
                return found
            try:
                for i, key in enumerate(keys):
                    found[i] = manager.probe_reuse(pool.scope, [pool.token(key)]) >= 1
                    if leading and not found[i]:
                        break
            except Exception as error:  # (a tier failing: the pages are not there)
                self._failed(pool, "exists", error)
                return [False] * len(keys)
        return found

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists_v2(
        self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None
    ) -> PoolTransferResult:
        """The usable prefix of `keys` (in pages) over the KV pool and each pool of
        `pool_transfers`, by its hit policy (module docstring); with each pool's own boundary
        and every prefix length all pools can restore."""
        _check_keys(keys)
        kv_pages = self.batch_exists(keys)
        hits: dict[Any, int] = {KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if not restorable:
                break
            name, policy = _value(transfer.name), _value(transfer.hit_policy)
            pool = self._pool(name)
            if pool is None or policy not in (ALL_PAGES, TRAILING_PAGES):
                if pool is not None:
                    pool.counters["unsupported_policy_queries"] += 1
                restorable = []  # (nothing this backend cannot restore is usable)
                break
            present = self._presence(pool, keys[:kv_pages], leading=policy == ALL_PAGES)
            if policy == ALL_PAGES:
                ok = set(range(1, (present + [False]).index(False) + 1))
            else:
                trailing = max(1, len(transfer.keys or ()))
                ok = {n for n in range(1, kv_pages + 1) if all(present[max(0, n - trailing) : n])}
            if ok:
                hits[transfer.name] = max(ok)
            restorable = [n for n in restorable if n in ok]
        return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Read page i of `keys` into the host pool at `host_indices[i * page_size]`."""
        _check_keys(keys)
        pool = self._pool(KV)
        targets = self._host_pages(pool, keys, host_indices)
        if pool is None or targets is None:
            return [False] * len(keys)
        return self._read(pool, keys, targets)

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Store page i of `keys` from the host pool at `host_indices[i * page_size]`."""
        _check_keys(keys)
        pool = self._pool(KV)
        sources = self._host_pages(pool, keys, host_indices)
        if pool is None or sources is None:
            return [False] * len(keys)
        return self._write(pool, keys, sources)

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> dict[Any, list[bool]]:
        """Each transfer's pages, from its pool into its host pool at `host_indices[i *
        page_size]` (by pool: the leading run read)."""
        return self._transfers(transfers, self._read)

    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> dict[Any, list[bool]]:
        """Each transfer's pages, from its host pool at `host_indices[i * page_size]` into its
        pool (by pool: which were stored)."""
        return self._transfers(transfers, self._write)

    def _transfers(self, transfers: Any, copy: Any) -> dict[Any, list[bool]]:
        done: dict[Any, list[bool]] = {}
        for transfer in transfers or []:
            keys = list(transfer.keys or [])
            _check_keys(keys)
            pool = self._pool(_value(transfer.name))
            pages = self._host_pages(pool, keys, transfer.host_indices)
            done[transfer.name] = (
                [False] * len(keys) if pool is None or pages is None else copy(pool, keys, pages)
            )
        return done

    def _host_pages(
        self, pool: _Pool | None, keys: list[str], host_indices: Any
    ) -> list[Any] | None:
        """`pool`'s host page i of `keys`, at `host_indices[i * page_size]`, each as its format
        copies it (None when the pool is not registered)."""
        if pool is None:
            return None
        _check_indices(host_indices, len(keys), pool.page.page_size, pool.name)
        starts = host_indices[:: pool.page.page_size].tolist()
        return [pool.page.target(pool.host_pool, int(s)) for s in starts]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """SGLang's generic path: each page into its flat tensor (the host pool's own order)."""
        _check_keys(keys)
        pool = self._pool(KV)
        if pool is None or target_locations is None:
            return [None] * len(keys)
        assert isinstance(pool.page, PageFormat)
        targets = [pool.page.native_of(t) for t in target_locations]
        done = self._read(pool, keys, targets)
        return [t if ok else None for t, ok in zip(target_locations, done, strict=True)]

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        found: torch.Tensor | None = self.batch_get([key], [target_location])[0]
        return found

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """SGLang's generic path: each page from its tensor (the host pool's own order)."""
        _check_keys(keys)
        pool = self._pool(KV)
        if pool is None or values is None:
            return False
        assert isinstance(pool.page, PageFormat)
        sources = [pool.page.native_of(v) for v in values]
        return all(self._write(pool, keys, sources))

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def clear(self) -> None:
        """Forget every stored page of every pool (a persistent disk level's records too)."""
        for pool in self.pools.values():
            with self._driving(pool, "clear") as manager:
                if manager is not None:
                    manager.clear_reusable_blocks()

    def close(self) -> None:
        """Write what waits for the remote tier, move cached pages down to a persistent disk
        level (a restart finds them), and free the managers."""
        for pool in self.pools.values():
            with self._driving(pool, "close") as manager:
                if manager is None:
                    continue
                try:
                    manager.flush_remote_writes(10.0)
                    if self.settings.disk_bytes and self.settings.disk_persist:
                        manager.save_to_disk()
                finally:
                    manager.shutdown()
                    pool.manager = None

    def get_stats(self) -> Any:
        """SGLang's `StorageMetrics` since the last call (pages per call, GB/s), with
        `kvpool`: `statistics()`."""
        metrics_class = _metrics_class()
        if metrics_class is None:
            return None
        metrics = metrics_class()
        for name, values in self._metrics.items():
            getattr(metrics, name).extend(values)
            values.clear()
        metrics.kvpool = self.statistics()
        return metrics

    def statistics(self) -> dict[str, Any]:
        """The KV pool's counters since start: `hit_pages_by_tier` (where each page read was
        found: staging, host, disk, remote), `miss_pages`, `corrupt_pages`, `stored_pages`,
        `present_pages` (writes of pages already stored), `failures`, timeouts, bytes; and
        `remote`, the remote tier's own counters (values found corrupt among them). A hybrid
        model's other pools: the same under `pools` (`pools["mamba"]["corrupt_pages"]`)."""
        kv = self.pools.get(KV)
        found = _pool_statistics(kv, self.counters)
        others = {name: _pool_statistics(p, Counter()) for name, p in self.pools.items()}
        others.pop(KV, None)
        if others:
            found["pools"] = others
        return found

    # -- the copies -----------------------------------------------------------------------------

    def _read(self, pool: _Pool, keys: Sequence[str], targets: Sequence[Any]) -> list[bool]:
        """Pages of `keys` into `targets` in order, stopping at the first that fails (SGLang
        uses the leading run)."""
        done = [False] * len(keys)
        started = time.perf_counter()
        with self._driving(pool, "get") as manager:
            if manager is None:
                return done
            view = manager.page_view(0, ROLE)  # (no pool resizes while the lock is held)
            for i, (key, target) in enumerate(zip(keys, targets, strict=True)):
                try:
                    ok = self._read_one(pool, manager, view, key, target)
                except Exception as error:
                    self._failed(pool, "get", error)
                    ok = False
                if not ok:
                    break
                done[i] = True
        self._note("prefetch", sum(done), pool.page.nbytes, started)
        return done

    def _read_one(
        self, pool: _Pool, manager: KVCacheManager, view: Any, key: str, target: Any
    ) -> bool:
        """Page `key` into `target`. A local page is read where it lies (into the pool's
        scratch row, then checked): SGLang's host pool is the cache above, so bringing the page
        up to kvpool's staging level would cost a copy and an eviction for nothing. A page
        found on the remote tier is fetched into the staging level (and stays there for the
        next reader)."""
        token = pool.token(key)
        cache = manager.create_kv_cache(pool.scope, [token])
        try:
            if cache.num_committed_tokens < 1:
                pool.counters["miss_pages"] += 1
                return False
            if cache.pending_remote_tokens:
                tier = "remote"
                if not cache.resume() or cache.num_committed_tokens < 1:
                    pool.counters["miss_pages"] += 1
                    return False
                row = view[int(cache.get_page_indices(0, ROLE)[0])]
                stored = pool.page.stored(row)
            else:
                tier = self._tier_of(pool, cache)
                cache.read_committed(0, 0, ROLE, pool.row)
                row, stored = pool.row, pool.scratch
            if bytes(row[pool.page.nbytes :]) != token[:TAG_BYTES]:
                pool.counters["corrupt_pages"] += 1
                log.warning(
                    "kvpool: the %s page stored for %s names another key: a miss", pool.name, key
                )
                return False
            pool.page.put(target, stored)
            pool.counters[f"hit_{tier}"] += 1
            pool.counters["read_bytes"] += pool.page.nbytes
            return True
        finally:
            cache.close()

    @staticmethod
    def _tier_of(pool: _Pool, cache: Any) -> str:
        page = cache.pages(0)[0]
        return "staging" if page is None else pool.level_names[page.level]

    def _write(self, pool: _Pool, keys: Sequence[str], sources: Sequence[Any]) -> list[bool]:
        done = [False] * len(keys)
        started = time.perf_counter()
        with self._driving(pool, "set") as manager:
            if manager is None:
                return done
            view = manager.page_view(0, ROLE)
            for i, (key, source) in enumerate(zip(keys, sources, strict=True)):
                try:
                    done[i] = self._write_one(pool, manager, view, key, source)
                except Exception as error:
                    self._failed(pool, "set", error)
        self._note("backup", sum(done), pool.page.nbytes, started)
        return done

    @staticmethod
    def _write_one(pool: _Pool, manager: KVCacheManager, view: Any, key: str, source: Any) -> bool:
        """Page `key` from `source` into a new staging page (through the pool's scratch row:
        the page in canonical order, then its tag), committed; a page stored already is left
        as it is."""
        token = pool.token(key)
        cache = manager.create_kv_cache(pool.scope, [token], remote=False)
        try:
            if cache.num_committed_tokens >= 1:
                pool.counters["present_pages"] += 1
                return True
            if not (cache.resume() and cache.resize(1)):
                pool.counters["no_room_pages"] += 1
                return False
            pool.page.take(pool.scratch, source)
            pool.row[pool.page.nbytes :] = np.frombuffer(token[:TAG_BYTES], dtype=np.uint8)
            view[int(cache.get_page_indices(0, ROLE)[0])] = pool.row
            cache.commit([token])
            manager.write_remote(cache, 0)
            pool.counters["stored_pages"] += 1
            pool.counters["written_bytes"] += pool.page.nbytes
            return True
        finally:
            cache.close()

    def _note(self, kind: str, pages: int, nbytes: int, started: float) -> None:
        if not pages:
            return
        seconds = max(time.perf_counter() - started, 1e-9)
        self._metrics[f"{kind}_pgs"].append(pages)
        self._metrics[f"{kind}_bandwidth"].append(pages * nbytes / seconds / 1e9)

    @staticmethod
    def _failed(pool: _Pool, operation: str, error: Exception) -> None:
        pool.counters["failures"] += 1
        log.warning(
            "kvpool: %s (%s) failed (%s: %s): a miss",
            operation,
            pool.name,
            type(error).__name__,
            error,
        )


def _pool_statistics(pool: _Pool | None, extra: Counter[str]) -> dict[str, Any]:
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


def _check_keys(keys: object) -> None:
    if not isinstance(keys, list | tuple) or not all(isinstance(k, str) for k in keys):
        raise ArgumentError(f"keys={keys!r} is invalid: must be a list of strings (page hashes)")


def _check_indices(host_indices: object, pages: int, page_size: int, pool: str) -> None:
    if not isinstance(host_indices, torch.Tensor) or host_indices.numel() != pages * page_size:
        got = host_indices.numel() if isinstance(host_indices, torch.Tensor) else host_indices
        raise ArgumentError(
            f"host_indices={got!r} is invalid: must be a tensor of {pages} x {page_size} "
            f"slots of pool {pool} (page_size per key)"
        )


__all__ = ["KVPoolHiCacheStorage"]

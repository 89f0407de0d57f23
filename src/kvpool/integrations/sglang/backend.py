"""`KVPoolHiCacheStorage`: SGLang's HiCache L3 storage on kvpool managers.

SGLang calls it from three of its cache controller's threads (the prefetch query, the prefetch
I/O and the write-back), with pages named by chained token hashes. Each SGLang page is one
kvpool block of one token: the token is a 32-byte digest of the page's key and this rank's
namespace (model identity, shard, pool), so kvpool's prefix tree holds every page as a chain of
its own (SGLang's key already names the page's whole prefix), and its levels, eviction policy,
persistent disk and shared tier hold it like any block. `batch_exists` asks for the pages in
order and stops at the first absent one, as SGLang's contract says.

Every host pool SGLang registers has a kvpool manager of its own (`StoredPool`): the KV pool
(`register_mem_pool_host`, and again as `kv` through `register_mem_host_pool_v2`), and a
hybrid model's `swa` and `mamba` pools (`register_mem_host_pool_v2`), whose pages differ in
size; `staging_bytes`, `host_bytes` and `disk_bytes` are split between them (`pool_shares`).
The managers are built once SGLang says the pools are all registered
(`on_host_pools_registered`). Any other pool is refused by name when it is registered.

Pages are copied between SGLang's host pool (by index: `batch_get_v1`/`batch_set_v1` and the
`_v2` forms, or the flat pages of SGLang's generic path) and each pool's manager as `pools.py`
says. A page whose tag names another key is a miss, never bytes in SGLang's pool; every
failure (a tier's error, a failed check, a timeout) is a miss or a write not done. Only
arguments that break SGLang's contract raise, an `ArgumentError` naming them.

`batch_exists_v2` answers with SGLang's per-pool hit policies: `all_pages` (the pool's leading
run), `trailing_pages` (a prefix of n pages is restorable when the pool holds the last
`len(transfer.keys)` pages before n: a Mamba state, an SWA window); the usable prefix is the
longest one every pool can restore, and the restorable lengths are returned too, as SGLang's
controller intersects them over ranks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, PoolTransferResult

from kvpool.errors import ConfigError, LogicError
from kvpool.integrations.identity import ModelIdentity
from kvpool.integrations.sglang.identity import Shard, rank_shard, sglang_identity, state_shard
from kvpool.integrations.sglang.pages import (
    PageFormat,
    StateFormat,
    check_indices,
    check_keys,
    page_format,
    state_format,
)
from kvpool.integrations.sglang.pools import (
    KV,
    ROLE,
    StoredPool,
    level_budgets,
    pool_statistics,
)
from kvpool.integrations.sglang.settings import BackendSettings
from kvpool.manager import KVCacheManager

log = logging.getLogger("kvpool.sglang")

SWA, MAMBA = "swa", "mamba"  # the pools stored beside KV (SGLang's PoolName values)
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
        self.pools: dict[str, StoredPool] = {}
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

    # -- set-up -------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang's KV host pool: its page format and the model's identity (`ConfigError`
        naming what is not supported)."""
        if KV in self.pools:
            raise LogicError("register_mem_pool_host: a host pool is registered already")
        page = page_format(mem_pool_host)
        identity = sglang_identity(self.storage_config, page, self.settings.model_id)
        self.mem_pool_host, self.page, self.identity = mem_pool_host, page, identity
        pool = StoredPool(KV, mem_pool_host, page, self.shard)
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
        self.pools[name] = StoredPool(name, host_pool, page, shard)

    def on_host_pools_registered(self) -> None:
        """Every pool is registered: build a manager per pool, the levels' bytes split between
        them (`ConfigError` naming what does not fit)."""
        self._build()

    def _build(self) -> None:
        with self._build_lock:
            if self._built or KV not in self.pools:
                return
            budgets = level_budgets(self.pools, self.settings)  # (a ConfigError: none built)
            assert self.identity is not None  # (the KV pool is registered)
            try:
                for name, pool in self.pools.items():
                    pool.build(
                        budgets[name], self.settings, self.storage_config, self.shard, self.identity
                    )
            finally:
                self._built = True  # (close() frees what was built)

    def _pool(self, name: str) -> StoredPool | None:
        """The pool named `name`, its manager built (None when not registered: counted)."""
        if not self._built:
            self._build()  # (SGLang calls on_host_pools_registered first; a direct caller may not)
        pool = self.pools.get(name)
        if pool is None:
            self.counters["not_registered"] += 1
        return pool

    @contextmanager
    def _driving(self, pool: StoredPool | None, operation: str) -> Iterator[KVCacheManager | None]:
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
        check_keys(keys)
        found = self._presence(self._pool(KV), keys, leading=True)
        return sum(found)

    def _presence(self, pool: StoredPool | None, keys: Sequence[str], leading: bool) -> list[bool]:
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
        check_keys(keys)
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
        check_keys(keys)
        pool = self._pool(KV)
        targets = self._host_pages(pool, keys, host_indices)
        if pool is None or targets is None:
            return [False] * len(keys)
        return self._read(pool, keys, targets)

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Store page i of `keys` from the host pool at `host_indices[i * page_size]`."""
        check_keys(keys)
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
            check_keys(keys)
            pool = self._pool(_value(transfer.name))
            pages = self._host_pages(pool, keys, transfer.host_indices)
            done[transfer.name] = (
                [False] * len(keys) if pool is None or pages is None else copy(pool, keys, pages)
            )
        return done

    def _host_pages(
        self, pool: StoredPool | None, keys: list[str], host_indices: Any
    ) -> list[Any] | None:
        """`pool`'s host page i of `keys`, at `host_indices[i * page_size]`, each as its format
        copies it (None when the pool is not registered)."""
        if pool is None:
            return None
        check_indices(host_indices, len(keys), pool.page.page_size, pool.name)
        starts = host_indices[:: pool.page.page_size].tolist()
        return [pool.page.target(pool.host_pool, int(s)) for s in starts]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """SGLang's generic path: each page into its flat tensor (the host pool's own order)."""
        check_keys(keys)
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
        check_keys(keys)
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
        found = pool_statistics(kv, self.counters)
        others = {name: pool_statistics(p, Counter()) for name, p in self.pools.items()}
        others.pop(KV, None)
        if others:
            found["pools"] = others
        return found

    # -- the copies -----------------------------------------------------------------------------

    def _read(self, pool: StoredPool, keys: Sequence[str], targets: Sequence[Any]) -> list[bool]:
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
                    ok = pool.read_one(manager, view, key, target)
                except Exception as error:
                    self._failed(pool, "get", error)
                    ok = False
                if not ok:
                    break
                done[i] = True
        self._note("prefetch", sum(done), pool.page.nbytes, started)
        return done

    def _write(self, pool: StoredPool, keys: Sequence[str], sources: Sequence[Any]) -> list[bool]:
        done = [False] * len(keys)
        started = time.perf_counter()
        with self._driving(pool, "set") as manager:
            if manager is None:
                return done
            view = manager.page_view(0, ROLE)
            for i, (key, source) in enumerate(zip(keys, sources, strict=True)):
                try:
                    done[i] = pool.write_one(manager, view, key, source)
                except Exception as error:
                    self._failed(pool, "set", error)
        self._note("backup", sum(done), pool.page.nbytes, started)
        return done

    def _note(self, kind: str, pages: int, nbytes: int, started: float) -> None:
        if not pages:
            return
        seconds = max(time.perf_counter() - started, 1e-9)
        self._metrics[f"{kind}_pgs"].append(pages)
        self._metrics[f"{kind}_bandwidth"].append(pages * nbytes / seconds / 1e9)

    @staticmethod
    def _failed(pool: StoredPool, operation: str, error: Exception) -> None:
        pool.counters["failures"] += 1
        log.warning(
            "kvpool: %s (%s) failed (%s: %s): a miss",
            operation,
            pool.name,
            type(error).__name__,
            error,
        )


__all__ = ["KVPoolHiCacheStorage"]

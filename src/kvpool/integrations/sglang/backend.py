"""`KVPoolHiCacheStorage`: SGLang's HiCache L3 storage on a kvpool manager.

SGLang calls it from three of its cache controller's threads (the prefetch query, the prefetch
I/O and the write-back), with pages named by chained token hashes. Each SGLang page is one
kvpool block of one token: the token is a 32-byte digest of the page's key and this rank's
namespace (model identity, shard), so kvpool's prefix tree holds every page as a chain of its
own (SGLang's key already names the page's whole prefix), and its levels, eviction policy,
persistent disk and shared tier hold it like any block. `batch_exists` asks for the pages in
order and stops at the first absent one, as SGLang's contract says.

Reads and writes copy straight between SGLang's host pool (a strided view of the page, by
index: `batch_get_v1`/`batch_set_v1`, or the flat page tensors of SGLang's generic path) and
kvpool's first level (`staging_bytes`): one copy each way, in the canonical order of
`pages.py`, whatever the host pool's layout. A stored value ends with a tag naming its key;
a page whose tag differs is a miss (counted as corrupt), never KV in SGLang's pool. Every
failure (a tier's error, a value failing a check, a timeout) is a miss or a write not done;
only arguments that break SGLang's contract (keys that are not strings, host indices that are
not `page_size` per key) raise, an `ArgumentError` naming them.
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
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

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
from kvpool.integrations.sglang.identity import Shard, rank_shard, sglang_identity
from kvpool.integrations.sglang.pages import TAG_BYTES, PageFormat, page_format
from kvpool.integrations.sglang.settings import BackendSettings
from kvpool.manager import KVCacheManager

log = logging.getLogger("kvpool.sglang")

ROLE = "page"  # the one buffer of kvpool's one layer: a whole SGLang page, then its tag


def _metrics_class() -> Any:
    try:
        from sglang.srt.observability.metrics_collector import StorageMetrics

        return StorageMetrics
    except ImportError:  # (metrics are optional in SGLang too)
        return None


class KVPoolHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """SGLang's `dynamic` storage backend (module docstring; the guide: docs/guides/sglang.md).
    SGLang builds it with `(storage_config, kwargs)`, then calls `register_mem_pool_host`, where
    the page format is known and the kvpool manager is built."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        if storage_config is None:
            raise ConfigError(
                "storage_config=None is invalid: must be SGLang's HiCacheStorageConfig"
            )
        self.storage_config = storage_config
        self.settings = BackendSettings.parse(storage_config.extra_config)
        self.shard: Shard = rank_shard(storage_config)
        self.manager: KVCacheManager | None = None
        self.page: PageFormat | None = None
        self.identity: ModelIdentity | None = None
        self.mem_pool_host: Any = None
        self._scratch: _Scratch | None = None
        self._lock = threading.Lock()
        self._salt = b""
        self._scope: ReuseScope | None = None
        self._level_names: list[str] = []
        self.counters: Counter[str] = Counter()
        self._metrics: dict[str, list[float]] = {
            "prefetch_pgs": [],
            "backup_pgs": [],
            "prefetch_bandwidth": [],
            "backup_bandwidth": [],
        }

    # -- set-up -------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang's host pool: its page format decides kvpool's layer, and the manager is built
        (`ConfigError` naming what is not supported)."""
        if self.manager is not None:
            raise LogicError("register_mem_pool_host: a host pool is registered already")
        page = page_format(mem_pool_host)
        identity = sglang_identity(self.storage_config, page, self.settings.model_id)
        self.mem_pool_host, self.page, self.identity = mem_pool_host, page, identity
        self._scratch = _Scratch(page)  # (one page; used while the lock is held)
        self._salt = f"sglang|{identity.digest}|{self.shard.label}".encode()
        self._scope = ReuseScope(salt=self._salt)
        self.manager = KVCacheManager(self._manager_config(page, identity))
        self.manager.transfer_to_current_thread()
        self._level_names = ["staging"] + [
            name.lower() for name in self.manager.stats().level_names[1:]
        ]
        recovery = self.manager.disk_recovery
        log.info(
            "kvpool: SGLang storage for %s, shard %s, pages of %d bytes (%s, %s); levels %s%s%s",
            identity,
            self.shard.label,
            page.nbytes,
            page.kind,
            page.layout,
            self._level_names,
            "" if self.settings.remote_url is None else ", remote",
            ""
            if recovery is None
            else f"; found on disk: {recovery.blocks} pages ({recovery.bytes_verified} bytes "
            f"checked), discarded {dict(recovery.discarded)}",
        )

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        raise ConfigError(
            f"host pool {host_pool_name!s} ({type(host_pool).__name__}): kvpool's SGLang backend "
            "does not store the extra pools of hybrid models (the _v2 interface) yet"
        )

    def _manager_config(self, page: PageFormat, identity: ModelIdentity) -> KVCacheManagerConfig:
        s = self.settings
        tiers: list[CacheTierConfig] = [GpuCacheTierConfig(s.staging_bytes, shared_by_fd=True)]
        if s.host_bytes:
            tiers.append(HostCacheTierConfig(s.host_bytes))
        if s.disk_bytes:
            assert s.disk_path is not None
            config = self.storage_config  # (a directory per process: one manager owns one)
            process = (
                f"{self.shard.label}-pp{config.pp_rank}of{config.pp_size}"
                f"-dp{getattr(config, 'dp_rank', 0)}"
            )
            path = os.path.join(s.disk_path, f"kvpool-sglang-{process}")
            os.makedirs(path, exist_ok=True)
            persistent = f"{identity.digest}|{self.shard.label}" if s.disk_persist else None
            tiers.append(DiskCacheTierConfig(s.disk_bytes, path, persistent))
        remote = None
        if s.remote_url is not None:
            remote = s.remote_tier(identity.digest, self.shard.index)
        layer = AttentionLayerConfig(0, [BufferConfig(ROLE, page.nbytes + TAG_BYTES)])
        return KVCacheManagerConfig(
            tokens_per_block=1,
            cache_tiers=tiers,
            layers=[layer],
            enable_partial_reuse=False,
            remote_tier=remote,
            eviction_policy=s.eviction_policy,
            max_util_for_resume=1.0,
        )

    # -- keys ---------------------------------------------------------------------------------

    def _token(self, key: str) -> bytes:
        """The kvpool token of SGLang page `key` in this rank's namespace (its first
        `TAG_BYTES` are the stored page's tag)."""
        return hashlib.sha256(self._salt + b"\0" + key.encode()).digest()

    @contextmanager
    def _driving(self, operation: str) -> Iterator[KVCacheManager | None]:
        """The manager, for this thread, while no other call runs; None when it is not built,
        or when `timeout_ms` passes first (counted)."""
        if self.manager is None:
            self.counters["not_registered"] += 1
            yield None
            return
        if not self._lock.acquire(timeout=self.settings.timeout_ms / 1000):
            self.counters[f"{operation}_timeouts"] += 1
            log.warning("kvpool: %s waited over %d ms: a miss", operation, self.settings.timeout_ms)
            yield None
            return
        try:
            self.manager.transfer_to_current_thread()
            yield self.manager
        finally:
            self._lock.release()

    # -- the storage interface SGLang's controller calls ----------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many of `keys`, from the first, are stored (locally, then on the remote tier)."""
        _check_keys(keys)
        with self._driving("exists") as manager:
            if manager is None:
                return 0
            try:
                for i, key in enumerate(keys):
                    if manager.probe_reuse(self._scope, [self._token(key)]) < 1:
                        return i
                return len(keys)
            except Exception as error:  # (a tier failing: the pages are not there)
                self._failed("exists", error)
                return 0

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Read page i of `keys` into the host pool at `host_indices[i * page_size]`."""
        targets = self._host_pages(keys, host_indices)
        return [False] * len(keys) if targets is None else self._read(keys, targets)

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Store page i of `keys` from the host pool at `host_indices[i * page_size]`."""
        sources = self._host_pages(keys, host_indices)
        return [False] * len(keys) if sources is None else self._write(keys, sources)

    def _host_pages(self, keys: list[str], host_indices: torch.Tensor) -> list[Any] | None:
        """The host pool's page i of `keys`, at `host_indices[i * page_size]`, each in the
        canonical order (None before a host pool is registered)."""
        page = self._page_or_none()
        _check_keys(keys)
        if page is None:
            return None
        _check_indices(host_indices, len(keys), page.page_size)
        starts = host_indices[:: page.page_size].tolist()
        return [page.canonical(self.mem_pool_host, int(s)) for s in starts]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """SGLang's generic path: each page into its flat tensor (the host pool's own order)."""
        page = self._page_or_none()
        _check_keys(keys)
        if page is None or target_locations is None:
            return [None] * len(keys)
        targets = [page.canonical_of(t) for t in target_locations]
        done = self._read(keys, targets)
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
        page = self._page_or_none()
        _check_keys(keys)
        if page is None or values is None:
            return False
        sources = [page.canonical_of(v) for v in values]
        return all(self._write(keys, sources))

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def clear(self) -> None:
        """Forget every stored page (a persistent disk level's records too)."""
        with self._driving("clear") as manager:
            if manager is not None:
                manager.clear_reusable_blocks()

    def close(self) -> None:
        """Write what waits for the remote tier, move cached pages down to a persistent disk
        level (a restart finds them), and free the manager."""
        with self._driving("close") as manager:
            if manager is None:
                return
            try:
                manager.flush_remote_writes(10.0)
                if self.settings.disk_bytes and self.settings.disk_persist:
                    manager.save_to_disk()
            finally:
                manager.shutdown()
                self.manager = None

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
        """Counters since start: `hit_pages_by_tier` (where each page read was found:
        staging, host, disk, remote), `miss_pages`, `corrupt_pages`, `stored_pages`,
        `present_pages` (writes of pages already stored), `failures`, timeouts, bytes; and
        `remote`, the remote tier's own counters (values found corrupt among them)."""
        counters = dict(self.counters)
        remote = None if self.manager is None else self.manager.remote_statistics()
        by_tier = {
            name.removeprefix("hit_"): n for name, n in counters.items() if name.startswith("hit_")
        }
        return {
            "hit_pages_by_tier": by_tier,
            **{k: v for k, v in counters.items() if not k.startswith("hit_")},
            "remote": None if remote is None else dataclasses.asdict(remote),
        }

    # -- the copies -----------------------------------------------------------------------------

    def _page_or_none(self) -> PageFormat | None:
        if self.page is None:
            self.counters["not_registered"] += 1
        return self.page

    def _read(self, keys: Sequence[str], targets: Sequence[Any]) -> list[bool]:
        """Pages of `keys` into `targets` (canonical views) in order, stopping at the first
        that fails (SGLang uses the leading run)."""
        done = [False] * len(keys)
        started = time.perf_counter()
        with self._driving("get") as manager:
            if manager is None:
                return done
            assert self.page is not None and self._scratch is not None  # (registered)
            view = manager.page_view(0, ROLE)  # (no pool resizes while the lock is held)
            scratch = self._scratch  # (pages read where they lie)
            for i, (key, target) in enumerate(zip(keys, targets, strict=True)):
                try:
                    ok = self._read_one(manager, view, scratch, key, target)
                except Exception as error:
                    self._failed("get", error)
                    ok = False
                if not ok:
                    break
                done[i] = True
        self._note("prefetch", sum(done), started)
        return done

    def _read_one(
        self, manager: KVCacheManager, view: Any, scratch: _Scratch, key: str, target: Any
    ) -> bool:
        """Page `key` into `target`. A local page is read where it lies (into `scratch`, then
        checked): SGLang's host pool is the cache above, so bringing the page up to kvpool's
        staging level would cost a copy and an eviction for nothing. A page found on the
        remote tier is fetched into the staging level (and stays there for the next reader)."""
        assert self.page is not None
        token = self._token(key)
        cache = manager.create_kv_cache(self._scope, [token])
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
                stored = torch.from_numpy(row[: self.page.nbytes]).view(self.page.dtype)
                stored = stored.view(self.page.shape)
            else:
                tier = self._tier_of(cache)
                cache.read_committed(0, 0, ROLE, scratch.row)
                row, stored = scratch.row, scratch.page
            if bytes(row[self.page.nbytes :]) != token[:TAG_BYTES]:
                self.counters["corrupt_pages"] += 1
                log.warning("kvpool: the page stored for %s names another key: a miss", key)
                return False
            target.copy_(stored)
            self.counters[f"hit_{tier}"] += 1
            self.counters["read_bytes"] += self.page.nbytes
            return True
        finally:
            cache.close()

    def _tier_of(self, cache: Any) -> str:
        page = cache.pages(0)[0]
        return "staging" if page is None else self._level_names[page.level]

    def _write(self, keys: Sequence[str], sources: Sequence[Any]) -> list[bool]:
        done = [False] * len(keys)
        started = time.perf_counter()
        with self._driving("set") as manager:
            if manager is None:
                return done
            assert self.page is not None and self._scratch is not None  # (registered)
            view = manager.page_view(0, ROLE)
            scratch = self._scratch
            for i, (key, source) in enumerate(zip(keys, sources, strict=True)):
                try:
                    done[i] = self._write_one(manager, view, scratch, key, source)
                except Exception as error:
                    self._failed("set", error)
        self._note("backup", sum(done), started)
        return done

    def _write_one(
        self, manager: KVCacheManager, view: Any, scratch: _Scratch, key: str, source: Any
    ) -> bool:
        """Page `key` from `source` into a new staging page (through `scratch`: the page in
        canonical order, then its tag), committed; a page stored already is left as it is."""
        assert self.page is not None
        token = self._token(key)
        cache = manager.create_kv_cache(self._scope, [token], remote=False)
        try:
            if cache.num_committed_tokens >= 1:
                self.counters["present_pages"] += 1
                return True
            if not (cache.resume() and cache.resize(1)):
                self.counters["no_room_pages"] += 1
                return False
            scratch.page.copy_(source)
            scratch.row[self.page.nbytes :] = np.frombuffer(token[:TAG_BYTES], dtype=np.uint8)
            view[int(cache.get_page_indices(0, ROLE)[0])] = scratch.row
            cache.commit([token])
            manager.write_remote(cache, 0)
            self.counters["stored_pages"] += 1
            self.counters["written_bytes"] += self.page.nbytes
            return True
        finally:
            cache.close()

    def _note(self, kind: str, pages: int, started: float) -> None:
        if not pages or self.page is None:
            return
        seconds = max(time.perf_counter() - started, 1e-9)
        self._metrics[f"{kind}_pgs"].append(pages)
        self._metrics[f"{kind}_bandwidth"].append(pages * self.page.nbytes / seconds / 1e9)

    def _failed(self, operation: str, error: Exception) -> None:
        self.counters["failures"] += 1
        log.warning("kvpool: %s failed (%s: %s): a miss", operation, type(error).__name__, error)


class _Scratch:
    """One stored page's bytes (`row`: the page, then its tag) and the page as a tensor in
    canonical order over them (`page`), made once per batch of reads."""

    def __init__(self, page: PageFormat) -> None:
        self.row = np.empty(page.nbytes + TAG_BYTES, dtype=np.uint8)
        self.page = torch.from_numpy(self.row[: page.nbytes]).view(page.dtype).view(page.shape)


def _check_keys(keys: object) -> None:
    if not isinstance(keys, list | tuple) or not all(isinstance(k, str) for k in keys):
        raise ArgumentError(f"keys={keys!r} is invalid: must be a list of strings (page hashes)")


def _check_indices(host_indices: object, pages: int, page_size: int) -> None:
    if not isinstance(host_indices, torch.Tensor) or host_indices.numel() != pages * page_size:
        got = host_indices.numel() if isinstance(host_indices, torch.Tensor) else host_indices
        raise ArgumentError(
            f"host_indices={got!r} is invalid: must be a tensor of {pages} x {page_size} "
            "token slots (page_size per key)"
        )


__all__ = ["KVPoolHiCacheStorage"]

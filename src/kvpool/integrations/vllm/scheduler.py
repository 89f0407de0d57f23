"""The connector's scheduler side: kvpool's manager lives here and takes every decision (what
is reused, where pages live, what is evicted); the workers only copy bytes where it says.

A request's kvpool pages are locked for exactly as long as a worker may touch them:
- a load: from the lookup (`get_num_new_matched_tokens`, which resumes a kvpool request
  holding the prefix, so pages on disk or in the remote tier are brought to the shared level
  then) until every worker reported the copy done (`finished_recving`);
- a save: from `request_finished` (a kvpool request with the tokens vLLM computed, new pages
  for the blocks kvpool lacks) until every worker reported the copy done
  (`finished_sending`); only then are the tokens committed, so no lookup can find a page
  before its bytes are there.
Loads are asynchronous in vLLM's sense (the request waits for `finished_recving`): a load that
failed is reported by the workers as load errors and vLLM recomputes those blocks.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

from kvpool.config import ReuseScope
from kvpool.errors import KVPoolError
from kvpool.integrations.identity import fingerprint_weights, model_identity
from kvpool.integrations.vllm.metadata import KVPoolConnectorMetadata, Transfer
from kvpool.integrations.vllm.settings import ConnectorSettings, PageFormat
from kvpool.manager import KVCacheManager

log = logging.getLogger("kvpool.vllm")


@dataclasses.dataclass
class _Pending:
    """A kvpool request with pages a worker reads (a load) or writes (a save)."""

    cache: Any  # kvpool.KVCache
    tokens: list[int]  # a save: what to commit once the bytes are there
    num_tokens: int  # a load: tokens it serves; a save: all its tokens
    first_block: int = 0  # a save: its first new block (the ones before were kvpool's)
    in_flight: bool = False  # the copy was handed to the workers


@dataclasses.dataclass
class ConnectorCounters:
    """What the connector did, for logs and metrics."""

    lookups: int = 0
    hit_tokens: int = 0
    hit_tokens_by_tier: dict[str, int] = dataclasses.field(
        default_factory=lambda: {"host": 0, "disk": 0, "remote": 0}
    )
    loaded_blocks: int = 0
    saved_blocks: int = 0
    skipped_saves: int = 0  # no room at kvpool's first level
    failed_saves: int = 0  # a worker could not write the pages: not committed
    load_failures: int = 0  # lookups that could not bring their pages up (a read error)


class AdapterIdentities:
    """The identity of each LoRA adapter (its config and a fingerprint of its weights), found
    once per adapter. vLLM's `lora_int_id` is a number a server's user picks: another server,
    or this one after a restart, may give the same number to another adapter, so keys that
    outlive the process (the shared tier, a persistent disk) carry the adapter's identity."""

    def __init__(self) -> None:
        self._known: dict[tuple[int, str, str], str] = {}

    def of(self, lora: Any) -> str:
        path = str(getattr(lora, "lora_path", "") or getattr(lora, "path", "") or "")
        key = (int(lora.lora_int_id), str(getattr(lora, "lora_name", "")), path)
        found = self._known.get(key)
        if found is None:
            try:
                weights = fingerprint_weights(path)
                config = Path(path, "adapter_config.json")
                settings = config.read_text() if config.is_file() else ""
                found = model_identity({"adapter_config": settings}, weights).digest
            except (OSError, ValueError):  # (no local files: the name and path stand in)
                found = model_identity({"lora_name": key[1], "lora_path": path}, None).digest
            self._known[key] = found
        return found


def reuse_scope(request: Any, adapters: AdapterIdentities) -> ReuseScope:
    """vLLM's prefix-cache scoping: the LoRA adapter (its id, with its identity in the salt)
    and the request's cache salt."""
    lora = getattr(request, "lora_request", None)
    if lora is None:
        return ReuseScope(lora_id=None, salt=request.cache_salt)
    salt = f"lora:{adapters.of(lora)}"
    if request.cache_salt is not None:
        salt += f"|salt:{request.cache_salt}"
    return ReuseScope(lora_id=int(lora.lora_int_id), salt=salt)


def reusable(request: Any) -> bool:
    """Token ids say everything about the request's KV (no images, no prompt embeddings)."""
    return (
        not getattr(request, "mm_features", None)
        and getattr(request, "prompt_embeds", None) is None
    )


class SchedulerSide:
    def __init__(self, settings: ConnectorSettings, page: PageFormat, model_id: str):
        """`model_id`: the model's identity (`identity.vllm_model_identity`)."""
        self.page = page
        self.block_size = page.block_size
        self.manager = KVCacheManager(page.manager_config(settings, model_id))
        self.shared = self.manager.shared_memory()
        self.adapters = AdapterIdentities()
        self.loads: dict[str, _Pending] = {}
        self.saves: dict[str, _Pending] = {}
        self._load_transfers: list[Transfer] = []
        self._save_transfers: list[Transfer] = []
        self.counters = ConnectorCounters()
        self.stats_path = settings.stats_path
        self._written: dict[str, int] | None = None
        self._closed = False

    # -- loads ---------------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        pending = self.loads.get(request.request_id)
        if pending is None:
            if not reusable(request):
                return 0, False
            pending = self._lookup(request)
            if pending is None:
                return 0, False
        if pending.in_flight:  # (asked again while its load runs: nothing new)
            return 0, False
        if pending.num_tokens <= num_computed_tokens:
            self._release_load(request.request_id)
            return 0, False
        return pending.num_tokens - num_computed_tokens, True

    def _lookup(self, request: Any) -> _Pending | None:
        """A resumed kvpool request holding the prefix vLLM may load, or None."""
        tokens = list(request.all_token_ids)
        usable = (len(tokens) - 1) // self.block_size * self.block_size  # vLLM computes the last
        if usable <= 0:
            return None
        self.counters.lookups += 1
        scope = reuse_scope(request, self.adapters)
        if self.manager.probe_reuse(scope, tokens[:usable]) < self.block_size:
            return None
        cache = self.manager.create_kv_cache(scope, tokens[:usable])
        tiers = self._tiers_of(cache)
        try:
            resumed = cache.resume()
        except (KVPoolError, OSError) as error:  # a read failed: a miss, not an engine error
            log.warning("kvpool: cannot bring a prefix up for %s: %s", request.request_id, error)
            self.counters.load_failures += 1
            cache.close()
            return None
        served = cache.num_committed_tokens // self.block_size * self.block_size
        if not resumed or served == 0:
            cache.close()
            return None
        pending = _Pending(cache, [], served)
        self.loads[request.request_id] = pending
        self.counters.hit_tokens += served
        by_tier = self.counters.hit_tokens_by_tier
        for block in range(served // self.block_size):
            by_tier[tiers[block] if block < len(tiers) else "remote"] += self.block_size
        return pending

    def _tiers_of(self, cache: Any) -> list[str]:
        """Where each locally held block of a new kvpool request is now (before its resume)."""
        held = (cache.num_committed_tokens - cache.pending_remote_tokens) // self.block_size
        return ["host" if page.level == 0 else "disk" for page in cache.pages(0)[:held]]

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pending = self.loads.get(request.request_id)
        if pending is None or pending.in_flight:
            return
        if num_external_tokens == 0:
            self._release_load(request.request_id)
            return
        first = (pending.num_tokens - num_external_tokens) // self.block_size
        last = pending.num_tokens // self.block_size
        block_ids = list(blocks.get_block_ids()[0][first:last])
        slots = [int(s) for s in pending.cache.get_base_page_indices(0)[first:last]]
        self._load_transfers.append(Transfer(request.request_id, block_ids, slots))
        self.counters.loaded_blocks += len(block_ids)
        pending.in_flight = True

    def _release_load(self, request_id: str) -> None:
        pending = self.loads.pop(request_id, None)
        if pending is not None:
            pending.cache.close()

    # -- saves ---------------------------------------------------------------------------
    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        request_id = request.request_id
        load = self.loads.get(request_id)
        if load is not None:
            if load.in_flight:  # closed when the workers report the copy (vLLM keeps the
                return False, None  # blocks until then); they may not hold KV yet: no save
            self._release_load(request_id)
        if not reusable(request):
            return False, None
        num_blocks = min(request.num_computed_tokens // self.block_size, len(block_ids))
        if num_blocks == 0 or request_id in self.saves:
            return False, None
        tokens = list(request.all_token_ids[: num_blocks * self.block_size])
        scope = reuse_scope(request, self.adapters)
        if self.manager.probe_reuse(scope, tokens) >= len(tokens):
            return False, None  # kvpool has all of it (at some level)
        cache = self.manager.create_kv_cache(scope, tokens)
        try:
            room = cache.resume() and cache.resize(len(tokens))
        except (KVPoolError, OSError) as error:
            log.warning("kvpool: not saving %s: %s", request_id, error)
            room = False
        if not room:
            self.counters.skipped_saves += 1
            cache.close()
            return False, None
        held = cache.num_committed_tokens  # (final after resume: a remote fetch may shorten it)
        first = held // self.block_size
        slots = [int(s) for s in cache.get_base_page_indices(0)[first:num_blocks]]
        self._save_transfers.append(Transfer(request_id, list(block_ids[first:num_blocks]), slots))
        self.saves[request_id] = _Pending(cache, tokens[held:], len(tokens), first, in_flight=True)
        return True, None

    # -- each step -----------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> KVPoolConnectorMetadata:
        meta = KVPoolConnectorMetadata(self.shared, self._save_transfers, self._load_transfers)
        self._save_transfers, self._load_transfers = [], []
        self._write_stats()
        return meta

    def update_connector_output(self, output: Any) -> None:
        for request_id in output.finished_recving or ():
            self._release_load(request_id)
        failed: set[str] = getattr(output.kv_connector_worker_meta, "failed_saves", set())
        for request_id in output.finished_sending or ():
            pending = self.saves.pop(request_id, None)
            if pending is None:
                continue
            try:
                if request_id in failed:  # some worker's bytes are missing: commit nothing
                    self.counters.failed_saves += 1
                else:
                    pending.cache.commit(pending.tokens)
                    self.counters.saved_blocks += -(-len(pending.tokens) // self.block_size)
                    # (write-through: other engines sharing the remote tier find them now)
                    self.manager.write_remote(pending.cache, pending.first_block)
            finally:
                pending.cache.close()
        self._write_stats()

    def _write_stats(self, force: bool = False) -> None:
        """`stats_path`, rewritten whenever the counts changed (an engine may be stopped
        before its shutdown reaches the connector): replaced whole, never half-written."""
        if self.stats_path is None:
            return
        counts = self.counts()
        if counts == self._written and not force:
            return
        self._written = counts
        partial = f"{self.stats_path}.partial"
        with open(partial, "w") as file:
            json.dump(self.statistics(), file)
        os.replace(partial, self.stats_path)

    def counts(self) -> dict[str, int]:
        """The counters vLLM's metrics report (`metrics.KEYS`)."""
        counters = self.counters
        return {
            "lookups": counters.lookups,
            "loaded_blocks": counters.loaded_blocks,
            "saved_blocks": counters.saved_blocks,
            "skipped_saves": counters.skipped_saves,
            "failed_saves": counters.failed_saves,
            "load_failures": counters.load_failures,
            **{f"hit_tokens_{tier}": n for tier, n in counters.hit_tokens_by_tier.items()},
        }

    def statistics(self) -> dict[str, Any]:
        """The connector's counters, kvpool's hits per level and the remote tier's counters."""
        stats = self.manager.stats()
        remote = self.manager.remote_statistics()
        return {
            **dataclasses.asdict(self.counters),
            "manager_hit_tokens_by_level": list(stats.hit_tokens_by_level),
            "remote": None if remote is None else dataclasses.asdict(remote),
        }

    def shutdown(self) -> None:
        """Close every kvpool request (uncommitted saves are dropped), write what is waiting
        for the remote tier, report, and free the shared memory (the workers' mappings keep
        theirs until they end)."""
        if self._closed:
            return
        self._closed = True
        for pending in [*self.loads.values(), *self.saves.values()]:
            pending.cache.close()
        self.loads.clear()
        self.saves.clear()
        try:
            self.manager.flush_remote_writes()
            log.info("kvpool connector: %s", self.statistics())
            self._write_stats(force=True)
        finally:
            self.manager.shutdown()

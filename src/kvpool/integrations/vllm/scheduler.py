"""The connector's scheduler side: kvpool's manager lives here and takes every decision (what
is reused, where pages live, what is evicted); the workers only copy bytes where it says.

Each vLLM KV-cache group maps to the kvpool layer group of its life cycle (full attention, or
a sliding window keeping the same blocks vLLM keeps): a transfer lists, per vLLM group, vLLM's
block ids and kvpool's slots. A request's kvpool pages are locked for exactly as long as a
worker may touch them:
- a load: from the lookup (`get_num_new_matched_tokens`, which resumes a kvpool request
  holding the prefix, so pages on disk or in the remote tier are brought to the shared level
  then) until every worker reported the copy done (`finished_recving`); per group, the blocks
  vLLM allocated for the hit (a sliding window's: only those in the window at the hit's end);
- a save: from `request_finished` (a kvpool request with the tokens vLLM computed, its history
  at their end: new pages for the blocks kvpool lacks that each group's life cycle keeps, the
  blocks vLLM still holds) until every worker reported the copy done (`finished_sending`);
  only then are the tokens committed, so no lookup can find a page before its bytes are there;
- a store (models with a sliding window only): the blocks a prompt ends with, copied by the
  workers after the forward pass that completes the prompt, before vLLM frees the window's
  blocks as the request decodes; committed once every worker reported it. A repeated prompt
  needs the window at the prompt's end, which a save at the request's end no longer has.
Loads are asynchronous in vLLM's sense (the request waits for `finished_recving`): a load that
failed is reported by the workers (load errors, or a failed receive with several groups) and
vLLM recomputes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from kvpool.errors import ConfigError
from kvpool.integrations.vllm.idle import IdlePause
from kvpool.integrations.vllm.metadata import KVPoolConnectorMetadata, Transfer
from kvpool.integrations.vllm.node import node_client
from kvpool.integrations.vllm.scoping import AdapterIdentities, reusable, reuse_scope
from kvpool.integrations.vllm.settings import NULL_BLOCK_ID, ConnectorSettings, PageFormat
from kvpool.layout import KVLayout
from kvpool.manager import KVCacheManager
from kvpool.node.store import Hit, LocalStore, Outcome, SavePlan, Store

log = logging.getLogger("kvpool.vllm")


@dataclasses.dataclass
class _Pending:
    """A kvpool request with pages a worker reads (a load) or writes (a save)."""

    cache: Any  # the store's handle (a kvpool.KVCache in process): `close()` releases it
    tokens: list[int]  # a save: what to commit once the bytes are there
    num_tokens: int  # a load: tokens it serves; a save: all its tokens
    first_block: int = 0  # a save: its first new block (the ones before were kvpool's)
    in_flight: bool = False  # the copy was handed to the workers
    blocks: int = 0  # a save: vLLM blocks copied (all groups)
    reports: int = 0  # a store: workers that reported the copy
    failed: bool = False  # a store: some worker could not copy
    loaded: frozenset[int] = frozenset()  # a load: the vLLM blocks it fills (all groups)
    slots: list[list[int]] | None = None  # a load: per kvpool layer group, each block's slot
    generation: int = 0  # the store's shared memory its slots are in


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
    skipped_window_saves: int = 0  # vLLM had freed a sliding-window block the save needs
    failed_saves: int = 0  # a worker could not write the pages: not committed
    load_failures: int = 0  # lookups that could not bring their pages up (a read error)
    stale_transfers: int = 0  # planned in a lost node daemon connection's memory: failed
    idle_waits: int = 0  # empty steps paused for a waiting lookup (not spun through)


BlockIds = Sequence[Sequence[int]]  # per vLLM KV-cache group
_WAIT = object()  # a lookup whose I/O runs: "not yet" to vLLM


class SchedulerSide:
    def __init__(
        self,
        settings: ConnectorSettings,
        page: PageFormat,
        model_id: str,
        num_workers: int = 1,
        store: Store | None = None,
    ):
        """`model_id`: the model's identity (`identity.vllm_model_identity`); `num_workers`:
        the worker processes that each report a store (vLLM's world size); `store`: where
        kvpool's decisions are taken (a node daemon's client), else a manager of its own."""
        self.page = page
        self.block_size = page.block_size
        config = page.manager_config(settings, model_id)
        # kvpool's layer group of each vLLM group; where a block is (host, disk): a full
        # attention group's page if there is one (a window's pages are only its tail)
        self.layer_groups = page.layer_groups(KVLayout(config.layers, config.tokens_per_block))
        groups = zip(page.groups, self.layer_groups, strict=True)
        full = [lg for group, lg in groups if group.window is None]
        tier_group = (full or self.layer_groups)[0]
        self.manager: Any = None  # (in process: the connector's own manager)
        self.store: Store
        if store is not None:
            self.store = store
        elif settings.node_cache is not None:
            self.store = node_client(settings, config, model_id, tier_group)
        else:
            try:
                self.manager = KVCacheManager(config)
            except ConfigError as error:  # (its levels are the connector's settings)
                raise ConfigError(
                    f"kv_connector_extra_config does not fit this model ({error}; "
                    "cache_tiers[0] is host_bytes, cache_tiers[1] disk_bytes)"
                ) from error
            self.store = LocalStore(self.manager, tier_group)
        self.num_workers = num_workers
        self._windowed = page.windowed  # (prompts are stored after their prefill)
        self.adapters = AdapterIdentities()
        self.async_lookups = settings.async_lookups
        self.lookups = getattr(self.store, "lookups", None)  # (in process: for tests)
        self.persist_on_shutdown = settings.disk_persist
        self.loads: dict[str, _Pending] = {}
        self.saves: dict[str, _Pending] = {}
        self.stores: dict[str, _Pending] = {}
        self._load_failed: set[str] = set()  # (vLLM recomputes them: no load offered again)
        self._prompts: dict[str, Any] = {}  # windowed models: prompts not stored yet
        # (the store's generation each transfer's slots belong to, with the transfer)
        self._load_transfers: list[tuple[int, Transfer]] = []
        self._save_transfers: list[tuple[int, Transfer]] = []
        self._store_transfers: list[tuple[int, Transfer]] = []
        self.counters = ConnectorCounters()
        self.stats_path = settings.stats_path
        self._written: dict[str, int] | None = None
        self._closed = False
        self._waiting: set[str] = set()  # requests told "not yet" (their lookup's I/O runs)
        self._idle = IdlePause()

    @property
    def shared(self) -> dict[str, str]:
        """Where the store's first level is: pool file name -> the path a worker maps."""
        return self.store.shared_memory()

    # -- loads ---------------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens vLLM may load past `num_computed_tokens`, or None ("not yet": ask again on a
        later step) while the lookup's disk or remote I/O runs (`lookups.py`)."""
        pending = self.loads.get(request.request_id)
        if pending is None:
            if not reusable(request) or request.request_id in self._load_failed:
                return 0, False  # (a failed load offered again would fail again, forever)
            found = self._lookup(request)
            if found is _WAIT:
                return None, False
            if not isinstance(found, _Pending):
                return 0, False
            pending = found
        if pending.in_flight:  # (asked again while its load runs: nothing new)
            return 0, False
        if pending.num_tokens <= num_computed_tokens:
            self._release_load(request.request_id)
            return 0, False
        return pending.num_tokens - num_computed_tokens, True

    def _lookup(self, request: Any) -> _Pending | object | None:
        """A resumed kvpool request holding the prefix vLLM may load, None (a miss), or
        `_WAIT` while the lookup's I/O runs. Asynchronous lookups take the remote tier's
        answer and values, and the disk pages read ahead, from the look-ahead threads; what
        is left on the scheduler's thread copies from memory."""
        request_id = request.request_id
        tokens = list(request.all_token_ids)
        usable = (len(tokens) - 1) // self.block_size * self.block_size  # vLLM computes the last
        if usable <= 0:
            return None
        scope = reuse_scope(request, self.adapters)
        found = self.store.lookup(request_id, scope, tokens[:usable], self.async_lookups)
        if found is Outcome.WAITING:
            if request_id not in self._waiting:
                self._waiting.add(request_id)
                self.counters.lookups += 1
            return _WAIT
        if request_id in self._waiting:
            self._waiting.discard(request_id)
        else:
            self.counters.lookups += 1
        if found is Outcome.FAILED:
            self.counters.load_failures += 1
        if not isinstance(found, Hit):
            return None
        pending = _Pending(found.handle, [], found.tokens, slots=found.slots)
        pending.generation = self.store.generation
        self.loads[request_id] = pending
        self.counters.hit_tokens += found.tokens
        by_tier = self.counters.hit_tokens_by_tier
        for tier in found.tiers:
            by_tier[tier] += self.block_size
        return pending

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self._windowed and reusable(request):
            self._prompts[request.request_id] = request  # (its prompt's end is stored later)
        pending = self.loads.get(request.request_id)
        if pending is None or pending.in_flight:
            return
        if num_external_tokens == 0:
            self._release_load(request.request_id)
            return
        first = (pending.num_tokens - num_external_tokens) // self.block_size
        last = pending.num_tokens // self.block_size
        transfer = self._load_transfer(request.request_id, pending, first, last, blocks)
        self._load_transfers.append((pending.generation, transfer))
        self.counters.loaded_blocks += transfer.num_blocks
        pending.loaded = frozenset(block for ids in transfer.block_ids for block in ids)
        pending.in_flight = True

    def _load_transfer(
        self, request_id: str, pending: _Pending, first: int, last: int, blocks: Any
    ) -> Transfer:
        """Per vLLM group, the blocks vLLM allocated for the hit's blocks [first, last) (not
        the null blocks a sliding window has out of its window) and kvpool's slots for them
        (-1 where kvpool has none: the worker then fails the load, and vLLM recomputes)."""
        block_ids: list[list[int]] = []
        slots: list[list[int]] = []
        for ids, group in zip(blocks.get_block_ids(), self.layer_groups, strict=True):
            assert pending.slots is not None
            base = pending.slots[group][first:last]
            pairs = [
                (block, base[i] if i < len(base) else -1)
                for i, block in enumerate(ids[first:last])
                if block != NULL_BLOCK_ID
            ]
            block_ids.append([block for block, _ in pairs])
            slots.append([slot for _, slot in pairs])
        return Transfer(request_id, block_ids, slots)

    def _release_load(self, request_id: str) -> None:
        pending = self.loads.pop(request_id, None)
        if pending is not None:
            self.store.release(pending.cache)

    # -- saves and stores ----------------------------------------------------------------
    def request_finished(
        self, request: Any, block_ids: BlockIds
    ) -> tuple[bool, dict[str, Any] | None]:
        """`block_ids`: per vLLM group, the request's blocks (a sliding window's out of the
        window are vLLM's null block)."""
        request_id = request.request_id
        self._prompts.pop(request_id, None)
        self._load_failed.discard(request_id)
        if request_id in self._waiting:  # (aborted while its lookup's I/O ran)
            self._waiting.discard(request_id)
            self.store.cancel(request_id)
        load = self.loads.get(request_id)
        if load is not None:
            if load.in_flight:  # closed when the workers report the copy (vLLM keeps the
                return False, None  # blocks until then); they may not hold KV yet: no save
            self._release_load(request_id)
        if not reusable(request) or request_id in self.saves:
            return False, None
        lengths = [len(ids) for ids in block_ids]
        num_blocks = min([request.num_computed_tokens // self.block_size, *lengths])
        if num_blocks <= 0:
            return False, None
        tokens = list(request.all_token_ids[: num_blocks * self.block_size])
        planned = self._plan_save(request, tokens, block_ids)
        if planned is None:
            return False, None
        self.saves[request_id], transfer = planned
        self._save_transfers.append((self.saves[request_id].generation, transfer))
        return True, None

    def _plan_save(
        self, request: Any, tokens: list[int], block_ids: BlockIds
    ) -> tuple[_Pending, Transfer] | None:
        """A kvpool request for `tokens` (whole blocks) whose history is at their end, with
        new pages for the blocks kvpool lacks that each group keeps there, and the copy that
        fills them from vLLM's `block_ids`; None when kvpool has them all, has no room, or a
        block it needs is one vLLM already freed (a sliding window's). The remote tier is not
        asked (no I/O in vLLM's step): what only it holds is saved again."""
        scope = reuse_scope(request, self.adapters)
        plan = self.store.plan_save(scope, tokens)
        if plan is Outcome.NO_ROOM:
            self.counters.skipped_saves += 1
        if not isinstance(plan, SavePlan):
            return None  # (the store has all of it, at some level, or no room)
        first = plan.first_block
        last = len(tokens) // self.block_size
        transfer = self._save_transfer(request.request_id, plan, first, last, block_ids)
        if transfer is None:
            self.counters.skipped_window_saves += 1
            self.store.release(plan.handle)
            return None
        held = first * self.block_size
        pending = _Pending(
            plan.handle, tokens[held:], len(tokens), first, True, transfer.num_blocks
        )
        pending.generation = self.store.generation
        return pending, transfer

    def _save_transfer(
        self, request_id: str, plan: SavePlan, first: int, last: int, block_ids: BlockIds
    ) -> Transfer | None:
        """Per vLLM group, the blocks [first, last) that kvpool has a new page for, and those
        pages' slots; None if vLLM no longer holds one of them."""
        ids: list[list[int]] = []
        slots: list[list[int]] = []
        for vllm, group in zip(block_ids, self.layer_groups, strict=True):
            base = plan.slots[group]
            held = list(vllm[first:last])
            pairs = [(held[i] if i < len(held) else NULL_BLOCK_ID, s) for i, s in enumerate(base)]
            pairs = [(block, slot) for block, slot in pairs if slot >= 0]
            if any(block == NULL_BLOCK_ID for block, _ in pairs):
                return None
            ids.append([block for block, _ in pairs])
            slots.append([slot for _, slot in pairs])
        return Transfer(request_id, ids, slots)

    def _plan_stores(
        self, scheduled: dict[str, int], block_ids_of: Callable[[str], BlockIds]
    ) -> None:
        """Store the prompts this step completes (models with a sliding window): their whole
        blocks up to the last token but one, where a lookup of the same prompt ends."""
        for request_id in [r for r in self._prompts if r in scheduled]:
            request = self._prompts[request_id]
            if request.num_computed_tokens + scheduled[request_id] < request.num_prompt_tokens:
                continue
            del self._prompts[request_id]
            end = (request.num_prompt_tokens - 1) // self.block_size * self.block_size
            if end <= 0 or request_id in self.stores:
                continue
            tokens = list(request.all_token_ids[:end])
            planned = self._plan_save(request, tokens, block_ids_of(request_id))
            if planned is not None:
                self.stores[request_id], transfer = planned
                self._store_transfers.append((self.stores[request_id].generation, transfer))

    def _finish_save(self, pending: _Pending, failed: bool) -> None:
        """Commit a save's or a store's tokens (none if some worker failed), then write them
        to the remote tier at once (write-through: other engines find them now)."""
        if failed or pending.generation != self.store.generation:  # bytes missing (or in
            self.counters.failed_saves += 1  # a restarted daemon's old memory): nothing
            self.store.release(pending.cache)
            return
        self.store.commit_save(pending.cache, pending.tokens, pending.first_block)
        self.counters.saved_blocks += pending.blocks

    # -- each step -----------------------------------------------------------------------
    def build_connector_meta(
        self, scheduler_output: Any, block_ids_of: Callable[[str], BlockIds] | None = None
    ) -> KVPoolConnectorMetadata:
        """`block_ids_of(request_id)`: vLLM's blocks of a running request, per group (vLLM's
        KV-cache manager); without it no prompt is stored."""
        if self._prompts and block_ids_of is not None:
            scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
            self._plan_stores(scheduled, block_ids_of)
        generation, shared = self.store.memory()
        meta = KVPoolConnectorMetadata(
            shared,
            self._of_generation(self._save_transfers, generation),
            self._of_generation(self._load_transfers, generation),
            self._of_generation(self._store_transfers, generation),
        )
        self._save_transfers, self._load_transfers, self._store_transfers = [], [], []
        self._write_stats()
        if (
            self._waiting
            and getattr(scheduler_output, "total_num_scheduled_tokens", None) == 0
            and not (meta.saves or meta.loads or meta.stores)
        ):
            self.counters.idle_waits += 1
            self._idle.pause(self.store)
        return meta

    def _of_generation(
        self, transfers: list[tuple[int, Transfer]], generation: int
    ) -> list[Transfer]:
        """The step's transfers; one whose slots are in another generation's shared memory
        (the connection to the node daemon was lost since it was planned: the daemon released
        its pages, or restarted) gets no slots, so that its workers fail it (a load is
        recomputed, a save dropped) rather than copy pages that are not its own."""
        found = []
        for g, transfer in transfers:
            if g != generation:
                self.counters.stale_transfers += 1
                slots = [[-1] * len(ids) for ids in transfer.block_ids]
                transfer = Transfer(transfer.request_id, transfer.block_ids, slots)
            found.append(transfer)
        return found

    def update_connector_output(self, output: Any) -> None:
        failed_loads = set(getattr(output, "failed_recving", None) or ())
        invalid = set(getattr(output, "invalid_block_ids", None) or ())
        for request_id in output.finished_recving or ():
            load = self.loads.get(request_id)
            if load is not None and (request_id in failed_loads or invalid & load.loaded):
                self._load_failed.add(request_id)
            self._release_load(request_id)
        meta = output.kv_connector_worker_meta
        failed: set[str] = getattr(meta, "failed_saves", set())
        for request_id in output.finished_sending or ():
            pending = self.saves.pop(request_id, None)
            if pending is not None:
                self._finish_save(pending, request_id in failed)
        failed_stores: set[str] = getattr(meta, "failed_stores", set())
        for request_id, count in getattr(meta, "stored", {}).items():
            pending = self.stores.get(request_id)
            if pending is None:
                continue
            pending.reports += count
            pending.failed = pending.failed or request_id in failed_stores
            if pending.reports >= self.num_workers:  # every worker copied it (or failed)
                del self.stores[request_id]
                self._finish_save(pending, pending.failed)
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
            "skipped_window_saves": counters.skipped_window_saves,
            "failed_saves": counters.failed_saves,
            "load_failures": counters.load_failures,
            **{f"hit_tokens_{tier}": n for tier, n in counters.hit_tokens_by_tier.items()},
        }

    def statistics(self) -> dict[str, Any]:
        """The connector's counters, kvpool's hits per level, the remote tier's counters, and
        the vLLM KV-cache groups it holds (with kvpool's layer group of each)."""
        return {
            **dataclasses.asdict(self.counters),
            **self.store.statistics(),
            "kv_cache_groups": [str(group) for group in self.page.groups],
            "kvpool_layer_groups": list(self.layer_groups),
        }

    def shutdown(self) -> None:
        """Close every kvpool request (uncommitted saves are dropped), write what is waiting
        for the remote tier, move the cached pages down to a persistent disk level, report,
        and free the shared memory (the workers' mappings keep
        theirs until they end)."""
        if self._closed:
            return
        self._closed = True
        for request_id in self._waiting:
            self.store.cancel(request_id)
        self._waiting.clear()
        for pending in [*self.loads.values(), *self.saves.values(), *self.stores.values()]:
            self.store.release(pending.cache)
        self.loads.clear()
        self.saves.clear()
        self.stores.clear()
        self._prompts.clear()
        self._load_failed.clear()
        try:
            log.info("kvpool connector: %s", self.statistics())
            self._write_stats(force=True)
        finally:
            self.store.shutdown(self.persist_on_shutdown)

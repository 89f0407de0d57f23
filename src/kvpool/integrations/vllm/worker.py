"""The connector's worker side: copies whole blocks between vLLM's KV-cache tensors and
kvpool's first level, which it maps from the scheduler side's shared memory (the paths in each
step's metadata: memfds opened through /proc), per vLLM KV-cache group (its layers share block
ids). It takes no decision; a copy that fails is reported, never half-used: a failed load goes
to vLLM as load errors for its blocks (one KV-cache group) or as a failed receive (several:
vLLM's block ids are then per group), and vLLM recomputes; a failed save or store is reported
to the scheduler side, which then never commits its pages."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

from kvpool.integrations.vllm.metadata import KVPoolConnectorMetadata, Transfer
from kvpool.integrations.vllm.settings import GroupFormat, PageFormat
from kvpool.layout import KVLayout
from kvpool.storage.shared import map_shared, shared_pool_file

log = logging.getLogger("kvpool.vllm")


@dataclass
class KVPoolWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Back to the scheduler side (vLLM merges every worker's with `aggregate`): saves that
    some worker could not write, and the stores each worker copied (`stored`: how many
    workers did, summed) and which some worker could not (`failed_stores`)."""

    failed_saves: set[str] = field(default_factory=set)
    stored: dict[str, int] = field(default_factory=dict)
    failed_stores: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVPoolWorkerMetadata)
        stored = dict(self.stored)
        for request_id, count in other.stored.items():
            stored[request_id] = stored.get(request_id, 0) + count
        return KVPoolWorkerMetadata(
            self.failed_saves | other.failed_saves,
            stored,
            self.failed_stores | other.failed_stores,
        )


def block_view(
    tensor: torch.Tensor, num_blocks: int, group: GroupFormat, block_size: int
) -> torch.Tensor:
    """`tensor` (one layer's KV cache) as [num_blocks, 2, local_heads, block_size, head_size],
    a view (no copy). Two layouts are known: vLLM's CPU backend, [blocks, heads, block_size,
    2 * head_size] holding per head the block's K rows then its V rows; and the 5-dimensional
    ones, a K/V dimension of 2 beside the block dimension, then heads and tokens in either
    order. Anything else is refused, naming the shape."""
    shape = list(tensor.shape)
    h, n, c = group.local_heads, block_size, group.head_size
    if shape == [num_blocks, h, n, 2 * c] and tensor.is_contiguous():
        return tensor.view(num_blocks, h, 2, n, c).permute(0, 2, 1, 3, 4)
    if len(shape) == 5 and num_blocks in shape[:2] and 2 in shape[:2]:
        b = shape.index(num_blocks) if shape[0] == num_blocks else 1
        k = 1 - b
        if shape[2:] == [h, n, c]:
            return tensor.permute(b, k, 2, 3, 4)
        if shape[2:] == [n, h, c]:
            return tensor.permute(b, k, 3, 2, 4)
    raise ValueError(
        f"KVPoolConnector does not know this KV-cache layout: shape {shape} for {num_blocks} "
        f"blocks of {n} tokens, {h} KV heads of size {c}"
    )


class WorkerSide:
    def __init__(self, page: PageFormat, num_blocks: int, layout: KVLayout) -> None:
        self.page = page
        self.num_blocks = num_blocks
        self.layout = layout
        # per vLLM group: (kvpool layer id, this rank's view of the layer's blocks)
        self.views: list[list[tuple[int, torch.Tensor]]] = []
        self._pools: dict[str, torch.Tensor] = {}  # file name -> its bytes
        self._views: dict[tuple[int, str], tuple[torch.Tensor, int, int]] = {}
        self._shared: dict[str, str] = {}
        self._sending: set[str] = set()
        self._recving: set[str] = set()
        self._failed_saves: set[str] = set()
        self._stored: dict[str, int] = {}
        self._failed_stores: set[str] = set()
        self._load_errors: set[int] = set()  # (one group: vLLM recomputes the failed blocks)
        self._failed_loads: set[str] = set()  # (several groups: the failed requests)
        self.counts = {"load_errors": 0, "bytes_loaded": 0, "bytes_saved": 0}
        # bytes one block of a group's layers is, for this rank's heads
        self._block_bytes = [
            2 * len(group.layer_names) * page.buffer_bytes(g) // page.tp_size
            for g, group in enumerate(page.groups)
        ]

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        page = self.page
        missing = [n for group in page.groups for n in group.layer_names if n not in kv_caches]
        if missing:
            raise ValueError(f"kv_caches has no tensor for layers {missing}")
        self.views = [
            [
                (layer_id, block_view(kv_caches[name], self.num_blocks, group, page.block_size))
                for layer_id, name in zip(page.layer_ids(g), group.layer_names, strict=True)
            ]
            for g, group in enumerate(page.groups)
        ]

    def _pages(self, g: int, layer: int, role: str) -> tuple[torch.Tensor, int, int]:
        """[rows, heads, block_size, head_size] over the shared pool of (layer, role) of vLLM
        group g, and the row of slot s as s * stride + offset; mapped once (the files never
        move or grow)."""
        key = (layer, role)
        found = self._views.get(key)
        if found is not None:
            return found
        placement = self.layout.placement(layer, role)
        name = shared_pool_file(placement.pool_group, placement.pool)
        pool = self._pools.get(name)
        if pool is None:
            pool = self._pools[name] = torch.from_numpy(map_shared(self._shared[name]))
        size, page, group = placement.size, self.page, self.page.groups[g]
        rows = pool.numel() // size
        dtype = self.views[g][0][1].dtype
        pages = (
            pool[: rows * size]
            .view(rows, size)
            .view(dtype)
            .view(rows, page.heads(g), page.block_size, group.head_size)
        )
        found = (pages, placement.buffers_per_slot, placement.position)
        self._views[key] = found
        return found

    def _map(self, meta: KVPoolConnectorMetadata) -> None:
        if meta.shared != self._shared:  # (the first step: map the scheduler's memory)
            self._shared = dict(meta.shared)
            self._pools.clear()
            self._views.clear()

    def _bytes(self, transfer: Transfer) -> int:
        return sum(len(ids) * self._block_bytes[g] for g, ids in enumerate(transfer.block_ids))

    def start_load_kv(self, meta: KVPoolConnectorMetadata) -> None:
        """The saves and loads of this step. (No page is both saved and loaded in one step: a
        save's pages are committed, so found by lookups, only after every worker reported
        it.) vLLM calls this before the forward pass, or after it when no load feeds it."""
        self._map(meta)
        for transfer in meta.saves:
            try:
                self._copy(transfer, save=True)
                self.counts["bytes_saved"] += self._bytes(transfer)
            except Exception:
                log.exception("kvpool: saving %s failed", transfer.request_id)
                self._failed_saves.add(transfer.request_id)
            self._sending.add(transfer.request_id)
        for transfer in meta.loads:
            try:
                self._copy(transfer, save=False)
                self.counts["bytes_loaded"] += self._bytes(transfer)
            except Exception:
                log.exception("kvpool: loading %s failed; vLLM recomputes it", transfer.request_id)
                if len(self.page.groups) == 1:
                    self._load_errors.update(transfer.block_ids[0])
                else:
                    self._failed_loads.add(transfer.request_id)
                self.counts["load_errors"] += transfer.num_blocks
            self._recving.add(transfer.request_id)

    def wait_for_save(self, meta: KVPoolConnectorMetadata) -> None:
        """The stores of this step, after its forward pass wrote their blocks."""
        if not meta.stores:
            return
        self._map(meta)
        for transfer in meta.stores:
            try:
                self._copy(transfer, save=True)
                self.counts["bytes_saved"] += self._bytes(transfer)
            except Exception:
                log.exception("kvpool: storing %s failed", transfer.request_id)
                self._failed_stores.add(transfer.request_id)
            self._stored[transfer.request_id] = self._stored.get(transfer.request_id, 0) + 1

    def _copy(self, transfer: Transfer, save: bool) -> None:
        page = self.page
        pairs = list(zip(transfer.block_ids, transfer.slots, strict=True))
        for g, (block_ids, slot_ids) in enumerate(pairs):  # (checked first: all or nothing)
            if len(block_ids) != len(slot_ids) or (slot_ids and min(slot_ids) < 0):
                raise ValueError(
                    f"KV-cache group {g}: {len(block_ids)} blocks for slots {slot_ids} (a block "
                    "vLLM expects that kvpool does not hold)"
                )
        for g, (block_ids, slot_ids) in enumerate(pairs):
            if not block_ids:
                continue
            blocks = torch.tensor(block_ids, dtype=torch.long)
            local = page.groups[g].local_heads
            heads = slice(page.tp_rank * local, (page.tp_rank + 1) * local)
            slots = torch.tensor(slot_ids, dtype=torch.long)
            for layer, view in self.views[g]:
                for kv, role in enumerate(("k", "v")):
                    pages, stride, offset = self._pages(g, layer, role)
                    rows = slots * stride + offset
                    if save:
                        pages[rows, heads] = view[blocks, kv]
                    else:
                        view[blocks, kv] = pages[rows, heads]

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = self._sending, self._recving
        self._sending, self._recving = set(), set()
        return sending or None, recving or None

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_failed_loads(self) -> set[str]:
        failed, self._failed_loads = self._failed_loads, set()
        return failed

    def build_worker_meta(self) -> KVPoolWorkerMetadata | None:
        if not (self._failed_saves or self._stored):
            return None
        meta = KVPoolWorkerMetadata(self._failed_saves, self._stored, self._failed_stores)
        self._failed_saves, self._stored, self._failed_stores = set(), {}, set()
        return meta

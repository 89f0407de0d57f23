"""The connector's worker side: copies whole blocks between vLLM's KV-cache tensors and
kvpool's first level, which it maps from the scheduler side's shared memory (the paths in each
step's metadata: memfds opened through /proc). It takes no decision; a copy that fails is reported, never half-used: a failed
load's blocks go to vLLM as load errors (vLLM recomputes them), a failed save is reported to
the scheduler side, which then never commits its pages."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

from kvpool.integrations.vllm.metadata import KVPoolConnectorMetadata, Transfer
from kvpool.integrations.vllm.settings import PageFormat
from kvpool.layout import KVLayout
from kvpool.storage.shared import map_shared, shared_pool_file

log = logging.getLogger("kvpool.vllm")


@dataclass
class KVPoolWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Back to the scheduler side: saves that some worker could not write."""

    failed_saves: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVPoolWorkerMetadata)
        return KVPoolWorkerMetadata(self.failed_saves | other.failed_saves)


def block_view(tensor: torch.Tensor, num_blocks: int, page: PageFormat) -> torch.Tensor:
    """`tensor` (one layer's KV cache) as [num_blocks, 2, local_heads, block_size, head_size],
    a view (no copy). Two layouts are known: vLLM's CPU backend, [blocks, heads, block_size,
    2 * head_size] holding per head the block's K rows then its V rows; and the 5-dimensional
    ones, a K/V dimension of 2 beside the block dimension, then heads and tokens in either
    order. Anything else is refused, naming the shape."""
    shape = list(tensor.shape)
    h, n, c = page.local_heads, page.block_size, page.head_size
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
        self.views: list[torch.Tensor] = []
        self._pools: dict[str, torch.Tensor] = {}  # file name -> its bytes
        self._views: dict[tuple[int, str], tuple[torch.Tensor, int, int]] = {}
        self._shared: dict[str, str] = {}
        self._sending: set[str] = set()
        self._recving: set[str] = set()
        self._failed_saves: set[str] = set()
        self._load_errors: set[int] = set()
        self.counts = {"load_errors": 0, "bytes_loaded": 0, "bytes_saved": 0}
        # bytes one block of every layer is, for this rank's heads
        self._block_bytes = 2 * len(page.layer_names) * page.buffer_bytes // page.tp_size

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [name for name in self.page.layer_names if name not in kv_caches]
        if missing:
            raise ValueError(f"kv_caches has no tensor for layers {missing}")
        self.views = [
            block_view(kv_caches[n], self.num_blocks, self.page) for n in self.page.layer_names
        ]

    def _pages(self, layer: int, role: str) -> tuple[torch.Tensor, int, int]:
        """[rows, heads, block_size, head_size] over the shared pool of (layer, role), and the
        row of slot s as s * stride + offset; mapped once (the files never move or grow)."""
        key = (layer, role)
        found = self._views.get(key)
        if found is not None:
            return found
        placement = self.layout.placement(layer, role)
        name = shared_pool_file(placement.pool_group, placement.pool)
        pool = self._pools.get(name)
        if pool is None:
            pool = self._pools[name] = torch.from_numpy(map_shared(self._shared[name]))
        size, page = placement.size, self.page
        rows = pool.numel() // size
        pages = (
            pool[: rows * size]
            .view(rows, size)
            .view(self.views[layer].dtype)
            .view(rows, page.heads, page.block_size, page.head_size)
        )
        found = (pages, placement.buffers_per_slot, placement.position)
        self._views[key] = found
        return found

    def start_load_kv(self, meta: KVPoolConnectorMetadata) -> None:
        """Every copy of this step. (No page is both saved and loaded in one step: a save's
        pages are committed, so found by lookups, only after every worker reported it.)"""
        if meta.shared != self._shared:  # (the first step: map the scheduler's memory)
            self._shared = dict(meta.shared)
            self._pools.clear()
            self._views.clear()
        for transfer in meta.saves:
            try:
                self._copy(transfer, save=True)
                self.counts["bytes_saved"] += len(transfer.block_ids) * self._block_bytes
            except Exception:
                log.exception("kvpool: saving %s failed", transfer.request_id)
                self._failed_saves.add(transfer.request_id)
            self._sending.add(transfer.request_id)
        for transfer in meta.loads:
            try:
                self._copy(transfer, save=False)
                self.counts["bytes_loaded"] += len(transfer.block_ids) * self._block_bytes
            except Exception:
                log.exception("kvpool: loading %s failed; vLLM recomputes it", transfer.request_id)
                self._load_errors.update(transfer.block_ids)
                self.counts["load_errors"] += len(transfer.block_ids)
            self._recving.add(transfer.request_id)

    def _copy(self, transfer: Transfer, save: bool) -> None:
        if not transfer.block_ids:
            return
        blocks = torch.tensor(transfer.block_ids, dtype=torch.long)
        heads = slice(
            self.page.tp_rank * self.page.local_heads,
            (self.page.tp_rank + 1) * self.page.local_heads,
        )
        slots = torch.tensor(transfer.slots, dtype=torch.long)
        for layer, view in enumerate(self.views):
            for kv, role in enumerate(("k", "v")):
                pages, stride, offset = self._pages(layer, role)
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

    def build_worker_meta(self) -> KVPoolWorkerMetadata | None:
        if not self._failed_saves:
            return None
        failed, self._failed_saves = self._failed_saves, set()
        return KVPoolWorkerMetadata(failed)

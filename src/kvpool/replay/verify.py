"""The data-verifying engine: a stand-in for model compute that proves no KV
was lost or mixed up.

For every token it "computes" it writes a record (token, position, layer, role) into that token's
bytes of every buffer's page, through `page_view` and `get_page_indices`, and `check` reads back
every history token's record. A request that reuses blocks thereby checks bytes another request
wrote, after whatever eviction, migration or rebalance happened in between. SSM layers get a
state record (last token, history length) in their live slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvpool.cache import KVCache
from kvpool.errors import ArgumentError
from kvpool.layout import BufferPlacement
from kvpool.lifecycles import SsmLifeCycle
from kvpool.manager import KVCacheManager
from kvpool.records import Page
from kvpool.storage.device import pinned
from kvpool.storage.slots import wait_before
from kvpool.tokens import Token

RECORD_BYTES = 16


def token_value(token: Token) -> int:
    if isinstance(token, bytes):
        return int.from_bytes(token[:4], "little") & 0x7FFFFFFF
    return int(token)


class CheckingEngine:
    """Writes and checks per-token records through a manager's page views."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        layout = manager.layout
        self.tpb = layout.tokens_per_block
        self.buffers: list[tuple[BufferPlacement, int, bool]] = []  # placement, role index, is SSM
        for (layer_id, role), placement in sorted(layout.buffers.items()):
            ssm = isinstance(layout.life_cycles[placement.layer_group], SsmLifeCycle)
            if not ssm and placement.size % (self.tpb * RECORD_BYTES):
                raise ArgumentError(
                    f"buffer ({layer_id}, {role!r}) of {placement.size} bytes cannot hold a "
                    f"{RECORD_BYTES}-byte record per token ({self.tpb} tokens per block)"
                )
            role_index = sum(1 for (lid, r) in layout.buffers if lid == layer_id and r < role)
            self.buffers.append((placement, role_index, ssm))
        self.records_checked = 0

    def _records(self, placement: BufferPlacement) -> Records:
        """Records of one buffer: [rows, tokens per block, repeats, 4] int32."""
        return Records(self.manager.page_view(placement.layer_id, placement.role), self.tpb)

    def write(self, cache: KVCache, tokens: Sequence[Token], start: int) -> None:
        """Write records for `tokens` at positions start, start + 1, ..."""
        if not tokens:
            return
        tpb = self.tpb
        positions = np.arange(start, start + len(tokens))
        values = np.array([token_value(t) for t in tokens], dtype=np.int32)
        for placement, role_index, ssm in self.buffers:
            if ssm:
                continue
            rows = cache.get_page_indices(placement.layer_id, placement.role)[positions // tpb]
            if (rows < 0).any():
                raise AssertionError(f"no page to write a position of layer {placement.layer_id}")
            records = np.stack(
                [
                    values,
                    positions,
                    np.full_like(values, placement.layer_id),
                    np.full_like(values, role_index),
                ],
                axis=1,
            ).astype(np.int32)
            self._records(placement).put(rows, positions % tpb, records[:, None, :])
        self.write_state(cache, tokens[-1], start + len(tokens))

    def write_state(self, cache: KVCache, last_token: Token, length: int) -> None:
        for placement, role_index, ssm in self.buffers:
            if ssm:
                (row,) = cache.get_page_indices(placement.layer_id, placement.role)
                if row < 0:
                    raise AssertionError("no live SSM state slot")
                state = np.array(
                    [token_value(last_token), length, placement.layer_id, role_index], np.int32
                )
                Records(self.manager.page_view(placement.layer_id, placement.role), 1).put_row(
                    int(row), state
                )

    def check(self, cache: KVCache, tokens: Sequence[Token]) -> None:
        """Every record of the first history_length tokens that has a page must be right;
        `tokens` are the request's tokens (at least history_length of them)."""
        tpb, history = self.tpb, cache.history_length
        values = np.array([token_value(t) for t in tokens[:history]], dtype=np.int32)
        for placement, role_index, ssm in self.buffers:
            rows = cache.get_page_indices(placement.layer_id, placement.role)
            if ssm:
                if history and rows[0] >= 0:
                    view = self.manager.page_view(placement.layer_id, placement.role)
                    state = Records(view, 1).row(int(rows[0])).reshape(-1, 4)
                    expected_state = (values[-1], history, placement.layer_id, role_index)
                    if not (state == expected_state).all():
                        raise AssertionError(
                            f"SSM state of layer {placement.layer_id}: {state[0]} != {expected_state}"
                        )
                continue
            positions = np.arange(history)
            positions = positions[rows[positions // tpb] >= 0]
            got = self._records(placement).get(rows[positions // tpb], positions % tpb)
            expected = np.stack(
                [
                    values[positions],
                    positions,
                    np.full_like(positions, placement.layer_id),
                    np.full_like(positions, role_index),
                ],
                axis=1,
            ).astype(np.int32)
            bad = np.flatnonzero((got != expected[:, None, :]).any(axis=(1, 2)))
            if bad.size:
                raise AssertionError(
                    f"cache {cache.id} layer {placement.layer_id} {placement.role}: position "
                    f"{positions[bad[0]]} holds {got[bad[0], 0].tolist()}, expected {expected[bad[0]].tolist()}"
                )
            self.records_checked += int(positions.size)

    def check_anywhere(self, cache: KVCache, tokens: Sequence[Token]) -> None:
        """`check` for a request in any state: each page's records are read at whatever level
        the page is (a suspended request's pages may be on the host or the disk)."""
        tpb, history = self.tpb, cache.history_length
        values = np.array([token_value(t) for t in tokens[:history]], dtype=np.int32)
        for placement, role_index, ssm in self.buffers:
            pages = cache.pages(placement.layer_group)
            if ssm:
                if history and pages[0] is not None:
                    (state,) = self._read_rows(placement, [pages[0]])
                    got = state.view(np.int32)[:4].tolist()
                    expected_state = [int(values[-1]), history, placement.layer_id, role_index]
                    if got != expected_state:
                        raise AssertionError(
                            f"cache {cache.id} SSM state of layer {placement.layer_id} at level "
                            f"{pages[0].level}: {got} != {expected_state}"
                        )
                continue
            blocks = [
                (index, page)
                for index, page in enumerate(pages)
                if page is not None and index * tpb < history
            ]
            if not blocks:
                continue
            data = self._read_rows(placement, [page for _, page in blocks])
            records = data.view(np.int32).reshape(len(blocks), tpb, -1, 4)
            positions = np.array([index for index, _ in blocks])[:, None] * tpb + np.arange(tpb)
            valid = positions < history
            expected = np.stack(
                [
                    values[np.minimum(positions, history - 1)],
                    positions,
                    np.full_like(positions, placement.layer_id),
                    np.full_like(positions, role_index),
                ],
                axis=-1,
            ).astype(np.int32)
            bad = np.argwhere(valid & (records != expected[:, :, None, :]).any(axis=(2, 3)))
            if bad.size:
                block, offset = bad[0]
                page = blocks[block][1]
                raise AssertionError(
                    f"cache {cache.id} layer {placement.layer_id} {placement.role} at level "
                    f"{page.level}: position {positions[block, offset]} holds "
                    f"{records[block, offset, 0].tolist()}, expected {expected[block, offset].tolist()}"
                )
            self.records_checked += int(valid.sum())

    def _read_rows(self, placement: BufferPlacement, pages: Sequence[Page]) -> Any:
        """The bytes of one buffer's row in each page, read at the page's level: [pages, size]."""
        storage = self.manager._storage
        for page in pages:  # (a copy into it may still run on the GPU: the CPU reads it next)
            assert page.slot is not None
            wait_before(page.slot.ready_event, False)
        data = np.empty((len(pages), placement.size), dtype=np.uint8)
        by_level: dict[int, list[int]] = {}
        for i, page in enumerate(pages):
            by_level.setdefault(page.level, []).append(i)
        for level, indices in by_level.items():
            group = storage.state.levels[level].pool_groups[pages[indices[0]].pool_group]
            rows = [
                pages[i].slot_id * placement.buffers_per_slot + placement.position for i in indices
            ]
            try:
                view = group.pool_view(placement.pool).reshape(-1, placement.size)
            except ArgumentError:  # disk memory: one read per row
                memory = group.memories[placement.pool]
                for i, row in zip(indices, rows, strict=True):
                    data[i] = memory.read(row * placement.size, placement.size)
            else:
                picked = view[rows]
                data[indices] = picked.cpu().numpy() if hasattr(picked, "cpu") else picked
        return data

    def step(self, cache: KVCache, tokens: Sequence[Token], new_tokens: Sequence[Token]) -> bool:
        """One engine step: reserve, compute (write) the new tokens, commit them. Returns False
        (nothing changed) when the manager has no pages for it."""
        start = cache.history_length
        if not cache.resize(start + len(new_tokens)):
            return False
        self.write(cache, new_tokens, start)
        cache.commit(new_tokens)
        return True


class Records:
    """A page view's int32 records, [rows, tokens per block, repeats, 4], read and written
    alike over host memory (numpy, or a CPU tensor) and CUDA memory (through torch)."""

    def __init__(self, view: Any, tpb: int) -> None:
        self.device = getattr(view, "device", None)  # (numpy 2's arrays have a "cpu" one too)
        if getattr(self.device, "type", "cpu") != "cpu":
            import torch

            self.torch = torch
            self.flat = view.view(torch.int32)
        else:
            self.device = None
            self.flat = np.asarray(view).view(np.int32)
        self.tpb = tpb

    def _shaped(self) -> Any:
        return self.flat.reshape(self.flat.shape[0], self.tpb, -1, 4)

    def put(self, rows: Any, offsets: Any, values: Any) -> None:
        if self.device is None:
            self._shaped()[rows, offsets] = values
            return
        index = (self._sent(rows), self._sent(offsets))
        self._shaped()[index] = self._sent(values).expand(len(rows), *self._shaped().shape[2:])

    def _sent(self, values: Any) -> Any:
        """`values` on the device without a host wait (pinned, non-blocking), as an engine
        queues its writes: a blocking copy would wait for the kernels queued before it."""
        return pinned(self.torch.as_tensor(values)).to(self.device, non_blocking=True)

    def get(self, rows: Any, offsets: Any) -> Any:
        if self.device is None:
            return self._shaped()[rows, offsets]
        torch, device = self.torch, self.device
        index = (torch.as_tensor(rows, device=device), torch.as_tensor(offsets, device=device))
        return self._shaped()[index].cpu().numpy()

    def row(self, row: int) -> Any:
        data = self.flat[row]
        return data if self.device is None else data.cpu().numpy()

    def put_row(self, row: int, values: Any) -> None:
        """Every record of `row` set to `values` (four int32s)."""
        if self.device is None:
            self.flat[row].reshape(-1, 4)[:] = values
        else:
            self.flat[row].view(-1, 4)[:] = self._sent(values)

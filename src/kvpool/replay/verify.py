"""The data-verifying engine (DESIGN section 5): a stand-in for model compute that proves no KV
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
from kvpool.layout import BufferPlacement, SsmLifeCycle
from kvpool.manager import KVCacheManager
from kvpool.radix import Token

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

    def _records(self, placement: BufferPlacement) -> Any:
        """Records of one buffer: [rows, tokens per block, repeats, 4] int32."""
        view = np.asarray(self.manager.page_view(placement.layer_id, placement.role))
        return view.view(np.int32).reshape(view.shape[0], self.tpb, -1, 4)

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
            self._records(placement)[rows, positions % tpb] = records[:, None, :]
        self.write_state(cache, tokens[-1], start + len(tokens))

    def write_state(self, cache: KVCache, last_token: Token, length: int) -> None:
        for placement, role_index, ssm in self.buffers:
            if ssm:
                (row,) = cache.get_page_indices(placement.layer_id, placement.role)
                if row < 0:
                    raise AssertionError("no live SSM state slot")
                view = np.asarray(self.manager.page_view(placement.layer_id, placement.role))
                view[row].view(np.int32).reshape(-1, 4)[:] = (
                    token_value(last_token),
                    length,
                    placement.layer_id,
                    role_index,
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
                    view = np.asarray(self.manager.page_view(placement.layer_id, placement.role))
                    state = view[rows[0]].view(np.int32).reshape(-1, 4)
                    expected_state = (values[-1], history, placement.layer_id, role_index)
                    if not (state == expected_state).all():
                        raise AssertionError(
                            f"SSM state of layer {placement.layer_id}: {state[0]} != {expected_state}"
                        )
                continue
            positions = np.arange(history)
            positions = positions[rows[positions // tpb] >= 0]
            got = self._records(placement)[rows[positions // tpb], positions % tpb]
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
        storage = self.manager._storage
        for placement, role_index, ssm in self.buffers:
            pages = cache.pages(placement.layer_group)
            for index, page in enumerate(pages):
                if page is None:
                    continue
                pool = storage.levels[page.level].pool_groups[page.pool_group]
                row = page.slot_id * placement.buffers_per_slot + placement.position
                data = pool.memories[placement.pool].read(row * placement.size, placement.size)
                values: Any = data.view(np.int32)
                if ssm:
                    state = values.reshape(-1, 4)[0].tolist()
                    last = token_value(tokens[history - 1]) if history else None
                    expected = [last, history, placement.layer_id, role_index]
                    if history and state != expected:
                        raise AssertionError(
                            f"cache {cache.id} SSM state of layer {placement.layer_id} at "
                            f"level {page.level}: {state} != {expected}"
                        )
                    continue
                records = values.reshape(tpb, -1, 4)
                for position in range(index * tpb, min((index + 1) * tpb, history)):
                    expected = [token_value(tokens[position]), position, placement.layer_id]
                    expected.append(role_index)
                    got = records[position % tpb]
                    if (got != expected).any():
                        raise AssertionError(
                            f"cache {cache.id} layer {placement.layer_id} {placement.role} at "
                            f"level {page.level}: position {position} holds {got[0].tolist()}, "
                            f"expected {list(expected)}"
                        )
                    self.records_checked += 1

    def step(self, cache: KVCache, tokens: Sequence[Token], new_tokens: Sequence[Token]) -> bool:
        """One engine step: reserve, compute (write) the new tokens, commit them. Returns False
        (nothing changed) when the manager has no pages for it."""
        start = cache.history_length
        if not cache.resize(start + len(new_tokens)):
            return False
        self.write(cache, new_tokens, start)
        cache.commit(new_tokens)
        return True

"""The data-verifying engine of DESIGN section 5.

For every token it "computes" it writes a record (token, position, layer, role) into that token's
bytes of every buffer's page, through `page_view` and `get_page_indices`, and it checks every
history token's record whenever asked. A request that reuses blocks thereby checks bytes another
request wrote, after whatever eviction, reuse or migration happened in between. SSM layers get a
state record (last token, history length) in their live slot.
"""

import numpy as np

from kvpool.layout import SsmLifeCycle

RECORD_BYTES = 16


def token_value(token):
    if isinstance(token, bytes):
        return int.from_bytes(token[:4], "little") & 0x7FFFFFFF
    return int(token)


class CheckingEngine:
    def __init__(self, manager):
        self.manager = manager
        layout = manager.layout
        self.tpb = layout.tokens_per_block
        self.buffers = []  # (placement, role index, is_ssm)
        for (layer_id, role), placement in sorted(
            layout.buffers.items(), key=lambda kv: (kv[0][0], kv[0][1])
        ):
            ssm = isinstance(layout.life_cycles[placement.layer_group], SsmLifeCycle)
            if not ssm:
                assert placement.size % (self.tpb * RECORD_BYTES) == 0, (
                    "buffer must hold whole records per token"
                )
            role_index = sum(1 for (lid, r) in layout.buffers if lid == layer_id and r < role)
            self.buffers.append((placement, role_index, ssm))
        self.records_checked = 0

    def _view(self, placement):
        """Records of one buffer: [rows, tokens per block, repeats, 4] (attention)."""
        view = self.manager.page_view(placement.layer_id, placement.role)
        return view.view(np.int32).reshape(view.shape[0], self.tpb, -1, 4)

    def write(self, cache, tokens, start):
        """Write records for `tokens` at positions start, start + 1, ..."""
        tpb = self.tpb
        for placement, role_index, ssm in self.buffers:
            if ssm:
                continue
            rows = cache.get_page_indices(placement.layer_id, placement.role)
            view = self._view(placement)
            for offset, token in enumerate(tokens):
                position = start + offset
                row = rows[position // tpb]
                assert row >= 0, (
                    f"no page to write position {position} of layer {placement.layer_id}"
                )
                view[row, position % tpb] = (
                    token_value(token),
                    position,
                    placement.layer_id,
                    role_index,
                )
        if tokens:
            self.write_state(cache, tokens[-1], start + len(tokens))

    def write_state(self, cache, last_token, length):
        for placement, role_index, ssm in self.buffers:
            if ssm:
                (row,) = cache.get_page_indices(placement.layer_id, placement.role)
                assert row >= 0, "no live SSM state slot"
                state = (
                    self.manager.page_view(placement.layer_id, placement.role)[row]
                    .view(np.int32)
                    .reshape(-1, 4)
                )
                state[:] = (token_value(last_token), length, placement.layer_id, role_index)

    def check(self, cache, tokens):
        """Every record of the first history_length tokens that has a page must be right;
        `tokens` are the request's tokens (at least history_length of them)."""
        tpb, history = self.tpb, cache.history_length
        values = np.array([token_value(t) for t in tokens[:history]], dtype=np.int32)
        for placement, role_index, ssm in self.buffers:
            rows = cache.get_page_indices(placement.layer_id, placement.role)
            if ssm:
                if history and rows[0] >= 0:
                    state = (
                        self.manager.page_view(placement.layer_id, placement.role)[rows[0]]
                        .view(np.int32)
                        .reshape(-1, 4)
                    )
                    expected = (values[-1], history, placement.layer_id, role_index)
                    assert (state == expected).all(), (
                        f"SSM state of layer {placement.layer_id}: {state[0]} != {expected}"
                    )
                continue
            positions = np.arange(history)
            blocks = positions // tpb
            with_page = rows[blocks] >= 0
            positions = positions[with_page]
            got = self._view(placement)[rows[positions // tpb], positions % tpb]  # [n, repeats, 4]
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
                p = positions[bad[0]]
                raise AssertionError(
                    f"cache {cache.id} layer {placement.layer_id} {placement.role}: position {p} holds "
                    f"{got[bad[0], 0].tolist()}, expected {expected[bad[0]].tolist()}"
                )
            self.records_checked += positions.size

    def step(self, cache, tokens, new_tokens):
        """One engine step: reserve, compute (write) the new tokens, commit them. Returns False
        (nothing changed) when the manager has no pages for it."""
        start = cache.history_length
        assert cache.num_committed_tokens == start
        if not cache.resize(start + len(new_tokens)):
            return False
        self.write(cache, new_tokens, start)
        cache.commit(new_tokens)
        return True

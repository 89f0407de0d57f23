"""kvpool as a Hugging Face transformers `Cache`: `model.generate()` keeps its keys and values in
kvpool's pages, reuses prefixes across calls, spills to host and disk between calls, and forks
beams with copy-on-write.

    manager = KVCacheManager(manager_config(model, gpu_quota=256 << 20))
    cache = KVPoolCache(model, manager)
    out = generate(model, cache, **tokenizer(prompts, return_tensors="pt", padding=True))
    # the next turn: only the tokens past the longest cached prefix are computed
    out = generate(model, cache, **tokenizer(next_prompts, return_tensors="pt", padding=True))

How it fits transformers' contract (5.x, `cache_utils.py`):
- One `KVPoolLayer` per model layer; each batch row is one kvpool request (`KVCache`). A
  layer's `update` writes the new K/V into the rows' pages (the first layer of a forward pass
  reserves the pages for every layer) and returns what attention needs: the rows' K/V gathered
  from the pages into [batch, kv heads, length, head dim] (a sliding layer: its window), or,
  with the `"kvpool"` attention implementation (`ATTENTION`), nothing gathered at all: that
  attention reads the pages through the page tables, block by block.
- `update` never sees token ids, so the cache is given them around a call: `prepare(input_ids,
  attention_mask)` looks every row's prompt up in kvpool's prefix tree and holds the longest
  prefix all rows can use in one forward pass (the columns before it are cached for every row,
  counting left padding); `get_seq_length()` then says so, and `generate` computes only the
  rest. `finish(sequences)` commits what was computed (prompt and output; after beam search,
  only the prompt: the beams' histories are not the returned sequences) and closes the rows,
  so the blocks stay reusable. `generate()` does both around `model.generate`.
- Left padding only: a row's leading padding columns hold no KV (they are masked); real tokens
  keep their own positions, so the KV reused by another call is the same whatever the padding.
- `batch_repeat_interleave`, `reorder_cache` and `batch_select_indices` fork rows
  (`KVCacheManager.fork_kv_cache`): a repeated or chosen-twice row shares every page, and a page
  is copied only when a beam writes into a shared partial block (`KVCache.prepare_write`).
- `crop(-n)` forgets the last n columns (assisted decoding), back at most to where the rows'
  kvpool history stands; `reset()` closes every row.

Supported: decoder-only models whose layers are full or sliding-window attention with one K and
one V per layer, as `manager_config_from_hf` lays them out (Llama, Mistral, Qwen2/3, Gemma 1/2/3,
SmolLM, ...). Anything else is refused by name when the cache is built.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import transformers
from transformers.cache_utils import Cache
from transformers.modeling_utils import AttentionInterface

from kvpool.cache import KVCache, KVCacheStatus
from kvpool.config import CacheTierConfig, KVCacheManagerConfig, ReuseScope
from kvpool.engine.model import manager_config_from_hf
from kvpool.engine.rope import reuse_limit_of
from kvpool.errors import ArgumentError, LogicError, OutOfPagesError
from kvpool.integrations.cache_layer import KVPoolLayer, model_layers
from kvpool.integrations.paged_attention import ATTENTION, CURRENT, paged_attention
from kvpool.manager import KVCacheManager
from kvpool.validation import check_int

SUPPORTED = ((5, 24), (6, 0))  # transformers versions: [5.24, 6)

AttentionInterface.register(ATTENTION, paged_attention)

_version = tuple(int(part) for part in transformers.__version__.split(".")[:2])
if not SUPPORTED[0] <= _version < SUPPORTED[1]:
    raise ImportError(
        f"kvpool.integrations.transformers supports transformers >= 5.24, < 6; "
        f"{transformers.__version__} is installed (pip install 'kvpool[transformers]')"
    )


def manager_config(
    model: Any,
    gpu_quota: int,
    more_tiers: list[CacheTierConfig] | None = None,
    tokens_per_block: int = 16,
    **options: Any,
) -> KVCacheManagerConfig:
    """A manager config for `model` (its config and dtype): K and V pages per layer, the
    model's sliding windows. `more_tiers`: host and disk levels below the GPU."""
    return manager_config_from_hf(
        model.config, tokens_per_block, gpu_quota, more_tiers, dtype=model.dtype, **options
    )


class KVPoolCache(Cache):
    """A transformers `Cache` whose K/V live in `manager`'s pages (module docstring).
    `reuse_scope` isolates prefix reuse (a LoRA adapter, a tenant's salt)."""

    def __init__(
        self, model: Any, manager: KVCacheManager, reuse_scope: ReuseScope | None = None
    ) -> None:
        config = getattr(model, "config", model).get_text_config(decoder=True)
        self.config = config
        self.manager = manager
        self.reuse_scope = reuse_scope
        self.reuse_limit = reuse_limit_of(config.to_dict())  # (length-dependent RoPE)
        self.unshared_calls = 0  # calls past it, each in a scope of its own
        self.tpb = manager.tokens_per_block
        layers = model_layers(self, config, manager.layout)
        super().__init__(layers=list(layers))
        self.kv_layers = layers  # (the same objects as `layers`, typed)
        self.rows: list[KVCache] = []
        self.pads: list[int] = []  # leading padding columns per row
        self.prompts: list[list[int]] = []  # the prompts' tokens (without padding)
        self.sources: list[int] = []  # per row: its prompt
        self.reordered = False  # rows were chosen among beams: their histories are not outputs
        self.reserved = 0  # columns the rows have pages for
        self.floor = 0  # columns below which nothing may be cropped (kvpool's history)
        layout = manager.layout
        self._group = [layout.placement(i, "k").layer_group for i in range(len(layers))]
        # Where the KV of each column is, for columns below `reserved` (set by `_reserve`): per
        # layer group the slot id of each (row, block) and of each (row, column), and per
        # (row, column) the offset in its block and whether it is padding.
        self._blocks: dict[int, torch.Tensor] = {}
        self._slots: dict[int, torch.Tensor] = {}
        self._offsets = self._padding = torch.zeros((0, 0), dtype=torch.int64)
        self._views: dict[tuple[int, str], torch.Tensor] = {}

    # -- rows ------------------------------------------------------------------------------------

    def prepare(
        self,
        input_ids: torch.Tensor | Sequence[Sequence[int]],
        attention_mask: torch.Tensor | Sequence[Sequence[int]] | None = None,
        expand: int = 1,
    ) -> int:
        """Open one row per prompt (left padding only) holding the longest prefix that every
        row has cached, in columns: `get_seq_length()` returns it and `generate` computes only
        the columns after it (at least the last one). `expand`: rows per prompt, as
        `max(num_beams, num_return_sequences)` makes them (forks, sharing every page). Returns
        the cached columns."""
        if self.rows:
            raise LogicError("KVPoolCache.prepare() with rows still open: call finish() first")
        ids = torch.as_tensor(input_ids)
        if ids.ndim != 2 or ids.shape[0] < 1 or ids.shape[1] < 1:
            raise ArgumentError(
                f"input_ids={tuple(ids.shape)} is invalid: must be [batch >= 1, length >= 1]"
            )
        mask = torch.ones_like(ids) if attention_mask is None else torch.as_tensor(attention_mask)
        if mask.shape != ids.shape:
            raise ArgumentError(
                f"attention_mask={tuple(mask.shape)} is invalid: must match input_ids "
                f"{tuple(ids.shape)}"
            )
        check_int("expand", expand, 1)
        length = ids.shape[1]
        pads, prompts = [], []
        for number in range(ids.shape[0]):
            real = int(mask[number].sum())
            pad = length - real
            if real < 1 or not bool(mask[number, pad:].all()):
                raise ArgumentError(
                    f"attention_mask[{number}] is invalid: must be left padding (zeros, then at least "
                    "one 1, then only 1s): tokenize with padding_side='left'"
                )
            pads.append(pad)
            prompts.append([int(token) for token in ids[number, pad:].tolist()])
        manager, scope = self.manager, self.reuse_scope
        if self.reuse_limit is not None and max(map(len, prompts)) > self.reuse_limit:
            # The model's RoPE frequencies follow the longest row: KV of no other call fits,
            # and this call's fits no other (`kvpool.engine.rope`): a scope of its own.
            self.unshared_calls += 1
            scope = ReuseScope(salt=f"kvpool:unshared:{id(self)}:{self.unshared_calls}")
        # The prefix every row can use: columns before it are padding or cached for each row.
        cached = min(
            [length - 1]
            + [
                pad + manager.probe_reuse(scope, p[:-1])
                for pad, p in zip(pads, prompts, strict=True)
            ]
        )
        while True:  # (holding one row's prefix cannot shorten another's, but check)
            rows = [
                manager.create_kv_cache(scope, p[: max(cached - pad, 0)])
                for pad, p in zip(pads, prompts, strict=True)
            ]
            got = min(
                [cached]
                + [
                    pad + row.num_committed_tokens
                    for pad, row in zip(pads, rows, strict=True)
                    if row.num_committed_tokens < cached - pad
                ]
            )
            if got == cached:
                break
            for row in rows:
                row.close()
            cached = got
        try:
            for index, row in enumerate(rows):
                if not row.resume():
                    raise OutOfPagesError(
                        f"kvpool has no room on the GPU level to resume row {index} "
                        f"({row.num_committed_tokens} cached tokens)"
                    )
        except BaseException:
            for row in rows:
                row.close()
            raise
        self.rows, self.pads, self.prompts = rows, pads, prompts
        self.sources = list(range(len(rows)))
        self.reordered = False
        self.reserved = self.floor = cached
        for layer in self.kv_layers:
            layer.length = cached
        if expand > 1:
            self.batch_repeat_interleave(expand)
        return cached

    def finish(self, sequences: torch.Tensor | Sequence[Sequence[int]] | None = None) -> None:
        """Commit what the rows computed and close them (their blocks stay cached for reuse).
        `sequences` (what `generate` returned, prompt included) are committed up to the last
        token whose KV was computed; without them, or after beam search reordered the rows,
        only the prompts are."""
        try:
            if self.rows:
                self._commit(sequences)
        finally:
            self.reset()

    def _commit(self, sequences: torch.Tensor | Sequence[Sequence[int]] | None) -> None:
        columns = self.kv_layers[0].length
        outputs = None
        if sequences is not None and not self.reordered:
            outputs = torch.as_tensor(sequences)
            if outputs.ndim != 2 or outputs.shape[0] != len(self.rows):
                raise ArgumentError(
                    f"sequences={tuple(outputs.shape)} is invalid: must be [{len(self.rows)}, "
                    "length] (one per row)"
                )
        for index, (row, pad) in enumerate(zip(self.rows, self.pads, strict=True)):
            if row.status is not KVCacheStatus.ACTIVE:
                continue
            if outputs is not None:
                tokens = [int(t) for t in outputs[index, pad:].tolist()]
                prompt = self.prompts[self.sources[index]]
                if tokens[: len(prompt)] != prompt:
                    raise ArgumentError(
                        f"sequences[{index}] is invalid: must begin with its row's prompt (what "
                        "generate returned for the input_ids given to prepare())"
                    )
            else:
                tokens = self.prompts[self.sources[index]]
            written = min(columns - pad, len(tokens))
            if written > row.num_committed_tokens:
                row.commit(tokens[row.num_committed_tokens : written])

    def reset(self) -> None:
        """Close every row (nothing is committed) and empty the layers."""
        for row in self.rows:
            row.close()
        self.rows, self.pads, self.prompts, self.sources = [], [], [], []
        self.reordered = False
        self.reserved = self.floor = 0
        self._views.clear()
        for layer in self.kv_layers:
            layer.reset()

    def _take_rows(self, picks: Sequence[int]) -> None:
        """New rows: row i continues old row picks[i] (the old row itself the first time it is
        picked, a fork sharing its pages after that); rows not picked are closed."""
        old, old_pads = self.rows, self.pads
        if any(not 0 <= pick < len(old) for pick in picks):
            raise ArgumentError(f"indices={list(picks)} is invalid: must be in [0, {len(old)})")
        taken: set[int] = set()
        rows = []
        for pick in picks:
            if pick in taken:
                rows.append(self.manager.fork_kv_cache(old[pick]))
            else:
                taken.add(pick)
                rows.append(old[pick])
        for index, row in enumerate(old):
            if index not in taken:
                row.close()
        self.rows = rows
        self.pads = [old_pads[pick] for pick in picks]
        self.sources = [self.sources[pick] for pick in picks]
        self.reserved = min(layer.length for layer in self.kv_layers)
        # (The next write reserves again: forks copy what they write, and the tables follow.)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row `repeats` times in a row (forks sharing its pages)."""
        check_int("repeats", repeats, 1)
        self._take_rows([index for index in range(len(self.rows)) for _ in range(repeats)])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i continues row beam_idx[i]."""
        picks = [int(i) for i in beam_idx.tolist()]
        if picks != list(range(len(self.rows))):
            self.reordered = True
            self._take_rows(picks)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows `indices` (in that order)."""
        self.reordered = True
        self._take_rows([int(i) for i in torch.as_tensor(indices).tolist()])

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last `-tokens_to_remove` columns (transformers' convention: a negative
        count), back at most to `floor`: the columns the rows' kvpool history covers, where the
        last forward pass that needed new pages started."""
        if tokens_to_remove > 0:
            raise ArgumentError(
                f"tokens_to_remove={tokens_to_remove} is invalid: must be <= 0 (the number of "
                "tokens to remove, negated)"
            )
        length = self.kv_layers[0].length
        if length + tokens_to_remove < self.floor:
            raise ArgumentError(
                f"tokens_to_remove={tokens_to_remove} is invalid: must be >= "
                f"{self.floor - length} (kvpool's history ends at column {self.floor})"
            )
        for layer in self.kv_layers:
            layer.length = min(layer.length, length + tokens_to_remove)

    # -- K/V -------------------------------------------------------------------------------------

    def check_states(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The model's K/V fit the manager's pages (heads x head dim x dtype per token)."""
        placement = self.manager.layout.placement(layer_idx, "k")
        token_bytes = keys.shape[1] * keys.shape[3] * keys.element_size()
        if keys.shape != values.shape or placement.size != token_bytes * self.tpb:
            raise ArgumentError(
                f"manager is invalid for this model: layer {layer_idx}'s pages hold "
                f"{placement.size // self.tpb} bytes per token, its keys and values "
                f"{tuple(keys.shape)} of {keys.dtype} need {token_bytes} (build the manager with "
                "kvpool.integrations.transformers.manager_config(model, ...))"
            )

    def _reserve(self, end: int) -> None:
        """Pages for columns up to `end` in every row (all layers), private where written; then
        where each column's KV is (`_where`)."""
        start = min(layer.length for layer in self.kv_layers)
        for index, (row, pad) in enumerate(zip(self.rows, self.pads, strict=True)):
            capacity = max(end - pad, 0)
            history = min(max(start - pad, row.history_length), capacity)
            if not row.resize(max(capacity, row.capacity), history) or not row.prepare_write(
                max(history, row.num_committed_tokens), max(capacity, row.num_committed_tokens)
            ):
                raise OutOfPagesError(
                    f"kvpool has no room on the GPU level for {capacity - history} more tokens "
                    f"of row {index}"
                )
        self.reserved, self.floor = end, start
        self._views.clear()  # (page views change when a level is resized or rebalanced)
        tpb, groups = self.tpb, {self._group[layer.layer_idx] for layer in self.kv_layers}
        pads = torch.tensor(self.pads, dtype=torch.int64)[:, None]
        positions = torch.arange(end, dtype=torch.int64)[None, :] - pads  # real positions
        self._offsets = positions.clamp(min=0) % tpb
        self._padding = positions < 0
        for g in groups:
            slots = [row.get_base_page_indices(g) for row in self.rows]
            table = np.full((len(slots), max(1, *(len(ids) for ids in slots))), -1, np.int64)
            for number, ids in enumerate(slots):
                table[number, : len(ids)] = ids
            blocks = torch.from_numpy(table)
            self._blocks[g] = blocks
            of_column = (positions.clamp(min=0) // tpb).clamp(max=blocks.shape[1] - 1)
            self._slots[g] = torch.gather(blocks, 1, of_column).clamp(min=0)

    def pages(self, layer_idx: int, role: str, like: torch.Tensor) -> torch.Tensor:
        """The layer's K or V pages as [slots, tokens per block, kv heads, head dim] (a strided
        view of the pool: a slot id indexes it)."""
        key = (layer_idx, role)
        view = self._views.get(key)
        if view is None:
            page_view = self.manager.page_view(layer_idx, role)
            raw = (
                page_view
                if isinstance(page_view, torch.Tensor)
                else torch.from_numpy(np.asarray(page_view))
            )
            placement = self.manager.layout.placement(layer_idx, role)
            view = raw.view(like.dtype).view(
                -1, placement.buffers_per_slot, self.tpb, like.shape[1], like.shape[3]
            )[:, placement.position]
            self._views[key] = view
        return view

    def blocks(self, layer_idx: int) -> torch.Tensor:
        """Slot ids per (row, block) of the layer's layer group, -1 where none: [rows, blocks]."""
        return self._blocks[self._group[layer_idx]]

    def write_and_read(
        self, layer: KVPoolLayer, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`KVPoolLayer.update`: write the new columns' K/V into the pages, return the K/V
        attention reads (module docstring)."""
        if not self.rows:
            raise LogicError(
                "KVPoolCache has no rows: call cache.prepare(input_ids, attention_mask) before "
                "the forward pass (kvpool.integrations.transformers.generate does)"
            )
        if keys.shape[0] != len(self.rows):
            raise ArgumentError(
                f"key_states={tuple(keys.shape)} is invalid: the cache has {len(self.rows)} rows "
                "(prepare(..., expand=max(num_beams, num_return_sequences)))"
            )
        start, count = layer.length, keys.shape[2]
        if start + count > self.reserved or start < self.floor:
            self._reserve(start + count)
        end = start + count
        slots = self._slots[self._group[layer.layer_idx]]
        written = ~self._padding[:, start:end]
        new_slots, new_offsets = slots[:, start:end][written], self._offsets[:, start:end][written]
        for role, states in (("k", keys), ("v", values)):
            pages = self.pages(layer.layer_idx, role, states)
            at = pages.device  # (the index tensors live on the CPU; the pages maybe on a GPU)
            pages[new_slots.to(at), new_offsets.to(at)] = states.transpose(1, 2)[
                written.to(states.device)
            ].to(at, pages.dtype)
        begin = layer.first_visible()  # (what get_mask_sizes told the mask, before this write)
        layer.length = end
        if self.config._attn_implementation == ATTENTION:
            CURRENT.set((self, layer))
            return keys, values
        return self._gather(layer.layer_idx, keys, begin, end), self._gather(
            layer.layer_idx, values, begin, end, "v"
        )

    def _gather(
        self, layer_idx: int, like: torch.Tensor, begin: int, end: int, role: str = "k"
    ) -> torch.Tensor:
        """Columns [begin, end) of one buffer as [rows, kv heads, columns, head dim]: whole
        blocks gathered at once, then each row's columns cut out (padding columns: zeros)."""
        tpb, pads = self.tpb, self.pads
        first = min(max(begin - pad, 0) for pad in pads) // tpb
        last = -(-max(end - pad for pad in pads) // tpb)
        pages = self.pages(layer_idx, role, like)
        blocks = self._blocks[self._group[layer_idx]][:, first:last].clamp(min=0).to(pages.device)
        real = pages[blocks].flatten(1, 2)  # [rows, tokens from block `first` on, heads, dim]
        base = first * tpb
        if not any(pads):  # every row's columns are its real positions
            out = real[:, begin - base : end - base]
        else:
            out = real.new_zeros((len(pads), end - begin, *real.shape[2:]))
            for row, pad in enumerate(pads):
                low = max(begin - pad, 0)
                out[row, low + pad - begin :] = real[row, low - base : end - pad - base]
        return out.transpose(1, 2).to(like.device)


# -- generate ------------------------------------------------------------------------------------


def generate(
    model: Any,
    cache: KVPoolCache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> Any:
    """`model.generate(input_ids, attention_mask, cache=cache, **kwargs)` around the cache's
    `prepare` (prefix reuse, one row per beam or returned sequence) and `finish` (commit and
    close). If generation raises (or is interrupted), the rows are closed uncommitted."""
    config = model.generation_config
    beams = kwargs.get("num_beams") or config.num_beams or 1
    returned = kwargs.get("num_return_sequences") or config.num_return_sequences or 1
    cache.prepare(input_ids, attention_mask, expand=max(beams, returned))
    try:
        output = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, cache=cache, **kwargs
        )
    except BaseException:
        cache.reset()
        raise
    sequences = output if isinstance(output, torch.Tensor) else output.sequences
    cache.finish(sequences if sequences.shape[0] == len(cache.rows) else None)
    return output


__all__ = [
    "ATTENTION",
    "KVPoolCache",
    "KVPoolLayer",
    "generate",
    "manager_config",
    "paged_attention",
]

"""One model layer of `kvpool.integrations.transformers.KVPoolCache`, as transformers' `Cache`
sees it: a `CacheLayerMixin` whose keys and values live in kvpool's pages. The rows (kvpool
requests) belong to the cache; a layer knows its length and window, and hands every row
operation to its owner once."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
from transformers.cache_utils import CacheLayerMixin, get_layer_types_and_kwargs

from kvpool.errors import ArgumentError

if TYPE_CHECKING:
    from kvpool.layout import KVLayout


class RowOwner(Protocol):
    """What a layer needs of the cache that owns the rows."""

    def check_states(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None: ...

    def write_and_read(
        self, layer: KVPoolLayer, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def crop(self, tokens_to_remove: int) -> None: ...

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None: ...

    def batch_repeat_interleave(self, repeats: int) -> None: ...

    def batch_select_indices(self, indices: torch.Tensor) -> None: ...


class KVPoolLayer(CacheLayerMixin):  # type: ignore[no-untyped-call]
    """One model layer's view of a `KVPoolCache`: how many columns it holds, and its window.
    Its keys and values live in kvpool's pages (`keys`/`values` stay None)."""

    is_croppable = True

    def __init__(self, cache: RowOwner, layer_idx: int, window: int | None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.cache = cache
        self.layer_idx = layer_idx
        self.window = window
        self.is_sliding = window is not None
        self.length = 0  # columns written (left padding included), as in transformers' layers

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.cache.check_states(self.layer_idx, key_states, value_states)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self.cache.write_and_read(self, key_states, value_states)

    def first_visible(self) -> int:
        """The first column attention still sees (a sliding window's start)."""
        if self.window is None:
            return 0
        return max(self.length - self.window + 1, 0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        offset = self.first_visible()
        return self.length + query_length - offset, offset

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1 if self.window is None else self.window

    # Row operations act on the cache's rows once, through `KVPoolCache`; per layer only the
    # length changes.
    def reset(self) -> None:
        self.length = 0

    def crop(self, tokens_to_remove: int) -> None:
        self.cache.crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.cache.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.cache.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.cache.batch_select_indices(indices)


def model_layers(owner: RowOwner, config: Any, layout: KVLayout) -> list[KVPoolLayer]:
    """One layer per model layer, each checked against the manager's layout: full or
    sliding-window attention with 'k' and 'v' buffers of one size, the same window."""
    layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
    layers: list[KVPoolLayer] = []
    for index, (kind, kwargs) in enumerate(zip(layer_types, layer_kwargs, strict=True)):
        if kind not in ("full_attention", "sliding_attention"):
            raise ArgumentError(
                f"layer_types[{index}]={kind!r} is invalid: must be 'full_attention' or "
                "'sliding_attention' (kvpool's transformers cache holds attention K/V only)"
            )
        try:
            keys, values = layout.placement(index, "k"), layout.placement(index, "v")
        except ArgumentError:
            raise ArgumentError(
                f"manager is invalid for this model: it has no 'k' and 'v' buffers for layer "
                f"{index} (build it with kvpool.integrations.transformers.manager_config)"
            ) from None
        life_cycle = layout.life_cycles[keys.layer_group]
        window = getattr(life_cycle, "window", None)
        wanted = kwargs.get("sliding_window") if kind == "sliding_attention" else None
        if window is not None and window != wanted:
            raise ArgumentError(
                f"manager is invalid for this model: layer {index} keeps a window of {window} "
                f"tokens, the model attends to {wanted or 'all of them'}"
            )
        if keys.size != values.size:
            raise ArgumentError(f"manager is invalid: layer {index}'s k and v sizes differ")
        layers.append(KVPoolLayer(owner, index, window))
    return layers


__all__ = ["KVPoolLayer", "RowOwner", "model_layers"]

"""SGLang's host-pool pages as kvpool stores them.

SGLang's HiCache host pool (`sglang.srt.mem_cache.pool_host`) keeps a model's KV in one of
three layouts; a page (the KV of `page_size` tokens, every layer) is not contiguous in any of
them except `page_first_direct`. kvpool stores one page as one block of one buffer, in a
canonical order that does not depend on the layout, so that a page written by a process with
one layout is read by a process with another:

- MHA (`MHATokenToKVPoolHost`): [K/V, layer, token, head, dim];
- MLA (`MLATokenToKVPoolHost`, the latent vector and rope part in one row per token):
  [layer, token, 1, dim].

Copies go straight between the host pool's page in its own order (SGLang's
`get_data_page(index, flat=False)`) and kvpool's page bytes seen in that same order
(`PageFormat.stored`: the canonical array, permuted once per scratch row rather than once per
host page), no intermediate tensor. After the KV bytes, each stored page carries a tag of
`TAG_BYTES` naming its key (see `backend.py`).

A hybrid model's extra pools (SGLang's `_v2` interface) are stored the same way, one value per
page key and pool:

- SWA (`swa`): an `MHATokenToKVPoolHost`/`MLATokenToKVPoolHost` of its own (the sliding-window
  layers), pages as above;
- Mamba state (`mamba`, `MambaPoolHost`): one state slot per key (its page size is 1), the
  bytes of its tensors in SGLang's own order (temporal state, each conv state, side states:
  `get_data_page(i, flat=True)`), copied straight between views of the slot and the page
  (`StateFormat`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvpool.errors import ArgumentError, ConfigError

TAG_BYTES = 16
LAYOUTS = ("layer_first", "page_first", "page_first_direct")

# The host pool classes whose page layout this module knows (by exact class name: a subclass
# stores something else: asymmetric K/V widths, FP8 scales, sparse pages, indexer buffers).
MHA_POOL = "MHATokenToKVPoolHost"
MLA_POOL = "MLATokenToKVPoolHost"
MAMBA_POOL = "MambaPoolHost"


@dataclass(frozen=True)
class PageFormat:
    """One page of a host pool: its kind (`mha`/`mla`), layout, canonical shape and dtype."""

    kind: str
    layout: str
    page_size: int
    layer_num: int
    head_num: int
    head_dim: int
    dtype: Any  # a torch.dtype
    shape: tuple[int, ...]  # the canonical order (module docstring)
    native_shape: tuple[int, ...]  # the layout's own (`get_data_page(i, flat=False)`)
    nbytes: int  # bytes of one page's KV (the stored value adds TAG_BYTES)

    def identity_parts(self) -> dict[str, object]:
        """What changes a stored page's bytes (not the layout: the canonical order hides it)."""
        return {
            "sglang.kind": self.kind,
            "sglang.page_size": self.page_size,
            "sglang.layer_num": self.layer_num,
            "sglang.head_num": self.head_num,
            "sglang.head_dim": self.head_dim,
            "sglang.dtype": str(self.dtype),
        }

    def native_of(self, page: Any) -> Any:
        """A page in the layout's own order, or flat (SGLang's flat data pages), as a view in
        the layout's own order."""
        return page.view(self.native_shape)

    # (the interface `backend.py` copies through, shared with `StateFormat`)

    def target(self, host_pool: Any, index: int) -> Any:
        """Where page `index` of `host_pool` is read from and written to (its own order)."""
        return host_pool.get_data_page(index, flat=False)  # (`native_shape`: page_format)

    def stored(self, row: Any) -> Any:
        """The page's bytes in a stored row (a uint8 array, canonical order) as a tensor in the
        layout's own order, to copy to and from `target`."""
        canonical = torch.from_numpy(row[: self.nbytes]).view(self.dtype).view(self.shape)
        return _NATIVE[(self.kind, self.layout)](canonical)

    def take(self, stored: Any, source: Any) -> None:
        """Copy a host page (`target`) into a stored page (`stored`)."""
        stored.copy_(source)

    def put(self, target: Any, stored: Any) -> None:
        """Copy a stored page into a host page."""
        target.copy_(stored)


_NATIVE: dict[tuple[str, str], Callable[[Any], Any]] = {  # canonical -> the layout's order
    ("mha", "layer_first"): lambda page: page,  # [2, L, P, H, D]
    ("mha", "page_first"): lambda page: page.permute(0, 2, 1, 3, 4),  # [2, P, L, H, D]
    ("mha", "page_first_direct"): lambda page: page.unsqueeze(1),  # [2, 1, L, P, H, D]
    ("mla", "layer_first"): lambda page: page,  # [L, P, 1, D]
    ("mla", "page_first"): lambda page: page.permute(1, 0, 2, 3),  # [P, L, 1, D]
    ("mla", "page_first_direct"): lambda page: page.unsqueeze(0),  # [1, L, P, 1, D]
}


def page_format(host_pool: Any) -> PageFormat:
    """The page format of an SGLang host pool; `ConfigError` naming what is not supported."""
    name = type(host_pool).__name__
    if name not in (MHA_POOL, MLA_POOL):
        raise ConfigError(
            f"mem_pool_host={name} is not supported: kvpool's SGLang backend stores the pages "
            f"of {MHA_POOL} and {MLA_POOL} (a hybrid or quantized-scale pool is not supported)"
        )
    layout = str(host_pool.layout)
    if layout not in LAYOUTS:
        raise ConfigError(
            f"mem_pool_host.layout={layout!r} is not supported: must be one of {list(LAYOUTS)}"
        )
    if int(getattr(host_pool, "dcp_size", 1)) != 1:
        raise ConfigError("mem_pool_host.dcp_size > 1 (decode context parallel) is not supported")
    page_size = int(host_pool.page_size)
    layer_num = int(host_pool.layer_num)
    if name == MHA_POOL:
        kind, head_num, head_dim = "mha", int(host_pool.head_num), int(host_pool.head_dim)
        if int(getattr(host_pool, "v_head_dim", head_dim)) != head_dim:
            raise ConfigError(
                f"mem_pool_host.v_head_dim={host_pool.v_head_dim} differs from head_dim="
                f"{head_dim}: not supported"
            )
        shape: tuple[int, ...] = (2, layer_num, page_size, head_num, head_dim)
    else:
        kind, head_num, head_dim = "mla", 1, int(host_pool.kv_cache_dim)
        shape = (layer_num, page_size, 1, head_dim)
    dtype = host_pool.dtype
    nbytes = dtype.itemsize
    for dim in shape:
        nbytes *= dim
    native = host_pool.get_data_page(0, flat=False)
    native_shape = tuple(int(d) for d in native.shape)
    found = PageFormat(
        kind, layout, page_size, layer_num, head_num, head_dim, dtype, shape, native_shape, nbytes
    )
    probe = _NATIVE[(kind, layout)](torch.empty(shape, dtype=dtype, device="meta"))
    if tuple(probe.shape) != native_shape or native.untyped_storage().data_ptr() != (
        host_pool.kv_buffer.untyped_storage().data_ptr()
    ):
        raise ConfigError(
            f"mem_pool_host ({name}, {layout}): its pages are not views of shape "
            f"{tuple(probe.shape)} of its buffer (got {native_shape}); this SGLang release "
            "stores pages differently"
        )
    return found


@dataclass(frozen=True)
class StateFormat:
    """One state slot of SGLang's `MambaPoolHost`: the bytes of its tensors, in SGLang's own
    order (`MambaPoolHost._iter_page_tensors`: temporal, each conv, side states), whatever the
    layout (both of its layouts keep a slot's tensors contiguous)."""

    kind: str
    layout: str
    page_size: int  # host slots per key (1)
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    nbytes: int

    def identity_parts(self) -> dict[str, object]:
        return {
            "sglang.kind": self.kind,
            "sglang.state_shapes": self.shapes,
            "sglang.state_dtypes": self.dtypes,
        }

    def target(self, host_pool: Any, index: int) -> list[Any]:
        """Slot `index` of `host_pool` as byte views of its tensors (no copy)."""
        return [_bytes_view(t) for t in host_pool._iter_page_tensors(index)]

    def stored(self, row: Any) -> Any:
        return torch.from_numpy(row[: self.nbytes])

    def take(self, stored: Any, source: list[Any]) -> None:
        start = 0
        for part in source:
            stored[start : start + part.numel()].copy_(part)
            start += part.numel()

    def put(self, target: list[Any], stored: Any) -> None:
        start = 0
        for part in target:
            part.copy_(stored[start : start + part.numel()])
            start += part.numel()


def _bytes_view(tensor: Any) -> Any:
    """A contiguous tensor's memory as a flat uint8 view."""
    if tensor.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return tensor.reshape(-1).view(torch.uint8)


def state_format(host_pool: Any) -> StateFormat:
    """The slot format of SGLang's `MambaPoolHost`; `ConfigError` naming what is not
    supported (a slot whose tensors are not contiguous views of the pool's buffers)."""
    name = type(host_pool).__name__
    if name != MAMBA_POOL:
        raise ConfigError(f"{name} is not {MAMBA_POOL}")
    layout = str(host_pool.layout)
    page_size = int(host_pool.page_size)
    parts = list(host_pool._iter_page_tensors(0))
    buffers = {b.untyped_storage().data_ptr() for b in host_pool.get_hybrid_pool_buffer()}
    if page_size != 1 or any(
        not p.is_contiguous() or (p.numel() and p.untyped_storage().data_ptr() not in buffers)
        for p in parts
    ):
        raise ConfigError(
            f"{name} ({layout}): its slots are not contiguous views of its buffers (page size "
            f"{page_size}); this SGLang release stores Mamba states differently"
        )
    nbytes = sum(p.numel() * p.element_size() for p in parts)
    if nbytes != int(host_pool.size_per_token):
        raise ConfigError(
            f"{name}: a slot's tensors hold {nbytes} bytes, not size_per_token="
            f"{host_pool.size_per_token}; this SGLang release stores Mamba states differently"
        )
    shapes = tuple(tuple(int(d) for d in p.shape) for p in parts)
    dtypes = tuple(str(p.dtype) for p in parts)
    return StateFormat("mamba", layout, page_size, shapes, dtypes, nbytes)


__all__ = [
    "LAYOUTS",
    "TAG_BYTES",
    "PageFormat",
    "StateFormat",
    "page_format",
    "state_format",
]


def check_keys(keys: object) -> None:
    """SGLang's keys: a list of strings (`ArgumentError` naming them)."""
    if not isinstance(keys, list | tuple) or not all(isinstance(k, str) for k in keys):
        raise ArgumentError(f"keys={keys!r} is invalid: must be a list of strings (page hashes)")


def check_indices(host_indices: object, pages: int, page_size: int, pool: str) -> None:
    """SGLang's host indices: `page_size` slots per key (`ArgumentError` naming them)."""
    if not isinstance(host_indices, torch.Tensor) or host_indices.numel() != pages * page_size:
        got = host_indices.numel() if isinstance(host_indices, torch.Tensor) else host_indices
        raise ArgumentError(
            f"host_indices={got!r} is invalid: must be a tensor of {pages} x {page_size} "
            f"slots of pool {pool} (page_size per key)"
        )

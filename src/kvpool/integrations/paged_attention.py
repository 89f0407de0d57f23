"""Attention over kvpool's pages for transformers (the `"kvpool"` attention implementation):
each row's keys and values are read through its block table, `CHUNK_BLOCKS` blocks at a time
with an online softmax, so the history is never gathered into one tensor. It applies causality,
each row's left padding and the layer's sliding window itself, from the cache's positions
(transformers builds no mask for an implementation it does not know).

`KVPoolCache` writes a layer's new K/V into the pages and leaves (cache, layer) in `CURRENT`
for the attention call that follows it in the same layer.
"""

from __future__ import annotations

import contextvars
from typing import Any, Protocol

import torch

from kvpool.errors import ArgumentError, LogicError
from kvpool.integrations.cache_layer import KVPoolLayer

ATTENTION = "kvpool"  # the name to load a model with: attn_implementation="kvpool"
CHUNK_BLOCKS = 64  # blocks per step of the online softmax


class PagedRows(Protocol):
    """What the attention reads of a `KVPoolCache`: its rows' pages and block tables."""

    tpb: int
    pads: list[int]  # leading padding columns per row

    def pages(self, layer_idx: int, role: str, like: torch.Tensor) -> torch.Tensor: ...

    def blocks(self, layer_idx: int) -> torch.Tensor: ...


CURRENT: contextvars.ContextVar[tuple[PagedRows, KVPoolLayer] | None] = contextvars.ContextVar(
    "kvpool_paged_attention", default=None
)


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface, over the pages of the layer `KVPoolCache` just
    wrote (module docstring); `key` and `value` are only the new tokens' (for their shape).
    `kvpool.integrations.transformers` registers it as "kvpool" when imported."""
    current = CURRENT.get()
    if current is None:
        raise LogicError(
            "attn_implementation='kvpool' reads kvpool's pages: pass a KVPoolCache (use_cache=True)"
        )
    cache, layer = current
    CURRENT.set(None)
    if dropout:
        raise ArgumentError(f"dropout={dropout} is invalid: must be 0 (inference only)")
    batch, heads, count, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    tpb = cache.tpb
    scale = scaling if scaling is not None else dim**-0.5
    keys_pages = cache.pages(layer.layer_idx, "k", key)
    values_pages = cache.pages(layer.layer_idx, "v", value)
    table = cache.blocks(layer.layer_idx).to(keys_pages.device)
    pads = torch.tensor(cache.pads, dtype=torch.int64, device=query.device)[:, None]
    positions = torch.arange(layer.length - count, layer.length, device=query.device)[None] - pads
    q = query.reshape(batch, kv_heads, group, count, dim).to(torch.float32) * scale
    best = torch.full((batch, kv_heads, group, count, 1), -torch.inf, device=query.device)
    total = torch.zeros((batch, kv_heads, group, count, 1), device=query.device)
    out = torch.zeros((batch, kv_heads, group, count, dim), device=query.device)
    first = 0
    if layer.window is not None:
        first = max(int(positions.min()) - layer.window + 1, 0) // tpb
    last = -(-int(positions.max() + 1) // tpb)
    for begin in range(first, last, CHUNK_BLOCKS):
        end = min(begin + CHUNK_BLOCKS, last)
        blocks = table[:, begin:end]
        k = keys_pages[blocks.clamp(min=0)].reshape(batch, -1, kv_heads, dim)
        v = values_pages[blocks.clamp(min=0)].reshape(batch, -1, kv_heads, dim)
        k, v = k.to(query.device, torch.float32), v.to(query.device, torch.float32)
        scores = torch.einsum("bhgqd,bkhd->bhgqk", q, k)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        key_positions = torch.arange(begin * tpb, end * tpb, device=query.device)
        allowed = (key_positions[None, None, :] <= positions[:, :, None]) & (
            blocks.to(query.device) >= 0
        ).repeat_interleave(tpb, dim=1)[:, None, :]
        if layer.window is not None:
            allowed &= positions[:, :, None] - key_positions[None, None, :] < layer.window
        scores = scores.masked_fill(~allowed[:, None, None], -torch.inf)
        peak = torch.maximum(best, scores.amax(dim=-1, keepdim=True))
        safe = torch.where(torch.isinf(peak), 0.0, peak)
        rescale = torch.exp(best - safe)
        weights = torch.exp(scores - safe)
        total = total * rescale + weights.sum(dim=-1, keepdim=True)
        out = out * rescale + torch.einsum("bhgqk,bkhd->bhgqd", weights, v)
        best = peak
    out = torch.where(total > 0, out / total.clamp(min=1e-30), 0.0)  # (padding rows: zeros)
    out = out.reshape(batch, heads, count, dim).transpose(1, 2).to(query.dtype).contiguous()
    return out, None

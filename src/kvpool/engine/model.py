"""A Llama/Mistral/Qwen2-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) in plain
torch, with paged attention over kvpool's pools: no KV lives anywhere but in kvpool's memory.

Weights load from a transformers model's state dict (same names), so a check against
transformers uses identical weights.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvpool.cache import KVCache
from kvpool.config import (
    CacheTierConfig,
    GpuCacheTierConfig,
    KVCacheManagerConfig,
)
from kvpool.manager import KVCacheManager
from kvpool.presets import hf_shape

_DTYPE_BYTES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}


def manager_config_from_hf(
    hf_config: Any,
    tokens_per_block: int,
    gpu_quota: int,
    more_tiers: list[CacheTierConfig] | None = None,
    dtype: torch.dtype = torch.float32,
    **options: Any,
) -> KVCacheManagerConfig:
    """A manager config for a transformers config: K and V buffers per layer (KV heads x head
    dim x dtype x tokens per block) with the model's sliding windows."""
    data = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
    configs = hf_shape(data).layers(tokens_per_block, _DTYPE_BYTES[dtype])
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(gpu_quota), *(more_tiers or [])]
    return KVCacheManagerConfig(tokens_per_block, tiers, configs, **options)


class PagedDecoder:
    """Forward passes of one decoder whose KV cache is a kvpool manager."""

    def __init__(
        self, hf_config: Any, state_dict: dict[str, torch.Tensor], manager: KVCacheManager
    ) -> None:
        data = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
        self.manager = manager
        shape = hf_shape(data)
        self.num_layers, self.heads = shape.num_layers, shape.num_heads
        self.kv_heads, self.head_dim = shape.num_kv_heads, shape.head_dim
        self.windows = list(shape.windows)
        self.eps = float(data.get("rms_norm_eps", 1e-6))
        theta = float(
            data.get("rope_theta") or (data.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        )
        self.weights = {
            name: tensor.detach().to(torch.float32) for name, tensor in state_dict.items()
        }
        if "lm_head.weight" not in self.weights:
            self.weights["lm_head.weight"] = self.weights["model.embed_tokens.weight"]
        self.inv_freq = 1.0 / (
            theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim)
        )
        self.tpb = manager.tokens_per_block

    # -- building blocks -------------------------------------------------------------------------

    def _w(self, name: str) -> torch.Tensor:
        return self.weights[name]

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        out = x @ self._w(name + ".weight").T
        bias = self.weights.get(name + ".bias")
        return out + bias if bias is not None else out

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self._w(name + ".weight") * (x * torch.rsqrt(variance + self.eps))

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [tokens, heads, head_dim]."""
        freqs = positions[:, None].to(torch.float32) * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def _pages(self, layer: int, role: str) -> torch.Tensor:
        """The layer's K or V pool as [rows, tokens per block, kv heads, head dim]."""
        view = self.manager.page_view(layer, role)
        tensor = view if isinstance(view, torch.Tensor) else torch.from_numpy(np.asarray(view))
        return tensor.view(torch.float32).view(-1, self.tpb, self.kv_heads, self.head_dim)

    # -- forward ---------------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, cache: KVCache, tokens: list[int]) -> torch.Tensor:
        """Compute `tokens` at positions history_length... of `cache` (whose capacity covers
        them): writes their K/V into the request's pages and returns logits [len(tokens), vocab]."""
        start = cache.history_length
        positions = torch.arange(start, start + len(tokens))
        x = self._w("model.embed_tokens.weight")[torch.tensor(tokens)]
        for layer in range(self.num_layers):
            prefix = f"model.layers.{layer}."
            h = self._norm(x, prefix + "input_layernorm")
            x = x + self._attention(cache, layer, h, positions)
            h = self._norm(x, prefix + "post_attention_layernorm")
            gate = self._linear(h, prefix + "mlp.gate_proj")
            up = self._linear(h, prefix + "mlp.up_proj")
            x = x + self._linear(torch.nn.functional.silu(gate) * up, prefix + "mlp.down_proj")
        x = self._norm(x, "model.norm")
        return x @ self._w("lm_head.weight").T

    def _attention(
        self, cache: KVCache, layer: int, h: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        prefix = f"model.layers.{layer}.self_attn."
        n = h.shape[0]
        q = self._rope(
            self._linear(h, prefix + "q_proj").view(n, self.heads, self.head_dim), positions
        )
        k = self._rope(
            self._linear(h, prefix + "k_proj").view(n, self.kv_heads, self.head_dim), positions
        )
        v = self._linear(h, prefix + "v_proj").view(n, self.kv_heads, self.head_dim)
        k_pages, v_pages = self._pages(layer, "k"), self._pages(layer, "v")
        rows = torch.from_numpy(cache.get_page_indices(layer, "k").astype(np.int64))
        v_rows = torch.from_numpy(cache.get_page_indices(layer, "v").astype(np.int64))
        block, offset = positions // self.tpb, positions % self.tpb
        k_pages[rows[block], offset] = k
        v_pages[v_rows[block], offset] = v
        # Gather every earlier position that still has a page (a window drops old blocks).
        end = int(positions[-1]) + 1
        seen = torch.arange(end)
        have = rows[seen // self.tpb] >= 0
        seen = seen[have]
        keys = k_pages[rows[seen // self.tpb], seen % self.tpb]  # [m, kv heads, dim]
        values = v_pages[v_rows[seen // self.tpb], seen % self.tpb]
        group = self.heads // self.kv_heads
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, keys) / self.head_dim**0.5
        allowed = seen[None, :] <= positions[:, None]
        window = self.windows[layer]
        if window is not None:
            allowed &= positions[:, None] - seen[None, :] < window
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), values).reshape(n, -1)
        return self._linear(out, prefix + "o_proj")

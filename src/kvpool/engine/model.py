"""A decoder-only transformer in plain torch (the Llama, Mistral, Qwen2/3 and Gemma 1/2/3
families, see `spec.py`) with paged attention over kvpool's pools: no KV lives anywhere but in
kvpool's memory, in the model's dtype (float32, bfloat16 or float16 pages).

Weights load from a transformers model's state dict (same names), and each operation follows
transformers' eager implementation (norms in float32, softmax in float32, RoPE cos/sin computed in
float32), so a check against transformers compares like with like.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from kvpool.cache import KVCache
from kvpool.config import CacheTierConfig, GpuCacheTierConfig, KVCacheManagerConfig
from kvpool.engine.parallel import TensorParallel, kv_head_split, shard_state_dict
from kvpool.engine.rope import Rotary, rotate
from kvpool.engine.spec import ModelSpec, config_dict, config_dtype, model_spec
from kvpool.errors import ArgumentError
from kvpool.manager import KVCacheManager
from kvpool.presets import hf_shape
from kvpool.validation import check_int

_DTYPE_BYTES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}


def manager_config_from_hf(
    hf_config: Any,
    tokens_per_block: int,
    gpu_quota: int,
    more_tiers: list[CacheTierConfig] | None = None,
    dtype: torch.dtype | None = None,
    tensor_parallel_size: int = 1,
    **options: Any,
) -> KVCacheManagerConfig:
    """A manager config for a transformers config: K and V buffers per layer (KV heads x head
    dim x the dtype's bytes x tokens per block) with the model's sliding windows. `dtype`
    defaults to the config's (float32 when it names none). With `tensor_parallel_size` > 1,
    the config of one rank's manager: its share of the KV heads (see `engine.parallel`)."""
    data = config_dict(hf_config)
    dtype = dtype or config_dtype(data)
    if dtype not in _DTYPE_BYTES:
        raise ArgumentError(f"dtype={dtype!r} is invalid: must be one of {list(_DTYPE_BYTES)}")
    shape = hf_shape(data)
    check_int("tensor_parallel_size", tensor_parallel_size, 1)
    _, local_kv = kv_head_split(shape.num_heads, shape.num_kv_heads, tensor_parallel_size)
    shape = dataclasses.replace(shape, num_kv_heads=local_kv)
    configs = shape.layers(tokens_per_block, _DTYPE_BYTES[dtype])
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(gpu_quota), *(more_tiers or [])]
    return KVCacheManagerConfig(tokens_per_block, tiers, configs, **options)


def _activation(name: str) -> Any:
    if name in ("silu", "swish"):
        return torch.nn.functional.silu
    if name == "gelu":
        return torch.nn.functional.gelu
    if name == "relu":
        return torch.relu
    if name == "gelu_fast":
        return lambda x: 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))
    return lambda x: torch.nn.functional.gelu(x, approximate="tanh")  # gelu_new, _pytorch_tanh


class PagedDecoder:
    """Forward passes of one decoder whose KV cache is a kvpool manager."""

    def __init__(
        self,
        hf_config: Any,
        state_dict: dict[str, torch.Tensor],
        manager: KVCacheManager,
        dtype: torch.dtype | None = None,
        tensor_parallel: TensorParallel | None = None,
    ) -> None:
        """`dtype` (default: the config's, else float32) is the compute and KV dtype; the
        manager's buffers must be sized for it (`manager_config_from_hf` with the same dtype).
        With `tensor_parallel`, this rank computes its share of the heads and MLP columns
        (`state_dict` is the whole model's) and `manager` holds its KV heads only
        (`manager_config_from_hf(..., tensor_parallel_size=)`)."""
        spec = model_spec(hf_config, dtype)
        self.tp = (
            tensor_parallel if tensor_parallel is not None and tensor_parallel.size > 1 else None
        )
        if self.tp is not None:
            heads, kv_heads = kv_head_split(spec.heads, spec.kv_heads, self.tp.size)
            state_dict = shard_state_dict(
                state_dict, spec.num_layers, spec.heads, spec.kv_heads, spec.head_dim, self.tp
            )
            spec = dataclasses.replace(spec, heads=heads, kv_heads=kv_heads)
        self.spec: ModelSpec = spec
        self.manager = manager
        self.dtype = spec.dtype
        self.tpb = manager.tokens_per_block
        self._check_buffers(manager)
        pages = manager.page_view(0, "k")
        # Compute where the pages are: on the GPU when the GPU level is CUDA memory.
        self.device = pages.device if isinstance(pages, torch.Tensor) else torch.device("cpu")
        self.weights = {
            name: tensor.detach().to(self.device, self.dtype) for name, tensor in state_dict.items()
        }
        if "lm_head.weight" not in self.weights:
            self.weights["lm_head.weight"] = self.weights["model.embed_tokens.weight"]
        self.vocab_size = int(self.weights["model.embed_tokens.weight"].shape[0])
        self.act = _activation(spec.activation)
        rotaries: dict[Any, Rotary] = {}
        for params in spec.ropes:  # one rotary per distinct parameter set, shared by its layers
            if params not in rotaries:
                rotaries[params] = Rotary(params)
        self.rotary = [rotaries[params] for params in spec.ropes]
        limits = [p.reuse_limit for p in spec.ropes if p.reuse_limit is not None]
        # The longest prompt that may reuse cached KV or leave its KV for others (`rope`).
        self.reuse_limit: int | None = min(limits) if limits else None

    def _check_buffers(self, manager: KVCacheManager) -> None:
        spec = self.spec
        expected = spec.kv_heads * spec.head_dim * _DTYPE_BYTES[self.dtype] * self.tpb
        for layer in range(spec.num_layers):
            for role in ("k", "v"):
                size = manager.layout.placement(layer, role).size
                if size != expected:
                    raise ArgumentError(
                        f"dtype={self.dtype} is invalid for this manager: its ({layer}, {role!r}) "
                        f"buffers hold {size} bytes per block, {self.dtype} needs {expected} "
                        "(build the manager with manager_config_from_hf(..., dtype=) the same dtype)"
                    )

    # -- building blocks -------------------------------------------------------------------------

    def _w(self, name: str) -> torch.Tensor:
        return self.weights[name]

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        out = x @ self._w(name + ".weight").T
        bias = self.weights.get(name + ".bias")
        return out + bias if bias is not None else out

    def _reduced_linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """A linear layer whose input columns are split over the tensor-parallel ranks: the
        partial products are summed over the ranks, then the bias is added once."""
        out = x @ self._w(name + ".weight").T
        if self.tp is not None:
            out = self.tp.all_reduce(out)
        bias = self.weights.get(name + ".bias")
        return out + bias if bias is not None else out

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """RMSNorm as transformers computes it (in float32; Gemma scales by 1 + weight)."""
        hidden = x.to(torch.float32)
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.spec.norm_eps)
        weight = self._w(name + ".weight")
        if self.spec.norm_plus_one:
            return (hidden * (1.0 + weight.to(torch.float32))).to(x.dtype)
        return weight * hidden.to(x.dtype)

    def _pages(self, layer: int, role: str) -> torch.Tensor:
        """The layer's K or V pool as [rows, tokens per block, kv heads, head dim] of the dtype."""
        view = self.manager.page_view(layer, role)
        tensor = view if isinstance(view, torch.Tensor) else torch.from_numpy(np.asarray(view))
        spec = self.spec
        return tensor.view(self.dtype).view(-1, self.tpb, spec.kv_heads, spec.head_dim)

    # -- forward ---------------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, cache: KVCache, tokens: list[int]) -> torch.Tensor:
        """Compute `tokens` at positions history_length... of `cache` (whose capacity covers
        them): writes their K/V into the request's pages and returns logits [len(tokens), vocab]
        in float32, on the CPU."""
        if len(tokens) == 0:
            raise ArgumentError("tokens is empty: forward computes at least one token")
        spec = self.spec
        start = cache.history_length
        positions = torch.arange(start, start + len(tokens), device=self.device)
        ids = torch.tensor(tokens, dtype=torch.long).to(self.device)
        x = self._w("model.embed_tokens.weight")[ids]
        if spec.embed_scale is not None:
            x = x * torch.tensor(spec.embed_scale).to(self.device, self.dtype)
        for layer in range(spec.num_layers):
            prefix = f"model.layers.{layer}."
            h = self._norm(x, prefix + "input_layernorm")
            h = self._attention(cache, layer, h, positions)
            if spec.sandwich_norms:
                x = x + self._norm(h, prefix + "post_attention_layernorm")
                h = self._norm(x, prefix + "pre_feedforward_layernorm")
                x = x + self._norm(self._mlp(h, prefix), prefix + "post_feedforward_layernorm")
            else:
                x = x + h
                x = x + self._mlp(self._norm(x, prefix + "post_attention_layernorm"), prefix)
        x = self._norm(x, "model.norm")
        logits = x @ self._w("lm_head.weight").T
        if spec.final_softcap is not None:
            logits = torch.tanh(logits / spec.final_softcap) * spec.final_softcap
        return logits.to("cpu", torch.float32)

    def _mlp(self, h: torch.Tensor, prefix: str) -> torch.Tensor:
        gate = self._linear(h, prefix + "mlp.gate_proj")
        up = self._linear(h, prefix + "mlp.up_proj")
        return self._reduced_linear(self.act(gate) * up, prefix + "mlp.down_proj")

    def _attention(
        self, cache: KVCache, layer: int, h: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        spec = self.spec
        prefix = f"model.layers.{layer}.self_attn."
        n = h.shape[0]
        q = self._linear(h, prefix + "q_proj").view(n, spec.heads, spec.head_dim)
        k = self._linear(h, prefix + "k_proj").view(n, spec.kv_heads, spec.head_dim)
        v = self._linear(h, prefix + "v_proj").view(n, spec.kv_heads, spec.head_dim)
        if spec.qk_norm:
            q, k = self._norm(q, prefix + "q_norm"), self._norm(k, prefix + "k_norm")
        cos, sin = self.rotary[layer].cos_sin(positions, self.dtype, int(positions[-1]) + 1)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        k_pages, v_pages = self._pages(layer, "k"), self._pages(layer, "v")
        rows = torch.from_numpy(cache.get_page_indices(layer, "k").astype(np.int64))
        v_rows = torch.from_numpy(cache.get_page_indices(layer, "v").astype(np.int64))
        rows, v_rows = rows.to(self.device), v_rows.to(self.device)
        block, offset = positions // self.tpb, positions % self.tpb
        k_pages[rows[block], offset] = k
        v_pages[v_rows[block], offset] = v
        # Gather every earlier position that still has a page (a window drops old blocks).
        end = int(positions[-1]) + 1
        seen = torch.arange(end, device=self.device)
        seen = seen[rows[seen // self.tpb] >= 0]
        keys = k_pages[rows[seen // self.tpb], seen % self.tpb]  # [m, kv heads, dim]
        values = v_pages[v_rows[seen // self.tpb], seen % self.tpb]
        group = spec.heads // spec.kv_heads
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, keys) * spec.attn_scale
        if spec.attn_softcap is not None:
            scores = torch.tanh(scores / spec.attn_softcap) * spec.attn_softcap
        allowed = seen[None, :] <= positions[:, None]
        window = spec.windows[layer]
        if window is not None:
            allowed &= positions[:, None] - seen[None, :] < window
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(self.dtype)
        out = torch.einsum("hqk,khd->qhd", weights, values).reshape(n, -1)
        return self._reduced_linear(out, prefix + "o_proj")

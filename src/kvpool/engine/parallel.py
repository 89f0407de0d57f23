"""Tensor parallelism for the reference engine, as engines split a decoder: each rank computes
its share of the attention heads (and of the KV heads, which are replicated when there are fewer
than ranks) and of the MLP's intermediate columns; the output and down projections are summed
over the ranks (one all-reduce each). Each rank's KV-cache manager holds only its KV heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kvpool.errors import ArgumentError


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group."""

    rank: int
    size: int
    group: Any = None  # a torch.distributed process group; None: the default group

    @classmethod
    def of(cls, group: Any = None) -> TensorParallel:
        """The calling process's rank and the size of `group` (torch.distributed must be
        initialized)."""
        if not dist.is_available() or not dist.is_initialized():
            raise ArgumentError(
                "tensor parallelism needs torch.distributed initialized "
                "(torch.distributed.init_process_group, or a launch by torchrun)"
            )
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the group (reduced in float32, returned in `x`'s dtype)."""
        total = x.to(torch.float32)
        dist.all_reduce(total, group=self.group)
        return total.to(x.dtype)


def kv_head_split(num_heads: int, num_kv_heads: int, size: int) -> tuple[int, int]:
    """(query heads, KV heads) per rank for a group of `size` ranks; KV heads are split when
    `size` divides them and replicated (one per rank) when they divide `size`."""
    if size < 1:
        raise ArgumentError(f"tensor_parallel_size={size} is invalid: must be >= 1")
    if num_heads % size:
        raise ArgumentError(
            f"num_attention_heads={num_heads} is invalid for tensor_parallel_size={size}: "
            "must be a multiple of it"
        )
    if num_kv_heads % size == 0:
        return num_heads // size, num_kv_heads // size
    if size % num_kv_heads == 0:
        return num_heads // size, 1
    raise ArgumentError(
        f"num_key_value_heads={num_kv_heads} is invalid for tensor_parallel_size={size}: "
        "one must divide the other"
    )


def shard_state_dict(
    state_dict: dict[str, torch.Tensor],
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    tp: TensorParallel,
) -> dict[str, torch.Tensor]:
    """This rank's weights: its query heads' rows of q_proj (and columns of o_proj), its KV
    heads' rows of k_proj/v_proj, its share of gate_proj/up_proj rows (and biases, with
    `mlp_bias`) and down_proj columns. Everything else (embeddings, norms, lm_head, the o/down
    biases: added once, after the all-reduce) is kept whole."""
    local_heads, local_kv = kv_head_split(num_heads, num_kv_heads, tp.size)
    q = slice(tp.rank * local_heads * head_dim, (tp.rank + 1) * local_heads * head_dim)
    if num_kv_heads % tp.size == 0:
        first_kv = tp.rank * local_kv
    else:
        first_kv = tp.rank // (tp.size // num_kv_heads)
    kv = slice(first_kv * head_dim, (first_kv + local_kv) * head_dim)
    shards = {}
    for layer in range(num_layers):
        attn, mlp = f"model.layers.{layer}.self_attn.", f"model.layers.{layer}.mlp."
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            for kind in ("weight", "bias"):
                key = f"{attn}{name}.{kind}"
                if key in state_dict:
                    shards[key] = state_dict[key][rows]
        shards[attn + "o_proj.weight"] = state_dict[attn + "o_proj.weight"][:, q]
        intermediate = state_dict[mlp + "gate_proj.weight"].shape[0]
        if intermediate % tp.size:
            raise ArgumentError(
                f"intermediate_size={intermediate} is invalid for tensor_parallel_size="
                f"{tp.size}: must be a multiple of it"
            )
        part = intermediate // tp.size
        columns = slice(tp.rank * part, (tp.rank + 1) * part)
        for name in ("gate_proj", "up_proj"):  # (their rows and biases: this rank's columns)
            for kind in ("weight", "bias"):
                key = f"{mlp}{name}.{kind}"
                if key in state_dict:
                    shards[key] = state_dict[key][columns]
        shards[mlp + "down_proj.weight"] = state_dict[mlp + "down_proj.weight"][:, columns]
    return {**state_dict, **shards}


__all__ = ["TensorParallel", "kv_head_split", "shard_state_dict"]

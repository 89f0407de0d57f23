"""Whose KV a stored page is: the model's identity (`kvpool.integrations.identity`) and the
part of the model's KV this rank holds.

SGLang's page keys are chained token hashes: the same prompt gives the same keys for any model.
kvpool puts the model identity and the rank's shard into every key (the reuse scope, the remote
tier's namespace, the persistent disk level's id), so a page is only ever read by a process
computing the same model with the same page format and the same heads.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from kvpool.integrations.identity import (
    ModelIdentity,
    WeightsFingerprint,
    explicit_identity,
    fingerprint_weights,
    model_identity,
)
from kvpool.integrations.sglang.pages import PageFormat

log = logging.getLogger("kvpool.sglang")


@dataclass(frozen=True)
class Shard:
    """The part of each page this rank stores: `index` numbers it among the model's shards
    (0 for all ranks of a rank-replicated MLA model), `label` names it in paths and logs."""

    index: int
    label: str


def rank_shard(storage_config: Any) -> Shard:
    """Non-MLA: each tensor-parallel rank holds its own KV heads, a shard of its own. MLA: the
    latent KV is the same on every rank, one shard. Context-parallel ranks hold disjoint
    slices of every page."""
    tp_rank, tp_size = int(storage_config.tp_rank), int(storage_config.tp_size)
    cp_rank, cp_size = int(storage_config.attn_cp_rank), int(storage_config.attn_cp_size)
    if storage_config.is_mla_model:
        tp_rank, tp_size = 0, 1
    index = cp_rank * tp_size + tp_rank
    return Shard(index, f"tp{tp_rank}of{tp_size}-cp{cp_rank}of{cp_size}")


def state_shard(storage_config: Any) -> Shard:
    """A Mamba state pool's shard: its state is split over tensor-parallel ranks even when the
    model's KV is MLA (the same on every rank)."""
    tp_rank, tp_size = int(storage_config.tp_rank), int(storage_config.tp_size)
    cp_rank, cp_size = int(storage_config.attn_cp_rank), int(storage_config.attn_cp_size)
    return Shard(cp_rank * tp_size + tp_rank, f"tp{tp_rank}of{tp_size}-cp{cp_rank}of{cp_size}")


def sglang_identity(storage_config: Any, page: PageFormat, model_id: str | None) -> ModelIdentity:
    """The identity of the model this SGLang process computes with: `model_id` if given; else
    the model's config and weights when SGLang's model name is a local directory; else the
    name (the description says the weights were not fingerprinted)."""
    parts: dict[str, object] = {
        **page.identity_parts(),
        "sglang.tp_size": int(storage_config.tp_size),
        "sglang.pp_rank": int(storage_config.pp_rank),
        "sglang.pp_size": int(storage_config.pp_size),
        "sglang.mla": bool(storage_config.is_mla_model),
    }
    if model_id is not None:
        return explicit_identity(model_id, **parts)
    name = storage_config.model_name or ""
    config: dict[str, Any] = {}
    weights: WeightsFingerprint | None = None
    if name and os.path.isdir(name):
        path = os.path.join(name, "config.json")
        try:
            with open(path) as file:
                loaded = json.load(file)
            config = loaded if isinstance(loaded, dict) else {}
        except (OSError, ValueError) as error:
            log.warning("kvpool: cannot read %s: %s", path, error)
        try:
            weights = fingerprint_weights(name)
        except (OSError, ValueError) as error:
            log.warning("kvpool: cannot fingerprint the weights at %s: %s", name, error)
    if weights is None:
        parts["sglang.model"] = name
    return model_identity(config, weights, **parts)


__all__ = ["Shard", "rank_shard", "sglang_identity", "state_shard"]

"""The model identity a vLLM engine's kvpool keys carry (`kvpool.integrations.identity`): vLLM's
model config as it runs (after its overrides), a fingerprint of the weights vLLM loaded, the
dtypes, the quantization, the page format and the parallel layout; or the user's `model_id`."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from kvpool.integrations.identity import (
    ModelIdentity,
    WeightsFingerprint,
    explicit_identity,
    fingerprint_weights,
    model_identity,
)
from kvpool.integrations.vllm.settings import PageFormat

log = logging.getLogger("kvpool.vllm")


def weights_location(model_config: Any, load_config: Any) -> str | None:
    """Where the weights vLLM loaded are on this machine: the model's path, or its snapshot
    in the hub cache (the workers downloaded it before the scheduler starts); None if
    neither (weights streamed from object storage, say)."""
    model = str(model_config.model)
    if os.path.exists(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return str(
            snapshot_download(
                repo_id=model,
                revision=getattr(model_config, "revision", None),
                cache_dir=getattr(load_config, "download_dir", None),
                local_files_only=True,
            )
        )
    except Exception:  # (not in the cache, no hub library, not a hub name)
        return None


def _page_parts(page: PageFormat) -> dict[str, object]:
    parts: dict[str, object] = {"page.block_size": page.block_size, "page.tp_size": page.tp_size}
    # (not tp_rank: every rank writes its own heads of one page, not a difference)
    for g, group in enumerate(page.groups):
        for key, value in sorted(dataclasses.asdict(group).items()):
            parts[f"page.group{g}.{key}"] = value
    return parts


def vllm_model_identity(vllm_config: Any, page: PageFormat, model_id: str | None) -> ModelIdentity:
    """The identity of the model this engine computes with (see the module docstring)."""
    model_config = vllm_config.model_config
    parts: dict[str, object] = {
        "dtype": str(model_config.dtype),
        "kv_cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "quantization": str(getattr(model_config, "quantization", None)),
        "tensor_parallel_size": int(vllm_config.parallel_config.tensor_parallel_size),
        "pipeline_parallel_size": int(vllm_config.parallel_config.pipeline_parallel_size),
        **_page_parts(page),
    }
    if model_id is not None:
        return explicit_identity(model_id, **parts)
    weights: WeightsFingerprint | None = None
    location = weights_location(model_config, vllm_config.load_config)
    if location is not None:
        try:
            weights = fingerprint_weights(location)
        except (OSError, ValueError) as error:
            log.warning("kvpool: cannot fingerprint the weights at %s: %s", location, error)
    if weights is None:  # the name and revision stand in, and the log says so
        parts["model"] = str(model_config.model)
        parts["revision"] = str(getattr(model_config, "revision", None))
    config = model_config.hf_config.to_dict()
    return model_identity(config, weights, **parts)


__all__ = ["vllm_model_identity", "weights_location"]

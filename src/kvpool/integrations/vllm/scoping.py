"""How a vLLM request's KV is scoped in kvpool: vLLM's own prefix-cache scoping (the LoRA
adapter, by its identity, and the request's cache salt), and which requests' KV is a function
of their token ids at all."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvpool.config import ReuseScope
from kvpool.integrations.identity import fingerprint_weights, model_identity


class AdapterIdentities:
    """The identity of each LoRA adapter (its config and a fingerprint of its weights), found
    once per adapter. vLLM's `lora_int_id` is a number a server's user picks: another server,
    or this one after a restart, may give the same number to another adapter, so keys that
    outlive the process (the shared tier, a persistent disk) carry the adapter's identity."""

    def __init__(self) -> None:
        self._known: dict[tuple[int, str, str], str] = {}

    def of(self, lora: Any) -> str:
        path = str(getattr(lora, "lora_path", "") or getattr(lora, "path", "") or "")
        key = (int(lora.lora_int_id), str(getattr(lora, "lora_name", "")), path)
        found = self._known.get(key)
        if found is None:
            try:
                weights = fingerprint_weights(path)
                config = Path(path, "adapter_config.json")
                settings = config.read_text() if config.is_file() else ""
                found = model_identity({"adapter_config": settings}, weights).digest
            except (OSError, ValueError):  # (no local files: the name and path stand in)
                found = model_identity({"lora_name": key[1], "lora_path": path}, None).digest
            self._known[key] = found
        return found


def reuse_scope(request: Any, adapters: AdapterIdentities) -> ReuseScope:
    """vLLM's prefix-cache scoping: the LoRA adapter (its id, with its identity in the salt)
    and the request's cache salt."""
    lora = getattr(request, "lora_request", None)
    if lora is None:
        return ReuseScope(lora_id=None, salt=request.cache_salt)
    salt = f"lora:{adapters.of(lora)}"
    if request.cache_salt is not None:
        salt += f"|salt:{request.cache_salt}"
    return ReuseScope(lora_id=int(lora.lora_int_id), salt=salt)


def reusable(request: Any) -> bool:
    """Token ids say everything about the request's KV (no images, no prompt embeddings)."""
    return (
        not getattr(request, "mm_features", None)
        and getattr(request, "prompt_embeds", None) is None
    )


__all__ = ["AdapterIdentities", "reusable", "reuse_scope"]

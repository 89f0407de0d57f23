"""Model layouts for replays: the built-in presets, or a Hugging Face `config.json`."""

from __future__ import annotations

import json
import os

from kvpool.config import LayerConfig
from kvpool.errors import ArgumentError
from kvpool.presets import PRESETS, hf_shape

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def preset_layers(name: str, tokens_per_block: int) -> list[LayerConfig]:
    try:
        return PRESETS[name].layers(tokens_per_block)
    except KeyError:
        raise ArgumentError(
            f"model={name!r} is invalid: must be one of {sorted(PRESETS)}"
        ) from None


def hf_config_layers(path: str | os.PathLike[str], tokens_per_block: int) -> list[LayerConfig]:
    """K and V buffers per layer from a transformers `config.json` (no hub access): layers,
    KV heads, head dim and dtype, and the sliding windows of Mistral-, Qwen2- and Gemma-style
    configs (`sliding_window` with `layer_types`, `sliding_window_pattern` or
    `use_sliding_window`/`max_window_layers`)."""
    if not os.path.isfile(path):
        raise ArgumentError(f"hf_config={os.fspath(path)!r} is invalid: no such file")
    try:
        with open(path, encoding="utf-8") as file:
            config = json.load(file)
        shape = hf_shape(config)
    except (ValueError, KeyError, TypeError) as error:
        raise ArgumentError(
            f"hf_config={os.fspath(path)!r} is invalid: {error!r} missing or malformed"
        ) from None
    config = config.get("text_config", config)
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return shape.layers(tokens_per_block, _DTYPE_BYTES.get(dtype, 2))

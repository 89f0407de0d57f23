"""Model layouts for replays: the built-in presets, or a Hugging Face `config.json`."""

from __future__ import annotations

import json
import os
from typing import Any

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


def read_hf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A transformers `config.json` (or a model directory holding one) as a dict; every problem
    is an `ArgumentError` naming `hf_config`."""
    name = os.fspath(path)
    if os.path.isdir(name):
        name = os.path.join(name, "config.json")
    if not os.path.isfile(name):
        raise ArgumentError(
            f"hf_config={os.fspath(path)!r} is invalid: must be a config.json file or a model "
            "directory holding one"
        )
    try:
        with open(name, encoding="utf-8") as file:
            config = json.load(file)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ArgumentError(f"hf_config={name!r} is invalid: not a JSON file ({error})") from None
    if not isinstance(config, dict):
        raise ArgumentError(
            f"hf_config={name!r} is invalid: must hold a JSON object, not a {type(config).__name__}"
        )
    return config


def hf_dtype_bytes(config: dict[str, Any]) -> int:
    """Bytes per K/V element from the config's dtype (bfloat16 when it names none)."""
    text = config.get("text_config", config)
    dtype = text.get("torch_dtype") or text.get("dtype") or "bfloat16"
    if dtype not in _DTYPE_BYTES:
        raise ArgumentError(
            f"torch_dtype={dtype!r} is invalid: must be one of {sorted(_DTYPE_BYTES)}"
        )
    return _DTYPE_BYTES[dtype]


def hf_config_layers(path: str | os.PathLike[str], tokens_per_block: int) -> list[LayerConfig]:
    """K and V buffers per layer from a transformers `config.json` (no hub access): layers,
    KV heads, head dim and dtype, and the sliding windows of Mistral-, Qwen2- and Gemma-style
    configs (`sliding_window` with `layer_types`, `sliding_window_pattern` or
    `use_sliding_window`/`max_window_layers`)."""
    config = read_hf_config(path)
    try:
        shape = hf_shape(config)
        dtype_bytes = hf_dtype_bytes(config)
    except ArgumentError as error:
        raise ArgumentError(f"hf_config {os.fspath(path)!r}: {error}") from None
    return shape.layers(tokens_per_block, dtype_bytes)

"""Model layouts for replays: the built-in presets, or a Hugging Face `config.json`."""

from __future__ import annotations

import json
import os

from kvpool.config import AttentionLayerConfig, BufferConfig, LayerConfig
from kvpool.errors import ArgumentError
from kvpool.presets import PRESETS

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
        config = config.get("text_config", config)  # multimodal wrappers
        num_layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (ValueError, KeyError, TypeError) as error:
        raise ArgumentError(
            f"hf_config={os.fspath(path)!r} is invalid: {error!r} missing or malformed"
        ) from None
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    size = kv_heads * head_dim * _DTYPE_BYTES.get(dtype, 2) * tokens_per_block
    windows = _windows(config, num_layers)
    return [
        AttentionLayerConfig(
            i, [BufferConfig("k", size), BufferConfig("v", size)], sliding_window_size=windows[i]
        )
        for i in range(num_layers)
    ]


def _windows(config: dict[str, object], num_layers: int) -> list[int | None]:
    window = config.get("sliding_window")
    if not isinstance(window, int) or window <= 0:
        return [None] * num_layers
    types = config.get("layer_types")
    if isinstance(types, list) and len(types) == num_layers:
        return [window if kind == "sliding_attention" else None for kind in types]
    pattern = config.get("sliding_window_pattern")
    if isinstance(pattern, int) and pattern > 0:  # every pattern-th layer is global
        return [None if (i + 1) % pattern == 0 else window for i in range(num_layers)]
    if config.get("use_sliding_window") is False:
        return [None] * num_layers
    first_windowed = config.get("max_window_layers") if config.get("use_sliding_window") else None
    if isinstance(first_windowed, int):  # Qwen2: layers from max_window_layers on use the window
        return [window if i >= first_windowed else None for i in range(num_layers)]
    return [window] * num_layers

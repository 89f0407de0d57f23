"""Built-in model layouts, for `kvpool info` and examples.

Per-block buffer sizes follow from the model's shape: bytes per token of K (or V) =
num_kv_heads x head_dim x bytes per element.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpool.config import AttentionLayerConfig, BufferConfig, LayerConfig


@dataclass(frozen=True)
class ModelPreset:
    """The KV-relevant shape of a model."""

    name: str
    description: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    sliding_window: int | None = None
    # Every `full_attention_every`-th layer uses full attention when the model has a window;
    # None means every layer has the window.
    full_attention_every: int | None = None

    def window_of(self, layer_id: int) -> int | None:
        if self.sliding_window is None:
            return None
        if (
            self.full_attention_every is not None
            and (layer_id + 1) % self.full_attention_every == 0
        ):
            return None
        return self.sliding_window

    def layers(self, tokens_per_block: int) -> list[LayerConfig]:
        """One attention layer config per layer, with K and V buffers of one token block each."""
        size = self.num_kv_heads * self.head_dim * self.dtype_bytes * tokens_per_block
        return [
            AttentionLayerConfig(
                layer_id,
                [BufferConfig("k", size), BufferConfig("v", size)],
                sliding_window_size=self.window_of(layer_id),
            )
            for layer_id in range(self.num_layers)
        ]


PRESETS: dict[str, ModelPreset] = {
    preset.name: preset
    for preset in (
        ModelPreset("llama-3-8b", "Llama-style, 32 full-attention layers", 32, 8, 128),
        ModelPreset(
            "gemma-3-1b",
            "Gemma-style hybrid: 5 sliding-window (512) layers per full-attention layer",
            26,
            1,
            256,
            sliding_window=512,
            full_attention_every=6,
        ),
        ModelPreset(
            "mistral-7b",
            "Mistral-style, 32 sliding-window (4096) layers",
            32,
            8,
            128,
            sliding_window=4096,
        ),
    )
}


@dataclass(frozen=True)
class HfShape:
    """The KV-relevant shape of a transformers model config."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    windows: tuple[int | None, ...]  # per layer

    def layers(self, tokens_per_block: int, dtype_bytes: int) -> list[LayerConfig]:
        """One K and one V buffer per layer, with the layer's window."""
        size = self.num_kv_heads * self.head_dim * dtype_bytes * tokens_per_block
        return [
            AttentionLayerConfig(
                i, [BufferConfig("k", size), BufferConfig("v", size)], sliding_window_size=window
            )
            for i, window in enumerate(self.windows)
        ]


def hf_shape(config: dict[str, Any]) -> HfShape:
    """Layers, heads, KV heads, head dim and per-layer sliding windows of a transformers config
    dict (Mistral `sliding_window`; Gemma `layer_types` or `sliding_window_pattern`; Qwen2
    `use_sliding_window` / `max_window_layers`). KeyError/ValueError/TypeError if malformed."""
    config = config.get("text_config", config)  # multimodal wrappers
    num_layers = int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    return HfShape(num_layers, heads, kv_heads, head_dim, tuple(_windows(config, num_layers)))


def _windows(config: dict[str, Any], num_layers: int) -> list[int | None]:
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

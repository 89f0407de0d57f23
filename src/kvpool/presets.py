"""Built-in model layouts, for `kvpool info` and examples.

Per-block buffer sizes follow from the model's shape: bytes per token of K (or V) =
num_kv_heads x head_dim x bytes per element.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpool.config import AttentionLayerConfig, BufferConfig, LayerConfig
from kvpool.validation import check_int, fail


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


LAYER_TYPES = {"full_attention": False, "sliding_attention": True}
"""The transformers `layer_types` kvpool lays out (value: whether the layer has the window)."""


def hf_shape(config: object) -> HfShape:
    """Layers, heads, KV heads, head dim and per-layer sliding windows of a transformers config
    dict (Mistral `sliding_window`; Gemma `layer_types` or `sliding_window_pattern`; Qwen2
    `use_sliding_window` / `max_window_layers`). Anything missing, malformed or inconsistent
    raises `ArgumentError` naming the field and its value."""
    if not isinstance(config, dict):
        fail("config", type(config).__name__, "a JSON object (a transformers config.json)")
    text = config.get("text_config", config)  # multimodal wrappers
    if not isinstance(text, dict):
        fail("text_config", text, "a JSON object")
    num_layers = _positive(text, "num_hidden_layers")
    heads = _positive(text, "num_attention_heads")
    kv_heads = _positive(text, "num_key_value_heads", default=heads)
    if heads % kv_heads:
        fail("num_key_value_heads", kv_heads, f"a divisor of num_attention_heads={heads}")
    if text.get("head_dim") is not None:
        head_dim = _positive(text, "head_dim")
    else:
        hidden = _positive(text, "hidden_size")
        if hidden % heads:
            fail(
                "hidden_size",
                hidden,
                f"a multiple of num_attention_heads={heads} (or set head_dim)",
            )
        head_dim = hidden // heads
    return HfShape(num_layers, heads, kv_heads, head_dim, tuple(_windows(text, num_layers)))


def _positive(config: dict[str, Any], name: str, default: int | None = None) -> int:
    value = config.get(name, default)
    if value is None and default is not None:
        value = default
    if value is None:
        fail(name, "missing", "an integer >= 1")
    return check_int(name, value, 1)


def _windows(config: dict[str, Any], num_layers: int) -> list[int | None]:
    window = config.get("sliding_window")
    if window is None:
        types = config.get("layer_types")
        if isinstance(types, list) and any(LAYER_TYPES.get(t) for t in types):
            fail("sliding_window", window, "an integer >= 1 when layer_types has sliding layers")
        return [None] * num_layers
    check_int("sliding_window", window, 1)
    types = config.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers:
            count = len(types) if isinstance(types, list) else type(types).__name__
            fail(
                "layer_types",
                f"<{count} entries>",
                f"a list of one entry per layer (num_hidden_layers={num_layers})",
            )
        for i, kind in enumerate(types):
            if kind not in LAYER_TYPES:
                fail(f"layer_types[{i}]", kind, f"one of {sorted(LAYER_TYPES)}")
        return [window if LAYER_TYPES[kind] else None for kind in types]
    pattern = config.get("sliding_window_pattern")
    if pattern is not None:  # every pattern-th layer is global
        check_int("sliding_window_pattern", pattern, 1)
        return [None if (i + 1) % pattern == 0 else window for i in range(num_layers)]
    use = config.get("use_sliding_window")
    if use is not None and not isinstance(use, bool):
        fail("use_sliding_window", use, "true or false")
    if use is False:
        return [None] * num_layers
    first_windowed = config.get("max_window_layers") if use else None
    if first_windowed is not None:  # Qwen2: layers from max_window_layers on use the window
        check_int("max_window_layers", first_windowed, 0, num_layers)
        return [window if i >= first_windowed else None for i in range(num_layers)]
    return [window] * num_layers

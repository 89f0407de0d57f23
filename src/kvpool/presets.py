"""Built-in model layouts, for `kvpool info` and examples.

Per-block buffer sizes follow from the model's shape: bytes per token of K (or V) =
num_kv_heads x head_dim x bytes per element.
"""

from __future__ import annotations

from dataclasses import dataclass

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

"""What the reference decoder needs from a transformers config, checked: the model family's
layer recipe (norms, embedding scale, attention scaling and soft-capping, query/key norms), the
activation, the RoPE of every layer, the sliding windows and the dtype.

Supported families (`model_type`): llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3 /
gemma3_text. Anything else, or a feature the decoder does not implement, raises `ArgumentError`
naming the config field and its value, at construction: the decoder never computes silently
wrong output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from kvpool.engine.rope import RopeParameters, rope_parameters
from kvpool.presets import hf_shape
from kvpool.validation import fail

LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")
GEMMA = ("gemma", "gemma2", "gemma3", "gemma3_text")
ACTIVATIONS = ("silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "relu")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    num_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden_size: int
    windows: tuple[int | None, ...]
    ropes: tuple[RopeParameters, ...]  # per layer
    activation: str
    norm_eps: float
    norm_plus_one: bool  # Gemma: x * (1 + w), computed in float32
    sandwich_norms: bool  # Gemma 2/3: norms after attention and around the MLP
    qk_norm: bool  # Qwen3, Gemma 3: RMSNorm of each query and key head
    embed_scale: float | None  # Gemma: embeddings times sqrt(hidden_size)
    attn_scale: float
    attn_softcap: float | None
    final_softcap: float | None
    dtype: torch.dtype

    @property
    def is_gemma(self) -> bool:
        return self.model_type in GEMMA


def _number(config: dict[str, Any], name: str, default: float | None = None) -> float | None:
    value = config.get(name, default)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        fail(name, value, "a finite number > 0")
    return float(value)


def config_dict(hf_config: Any) -> dict[str, Any]:
    """A transformers config (object or dict) as a dict; a multimodal wrapper's text part."""
    data = hf_config.to_dict() if hasattr(hf_config, "to_dict") else hf_config
    if not isinstance(data, dict):
        fail("hf_config", type(hf_config).__name__, "a transformers config or a dict")
    text = data.get("text_config")
    if isinstance(text, dict):
        text = {**text, "model_type": text.get("model_type") or data.get("model_type")}
        return text
    return dict(data)


def config_dtype(config: dict[str, Any]) -> torch.dtype:
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    name = str(name).removeprefix("torch.")
    if name not in DTYPES:
        fail("dtype", name, f"one of {sorted(DTYPES)}")
    return DTYPES[name]


def model_spec(hf_config: Any, dtype: torch.dtype | None = None) -> ModelSpec:
    """The checked `ModelSpec` of a transformers config; `dtype` overrides the config's."""
    config = config_dict(hf_config)
    model_type = config.get("model_type")
    if model_type not in LLAMA_LIKE + GEMMA:
        fail("model_type", model_type, f"one of {sorted(LLAMA_LIKE + GEMMA)}")
    shape = hf_shape(config)
    hidden = int(config["hidden_size"])
    if config.get("use_bidirectional_attention"):
        fail(
            "use_bidirectional_attention",
            config["use_bidirectional_attention"],
            "false (not supported)",
        )
    if config.get("pretraining_tp", 1) not in (1, None):
        fail("pretraining_tp", config["pretraining_tp"], "1 (not supported)")
    activation = config.get("hidden_activation") or config.get("hidden_act") or "silu"
    if activation not in ACTIVATIONS:
        fail("hidden_act", activation, f"one of {list(ACTIVATIONS)}")
    gemma = model_type in GEMMA
    max_pos = int(config.get("max_position_embeddings") or 2048)
    ropes = _ropes(config, shape.head_dim, max_pos, shape.num_layers)
    if gemma:
        scalar = _number(config, "query_pre_attn_scalar", shape.head_dim)
        assert scalar is not None
        attn_scale = scalar**-0.5
    else:
        attn_scale = shape.head_dim**-0.5
    resolved = dtype or config_dtype(config)
    if resolved not in DTYPES.values():
        fail("dtype", resolved, f"one of {sorted(DTYPES)}")
    return ModelSpec(
        model_type=model_type,
        num_layers=shape.num_layers,
        heads=shape.num_heads,
        kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        hidden_size=hidden,
        windows=shape.windows,
        ropes=ropes,
        activation=activation,
        norm_eps=float(config.get("rms_norm_eps") or 1e-6),
        norm_plus_one=gemma,
        sandwich_norms=model_type in ("gemma2", "gemma3", "gemma3_text"),
        qk_norm=model_type in ("qwen3", "gemma3", "gemma3_text"),
        embed_scale=hidden**0.5 if gemma else None,
        attn_scale=attn_scale,
        attn_softcap=_number(config, "attn_logit_softcapping") if gemma else None,
        final_softcap=_number(config, "final_logit_softcapping") if gemma else None,
        dtype=resolved,
    )


def _ropes(
    config: dict[str, Any], head_dim: int, max_pos: int, num_layers: int
) -> tuple[RopeParameters, ...]:
    """Per layer: the RoPE parameters of its layer type (transformers 5's `rope_parameters`, a
    dict or one dict per layer type; older configs' `rope_theta` + `rope_scaling`, and Gemma 3's
    `rope_local_base_freq` for its sliding layers)."""
    types = config.get("layer_types") or ["full_attention"] * num_layers
    params = config.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        per_type = {
            kind: rope_parameters(p, head_dim, max_pos, f"rope_parameters.{kind}")
            for kind, p in params.items()
        }
        missing = sorted(set(types) - set(per_type))
        if missing:
            fail(
                "rope_parameters",
                sorted(per_type),
                f"parameters for every layer type ({missing} missing)",
            )
        return tuple(per_type[kind] for kind in types)
    if isinstance(params, dict) and params:
        one = rope_parameters(params, head_dim, max_pos, "rope_parameters")
        return (one,) * num_layers
    scaling = config.get("rope_scaling") or {}
    legacy = {**scaling, "rope_theta": config.get("rope_theta", 10000.0)}
    if scaling and "rope_type" not in scaling and "type" not in scaling:
        fail("rope_scaling", scaling, "a dict with rope_type")
    global_rope = rope_parameters(legacy, head_dim, max_pos, "rope_scaling")
    local_base = config.get("rope_local_base_freq")
    if local_base is None:
        return (global_rope,) * num_layers
    local = rope_parameters({"rope_theta": local_base}, head_dim, max_pos, "rope_local_base_freq")
    return tuple(local if kind == "sliding_attention" else global_rope for kind in types)

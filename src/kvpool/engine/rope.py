"""Rotary position embeddings as transformers defines them: the inverse frequencies of the
`default`, `linear`, `dynamic`, `llama3`, `yarn` and `longrope` types.

Two types are length-dependent: a forward pass's frequencies depend on the length the sequence
has reached (`dynamic` past `max_position_embeddings`, `longrope` past its
`original_max_position_embeddings`), and the keys cached earlier keep theirs. Here that length
is each request's own (transformers keeps one state for its whole batch: a request's output
would depend on its neighbours). KV computed under other frequencies than a prompt's own is not
that prompt's KV, so reusing it is only sound below `reuse_limit` (see `engine.generator`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from kvpool.validation import fail

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
_REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("original_max_position_embeddings",),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}


@dataclass(frozen=True)
class RopeParameters:
    """One set of RoPE parameters (a model has one, or one per layer type)."""

    rope_type: str
    theta: float
    head_dim: int
    max_position_embeddings: int
    options: dict[str, Any] = field(default_factory=dict)  # the type's own parameters

    def __hash__(self) -> int:
        return hash((self.rope_type, self.theta, self.head_dim, self.max_position_embeddings))

    @property
    def reuse_limit(self) -> int | None:
        """For a length-dependent type, the longest sequence still computed with the original
        frequencies whatever came before (transformers' dynamic state stays scaled at exactly
        its threshold after a longer sequence: one less); None: the frequencies never change."""
        if self.rope_type == "dynamic":
            return self.max_position_embeddings - 1
        if self.rope_type == "longrope":
            return int(self.options["original_max_position_embeddings"])
        return None


def rope_parameters(
    params: dict[str, Any], head_dim: int, max_position_embeddings: int, where: str
) -> RopeParameters:
    """Checked parameters from a transformers `rope_parameters` (or legacy `rope_scaling`) dict;
    `where` names the config field in errors."""
    if not isinstance(params, dict):
        fail(where, params, "a dict of RoPE parameters")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        fail(
            f"{where}.rope_type", rope_type, f"one of {list(ROPE_TYPES)} (others are not supported)"
        )
    theta = params.get("rope_theta", 10000.0)
    if not isinstance(theta, int | float) or isinstance(theta, bool) or theta <= 1:
        fail(f"{where}.rope_theta", theta, "a number > 1")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        fail(
            f"{where}.partial_rotary_factor", params["partial_rotary_factor"], "1.0 (not supported)"
        )
    for name in _REQUIRED.get(rope_type, ()):
        if params.get(name) is None:
            fail(f"{where}.{name}", None, f"set for rope_type {rope_type!r}")
    options = {
        key: value
        for key, value in params.items()
        if key not in ("rope_type", "type", "rope_theta", "partial_rotary_factor")
    }
    return RopeParameters(rope_type, float(theta), head_dim, max_position_embeddings, options)


def reuse_limit_of(config: dict[str, Any]) -> int | None:
    """`RopeParameters.reuse_limit` of a transformers config (a dict), the least over its
    layer types; read leniently (only the length-dependent types matter), for models the
    reference decoder does not run (the transformers integration)."""
    max_pos = int(config.get("max_position_embeddings") or 2048)
    found: list[dict[str, Any]] = []
    for source in (config.get("rope_parameters"), config.get("rope_scaling")):
        if isinstance(source, dict):
            nested = [v for v in source.values() if isinstance(v, dict)]
            found += nested if nested else [source]
    limits = []
    for params in found:
        kind = params.get("rope_type", params.get("type"))
        if kind == "dynamic":
            limits.append(max_pos - 1)
        elif kind == "longrope":
            original = params.get("original_max_position_embeddings")
            limits.append(
                int(original or config.get("original_max_position_embeddings") or max_pos)
            )
    return min(limits) if limits else None


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))


def inverse_frequencies(
    params: RopeParameters, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, attention scaling of cos/sin), as transformers computes them."""
    o, dim, base = params.options, params.head_dim, params.theta
    kind = params.rope_type
    if kind == "default":
        return _base_inv_freq(base, dim), 1.0
    if kind == "linear":
        return _base_inv_freq(base, dim) / o["factor"], 1.0
    if kind == "dynamic":
        factor, max_pos = o["factor"], params.max_position_embeddings
        seq_len = max_pos if seq_len is None else max(seq_len, max_pos)
        base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(base, dim), 1.0
    if kind == "llama3":
        inv_freq = _base_inv_freq(base, dim)
        factor, low, high = o["factor"], o["low_freq_factor"], o["high_freq_factor"]
        old_context = o["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_context / low, old_context / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(params)
    return _longrope(params, seq_len)


def _yarn(params: RopeParameters) -> tuple[torch.Tensor, float]:
    o, dim, base = params.options, params.head_dim, params.theta
    original = o["original_max_position_embeddings"]
    factor = o.get("factor") or params.max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = o.get("attention_factor")
    if attention is None:
        if o.get("mscale") and o.get("mscale_all_dim"):
            attention = float(mscale(factor, o["mscale"]) / mscale(factor, o["mscale_all_dim"]))
        else:
            attention = mscale(factor)
    beta_fast, beta_slow = o.get("beta_fast") or 32, o.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if o.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no singularity
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    positions = base ** (torch.arange(0, dim, 2).to(torch.float) / dim)
    extrapolation, interpolation = 1.0 / positions, 1.0 / (factor * positions)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention)


def _longrope(params: RopeParameters, seq_len: int | None) -> tuple[torch.Tensor, float]:
    o, dim, base = params.options, params.head_dim, params.theta
    original = o["original_max_position_embeddings"]
    factor = o.get("factor") or params.max_position_embeddings / original
    attention = o.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    long = seq_len is not None and seq_len > original
    ext = torch.tensor(o["long_factor"] if long else o["short_factor"], dtype=torch.float32)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * base**shape), float(attention)


class Rotary:
    """The rotation of one parameter set. The frequencies of a length-dependent type are a
    function of the length a request's sequence has reached at a forward pass (its highest
    position + 1; a request's length only grows), computed once per distinct value."""

    def __init__(self, params: RopeParameters) -> None:
        self.params = params
        self._by_length: dict[int, tuple[torch.Tensor, float]] = {}
        self._fixed = inverse_frequencies(params)

    def frequencies(self, seq_len: int) -> tuple[torch.Tensor, float]:
        """(inverse frequencies, attention scaling) of a forward pass reaching `seq_len`."""
        params = self.params
        if params.rope_type == "dynamic":
            if seq_len <= params.max_position_embeddings:
                return self._fixed
            key = seq_len
        elif params.rope_type == "longrope":
            key = int(seq_len > params.options["original_max_position_embeddings"])
        else:
            return self._fixed
        found = self._by_length.get(key)
        if found is None:
            if len(self._by_length) > 4096:  # (dynamic: one entry per length; keep it bounded)
                self._by_length.clear()
            found = self._by_length[key] = inverse_frequencies(params, seq_len)
        return found

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [tokens, 1, head_dim] for `positions` of a forward pass whose sequence
        reaches `seq_len`, in `dtype`."""
        inv_freq, scaling = self.frequencies(seq_len)
        freqs = positions[:, None].to(torch.float32) * inv_freq.to(positions.device)[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos() * scaling, emb.sin() * scaling
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim] rotated (rotate_half convention)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

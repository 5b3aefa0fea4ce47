"""Rotary position embedding (RoPE): its parameters as config.json gives them, and the cos/sin
tables of every scaling the supported families use (linear, llama3, yarn, longrope, and
Gemma 4's proportional), for a rotary part that may be a leading fraction of each head
(Phi-4-mini rotates 96 of 128 dims).

Inverse frequencies are computed with the same float32 operations as transformers'
`modeling_rope_utils`, so the tables agree with it bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from appliance.engine.errors import ModelLoadError

SUPPORTED_ROPE_TYPES = frozenset(
    {"default", "linear", "llama3", "yarn", "longrope", "proportional"}
)


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Base frequency and optional context-extension scaling. Fields a type does not use keep
    their defaults; `attention_factor` None means "derived from the scaling" (yarn, longrope)."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # longrope: one factor per rotary frequency, short below the original context, long above
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float | None = None
    # proportional (Gemma 4's global layers): only the first `proportion` of each half's
    # frequencies turn, with exponents over the whole head; the rest are 0 (cos 1, sin 0), so
    # dims i and i + D/2 are a rotated pair for i < proportion * D/2 and the others pass through.
    proportion: float = 1.0

    @classmethod
    def parse(cls, params: Mapping[str, Any], raw: Mapping[str, Any], *, source: str) -> RopeConfig:
        """From one transformers 5 `rope_parameters` dict (or an older `rope_scaling`) of the
        config.json `raw`, whose top-level `rope_theta`, `original_max_position_embeddings` and
        `max_position_embeddings` fill what the dict leaves out, as transformers does."""
        rope_type = params.get("rope_type", params.get("type", "default"))
        if raw.get("architectures") == ["Phi3ForCausalLM"] and rope_type in ("su", "yarn"):
            rope_type = "longrope"  # Phi-3's names for it before transformers settled on one
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(
                f"{source}: rope scaling {rope_type!r} is not supported; "
                f"supported: {', '.join(sorted(SUPPORTED_ROPE_TYPES))}"
            )
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        kwargs: dict[str, Any] = {
            "theta": _number(theta, "rope_theta", source),
            "rope_type": rope_type,
        }
        for key in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"):
            if params.get(key):
                kwargs[key] = _number(params[key], key, source)
        for key in ("mscale", "mscale_all_dim", "attention_factor"):
            if params.get(key) is not None:
                kwargs[key] = _number(params[key], key, source)
        if params.get("truncate") is not None:
            kwargs["truncate"] = bool(params["truncate"])
        # Phi-3 keeps the pretraining context at the top level, and there it takes precedence.
        original = None
        if rope_type in ("llama3", "yarn", "longrope"):
            original = raw.get("original_max_position_embeddings")
        if original is None:
            original = params.get("original_max_position_embeddings")
        if original is None and rope_type in ("llama3", "yarn", "longrope"):
            original = raw.get("max_position_embeddings")
        if original is not None:
            if not isinstance(original, int) or isinstance(original, bool) or original < 1:
                raise ModelLoadError(
                    f"{source}: 'original_max_position_embeddings' must be a positive integer, "
                    f"got {original!r}"
                )
            kwargs["original_max_position_embeddings"] = original
        factor = params.get("factor")
        if factor is None and rope_type in ("yarn", "longrope"):
            # Phi-3 and DeepSeek leave it out: the extension is the ratio of the two contexts.
            factor = raw.get("max_position_embeddings", original) / original
        if factor is not None:
            kwargs["factor"] = _number(factor, "factor", source)
        if rope_type == "proportional" and params.get("partial_rotary_factor") is not None:
            proportion = _number(params["partial_rotary_factor"], "partial_rotary_factor", source)
            if not 0 < proportion <= 1:
                raise ModelLoadError(
                    f"{source}: rope 'partial_rotary_factor' must be in (0, 1], got {proportion}"
                )
            kwargs["proportion"] = proportion
        if rope_type == "longrope":
            for key in ("short_factor", "long_factor"):
                values = params.get(key)
                if not isinstance(values, list) or not values:
                    raise ModelLoadError(f"{source}: longrope scaling needs a list {key!r}")
                kwargs[key] = tuple(_number(v, key, source) for v in values)
        return cls(**kwargs)


def _number(value: Any, key: str, source: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ModelLoadError(f"{source}: rope {key!r} must be a finite number, got {value!r}")
    return float(value)


def inverse_frequencies(rope: RopeConfig, rotary_dim: int, *, long: bool = False) -> torch.Tensor:
    """[rotary_dim // 2] float32. `long`: longrope's factors for positions past the original
    context (other types ignore it)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    if rope.rope_type == "longrope":
        factors = rope.long_factor if long else rope.short_factor
        if len(factors) != rotary_dim // 2:
            raise ModelLoadError(
                f"longrope has {len(factors)} factors for {rotary_dim // 2} rotary frequencies"
            )
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * rope.theta**exponents)
    if rope.rope_type == "proportional":
        return _proportional(rope, rotary_dim)
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scaled(inv_freq, rope)
    if rope.rope_type == "yarn":
        return _yarn_scaled(rope, rotary_dim)
    return inv_freq


def attention_factor(rope: RopeConfig) -> float:
    """What yarn and longrope multiply cos and sin by (so attention logits by its square)."""
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.rope_type == "yarn":

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if rope.mscale and rope.mscale_all_dim:
            return mscale(rope.factor, rope.mscale) / mscale(rope.factor, rope.mscale_all_dim)
        return mscale(rope.factor)
    if rope.rope_type == "longrope" and rope.factor > 1.0:
        return math.sqrt(
            1 + math.log(rope.factor) / math.log(rope.original_max_position_embeddings)
        )
    return 1.0


def _llama3_scaled(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Llama 3.1 slows long wavelengths by `factor`, keeps short ones, and interpolates the band
    # between them smoothly.
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _proportional(rope: RopeConfig, rotary_dim: int) -> torch.Tensor:
    # transformers' _compute_proportional_rope_parameters, operation for operation.
    num_turning = int(rope.proportion * rotary_dim // 2)
    exponents = torch.arange(0, 2 * num_turning, 2, dtype=torch.int64).float() / rotary_dim
    turning = 1.0 / (rope.theta**exponents)
    still = torch.zeros(rotary_dim // 2 - num_turning, dtype=torch.float32)
    return torch.cat((turning, still)) / rope.factor


def _yarn_scaled(rope: RopeConfig, dim: int) -> torch.Tensor:
    # YaRN (arXiv 2309.00071): frequencies that turn fewer than beta_slow times over the original
    # context are interpolated (divided by factor), those turning more than beta_fast times are
    # kept, with a linear ramp between.
    base, original = rope.theta, rope.original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (rope.factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def cos_sin_table(
    rope: RopeConfig, rotary_dim: int, max_len: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for every position < max_len: each [max_len, rotary_dim] float32, the
    frequencies repeated for the two halves of the rotary part, times the attention factor.

    longrope takes its short factors below `original_max_position_embeddings` and its long ones
    from there on, per position: a cached key keeps the rotation it was written with.
    (transformers instead switches every position of a forward pass to the long factors once
    the sequence outgrows the original context, so it recomputes its cache at that point.)"""
    positions = torch.arange(max_len, dtype=torch.float32)
    inv_freq = inverse_frequencies(rope, rotary_dim)
    freqs = positions[:, None] * inv_freq[None, :]
    if rope.rope_type == "longrope":
        long = positions >= rope.original_max_position_embeddings
        long_freqs = positions[:, None] * inverse_frequencies(rope, rotary_dim, long=True)
        freqs = torch.where(long[:, None], long_freqs, freqs)
    emb = torch.cat((freqs, freqs), dim=-1)
    scale = attention_factor(rope)
    return (emb.cos() * scale).to(device), (emb.sin() * scale).to(device)

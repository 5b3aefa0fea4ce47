"""Rotary position embedding (RoPE): the cos/sin tables of every scaling the supported families
use (linear, llama3, yarn, longrope, and Gemma 4's proportional), for a rotary part that may be
a leading fraction of each head (Phi-4-mini rotates 96 of 128 dims). Their parameters, as
config.json gives them, are `models.rope_config`'s.

Inverse frequencies are computed with the same float32 operations as transformers'
`modeling_rope_utils`, so the tables agree with it bit for bit.
"""

from __future__ import annotations

import math

import torch

from appliance.engine.errors import ModelLoadError
from appliance.engine.models.rope_config import RopeConfig


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

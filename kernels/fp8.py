"""FP8 e4m3 numbers as Inferno uses them: symmetric scales, one per row, in plain torch.

The format is OCP's E4M3 as NVIDIA's Hopper tensor cores take it (`torch.float8_e4m3fn`: no
infinities, largest finite value 448). A row is quantized by dividing it by its scale
`amax / 448`, so its largest magnitude lands on 448 and nothing overflows; values round to
nearest (even). Dividing means multiplying by the scale's reciprocal (correctly rounded), as
vLLM's FP8 quantization kernels do: a quotient can then lie an ulp from the exact one, far below
e4m3's own rounding, and the Triton kernels do one division a row instead of one a value (which
held the down projection's quantization at 62% of copy bandwidth on an H200). Weights are
quantized per output channel (a row of nn.Linear's [N, K]), activations per token (a row of x),
which is the scheme vLLM serves as FP8 "dynamic" W8A8.

These functions are the reference the Triton kernels (`kernels.fp8_linear`) reproduce, and what
the loader uses to quantize a checkpoint's bfloat16 weights.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# An all-zero row still needs a finite, non-zero scale (its values all quantize to 0).
MIN_AMAX = 1e-12
# Attention over an FP8 KV cache stores its softmax probabilities times this in e4m3 for the
# P V product (`kernels.fp8_attention`): a power of two, so the scaling rounds nothing. A row's
# largest p lies in (1/2, 1] and lands in (128, 256], inside e4m3's range (448); p down to
# 2**-17 (the smallest subnormal, 2**-9, over 256) stays non-zero, a weight below which is
# negligible beside the largest.
P_SCALE = 256.0


def row_scales(x: torch.Tensor) -> torch.Tensor:
    """x: [M, K] -> [M] float32, the scale that maps each row's largest magnitude to FP8_MAX.
    Divided by a tensor: CUDA divides by a Python scalar as a multiplication by its reciprocal,
    an ulp off the correctly rounded quotient the Triton kernels compute."""
    amax = x.float().abs().amax(dim=-1).clamp(min=MIN_AMAX)
    return amax / torch.full_like(amax, FP8_MAX)


def quantize_rows(
    x: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] -> (q: [M, K] float8_e4m3fn, scale: [M] float32) with x ≈ q * scale[:, None].

    `scale`: one static scale ([1] float32) for every row instead of each row's own; values
    beyond its range saturate at ±FP8_MAX.
    """
    scale = row_scales(x) if scale is None else scale.float().expand(x.shape[0])
    q = (x.float() * torch.reciprocal(scale)[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight an FP8 weight with per-row scales stands for: q [N, K], scale [N] -> [N, K]."""
    return (q.float() * scale.float()[:, None]).to(dtype)


def dequantize_blocks(
    q: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """The float32 weight a block-scaled FP8 weight stands for: q [N, K], scales
    [ceil(N / bn), ceil(K / bk)] (one per bn x bk block, the last ones partial) -> [N, K]."""
    (bn, bk), (n, k) = block, q.shape
    per_element = scales.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return q.float() * per_element

"""How close attention over an FP8 KV cache must come to its two references (used by the prefill
and decode kernels' tests, on unit-normal q, keys and values and a D ** -0.5 softmax scale).

The kernels quantize each q row and the softmax probabilities P to e4m3 for their tensor-core
products (`kernels.fp8_attention`). They are compared with:

1. `kernels.reference.paged_attention` on the same FP8 cache, which quantizes q and P the same
   way. q's roundings are identical. P's may differ by one e4m3 step (up to 2**-3 of p) where
   the kernel rounded p relative to a running maximum below the row's final one (the row's
   largest p is 1 in both, so the heaviest weight never differs); those roundings are
   independent, so in the output they mostly cancel. Measured on the CPU test shapes (Triton's
   interpreter, 4 seeds, float32 and float16): worst 0.029 and mean 0.0015 for prefill, 0.016
   and 0.0009 for decode. Bound: twice the worst measured, and a mean below half the
   reference's own distance from exact attention (measured: a quarter of it), so a kernel that
   rounds q or P otherwise than the reference (or not at all) fails.
2. Exact attention on the dequantized cache (float32 q and P, `stored * scale`): q and P each
   carry up to half an e4m3 step (2**-4) of relative error per element. Bounding that through
   the softmax element by element gives nothing useful (a score error scales with |q| |k|), so
   the bound is measured: worst 0.093 and mean 0.0059 (prefill; decode 0.041 and 0.0037) on
   the same shapes; allowed twice that. Half an e4m3 step of V itself, which the cache already
   costs, is 0.06 of a unit value: the quantized products stay at that scale.

A missing or swapped scale, a stale tile or an unmasked key moves outputs by whole units.
"""

from __future__ import annotations

import torch

WORST_VS_FP8_REFERENCE = 0.06
WORST_VS_EXACT = 0.2
MEAN_VS_EXACT = 0.012


def assert_fp8_attention_close(
    out: torch.Tensor, fp8_reference: torch.Tensor, exact: torch.Tensor, output_atol: float
) -> None:
    """out: the kernel's output; fp8_reference, exact: float32 references of the same shape.
    output_atol: what rounding the output to its dtype may add to the worst element."""
    out = out.float()
    vs_reference = (out - fp8_reference).abs()
    vs_exact = (out - exact).abs()
    reference_vs_exact = (fp8_reference - exact).abs().mean()
    assert vs_reference.max() <= WORST_VS_FP8_REFERENCE + output_atol, vs_reference.max()
    assert vs_reference.mean() <= 0.5 * reference_vs_exact, (
        vs_reference.mean(),
        reference_vs_exact,
    )
    assert vs_exact.max() <= WORST_VS_EXACT + output_atol, vs_exact.max()
    assert vs_exact.mean() <= MEAN_VS_EXACT, vs_exact.mean()

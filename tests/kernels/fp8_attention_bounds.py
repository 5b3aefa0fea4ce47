"""How close attention over an FP8 KV cache must come to its two references (used by the prefill
and decode kernels' tests, on unit-normal q, keys and values and a D ** -0.5 softmax scale).

The kernels quantize each q row and the softmax probabilities P to e4m3 for their tensor-core
products (`kernels.fp8_attention`). They are compared with:

1. `kernels.reference.paged_attention` on the same FP8 cache, which quantizes q and P the same
   way, rounded to the output's dtype as the kernel's output is. q's roundings are identical;
   P's too, since the kernels keep their running maximum on whole log2 units: only where
   float32 sums or exp2 differ in a last bit at an e4m3 tie does one weight move by one e4m3
   step. Measured on the CPU test shapes (Triton's interpreter, 4 seeds, float32 and
   float16): no difference beyond one output ulp (0.001). Bound: 0.03 worst (a flip on a
   weight near 1/2 of a unit value moves the output by 2**-4 / 2), and a mean below a tenth of
   the reference's own distance from exact attention, so that a kernel rounding q or P
   otherwise (against a running maximum that is not whole, measured: a quarter of it; or not
   at all: all of it) fails.
2. Exact attention on the dequantized cache (float32 q and P, `stored * scale`): q and P each
   carry up to half an e4m3 step (2**-4) of relative error per element, the row's largest p
   included (it lies in (1/2, 1] against a whole-number maximum). Bounding that through the
   softmax element by element gives nothing useful (a score's error scales with |q| |k|), so
   the bound is measured: worst 0.15 and mean 0.0075 for prefill, 0.13 and 0.009 for decode,
   on the same shapes; allowed twice that.

On the GPU the prefill kernel's score product is an e4m3 `wgmma` (FlashAttention-3's), and
Hopper's FP8 tensor cores keep fewer bits than float32 in their sums across D. Scores then
differ from the reference's by more than a last bit, and P weights near an e4m3 rounding
boundary round the other way: measured on the H100 (8 x 2,048 at D = 128, 4 seeds) 358-733
outputs beyond 0.03, worst 0.13-0.19, mostly at a sequence's first positions, whose few
weights are large; the mean 7.8e-5, within bound 1's (an exact exp2 in place of the fast one
changed no output). The decode kernel, whose score product takes float16 operands, stays
within bound 1 on the GPU. A weight that rounds the other way moves by one e4m3 step, at most
2**-3 of it, and the row's output by that over the row's sum times its value: all of a row's
weights flipping at once would move it by 2**-3 * max |v| (`fp8_score_sums_worst`), which
such a run's worst checks allow on top. The means stay as tight as on the CPU.

A missing or swapped scale, a stale tile or an unmasked key moves outputs by whole units.
"""

from __future__ import annotations

import torch

WORST_VS_FP8_REFERENCE = 0.03
MEAN_VS_FP8_REFERENCE_OVER_FP8_ERROR = 0.1
WORST_VS_EXACT = 0.3
MEAN_VS_EXACT = 0.018


def fp8_score_sums_worst(v: torch.Tensor) -> float:
    """What P weights rounding the other way may add to an output's worst element where the
    score product's sums keep fewer bits than float32 (Hopper's FP8 tensor cores); v: the
    dequantized values (NaN in the slots no context holds: the tests' poison)."""
    return 2**-3 * v.abs().nan_to_num(0.0).max().item()


def assert_fp8_attention_close(
    out: torch.Tensor,
    fp8_reference: torch.Tensor,
    exact: torch.Tensor,
    output_atol: float,
    score_sums_worst: float = 0.0,
) -> None:
    """out: the kernel's output; fp8_reference, exact: float32 references of its shape.
    output_atol: what rounding the output to its dtype may add to its worst element;
    score_sums_worst: what the score product's sums may (`fp8_score_sums_worst`)."""
    like = fp8_reference.to(out.dtype).float()
    out = out.float()
    vs_reference = (out - like).abs()
    fp8_error = (fp8_reference - exact).abs().mean()
    worst_allowance = output_atol + score_sums_worst
    assert vs_reference.max() <= WORST_VS_FP8_REFERENCE + worst_allowance, vs_reference.max()
    assert vs_reference.mean() <= MEAN_VS_FP8_REFERENCE_OVER_FP8_ERROR * fp8_error, (
        vs_reference.mean(),
        fp8_error,
    )
    vs_exact = (out - exact).abs()
    assert vs_exact.max() <= WORST_VS_EXACT + worst_allowance, vs_exact.max()
    assert vs_exact.mean() <= MEAN_VS_EXACT, vs_exact.mean()

"""FP8 tensor-core attention: the arithmetic the paged attention kernels share with an FP8 cache.

With a float8_e4m3fn KV cache both products of attention take e4m3 operands straight from the
cache (FlashAttention-3's FP8 path), instead of widening every K and V tile to q's dtype first:
- Q K^T: each row of the q tile (one query token's vector for one head) is quantized in
  registers with its own scale max|row| / 448 (`kernels.fp8.quantize_rows`' rounding); the row
  scales join K's per-tensor scale in the score scale, so the product is one FP8 `tl.dot` with
  float32 sums and the scores are exact in those operands.
- P V: the online softmax's probabilities lie in [0, 1] (each relative to its row's running
  maximum), so they are quantized with the fixed scale `kernels.fp8.P_SCALE`; 1 / P_SCALE joins
  V's scale, applied once to the output. The row sums use the float32 probabilities.
- The running maximum (in log2 units) is kept on whole numbers (`round_up_running_max`): a
  tile's p = exp2(s - m) then differs from p against the row's final maximum by an exact power
  of two, which e4m3 rounding commutes with, so P rounds the same whatever order the tiles come
  in (bar values near e4m3's subnormals and exp2's last-bit differences), and rescaling the
  accumulator by exp2(m_old - m_new) is exact.
`kernels.reference.fp8_attention` does the same arithmetic in plain torch, against each row's
final maximum rounded up likewise.

Triton's 3.9 interpreter rounds float32 to e4m3 wrongly (a value that rounds up to a power of
two comes out halved, subnormals are flushed), while it converts values already on e4m3's grid
exactly; under the interpreter (`EMULATE_ROUNDING`) values are first rounded to that grid here,
to nearest even as the GPU's conversion does, so the CPU tests run the real arithmetic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8 import FP8_MAX, MIN_AMAX, P_SCALE

# Triton reads module globals only as constexprs.
_FP8_MAX_C = tl.constexpr(FP8_MAX)
_MIN_AMAX_C = tl.constexpr(MIN_AMAX)
P_SCALE_C = tl.constexpr(P_SCALE)
# Exact: P_SCALE is a power of two.
P_UNSCALE_C = tl.constexpr(1.0 / P_SCALE)
# Below 2**-6 e4m3 is subnormal: multiples of 2**-9. Adding 1.5 * 2**14 (whose float32 ulp is
# 2**-9) and subtracting it again rounds a float32 to that grid, ties to even.
_SUBNORMAL_LIMIT_C = tl.constexpr(2.0**-6)
_SUBNORMAL_ROUNDER_C = tl.constexpr(1.5 * 2.0**14)


@triton.jit
def to_e4m3(x, EMULATE_ROUNDING: tl.constexpr):
    """float32 x, within +-448 -> float8e4nv, rounded to nearest even."""
    if EMULATE_ROUNDING:
        # Normal range: keep 3 of float32's 23 mantissa bits, ties to even (a carry into the
        # exponent is the right answer too).
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
        normal = bits.to(tl.float32, bitcast=True)
        subnormal = (x + _SUBNORMAL_ROUNDER_C) - _SUBNORMAL_ROUNDER_C
        x = tl.where(tl.abs(x) < _SUBNORMAL_LIMIT_C, subnormal, normal)
    return x.to(tl.float8e4nv)


@triton.jit
def quantize_q_rows(q, EMULATE_ROUNDING: tl.constexpr):
    """q: [M, D] -> (q8: [M, D] float8e4nv, scale: [M] float32) with q ≈ q8 * scale[:, None],
    each row divided by its own max|row| / 448 (an all-zero row, e.g. padding, by a tiny
    positive scale: it stays zero)."""
    q32 = q.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(q32), axis=1), _MIN_AMAX_C)
    # div_rn: correctly rounded, as torch divides (Triton's default division is approximate);
    # the values are multiplied by the scale's reciprocal, as kernels.fp8 quantizes.
    scale = tl.math.div_rn(amax, _FP8_MAX_C)
    scaled = tl.clamp(q32 * tl.math.div_rn(1.0, scale)[:, None], -_FP8_MAX_C, _FP8_MAX_C)
    return to_e4m3(scaled, EMULATE_ROUNDING), scale


@triton.jit
def quantize_probabilities(p, EMULATE_ROUNDING: tl.constexpr):
    """p: [M, N] float32 in [0, 1] -> p * P_SCALE in float8e4nv (P_SCALE is a power of two, so
    only the conversion rounds)."""
    return to_e4m3(p * P_SCALE_C, EMULATE_ROUNDING)


@triton.jit
def dot_e4m3(a, b, K: tl.constexpr):
    """a: [M, K] @ b: [K, N], both float8e4nv -> float32 sums of the exact products.

    Triton's FP8 dot takes K in steps of 32; below that (a head_dim of 16, tiny models) the
    operands are widened to float16 first, exactly (every e4m3 value is a float16), so the
    result is the same."""
    return tl.dot(a.to(tl.float16), b.to(tl.float16)) if K < 32 else tl.dot(a, b)


@triton.jit
def round_up_running_max(m):
    """m: [M] float32 running row maxima in log2 units -> the same rounded up to whole numbers."""
    return tl.math.ceil(m)


def fits_word_planes(v_cache: torch.Tensor) -> bool:
    """Whether an FP8 V cache can be read as int32 words in four byte planes: each plane at
    least 16 wide (a product's least dimension) and every row of D bytes starting on a word."""
    head_dim = v_cache.shape[-1]
    return (
        head_dim >= 64
        and head_dim % 4 == 0
        and v_cache.storage_offset() % 4 == 0
        and all(stride % 4 == 0 for stride in v_cache.stride()[:-1])
    )


@triton.jit
def e4m3_planes(words, INTERPRETED: tl.constexpr):
    """int32 words, each holding 4 consecutive e4m3 values (lowest byte first, as the cache lays
    them out) -> the 4 byte planes in float16 (exact: every e4m3 value is a float16): plane j
    of word i is element 4i + j.

    Why words: a product that reduces across the rows of an 8-bit tile (P V reduces over
    tokens, and V's bytes run along D) makes Triton 3.6 transpose the tile out of shared memory
    a byte at a time (128 `ld.shared.b8` per thread and tile). Loaded as words and widened in
    registers, the planes reach the product as 16-bit tiles, which it moves 16 or 32 bits at a
    time. On the GPU each word takes two `cvt.rn.f16x2.e4m3x2`; the interpreter, which runs no
    inline assembly, shifts the bytes out instead."""
    if INTERPRETED:
        p0 = (words & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        p1 = ((words >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        p2 = ((words >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        p3 = ((words >> 24) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    else:
        p0, p1, p2, p3 = tl.inline_asm_elementwise(
            """
            {
            .reg .b16 lo, hi;
            .reg .b32 a, b;
            mov.b32 {lo, hi}, $4;
            cvt.rn.f16x2.e4m3x2 a, lo;
            cvt.rn.f16x2.e4m3x2 b, hi;
            mov.b32 {$0, $1}, a;
            mov.b32 {$2, $3}, b;
            }
            """,
            "=h,=h,=h,=h,r",
            [words],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True,
            pack=1,
        )
    return p0, p1, p2, p3


@triton.jit
def join_planes(p0, p1, p2, p3):
    """Four [ROWS, C] planes -> [ROWS, C, 2, 2], whose row-major order puts plane j's column i
    at 4i + j (the inverse of `e4m3_planes`' split, once reshaped to [ROWS, 4C]). Joining stays
    in registers, so an accumulator can be kept in this shape and reshaped once at the end."""
    return tl.join(tl.join(p0, p2), tl.join(p1, p3))


@triton.jit
def interleave_planes(p0, p1, p2, p3, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Four [ROWS, COLS // 4] planes -> [ROWS, COLS] with element 4i + j from plane j's
    column i."""
    return tl.reshape(join_planes(p0, p1, p2, p3), [ROWS, COLS])

"""FP8 projections on the GPU: `x @ W.T (+ b)` with W an `Fp8Weight` (e4m3, a scale per output
channel).

By batch size:
- one row (batch-1 decode): weight-only, `kernels.linear`'s weight-streaming GEMV reading the
  FP8 bytes (half the bfloat16 weight's) and multiplying them on the CUDA cores with x as it
  is, in its own dtype. On the CUDA cores a quantized x would save nothing and cost a launch
  (and a rounding) per projection, so the row is not quantized: the result is the dequantized
  weight's exact product, closer to the unquantized model than W8A8's.
- more rows, W8A8, two launches (one when the norm before the projection quantized the rows
  in its own launch and passes them as `kernels.ops.Fp8Rows`: `kernels.rmsnorm`):
  1. `quantize_rows`: one program per row of x finds the row's largest magnitude, then writes
     the row in FP8 and its scale (`kernels.fp8.quantize_rows`' rounding: one division a row,
     a multiplication by its result a value), reading a row of up to 16,384 values once (held
     in registers) and a wider one twice. For the MLP's down projection it takes the fused
     [gate | up] output and applies SiLU(gate)·up while loading, rounded where
     `kernels.reference.silu_and_mul` rounds, so the product never goes through memory in the
     model's dtype.
  2. up to `MAX_ROWS` rows: each [BLOCK_N, BLOCK_K] FP8 weight tile meets all rows of x on the
     tensor cores (FP8 values widened exactly to float16); more rows: cuBLASLt's FP8
     tensor-core matmul (`torch._scaled_mm` with row-wise scales; torch's CPU build has the
     same operator, so the interpreted tests call it as the GPU does).
  Both sum the exact FP8 products and scale the sums by x's scale, then the weight's. The
  skinny kernel sums in float32; cuBLASLt with fast accumulation, in the FP8 tensor cores'
  own accumulator without promoting partial sums to float32 registers along K (vLLM's
  CUTLASS FP8 kernels for Hopper run the same `FP8FastAccum` schedules): 8-13% faster at the
  8B model's prompt-step shapes (docs/BENCHMARKS.md, issue 17 round 16), its rounding far
  below the FP8 operands' own.

Semantics of the W8A8 path are `kernels.reference.linear` with an `Fp8Weight`: the sums differ
in their order (and, in the large-batch path, in the accumulator's precision), and the
large-batch path rounds its output to bfloat16 before the bias is added (cuBLAS's row-wise FP8
matmul writes bfloat16 only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.activation import gated_product, gelu_tanh_and_mul
from kernels.errors import KernelInputError
from kernels.fp8 import FP8_DTYPE, FP8_MAX, MIN_AMAX
from kernels.launch_checks import FLOAT_DTYPES, check_devices
from kernels.linear import MAX_ROWS, config_for, gemv
from kernels.ops import Fp8Rows, Fp8Weight

# Triton reads module globals only as constexprs.
_FP8_MAX_C = tl.constexpr(FP8_MAX)
_MIN_AMAX_C = tl.constexpr(MIN_AMAX)
# A row of x up to this wide is quantized from registers in one pass (read once: its largest
# magnitude, then its FP8 values); the 8B model's hidden size (4,096) and its SiLU·mul product
# (14,336) are. A wider row is read twice, in tiles of `_QUANT_TILE_K`: its largest magnitude,
# then its values.
_QUANT_ONE_PASS_K = 16384
_QUANT_TILE_K = 4096
# cuBLASLt's FP8 matmul needs both matrix widths to be multiples of 16.
_SCALED_MM_ALIGN = 16


@triton.jit
def _row_values(x_row, offs_k, mask, k, SILU_MUL: tl.constexpr):
    """A tile of one row of x in float32; with SILU_MUL, of SiLU(gate) * up for x = [gate | up],
    each rounded to x's dtype as the reference rounds."""
    if SILU_MUL:
        gate = tl.load(x_row + offs_k, mask=mask, other=0.0)
        up = tl.load(x_row + k + offs_k, mask=mask, other=0.0)
        return gated_product(gate, up, "silu").to(tl.float32)
    return tl.load(x_row + offs_k, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    static_scale_ptr,
    k,
    x_row_stride,
    q_row_stride,
    SILU_MUL: tl.constexpr,
    STATIC: tl.constexpr,
    ONE_PASS: tl.constexpr,  # BLOCK_K >= k: the row is read once and held in registers
    BLOCK_K: tl.constexpr,
):
    """One row per program: q[row] = x[row] / scale, scale = max|x[row]| / FP8_MAX (or static)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    q_row = q_ptr + row * q_row_stride
    if ONE_PASS:
        offs_k = tl.arange(0, BLOCK_K)
        mask = offs_k < k
        values = _row_values(x_row, offs_k, mask, k, SILU_MUL)
        quantize_row(values, q_row + offs_k, mask, scale_ptr + row, static_scale_ptr, STATIC)
    else:
        amax = 0.0
        if not STATIC:
            amaxes = tl.zeros((BLOCK_K,), dtype=tl.float32)
            for k0 in range(0, k, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                values = _row_values(x_row, offs_k, offs_k < k, k, SILU_MUL)
                amaxes = tl.maximum(amaxes, tl.abs(values))
            amax = tl.max(amaxes, axis=0)
        inv_scale = _store_scale(amax, scale_ptr + row, static_scale_ptr, STATIC)
        for k0 in range(0, k, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask = offs_k < k
            _store_quantized(
                q_row + offs_k, _row_values(x_row, offs_k, mask, k, SILU_MUL), inv_scale, mask
            )


@triton.jit
def quantize_row(values, q_ptrs, mask, scale_ptr, static_scale_ptr, STATIC: tl.constexpr):
    """Quantize one row held in registers (`values` in float32, 0 where masked): store its
    scale at `scale_ptr` and its FP8 values at `q_ptrs` (`kernels.fp8.quantize_rows`)."""
    amax = tl.max(tl.abs(values), axis=0)
    _store_quantized(q_ptrs, values, _store_scale(amax, scale_ptr, static_scale_ptr, STATIC), mask)


@triton.jit
def _store_scale(amax, scale_ptr, static_scale_ptr, STATIC: tl.constexpr):
    """Store a row's scale at `scale_ptr` (its largest magnitude `amax` over FP8_MAX, correctly
    rounded, or the static one) and return the scale's correctly rounded reciprocal: one
    division a row, each value then multiplied (kernels.fp8)."""
    if STATIC:
        scale = tl.load(static_scale_ptr).to(tl.float32)
    else:
        scale = tl.math.div_rn(tl.maximum(amax, _MIN_AMAX_C), _FP8_MAX_C)
    tl.store(scale_ptr, scale)
    return tl.math.div_rn(1.0, scale)


@triton.jit
def _store_quantized(q_ptrs, values, inv_scale, mask):
    q = tl.clamp(values * inv_scale, -_FP8_MAX_C, _FP8_MAX_C)
    tl.store(q_ptrs, q.to(q_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_skinny_kernel(
    xq_ptr,
    x_scale_ptr,
    w_ptr,
    w_scale_ptr,
    b_ptr,
    out_ptr,
    rows,
    n,
    k,
    x_row_stride,
    w_row_stride,
    out_row_stride,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Up to BLOCK_M rows of x: each weight tile meets all of them on the tensor cores."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < n
    m_mask = offs_m < rows
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * w_row_stride
    x_rows = xq_ptr + offs_m.to(tl.int64)[:, None] * x_row_stride
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w_mask = n_mask[:, None]
            x_mask = m_mask[:, None]
        else:
            w_mask = n_mask[:, None] & (offs_k < k)[None, :]
            x_mask = m_mask[:, None] & (offs_k < k)[None, :]
        w = tl.load(w_rows + offs_k[None, :], mask=w_mask, other=0.0)
        x = tl.load(x_rows + offs_k[None, :], mask=x_mask, other=0.0)
        # Every e4m3 value is exact in float16, so the float16 products are the FP8 products.
        # [BLOCK_N, BLOCK_K] @ [BLOCK_K, BLOCK_M]: the weight tile is the wide operand.
        acc = tl.dot(w.to(tl.float16), tl.trans(x.to(tl.float16)), acc)
    x_scale = tl.load(x_scale_ptr + offs_m, mask=m_mask, other=0.0)
    w_scale = tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)
    acc = acc * x_scale[None, :] * w_scale[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + offs_m.to(tl.int64)[None, :] * out_row_stride + offs_n[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])


def quantize_rows(
    x: torch.Tensor, *, silu_mul: bool = False, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] (or [M, 2K] = [gate | up] with `silu_mul`) -> (q: [M, K] float8_e4m3fn,
    scale: [M] float32); see `kernels.fp8.quantize_rows`. `static_scale`: [1] float32."""
    check_static_scale(x, static_scale)
    if x.dim() != 2 or x.dtype not in FLOAT_DTYPES:
        raise KernelInputError(
            f"x must be [M, K] of float16, bfloat16 or float32, got {tuple(x.shape)} {x.dtype}"
        )
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise KernelInputError(f"x must be contiguous along its last dimension: {x.stride()}")
    if silu_mul and x.shape[1] % 2:
        raise KernelInputError(f"[gate | up] needs an even width, got {x.shape[1]}")
    rows, k = x.shape[0], x.shape[1] // 2 if silu_mul else x.shape[1]
    q = torch.empty((rows, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows == 0 or k == 0:
        return q, scale.fill_(MIN_AMAX / FP8_MAX)
    one_pass = k <= _QUANT_ONE_PASS_K
    block_k = triton.next_power_of_2(k) if one_pass else _QUANT_TILE_K
    _quantize_rows_kernel[(rows,)](
        x,
        q,
        scale,
        static_scale if static_scale is not None else scale,  # never read without STATIC
        k,
        x.stride(0),
        q.stride(0),
        SILU_MUL=silu_mul,
        STATIC=static_scale is not None,
        ONE_PASS=one_pass,
        BLOCK_K=block_k,
        num_warps=8,
    )
    return q, scale


def check_static_scale(x: torch.Tensor, static_scale: torch.Tensor | None) -> None:
    """A static input scale is None or [1] float32 on x's device (x checked for its device)."""
    check_devices({"x": x} if static_scale is None else {"x": x, "static_scale": static_scale})
    if static_scale is not None and (
        static_scale.shape != (1,) or static_scale.dtype != torch.float32
    ):
        raise KernelInputError(
            f"static_scale must be [1] float32, got {tuple(static_scale.shape)} "
            f"{static_scale.dtype}"
        )


def quantizes(rows: int) -> bool:
    """Whether a projection of this many rows quantizes them (W8A8): all but the batch-1 path,
    which multiplies the FP8 weight by x as it is."""
    return rows != 1


def linear(
    x: torch.Tensor | Fp8Rows, weight: Fp8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x: [M, K], weight: an [N, K] Fp8Weight, bias: [N] or None -> [M, N] in x's dtype.
    x may come quantized for this weight (`Fp8Rows`, of more than one row: `quantizes`)."""
    if isinstance(x, Fp8Rows):
        _validate_quantized(x, weight, bias)
        return project(x.q, x.scale, weight, bias, x.dtype)
    _validate(x, weight, bias, in_features=weight.weight.shape[-1])
    if not quantizes(x.shape[0]):
        return _one_row(x, weight, bias, activation="")
    xq, x_scale = quantize_rows(x, static_scale=weight.input_scale)
    return project(xq, x_scale, weight, bias, x.dtype)


def silu_mul_linear(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """The MLP's down projection of SiLU(gate) * up: x = [gate | up]: [M, 2I], weight: an
    [N, I] Fp8Weight -> [M, N] in x's dtype."""
    _validate(x, weight, None, in_features=2 * weight.weight.shape[-1])
    if not quantizes(x.shape[0]):
        return _one_row(x, weight, None, activation="silu")
    xq, x_scale = quantize_rows(x, silu_mul=True, static_scale=weight.input_scale)
    return project(xq, x_scale, weight, None, x.dtype)


def gelu_tanh_mul_linear(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """`silu_mul_linear` with GELU-tanh(gate) * up (Gemma): one row fused as there; more rows
    through `kernels.activation.gelu_tanh_and_mul`, whose product is then quantized."""
    _validate(x, weight, None, in_features=2 * weight.weight.shape[-1])
    if not quantizes(x.shape[0]):
        return _one_row(x, weight, None, activation="gelu_tanh")
    return linear(gelu_tanh_and_mul(x), weight)


def project(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: Fp8Weight,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Rows already quantized: xq: [M, K] float8_e4m3fn, x_scale: [M] float32 -> [M, N] in
    `dtype`, by the path the module docstring names."""
    rows, (n, k) = xq.shape[0], weight.weight.shape
    if rows > MAX_ROWS and n % _SCALED_MM_ALIGN == 0 and k % _SCALED_MM_ALIGN == 0:
        out = torch._scaled_mm(
            xq,
            weight.weight.t(),  # [K, N], column-major: the layout cuBLASLt's FP8 matmul needs
            scale_a=x_scale[:, None],  # [M, 1]
            scale_b=weight.scale[None, :],  # [1, N]
            out_dtype=torch.bfloat16,
            use_fast_accum=True,
        )
        if bias is not None:
            return (out.float() + bias.float()).to(dtype)
        return out.to(dtype)
    out = torch.empty((rows, n), dtype=dtype, device=xq.device)
    # Shapes cuBLASLt refuses take the skinny kernel, MAX_ROWS rows at a time.
    for start in range(0, rows, MAX_ROWS):
        stop = min(start + MAX_ROWS, rows)
        _launch_skinny(xq[start:stop], x_scale[start:stop], weight, bias, out[start:stop])
    return out


def _one_row(
    x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None, *, activation: str
) -> torch.Tensor:
    """Weight-only: x (or act(gate)·up of x = [gate | up]) in its dtype times the FP8 weight."""
    n, k = weight.weight.shape
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    if k == 0:
        return out.copy_(bias[None, :]) if bias is not None else out.zero_()
    config = config_for(n, k, 1, weight.weight.element_size())
    return gemv(
        x, weight.weight, bias, out, activation=activation, config=config, scale=weight.scale
    )


def _launch_skinny(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: Fp8Weight,
    bias: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    rows, (n, k) = xq.shape[0], weight.weight.shape
    if n == 0:
        return
    # The bfloat16 tensor-core tiles (also for one row: this kernel pads x to a tile): the
    # same elements per tile, half the bytes.
    config = config_for(n, k, MAX_ROWS, 2)
    common = {
        "HAS_BIAS": bias is not None,
        "EVEN_K": k % config.block_k == 0,
        "BLOCK_N": config.block_n,
        "BLOCK_K": config.block_k,
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
    }
    grid = (triton.cdiv(n, config.block_n),)
    b = bias if bias is not None else weight.scale  # never read without HAS_BIAS
    _fp8_skinny_kernel[grid](
        xq, x_scale, weight.weight, weight.scale, b, out, rows, n, k,
        xq.stride(0), weight.weight.stride(0), out.stride(0), BLOCK_M=MAX_ROWS, **common,
    )  # fmt: skip


def _validate(
    x: torch.Tensor,
    weight: Fp8Weight,
    bias: torch.Tensor | None,
    *,
    in_features: int,
    dtype: torch.dtype | None = None,
) -> None:
    """x [M, in_features] for `weight`, and a bias of the output's dtype (x's unless given)."""
    dtype = x.dtype if dtype is None else dtype
    named = {"x": x, "weight": weight.weight, "scale": weight.scale}
    if bias is not None:
        named["bias"] = bias
    check_devices(named)
    w, scale = weight.weight, weight.scale
    if w.dim() != 2 or w.dtype != FP8_DTYPE or (w.shape[-1] > 1 and w.stride(-1) != 1):
        raise KernelInputError(
            f"an Fp8Weight's weight must be [N, K] float8_e4m3fn, contiguous along K; got "
            f"{tuple(w.shape)} {w.dtype} strides {w.stride()}"
        )
    if scale.shape != (w.shape[0],) or scale.dtype != torch.float32 or scale.stride(0) != 1:
        raise KernelInputError(
            f"an Fp8Weight's scale must be [{w.shape[0]}] float32 and contiguous, got "
            f"{tuple(scale.shape)} {scale.dtype}"
        )
    if x.dim() != 2 or x.shape[1] != in_features:
        raise KernelInputError(
            f"x must have shape [M, {in_features}] for weight {tuple(w.shape)}, "
            f"got {tuple(x.shape)}"
        )
    if bias is not None and (bias.shape != (w.shape[0],) or bias.dtype != dtype):
        raise KernelInputError(
            f"bias must be [{w.shape[0]}] of x's dtype {dtype}, got {tuple(bias.shape)} "
            f"{bias.dtype}"
        )


def _validate_quantized(x: Fp8Rows, weight: Fp8Weight, bias: torch.Tensor | None) -> None:
    """Rows quantized for `weight`: q [M, K] e4m3 with M > 1, scale [M] float32 (the rest as
    `_validate`)."""
    q, scale = x.q, x.scale
    if q.dim() != 2 or q.dtype != FP8_DTYPE or (q.shape[-1] > 1 and q.stride(-1) != 1):
        raise KernelInputError(
            f"quantized rows must be [M, K] float8_e4m3fn, contiguous along K; got "
            f"{tuple(q.shape)} {q.dtype} strides {q.stride()}"
        )
    if not quantizes(q.shape[0]):
        raise KernelInputError("one row is projected unquantized (weight-only), not as Fp8Rows")
    if scale.shape != (q.shape[0],) or scale.dtype != torch.float32:
        raise KernelInputError(
            f"quantized rows' scale must be [{q.shape[0]}] float32, got {tuple(scale.shape)} "
            f"{scale.dtype}"
        )
    check_devices({"q": q, "x_scale": scale})
    _validate(q, weight, bias, in_features=weight.weight.shape[-1], dtype=x.dtype)

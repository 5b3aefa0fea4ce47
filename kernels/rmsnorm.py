"""Triton RMSNorm kernels: plain, and fused with the residual add that precedes it in Llama.

Semantics are those of `kernels.reference.rms_norm` / `add_rms_norm`, rounding included: the
statistics are float32, the normalized row is rounded to x's dtype before it is scaled by the
weight (as Hugging Face's Llama does) unless the weight is float32 and x narrower (Gemma's and
Qwen3.5's `1 + w` norms: scaled in float32, rounded once to x's dtype), and the fused residual
sum is rounded to x's dtype before it is normalized. One program normalizes one row of H
elements held entirely in registers.

Before an FP8 projection (W8A8, `kernels.fp8_linear`) the fused kernel can quantize the normed
row too (`add_rms_norm_fp8`), as the projection's own quantization kernel would quantize the
norm's output, so that row never goes through memory in the model's dtype: the norm and the
quantization kernel read and wrote 8 + 3 bytes a value where the fused kernel moves 7, and a
launch is saved twice a layer (an 8,192 x 4,096 bfloat16 step on an H200: 58 against 94 µs).

On Hopper both kernels are programmatic dependents (`kernels.pdl`): a norm launches while the
kernel before it (a decode step's projection) finishes, loads its weight, and only then waits
for its input; a projection after it likewise streams its first weights while the norm runs.
At batch 1 a norm is latency, not bandwidth: 3.4 µs a launch on an H100 in plain stream order,
two per layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.errors import KernelInputError
from kernels.fp8 import FP8_DTYPE
from kernels.fp8_linear import check_static_scale, quantize_row
from kernels.launch_checks import FLOAT_DTYPES, check_devices
from kernels.ops import Fp8Rows
from kernels.pdl import launch_options, wait_for_previous

# A whole row lives in one program's registers; 16 warps hold 32768 floats without spilling much.
_MAX_HIDDEN = 32768


@triton.jit
def _normed(x, w, eps, HIDDEN: tl.constexpr, ROUND_NORMED: tl.constexpr):
    """RMSNorm(x) * w of one row `x` (in x's dtype, masked lanes 0; w: the weight in float32),
    in float32, not yet rounded to the output's dtype."""
    x32 = x.to(tl.float32)
    # Masked lanes are 0, so the sum covers exactly the H real elements.
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=0) / HIDDEN + eps)
    normed = x32 * rstd
    if ROUND_NORMED:  # exactly where the reference rounds
        normed = normed.to(x.dtype).to(tl.float32)
    return normed * w


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    weight_ptr,
    out_ptr,
    x_row_stride,
    out_row_stride,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two of HIDDEN
    ROUND_NORMED: tl.constexpr,  # round the normed row to x's dtype before the scale
    PDL: tl.constexpr,  # launched as a programmatic dependent (kernels.pdl)
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # nothing writes it
    wait_for_previous(PDL)
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    y = _normed(x, w, eps, HIDDEN, ROUND_NORMED)
    tl.store(out_ptr + row * out_row_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,  # the normed rows, or with QUANTIZE their FP8 values
    scale_ptr,  # QUANTIZE: [T] float32, each row's scale
    static_scale_ptr,  # QUANTIZE and STATIC: [1] float32, every row's
    x_row_stride,
    residual_row_stride,
    out_row_stride,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    ROUND_NORMED: tl.constexpr,
    QUANTIZE: tl.constexpr,  # quantize each normed row to FP8 (kernels.fp8_linear.quantize_row)
    ROUND_TO_X: tl.constexpr,  # QUANTIZE: round the normed row to x's dtype first
    STATIC: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    wait_for_previous(PDL)
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    residual_row = residual_ptr + row * residual_row_stride + cols
    r = tl.load(residual_row, mask=mask, other=0.0)
    # The new residual is rounded to the activation dtype (as the reference's `residual + x` is)
    # and the norm is taken of that rounded sum, so both outputs match the reference.
    total = (r.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
    tl.store(residual_row, total, mask=mask)
    y = _normed(total, w, eps, HIDDEN, ROUND_NORMED)
    out_row = out_ptr + row * out_row_stride + cols
    if QUANTIZE:
        # The row as the unfused norm would store it, then as `quantize_rows` quantizes that.
        if ROUND_TO_X:
            y = y.to(x.dtype).to(tl.float32)
        quantize_row(y, out_row, mask, scale_ptr + row, static_scale_ptr, STATIC)
    else:
        tl.store(out_row, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm of each row of x, scaled by weight.

    x: [T, H] with unit column stride (any row stride); weight: [H] contiguous;
    out (optional): [T, H] with unit column stride, of the reference's dtype (`_out_dtype`).
    Returns out, allocated when not given.
    Raises `KernelInputError` for any shape, dtype, device or layout it cannot handle.
    """
    _validate_rows({"x": x}, weight, eps)
    out_dtype = _out_dtype(x, weight)
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    else:
        _validate_out(out, x, out_dtype)
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        return out
    block, num_warps = _launch_shape(hidden)
    _rms_norm_kernel[(num_tokens,)](
        x,
        weight,
        out,
        x.stride(0),
        out.stride(0),
        float(eps),
        HIDDEN=hidden,
        BLOCK=block,
        ROUND_NORMED=not _scales_in_float32(x, weight),
        num_warps=num_warps,
        **launch_options(x.device),
    )
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual += x`, then RMSNorm of the sum. Returns (normed, residual).

    IN PLACE: the sum is written into `residual`, and the returned residual IS that tensor. The
    caller's old residual values are gone; callers must not reuse them (the reference returns a
    fresh tensor instead, with the same values).

    x, residual: [T, H], same dtype, unit column stride (any row stride); weight: [H]
    contiguous. normed is a new [T, H] tensor of the reference's dtype (`_out_dtype`).
    Raises `KernelInputError` for any shape, dtype, device or layout it cannot handle.
    """
    _validate_rows({"x": x, "residual": residual}, weight, eps)
    out = torch.empty(x.shape, dtype=_out_dtype(x, weight), device=x.device)
    _launch_add_rms_norm(x, residual, weight, eps, out)
    return out, residual


def add_rms_norm_fp8(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    static_scale: torch.Tensor | None = None,
) -> tuple[Fp8Rows, torch.Tensor]:
    """`add_rms_norm` with its normed rows quantized to FP8 in the same launch, as
    `kernels.fp8_linear.quantize_rows` quantizes `add_rms_norm`'s output (each row's own
    scale, or `static_scale`: [1] float32): the normed row, rounded to its dtype as
    `add_rms_norm` stores it, is quantized from registers and never stored. The same
    arithmetic, though the compiler may add a row's squares in another order than in
    `add_rms_norm` (a value rounding the other way lands an FP8 step apart: 2 in 33.5 M on an
    H200). Returns (the rows as `Fp8Rows` of the normed rows' dtype, residual), residual IN
    PLACE as there. An FP8 projection's input (a layer's qkv and gate/up projections) then
    costs no quantization kernel of its own.
    """
    _validate_rows({"x": x, "residual": residual}, weight, eps)
    check_static_scale(x, static_scale)
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    _launch_add_rms_norm(x, residual, weight, eps, q, scale, static_scale)
    return Fp8Rows(q, scale, _out_dtype(x, weight)), residual


def _launch_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    scale: torch.Tensor | None = None,
    static_scale: torch.Tensor | None = None,
) -> None:
    """Both `add_rms_norm`s' launch: with `scale`, `out` takes FP8 values and `scale` theirs."""
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        return
    block, num_warps = _launch_shape(hidden)
    _add_rms_norm_kernel[(num_tokens,)](
        x,
        residual,
        weight,
        out,
        out if scale is None else scale,  # any pointer: not read without QUANTIZE
        out if static_scale is None else static_scale,
        x.stride(0),
        residual.stride(0),
        out.stride(0),
        float(eps),
        HIDDEN=hidden,
        BLOCK=block,
        ROUND_NORMED=not _scales_in_float32(x, weight),
        QUANTIZE=scale is not None,
        ROUND_TO_X=_out_dtype(x, weight) == x.dtype,
        STATIC=static_scale is not None,
        num_warps=num_warps,
        **launch_options(x.device),
    )


def _scales_in_float32(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A float32 weight of a narrower x (Gemma's and Qwen3.5's `1 + w`): the normed row is
    scaled in float32 and rounded once, to x's dtype."""
    return weight.dtype == torch.float32 and x.dtype != torch.float32


def _out_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The reference's: x's dtype when scaled in float32, else `promote_types` of the two (the
    dtype of `weight * normed`)."""
    if _scales_in_float32(x, weight):
        return x.dtype
    return torch.promote_types(x.dtype, weight.dtype)


def _launch_shape(hidden: int) -> tuple[int, int]:
    block = triton.next_power_of_2(hidden)
    # About 8 to 16 elements per thread: H=4096 -> 8 warps, H=64 -> 1 warp; at most 16 warps.
    return block, max(1, min(16, block // 512))


def _validate_rows(rows: dict[str, torch.Tensor], weight: torch.Tensor, eps: float) -> None:
    """Check the [T, H] inputs (all of x's shape and dtype), weight [H] and eps."""
    named = {**rows, "weight": weight}
    for name, tensor in named.items():
        if not isinstance(tensor, torch.Tensor):
            raise KernelInputError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    check_devices(named)
    x = rows["x"]
    if x.dim() != 2:
        raise KernelInputError(f"x must have shape [T, H], got {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise KernelInputError(f"x dtype {x.dtype} is not one of float16, bfloat16, float32")
    for name, tensor in rows.items():
        if tensor.shape != x.shape:
            raise KernelInputError(
                f"{name} shape {tuple(tensor.shape)} differs from x {tuple(x.shape)}"
            )
        if tensor.dtype != x.dtype:
            raise KernelInputError(f"{name} dtype {tensor.dtype} differs from x dtype {x.dtype}")
        if x.shape[1] > 1 and tensor.stride(1) != 1:
            raise KernelInputError(
                f"{name} rows must be contiguous (unit column stride), got strides "
                f"{tensor.stride()}"
            )
    hidden = x.shape[1]
    if hidden == 0 or hidden > _MAX_HIDDEN:
        raise KernelInputError(f"hidden size {hidden} must be between 1 and {_MAX_HIDDEN}")
    if weight.shape != (hidden,):
        raise KernelInputError(f"weight must have shape ({hidden},), got {tuple(weight.shape)}")
    if weight.dtype not in FLOAT_DTYPES:
        raise KernelInputError(
            f"weight dtype {weight.dtype} is not one of float16, bfloat16, float32"
        )
    if not weight.is_contiguous():
        raise KernelInputError(f"weight must be contiguous, got strides {weight.stride()}")
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not eps >= 0:
        raise KernelInputError(f"eps must be a non-negative number, got {eps!r}")


def _validate_out(out: torch.Tensor, x: torch.Tensor, out_dtype: torch.dtype) -> None:
    if not isinstance(out, torch.Tensor):
        raise KernelInputError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.device != x.device:
        raise KernelInputError(f"out is on {out.device}, x on {x.device}")
    if out.shape != x.shape:
        raise KernelInputError(f"out shape {tuple(out.shape)} differs from x {tuple(x.shape)}")
    if out.dtype != out_dtype:
        raise KernelInputError(f"out dtype {out.dtype} must be {out_dtype} (weight * normed x)")
    if x.shape[1] > 1 and out.stride(1) != 1:
        raise KernelInputError(
            f"out rows must be contiguous (unit column stride), got strides {out.stride()}"
        )

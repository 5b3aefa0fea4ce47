"""Triton RMSNorm kernels: plain, and fused with the residual add that precedes it in Llama.

Semantics are those of `kernels.reference.rms_norm` / `add_rms_norm`, rounding included: the
statistics are float32, the normalized row is rounded to x's dtype before it is scaled by the
weight (as Hugging Face's Llama does) unless the weight is float32 and x narrower (Gemma's and
Qwen3.5's `1 + w` norms: scaled in float32, rounded once to x's dtype), and the fused residual
sum is rounded to x's dtype before it is normalized. One program normalizes one row of H
elements held entirely in registers.

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
from kernels.launch_checks import FLOAT_DTYPES, check_devices
from kernels.pdl import launch_options, wait_for_previous

# A whole row lives in one program's registers; 16 warps hold 32768 floats without spilling much.
_MAX_HIDDEN = 32768


@triton.jit
def _store_normed(x, w, out_row, mask, eps, HIDDEN: tl.constexpr, ROUND_NORMED: tl.constexpr):
    """Store RMSNorm(x) * w of one row `x` (in x's dtype, masked lanes 0; w: the weight in
    float32) at `out_row`, in out's dtype; both kernels end with it."""
    x32 = x.to(tl.float32)
    # Masked lanes are 0, so the sum covers exactly the H real elements.
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=0) / HIDDEN + eps)
    normed = x32 * rstd
    if ROUND_NORMED:  # exactly where the reference rounds
        normed = normed.to(x.dtype).to(tl.float32)
    y = normed * w
    tl.store(out_row, y.to(out_row.dtype.element_ty), mask=mask)


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
    out_row = out_ptr + row * out_row_stride + cols
    _store_normed(x, w, out_row, mask, eps, HIDDEN, ROUND_NORMED)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    x_row_stride,
    residual_row_stride,
    out_row_stride,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    ROUND_NORMED: tl.constexpr,
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
    out_row = out_ptr + row * out_row_stride + cols
    _store_normed(total, w, out_row, mask, eps, HIDDEN, ROUND_NORMED)


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
    out_dtype = _out_dtype(x, weight)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        return out, residual
    block, num_warps = _launch_shape(hidden)
    _add_rms_norm_kernel[(num_tokens,)](
        x,
        residual,
        weight,
        out,
        x.stride(0),
        residual.stride(0),
        out.stride(0),
        float(eps),
        HIDDEN=hidden,
        BLOCK=block,
        ROUND_NORMED=not _scales_in_float32(x, weight),
        num_warps=num_warps,
        **launch_options(x.device),
    )
    return out, residual


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

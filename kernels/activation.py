"""Triton SwiGLU activation: SiLU(gate) * up over the fused gate/up projection output.

Semantics are those of `kernels.reference.silu_and_mul`, rounding included: the math is float32,
SiLU(gate) is rounded to x's dtype (the reference's `F.silu` returns x's dtype) and the product
is rounded once more. Programs tile [token, column block]: I is large (14336 for Llama-3-8B), so
one row spans several programs and small batches still fill the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.errors import KernelInputError
from kernels.launch_checks import FLOAT_DTYPES, check_devices

# Columns per program: 8 per thread with 4 warps, 16-byte fp16/bf16 accesses.
_BLOCK = 1024
_NUM_WARPS = 4


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    x_row_stride,
    out_row_stride,
    intermediate,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate
    x_row = x_ptr + row * x_row_stride
    gate = tl.load(x_row + cols, mask=mask, other=0.0)
    up = tl.load(x_row + intermediate + cols, mask=mask, other=0.0).to(tl.float32)
    gate32 = gate.to(tl.float32)
    # gate / (1 + exp(-gate)) stays finite for very negative gate (exp -> inf gives -0).
    silu = (gate32 / (1.0 + tl.exp(-gate32))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, (silu * up).to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """SiLU(x[:, :I]) * x[:, I:].

    x: [T, 2I] with unit column stride (any row stride); out (optional): [T, I], x's dtype,
    unit column stride. Returns out, allocated when not given. Raises `KernelInputError` for
    any shape, dtype, device or layout it cannot handle.
    """
    _validate(x, out)
    num_tokens, width = x.shape
    intermediate = width // 2
    if out is None:
        out = torch.empty((num_tokens, intermediate), dtype=x.dtype, device=x.device)
    if num_tokens == 0 or intermediate == 0:
        return out
    grid = (num_tokens, triton.cdiv(intermediate, _BLOCK))
    _silu_and_mul_kernel[grid](
        x,
        out,
        x.stride(0),
        out.stride(0),
        intermediate,
        BLOCK=_BLOCK,
        num_warps=_NUM_WARPS,
    )
    return out


def _validate(x: torch.Tensor, out: torch.Tensor | None) -> None:
    named = {"x": x} if out is None else {"x": x, "out": out}
    for name, tensor in named.items():
        if not isinstance(tensor, torch.Tensor):
            raise KernelInputError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    check_devices(named)
    if x.dim() != 2:
        raise KernelInputError(f"x must have shape [T, 2I], got {tuple(x.shape)}")
    if x.shape[1] % 2 != 0:
        raise KernelInputError(f"x width {x.shape[1]} must be even (gate and up halves)")
    if x.dtype not in FLOAT_DTYPES:
        raise KernelInputError(f"x dtype {x.dtype} is not one of float16, bfloat16, float32")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise KernelInputError(
            f"x rows must be contiguous (unit column stride), got strides {x.stride()}"
        )
    if out is None:
        return
    expected = (x.shape[0], x.shape[1] // 2)
    if out.shape != expected:
        raise KernelInputError(f"out must have shape {expected}, got {tuple(out.shape)}")
    if out.dtype != x.dtype:
        raise KernelInputError(f"out dtype {out.dtype} differs from x dtype {x.dtype}")
    if out.shape[1] > 1 and out.stride(1) != 1:
        raise KernelInputError(
            f"out rows must be contiguous (unit column stride), got strides {out.stride()}"
        )

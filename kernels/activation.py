"""Triton gated activations over the fused gate/up projection output: SiLU(gate) * up (SwiGLU:
Llama and most families) and GELU-tanh(gate) * up (GeGLU: Gemma).

Semantics are those of `kernels.reference.silu_and_mul` / `gelu_tanh_and_mul`, rounding
included: the math is float32, the activation of gate is rounded to x's dtype (as torch's
`F.silu` / `F.gelu` return x's dtype) and the product is rounded once more. GELU's tanh form,
0.5·g·(1 + tanh(z)) with z = sqrt(2/pi)·(g + 0.044715·g³), is computed as g / (1 + exp(-2z)),
the same function, finite for every g. `gated_product` is the one definition the fused
projections (`kernels.linear`, `kernels.fp8_linear`) share; `expert_gated_product` (of float32
sums, and gpt-oss's clamped SwiGLU) the one the fused MoE kernel's two paths share. Programs
tile [token, column block]: I is large (14336 for Llama-3-8B), so one row spans several
programs and small batches still fill the GPU.
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


# The gated activations by name: the `activation` of a model's MLP (ModelConfig.activation).
ACTIVATIONS = ("silu", "gelu_tanh")
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # a Triton global must be a constexpr


@triton.jit
def gated_product(gate, up, ACTIVATION: tl.constexpr):
    """act(gate) * up for tiles of x's dtype, rounded where the reference rounds (module
    docstring); in x's dtype."""
    g = gate.to(tl.float32)
    if ACTIVATION == "gelu_tanh":
        z = _SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)
        act = g / (1.0 + tl.exp(-2.0 * z))
    else:
        # g / (1 + exp(-g)) stays finite for very negative g (exp -> inf gives -0).
        act = g / (1.0 + tl.exp(-g))
    return (act.to(gate.dtype).to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def expert_gated_product(
    gate_sum, up_sum, dtype: tl.constexpr, alpha, limit, CLAMPED: tl.constexpr,
    ACTIVATION: tl.constexpr,
):  # fmt: skip
    """act(gate) * up of a mixture of experts' float32 gate and up sums, act SiLU or (Gemma 4)
    GELU-tanh by ACTIVATION (gpt-oss, CLAMPED: its clamped SwiGLU,
    `kernels.moe_spec.ClampedSwiglu`'s alpha and limit), in `dtype`, rounded as the reference
    rounds: the sums to the dtype, then each elementwise op's result. Both paths of the fused MoE
    kernel (`kernels.moe`, `kernels.moe_gemv`) end their gate/up step with it."""
    if CLAMPED:
        gate = tl.minimum(gate_sum.to(dtype).to(tl.float32), limit)
        up = tl.minimum(tl.maximum(up_sum.to(dtype).to(tl.float32), -limit), limit)
        scaled = (gate * alpha).to(dtype).to(tl.float32)
        sigmoid = (1.0 / (1.0 + tl.exp(-scaled))).to(dtype).to(tl.float32)
        glu = (gate * sigmoid).to(dtype).to(tl.float32)
        out = ((up + 1.0).to(dtype).to(tl.float32) * glu).to(dtype)
    else:
        out = gated_product(gate_sum.to(dtype), up_sum.to(dtype), ACTIVATION)
    return out


@triton.jit
def _gated_and_mul_kernel(
    x_ptr,
    out_ptr,
    x_row_stride,
    out_row_stride,
    intermediate,
    ACTIVATION: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate
    x_row = x_ptr + row * x_row_stride
    gate = tl.load(x_row + cols, mask=mask, other=0.0)
    up = tl.load(x_row + intermediate + cols, mask=mask, other=0.0)
    product = gated_product(gate, up, ACTIVATION)
    tl.store(out_ptr + row * out_row_stride + cols, product, mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """SiLU(x[:, :I]) * x[:, I:].

    x: [T, 2I] with unit column stride (any row stride); out (optional): [T, I], x's dtype,
    unit column stride. Returns out, allocated when not given. Raises `KernelInputError` for
    any shape, dtype, device or layout it cannot handle.
    """
    return gated_and_mul(x, "silu", out)


def gelu_tanh_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """GELU-tanh(x[:, :I]) * x[:, I:], as `silu_and_mul` takes and returns them."""
    return gated_and_mul(x, "gelu_tanh", out)


def gated_and_mul(
    x: torch.Tensor, activation: str, out: torch.Tensor | None = None
) -> torch.Tensor:
    """act(x[:, :I]) * x[:, I:] for `activation` one of `ACTIVATIONS`."""
    if activation not in ACTIVATIONS:
        raise KernelInputError(f"activation {activation!r} is not one of {ACTIVATIONS}")
    _validate(x, out)
    num_tokens, width = x.shape
    intermediate = width // 2
    if out is None:
        out = torch.empty((num_tokens, intermediate), dtype=x.dtype, device=x.device)
    if num_tokens == 0 or intermediate == 0:
        return out
    grid = (num_tokens, triton.cdiv(intermediate, _BLOCK))
    _gated_and_mul_kernel[grid](
        x,
        out,
        x.stride(0),
        out.stride(0),
        intermediate,
        ACTIVATION=activation,
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

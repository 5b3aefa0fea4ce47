"""Triton projections for decode-sized batches: `x @ W.T (+ b)` with at most 16 rows in x.

A decode step at small batch reads every weight once and does almost no arithmetic with it, so
its speed is the rate at which the weights stream from memory, and both kernels here are built
for that. Each program owns a few output features and streams their weight rows along K
(K-contiguous, the layout `nn.Linear` stores), so every weight byte is read exactly once:

- one row of x (batch-1 decode): products on the CUDA cores, summed along K at the end. With
  no tensor-core tile to fill, a program can own as few as 2 weight rows, which gives enough
  programs to keep every SM streaming even for the 4096-row projections. Measured on an H100,
  this beats cuBLAS's GEMV on all five projections of the 8B model (docs/BENCHMARKS.md).
- 2 to 16 rows: each `[BLOCK_N, BLOCK_K]` weight tile meets all rows of x at once on the
  tensor cores (x padded to 16 rows).

The down projection of one row can take the fused gate/up output and apply SiLU(gate)·up or
GELU-tanh(gate)·up while loading it (`silu_mul_linear`, `gelu_tanh_mul_linear`), which saves
the activation kernel and its output's round trip through memory. Semantics are those of
`kernels.reference.linear` / `silu_mul_linear` / `gelu_tanh_mul_linear`: float32 accumulation,
the gated product rounded where the reference rounds it, bias added in float32, one final
rounding to x's dtype. Batches of more than `MAX_ROWS` rows are the matmul library's
job, and `kernels.triton_ops` routes them there.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kernels.activation import ACTIVATIONS, gated_product
from kernels.errors import KernelInputError
from kernels.launch_checks import FLOAT_DTYPES, check_devices, triton_interprets
from kernels.pdl import launch_options, wait_for_previous

# x rows are padded to one tensor-core tile; more rows than this go to cuBLAS.
MAX_ROWS = 16


@dataclass(frozen=True, slots=True)
class LinearConfig:
    """Tiles of one launch. `fma`: a single row of x, multiplied on the CUDA cores rather than
    padded to a tensor-core tile, so `block_n` may go below 16 and more programs share the
    weight stream."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    fma: bool = False


# Measured with `bench/kernel_micro.py --sweep-linear` on an H100 (back-to-back launches, none
# served from L2): the fastest tiles for the 8B model's projections, at 1 row (CUDA cores) and
# at 8 rows (tensor cores). Other shapes take the defaults, the most common winners.
_ONE_ROW = {
    (6144, 4096): LinearConfig(2, 1024, num_warps=4, num_stages=4, fma=True),
    (4096, 4096): LinearConfig(4, 1024, num_warps=8, num_stages=3, fma=True),
    (28672, 4096): LinearConfig(2, 1024, num_warps=4, num_stages=4, fma=True),
    (4096, 14336): LinearConfig(2, 1024, num_warps=8, num_stages=2, fma=True),
    (128256, 4096): LinearConfig(4, 1024, num_warps=8, num_stages=4, fma=True),
}
_ONE_ROW_DEFAULT = LinearConfig(2, 1024, num_warps=4, num_stages=3, fma=True)
# The same for FP8 weights (`kernels.fp8_linear`'s one-row path, `--sweep-fp8`): a byte per
# weight wants longer K tiles and more rows per program for the same bytes in flight.
_ONE_ROW_FP8 = {
    (6144, 4096): LinearConfig(2, 2048, num_warps=4, num_stages=4, fma=True),
    (4096, 4096): LinearConfig(4, 1024, num_warps=4, num_stages=3, fma=True),
    (28672, 4096): LinearConfig(4, 1024, num_warps=4, num_stages=3, fma=True),
    (4096, 14336): LinearConfig(8, 1024, num_warps=8, num_stages=4, fma=True),
}
_FEW_ROWS = {
    (6144, 4096): LinearConfig(64, 256, num_warps=4, num_stages=4),
    (4096, 4096): LinearConfig(64, 256, num_warps=4, num_stages=4),
    (28672, 4096): LinearConfig(32, 512, num_warps=4, num_stages=4),
    (128256, 4096): LinearConfig(32, 512, num_warps=4, num_stages=4),
}
_FEW_ROWS_DEFAULT = LinearConfig(32, 256, num_warps=4, num_stages=4)


def config_for(n: int, k: int, rows: int, itemsize: int) -> LinearConfig:
    """Tiles for an [N, K] weight of `itemsize`-byte elements and `rows` rows of x.

    The tables are for 16-bit weights, one row's also for FP8; other widths take K tiles of the
    same bytes (so the pipeline stages still fit in shared memory).
    """
    if rows == 1 and itemsize == 1 and (n, k) in _ONE_ROW_FP8:
        return _ONE_ROW_FP8[(n, k)]
    config = (
        _ONE_ROW.get((n, k), _ONE_ROW_DEFAULT)
        if rows == 1
        else _FEW_ROWS.get((n, k), _FEW_ROWS_DEFAULT)
    )
    if itemsize != 2:
        config = replace(config, block_k=config.block_k * 2 // itemsize)
    return config


@triton.jit
def _x_tile(x_ptr, offs_k, x_mask, k, ACTIVATION: tl.constexpr):
    """A tile of the one row of x, in x's dtype; with an ACTIVATION, of act(gate) * up for
    x = [gate | up] (`kernels.activation.gated_product`)."""
    if ACTIVATION == "":
        return tl.load(x_ptr + offs_k, mask=x_mask, other=0.0)
    gate = tl.load(x_ptr + offs_k, mask=x_mask, other=0.0)
    up = tl.load(x_ptr + k + offs_k, mask=x_mask, other=0.0)
    return gated_product(gate, up, ACTIVATION)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    w_scale_ptr,
    b_ptr,
    out_ptr,
    n,
    k,
    w_row_stride,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,  # "", or x is [1, 2k] = [gate | up]: multiply act(gate) * up
    SCALED: tl.constexpr,  # an FP8 weight: multiply each output by its channel's scale
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent of the kernel before it
):
    """One row of x: products on the CUDA cores, summed along K once at the end.

    The first weight tile is requested before x, the previous kernel's output, is waited for:
    launched as a programmatic dependent (Hopper), the weights start streaming while the
    previous kernel's last programs finish.
    """
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * w_row_stride
    offs_k = tl.arange(0, BLOCK_K)
    x_mask = offs_k < k  # x is a few KiB read from L2: its mask costs nothing
    w_mask = n_mask[:, None] if EVEN_K else n_mask[:, None] & x_mask[None, :]
    w = tl.load(w_rows + offs_k[None, :], mask=w_mask, other=0.0)
    wait_for_previous(PDL)
    x = _x_tile(x_ptr, offs_k, x_mask, k, ACTIVATION)
    acc = w.to(tl.float32) * x.to(tl.float32)[None, :]
    for k0 in range(BLOCK_K, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x_mask = offs_k < k
        w_mask = n_mask[:, None] if EVEN_K else n_mask[:, None] & x_mask[None, :]
        w = tl.load(w_rows + offs_k[None, :], mask=w_mask, other=0.0)
        x = _x_tile(x_ptr, offs_k, x_mask, k, ACTIVATION)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if SCALED:
        y *= tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _skinny_linear_kernel(
    x_ptr,
    w_ptr,
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
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < n
    m_mask = offs_m < rows
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * w_row_stride
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * x_row_stride
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
        # [BLOCK_N, BLOCK_K] @ [BLOCK_K, BLOCK_M]: the weight tile is the wide operand.
        acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + offs_m.to(tl.int64)[None, :] * out_row_stride + offs_n[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: LinearConfig | None = None,
) -> torch.Tensor:
    """x: [M, K] with M <= 16, weight: [N, K], bias: [N] or None -> [M, N] in x's dtype.

    `config` overrides the tiles `config_for` picks (benchmarks and tests).
    """
    _validate(x, weight, bias, in_features=weight.shape[1] if weight.dim() == 2 else -1)
    rows, (n, k) = x.shape[0], weight.shape
    config = config or config_for(n, k, rows, weight.element_size())
    if config.fma and rows != 1:
        raise KernelInputError(f"an fma config takes one row of x, got {rows}")
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(bias.expand(rows, n)) if bias is not None else out.zero_()
    if config.fma:
        return gemv(x, weight, bias, out, activation="", config=config)
    _skinny_linear_kernel[(triton.cdiv(n, config.block_n),)](
        x,
        weight,
        bias if bias is not None else weight,  # never read without HAS_BIAS
        out,
        rows,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        EVEN_K=k % config.block_k == 0,
        BLOCK_M=MAX_ROWS,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        # float32 must stay float32: TF32 would change the greedy tokens the GPU tests compare.
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def silu_mul_linear(
    x: torch.Tensor, weight: torch.Tensor, *, config: LinearConfig | None = None
) -> torch.Tensor:
    """The MLP's down projection of SiLU(gate) * up for one row x = [gate | up]: [1, 2I],
    weight: [N, I] -> [1, N] in x's dtype. (Several rows: `silu_and_mul`, then a matmul.)"""
    return gated_linear(x, weight, "silu", config=config)


def gelu_tanh_mul_linear(
    x: torch.Tensor, weight: torch.Tensor, *, config: LinearConfig | None = None
) -> torch.Tensor:
    """`silu_mul_linear` with GELU-tanh(gate) * up (Gemma)."""
    return gated_linear(x, weight, "gelu_tanh", config=config)


def gated_linear(
    x: torch.Tensor, weight: torch.Tensor, activation: str, *, config: LinearConfig | None = None
) -> torch.Tensor:
    """The down projection of act(gate) * up for one row x = [gate | up], `activation` one of
    `kernels.activation.ACTIVATIONS`."""
    in_features = weight.shape[1] if weight.dim() == 2 else -1
    _validate(x, weight, None, in_features=2 * in_features)
    if activation not in ACTIVATIONS:
        raise KernelInputError(f"activation {activation!r} is not one of {ACTIVATIONS}")
    if x.shape[0] != 1:
        raise KernelInputError(f"the fused down projection takes one row of x, got {x.shape[0]}")
    n, k = weight.shape
    config = config or config_for(n, k, 1, weight.element_size())
    if not config.fma:
        raise KernelInputError(
            "the fused down projection runs on the CUDA cores: give an fma config"
        )
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    if n == 0 or k == 0:
        return out.zero_()
    return gemv(x, weight, None, out, activation=activation, config=config)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    *,
    activation: str,
    config: LinearConfig,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The one-row launch, inputs already checked: out[0] = x[0] @ weight.T (* scale) (+ bias).
    `scale`: [N] float32 per output channel, for an FP8 weight (`kernels.fp8_linear`)."""
    n, k = weight.shape
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x,
        weight,
        scale if scale is not None else weight,  # never read without SCALED
        bias if bias is not None else weight,  # never read without HAS_BIAS
        out,
        n,
        k,
        weight.stride(0),
        HAS_BIAS=bias is not None,
        ACTIVATION=activation,
        SCALED=scale is not None,
        EVEN_K=k % config.block_k == 0,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **launch_options(x.device),
    )
    return out


def _validate(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, in_features: int
) -> None:
    named = {"x": x, "weight": weight} if bias is None else {"x": x, "weight": weight, "bias": bias}
    for name, tensor in named.items():
        if not isinstance(tensor, torch.Tensor):
            raise KernelInputError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    check_devices(named)
    if weight.dim() != 2:
        raise KernelInputError(f"weight must have shape [N, K], got {tuple(weight.shape)}")
    if x.dim() != 2 or x.shape[1] != in_features:
        raise KernelInputError(
            f"x must have shape [M, {in_features}] for weight {tuple(weight.shape)}, "
            f"got {tuple(x.shape)}"
        )
    if x.shape[0] > MAX_ROWS:
        raise KernelInputError(
            f"x has {x.shape[0]} rows; this kernel takes at most {MAX_ROWS} (use a matmul)"
        )
    if x.dtype not in FLOAT_DTYPES:
        raise KernelInputError(f"x dtype {x.dtype} is not one of float16, bfloat16, float32")
    if x.dtype == torch.bfloat16 and triton_interprets():
        # Triton's interpreter multiplies bfloat16 tl.dot operands as raw integers; fail closed.
        raise KernelInputError("bfloat16 is not supported under TRITON_INTERPRET=1; use fp16/fp32")
    for name, tensor in named.items():
        if name != "x" and tensor.dtype != x.dtype:
            raise KernelInputError(f"{name} dtype {tensor.dtype} differs from x dtype {x.dtype}")
        if tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
            raise KernelInputError(
                f"{name} must be contiguous along its last dimension, got strides {tensor.stride()}"
            )
    if bias is not None and bias.shape != (weight.shape[0],):
        raise KernelInputError(
            f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}"
        )

"""The fused mixture of experts' path for a few tokens (`kernels.moe.fused_moe` takes it by
`kernels.moe.tiles_for`): per-pair GEMVs, no grouping.

A batch of a few tokens (at most `GEMV_MAX_PAIRS` pairs, and fewer than E) skips the grouping:
its three steps of small torch ops cost more than the experts' bytes take to stream at batch
1. There, each (pair, column block) program streams its expert's gate and up rows against the
token's row of x on the CUDA cores (a GEMV, as `kernels.linear`'s for one row), and the down
step is a GEMV per (token, column block) that runs the token's k experts in turn, weights each
output and sums them: the combine happens in registers, and no pair is ever sorted. A pair
whose expert repeats in another token's pairs reads it again, which a few tokens can afford.

Semantics are `kernels.reference.fused_moe`'s, rounding included, as on the grouped path.
FP8 experts are read weight-only here, as the dense FP8 projections' one-row GEMV reads its
weight (`kernels.fp8_linear`): the e4m3 bytes (half bfloat16's) meet x as it is, in float32,
and each channel's sum is multiplied by its scale before the bias: the product of x with the
dequantized weight, which W8A8 would only round further on the CUDA cores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.activation import expert_gated_product
from kernels.moe_spec import ClampedSwiglu
from kernels.ops import Fp8Weight


@dataclass(frozen=True, slots=True)
class GemvTiles:
    """The per-pair GEMV path's tiles: columns per program of the gate/up step and of the down
    step, and the K tile both stream."""

    block_n: int
    down_block_n: int
    block_k: int
    num_warps: int = 4


# `bench/moe_kernel.py --sweep` on an H100, Qwen3-30B-A3B's experts: at batch 1 53 µs (47% of
# copy) against 69 µs with 256-wide K tiles; at batch 4 (32 pairs) the GEMV path's 121 µs beat
# the grouped GEMMs' 187 µs.
GEMV_TILES = GemvTiles(block_n=16, down_block_n=8, block_k=512)
# At most this many (token, expert) pairs take the GEMV path (and fewer than E).
GEMV_MAX_PAIRS = 32


@triton.jit
def _gemv_gate_up_kernel(
    x_ptr,  # [T, H]
    w_ptr,  # [E, 2I, H]: each expert's gate rows, then its up rows (FP8: e4m3)
    bias_ptr,  # [E, 2I] (read only when HAS_BIAS)
    scale_ptr,  # [E, 2I] float32 per-channel scales (read only when FP8)
    out_ptr,  # [T * k, I]: act(gate) * up per pair
    ids_ptr,  # [T * k]: each pair's expert (-1: held by another rank)
    size,  # I
    hidden,  # H
    x_row_stride,
    w_expert_stride,
    w_row_stride,
    bias_expert_stride,
    scale_expert_stride,
    out_row_stride,
    alpha,
    limit,
    TOP_K: tl.constexpr,
    CLAMPED: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program (pair, column block): its expert's gate and up rows times its token's row."""
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    if expert < 0:
        return  # an expert another rank holds: the down step skips the pair
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < size
    gate_rows = w_ptr + expert * w_expert_stride + offs_n.to(tl.int64)[:, None] * w_row_stride
    up_rows = gate_rows + size * w_row_stride
    x_row = x_ptr + (pair // TOP_K).to(tl.int64) * x_row_stride
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < hidden
        w_mask = n_mask[:, None] & k_mask[None, :]
        x = tl.load(x_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        acc += tl.load(gate_rows + offs_k[None, :], mask=w_mask, other=0.0).to(tl.float32) * x
        acc_up += tl.load(up_rows + offs_k[None, :], mask=w_mask, other=0.0).to(tl.float32) * x
    gate = tl.sum(acc, axis=1)
    up = tl.sum(acc_up, axis=1)
    if FP8:
        scales = scale_ptr + expert * scale_expert_stride + offs_n
        gate *= tl.load(scales, mask=n_mask, other=0.0)
        up *= tl.load(scales + size, mask=n_mask, other=0.0)
    if HAS_BIAS:  # added to the float32 sums, before their one rounding (as F.linear's)
        bias_row = bias_ptr + expert * bias_expert_stride + offs_n
        gate += tl.load(bias_row, mask=n_mask, other=0.0).to(tl.float32)
        up += tl.load(bias_row + size, mask=n_mask, other=0.0).to(tl.float32)
    out = expert_gated_product(
        gate, up, out_ptr.dtype.element_ty, alpha, limit, CLAMPED, ACTIVATION
    )
    tl.store(out_ptr + pair.to(tl.int64) * out_row_stride + offs_n, out, mask=n_mask)


@triton.jit
def _gemv_down_combine_kernel(
    h_ptr,  # [T * k, I]: the gate/up step's output
    w_ptr,  # [E, H, I] (FP8: e4m3)
    bias_ptr,  # [E, H] (read only when HAS_BIAS)
    scale_ptr,  # [E, H] float32 per-channel scales (read only when FP8)
    out_ptr,  # [T, H]
    ids_ptr,  # [T * k]
    weights_ptr,  # [T * k] float32 routing weights
    hidden,  # H
    size,  # I
    h_row_stride,
    w_expert_stride,
    w_row_stride,
    bias_expert_stride,
    scale_expert_stride,
    out_row_stride,
    TOP_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program (token, column block): the token's k experts' down rows in turn, each output
    rounded and weighted as the reference's, summed in float32 and rounded once."""
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    dtype = out_ptr.dtype.element_ty
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = token * TOP_K + j
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        if expert >= 0:  # -1: held by another rank, adds nothing here
            rows = w_ptr + expert * w_expert_stride + offs_n.to(tl.int64)[:, None] * w_row_stride
            h_row = h_ptr + pair * h_row_stride
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            for k0 in range(0, size, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_mask = offs_k < size
                h = tl.load(h_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)[None, :]
                w_mask = n_mask[:, None] & k_mask[None, :]
                acc += tl.load(rows + offs_k[None, :], mask=w_mask, other=0.0).to(tl.float32) * h
            y = tl.sum(acc, axis=1)
            if FP8:
                scales = scale_ptr + expert * scale_expert_stride + offs_n
                y *= tl.load(scales, mask=n_mask, other=0.0)
            if HAS_BIAS:
                y += tl.load(
                    bias_ptr + expert * bias_expert_stride + offs_n, mask=n_mask, other=0.0
                ).to(tl.float32)
            weight = tl.load(weights_ptr + pair)
            total += (y.to(dtype).to(tl.float32) * weight).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * out_row_stride + offs_n, total.to(dtype), mask=n_mask)


def gemv_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor | Fp8Weight,
    down: torch.Tensor | Fp8Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    tiles: GemvTiles,
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    clamped_swiglu: ClampedSwiglu | None,
    activation: str,
) -> torch.Tensor:
    """`kernels.moe.fused_moe` over few pairs, its arguments validated there: two launches, no
    grouping, the combine in the second."""
    num_tokens, hidden = x.shape
    w_gate_up, w_down = expert_bytes(gate_up), expert_bytes(down)
    size, top_k = w_gate_up.shape[1] // 2, topk_ids.shape[1]
    fp8 = isinstance(gate_up, Fp8Weight)
    ids = topk_ids.reshape(-1)
    swiglu = torch.empty(num_tokens * top_k, size, dtype=x.dtype, device=x.device)
    out = torch.empty_like(x)
    act = clamped_swiglu or ClampedSwiglu(alpha=1.0, limit=1.0)  # unread unless CLAMPED
    _gemv_gate_up_kernel[(ids.numel(), triton.cdiv(size, tiles.block_n))](
        x, w_gate_up, bias_or(gate_up_bias, w_gate_up), scale_or(gate_up), swiglu, ids, size,
        hidden, x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1),
        bias_stride(gate_up_bias), scale_or(gate_up).stride(0), swiglu.stride(0), act.alpha,
        act.limit, TOP_K=top_k, CLAMPED=clamped_swiglu is not None, ACTIVATION=activation,
        HAS_BIAS=gate_up_bias is not None, FP8=fp8, BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, num_warps=tiles.num_warps,
    )  # fmt: skip
    _gemv_down_combine_kernel[(num_tokens, triton.cdiv(hidden, tiles.down_block_n))](
        swiglu, w_down, bias_or(down_bias, w_down), scale_or(down), out, ids,
        topk_weights.reshape(-1), hidden, size, swiglu.stride(0), w_down.stride(0),
        w_down.stride(1), bias_stride(down_bias), scale_or(down).stride(0), out.stride(0),
        TOP_K=top_k, HAS_BIAS=down_bias is not None, FP8=fp8, BLOCK_N=tiles.down_block_n,
        BLOCK_K=tiles.block_k, num_warps=tiles.num_warps,
    )  # fmt: skip
    return out


def expert_bytes(weight: torch.Tensor | Fp8Weight) -> torch.Tensor:
    """The stacked expert tensor a kernel streams: the weight itself, or an FP8 one's e4m3."""
    return weight.weight if isinstance(weight, Fp8Weight) else weight


def scale_or(weight: torch.Tensor | Fp8Weight) -> torch.Tensor:
    """The per-channel scales ([E, N] float32) a kernel takes for an FP8 expert weight; for one
    in the model's dtype any tensor, unread without FP8."""
    return weight.scale if isinstance(weight, Fp8Weight) else weight


def bias_or(bias: torch.Tensor | None, placeholder: torch.Tensor) -> torch.Tensor:
    """The pointer a kernel takes for an optional expert bias (both MoE paths): any tensor,
    unread without HAS_BIAS."""
    return placeholder if bias is None else bias


def bias_stride(bias: torch.Tensor | None) -> int:
    """The expert stride a kernel takes for an optional expert bias (0 when there is none)."""
    return 0 if bias is None else bias.stride(0)

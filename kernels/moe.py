"""Triton fused mixture-of-experts: each token through its k SwiGLU experts, weighted and summed.

The plan (vLLM's and SGLang's fused_moe, in three steps):

1. `align_block_size`: the T * k (token, expert) pairs are sorted by expert, and each expert's
   run is padded to a multiple of BLOCK_M with an index no pair has, so every block of BLOCK_M
   sorted pairs belongs to one expert. Plain torch ops on the device, no host sync: the grid is
   sized for the worst padding, and blocks past the real total return at once, so a decode
   step's launch has a fixed shape a CUDA graph can capture. Pairs whose expert id is -1 (an
   expert another rank holds, under expert parallelism) are grouped last, as if of an expert
   E, whose blocks store zeros for them and read no weights.
2. One grouped GEMM for gate and up: a program takes a block of pairs and a column block of I,
   gathers its tokens' rows of x, multiplies them by its expert's gate rows and up rows (two
   accumulators over the same x tile) and stores act(gate) * up for each pair: [T * k, I],
   act SiLU or (Gemma 4) tanh-approximated GELU (gpt-oss: the experts' biases added first, and
   its clamped SwiGLU, `ClampedSwiglu`).
3. One grouped GEMM for down over those rows, each pair's output multiplied by its routing
   weight as it is stored ([T * k, H]); the k outputs of a token are then summed in float32
   (the combine, in torch).

An expert's weights are read once per block of its pairs, so a decode step reads each chosen
expert once, and only those. Semantics are `kernels.reference.fused_moe`'s, rounding included.

A batch of a few tokens (at most `GEMV_MAX_PAIRS` pairs, and fewer than E) skips the grouping
for per-pair GEMVs (`kernels.moe_gemv`, whose tiles `tiles_for` returns for it).

FP8 experts (`kernels.ops.Fp8Weight`s of [E, N, K] e4m3 with a scale per output channel, [E, N])
follow the dense FP8 projections' choice per regime (`kernels.fp8_linear`): the GEMV path is
weight-only (x as it is against the FP8 bytes, the sums scaled by the channel's scale); the
grouped GEMMs are W8A8: x is quantized per token (`kernels.fp8_linear.quantize_rows`) before
the gate/up GEMM, and the act(gate) * up rows per pair before the down GEMM, and each FP8 tile
is widened exactly to float16 for the tensor cores, the float32 sums scaled by the row's scale,
then the channel's. Semantics are then `kernels.reference.fused_moe` with FP8 weights.

Tiles (`MoeTiles`) come from a small table by the pairs per expert: few (decode) want short
BLOCK_M and long K tiles to stream weights; many (prefill) want square tensor-core tiles. The
values are starting points from vLLM's H100 tables; `bench/moe_kernel.py --sweep` measures them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.activation import ACTIVATIONS, expert_gated_product
from kernels.errors import KernelInputError
from kernels.fp8 import FP8_DTYPE
from kernels.fp8_linear import quantize_rows
from kernels.launch_checks import FLOAT_DTYPES, check_devices, triton_interprets
from kernels.moe_gemv import (
    GEMV_MAX_PAIRS,
    GEMV_TILES,
    GemvTiles,
    bias_or,
    bias_stride,
    expert_bytes,
    gemv_moe,
    scale_or,
)
from kernels.moe_spec import ClampedSwiglu
from kernels.ops import Fp8Weight


@dataclass(frozen=True, slots=True)
class MoeTiles:
    block_m: int  # (token, expert) pairs per program, all of one expert
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# tl.dot needs every tile dimension >= 16.
DECODE_TILES = MoeTiles(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
PREFILL_TILES = MoeTiles(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)
LONG_PREFILL_TILES = MoeTiles(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
# Above this many pairs per expert on average, an expert's blocks are full enough for the
# prefill tiles; from the second, for 128-row ones. Measured on the H100 with Qwen3-30B-A3B's
# experts (bench/moe_kernel.py --sweep, docs/BENCHMARKS.md): at 32 pairs per expert (512
# tokens) the best 64-row tiles tie; at 128 and 512 (2,048 and 8,192 tokens) 128-row tiles are
# 7% and 11% faster.
_DECODE_PAIRS_PER_EXPERT = 16
_LONG_PREFILL_PAIRS_PER_EXPERT = 128


def tiles_for(num_tokens: int, top_k: int, num_experts: int) -> MoeTiles | GemvTiles:
    """The table's plan for a batch (a function of shapes only: CUDA graphs replay it)."""
    num_pairs = num_tokens * top_k
    if num_pairs <= GEMV_MAX_PAIRS and num_pairs < num_experts:
        return GEMV_TILES
    pairs_per_expert = num_pairs / num_experts
    if pairs_per_expert <= _DECODE_PAIRS_PER_EXPERT:
        return DECODE_TILES
    return (
        LONG_PREFILL_TILES if pairs_per_expert >= _LONG_PREFILL_PAIRS_PER_EXPERT else PREFILL_TILES
    )


def align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, expert) pairs grouped by expert, each group padded to a multiple of block_m.

    topk_ids: [T, k], each in 0..E-1 or -1 (an expert another rank holds) -> (sorted_ids,
    block_experts, num_padded):
    sorted_ids [P] int32: pair indices (t * k + j), expert by expert, in pair order within an
      expert, the -1 pairs last as if of expert E, each run padded with T * k; P = T*k +
      min(T*k, E + 1) * (block_m - 1), the most padding can take;
    block_experts [P / block_m] int32: the expert of each block, E for the -1 pairs' blocks
      (whose outputs are zeros) and past the real blocks;
    num_padded [1] int32: how many of sorted_ids are real pairs or their padding.
    """
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)  # [N]
    flat = torch.where(flat < 0, num_experts, flat)  # expert E: held by another rank
    num_pairs = flat.numel()
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)  # [E + 1]
    padded_start = padded_end - padded
    order = torch.argsort(flat, stable=True)  # pair indices, grouped by expert
    experts = flat[order]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[experts]
    size = num_pairs + min(num_pairs, num_experts + 1) * (block_m - 1)
    sorted_ids = torch.full((size,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, padded_start[experts] + rank, order.to(torch.int32))
    block_starts = torch.arange(0, size, block_m, device=device)
    block_experts = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts)
    return sorted_ids, block_experts.to(torch.int32), padded_end[-1:].to(torch.int32)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [num_a_rows, K]: x (by token) or the SwiGLU rows (by pair); FP8: quantized
    b_ptr,  # [E, N, K]: the experts' weights, nn.Linear's layout per expert (FP8: e4m3)
    bias_ptr,  # [E, N]: the experts' biases (read only when HAS_BIAS)
    a_scale_ptr,  # [num_a_rows] float32: each row's scale (read only when FP8)
    b_scale_ptr,  # [E, N] float32: each output channel's scale (read only when FP8)
    c_ptr,  # [T * k, N_OUT]: one row per pair
    weights_ptr,  # [T * k] float32 routing weights (MUL_WEIGHT)
    sorted_ids_ptr,
    block_experts_ptr,
    num_padded_ptr,
    n_out,  # output columns: I (SILU_MUL, of 2I weight rows) or H
    num_experts,  # E: a block of expert E holds pairs of experts another rank holds
    k,
    num_pairs,
    a_row_stride,
    b_expert_stride,
    b_row_stride,
    bias_expert_stride,
    b_scale_expert_stride,
    c_row_stride,
    alpha,  # CLAMPED: gpt-oss's sigmoid slope
    limit,  # CLAMPED: its clamp on gate (above) and up (both sides)
    PAIRS_PER_A_ROW: tl.constexpr,  # top_k when a is x (pair t * k + j reads token t), else 1
    SILU_MUL: tl.constexpr,  # b holds [gate; up] rows: store SiLU(a @ gate.T) * (a @ up.T)
    CLAMPED: tl.constexpr,  # SILU_MUL as gpt-oss's clamped SwiGLU (kernels.moe_spec.ClampedSwiglu)
    ACTIVATION: tl.constexpr,  # SILU_MUL, not CLAMPED: the gate's "silu" or "gelu_tanh"
    HAS_BIAS: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    FP8: tl.constexpr,  # W8A8: a and b in e4m3, the sums scaled by a's rows' and b's channels'
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return  # past the real blocks: the grid is sized for the worst padding
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)  # [BLOCK_M]; num_pairs: padding
    pair_mask = pairs < num_pairs
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_out
    if expert == num_experts:
        # Pairs of experts another rank holds (expert parallelism): they add nothing here, so
        # their weighted outputs, which the combine sums, are zeros; nothing else is read.
        if MUL_WEIGHT:
            zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=c_ptr.dtype.element_ty)
            c = c_ptr + pairs[:, None] * c_row_stride + offs_n[None, :]
            tl.store(c, zeros, mask=pair_mask[:, None] & n_mask[None, :])
        return
    a_rows = a_ptr + (pairs // PAIRS_PER_A_ROW)[:, None] * a_row_stride
    b_cols = b_ptr + expert * b_expert_stride + offs_n.to(tl.int64)[None, :] * b_row_stride
    up_cols = b_cols + n_out * b_row_stride  # SILU_MUL: the up rows follow the I gate rows
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k
        a = tl.load(a_rows + offs_k[None, :], mask=pair_mask[:, None] & k_mask[None, :], other=0.0)
        b_mask = k_mask[:, None] & n_mask[None, :]
        b = tl.load(b_cols + offs_k[:, None], mask=b_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        if FP8:  # every e4m3 value is exact in float16: the float16 products are the FP8 ones
            a = a.to(tl.float16)
            b = b.to(tl.float16)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if SILU_MUL:
            up = tl.load(up_cols + offs_k[:, None], mask=b_mask, other=0.0)
            if FP8:
                up = up.to(tl.float16)
            acc_up = tl.dot(a, up, acc_up, input_precision=PRECISION)
    dtype = c_ptr.dtype.element_ty
    if FP8:  # as kernels.reference.linear: the sums times the row's scale, then the channel's
        a_scale = tl.load(a_scale_ptr + pairs // PAIRS_PER_A_ROW, mask=pair_mask, other=0.0)
        channel_scales = b_scale_ptr + expert * b_scale_expert_stride + offs_n
        acc = acc * a_scale[:, None] * tl.load(channel_scales, mask=n_mask, other=0.0)[None, :]
        if SILU_MUL:
            up_scale = tl.load(channel_scales + n_out, mask=n_mask, other=0.0)
            acc_up = acc_up * a_scale[:, None] * up_scale[None, :]
    if HAS_BIAS:  # added to the float32 sums, before their one rounding (as F.linear's)
        bias_row = bias_ptr + expert * bias_expert_stride + offs_n
        acc += tl.load(bias_row, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if SILU_MUL:
            up_bias = tl.load(bias_row + n_out, mask=n_mask, other=0.0).to(tl.float32)
            acc_up += up_bias[None, :]
    if SILU_MUL:  # a constexpr branch: Triton compiles only the one taken
        out = expert_gated_product(acc, acc_up, dtype, alpha, limit, CLAMPED, ACTIVATION)
    else:
        out = acc.to(dtype)
    if MUL_WEIGHT:
        weight = tl.load(weights_ptr + pairs, mask=pair_mask, other=0.0)
        out = (out.to(tl.float32) * weight[:, None]).to(dtype)
    c = c_ptr + pairs[:, None] * c_row_stride + offs_n[None, :]
    tl.store(c, out, mask=pair_mask[:, None] & n_mask[None, :])


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor | Fp8Weight,
    down: torch.Tensor | Fp8Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    tiles: MoeTiles | GemvTiles | None = None,
    *,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    clamped_swiglu: ClampedSwiglu | None = None,
    activation: str = "silu",
) -> torch.Tensor:
    """x: [T, H]; gate_up: [E, 2I, H]; down: [E, H, I] (each in x's dtype, or both FP8
    `Fp8Weight`s with scales [E, 2I] and [E, H]); topk_weights: [T, k] float32;
    topk_ids: [T, k] integer in 0..E-1, or -1 for an expert another rank holds (expert
    parallelism: the pair adds nothing), not checked on the device (that would sync) -> [T, H];
    gpt-oss's gate_up_bias [E, 2I], down_bias [E, H] (in x's dtype) and `clamped_swiglu`
    optional; `activation` of the gate, "silu" or "gelu_tanh" (kernels.activation.ACTIVATIONS).

    See `kernels.reference.fused_moe` (FP8: the module docstring). `tiles`: None for the
    table's (`tiles_for`). Raises `KernelInputError` for any shape, dtype, device or layout it
    cannot handle.
    """
    _validate(x, gate_up, down, topk_weights, topk_ids)
    if activation not in ACTIVATIONS:
        raise KernelInputError(
            f"fused_moe: activation {activation!r} is not one of {', '.join(ACTIVATIONS)}"
        )
    _validate_bias("gate_up_bias", gate_up_bias, x, gate_up)
    _validate_bias("down_bias", down_bias, x, down)
    num_tokens, hidden = x.shape
    num_experts, width, _ = expert_bytes(gate_up).shape
    size, top_k = width // 2, topk_ids.shape[1]
    if tiles is None:
        tiles = tiles_for(num_tokens, top_k, num_experts)
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    if isinstance(tiles, GemvTiles):
        return gemv_moe(x, gate_up, down, topk_weights, topk_ids, tiles, gate_up_bias,
                         down_bias, clamped_swiglu, activation)  # fmt: skip
    sorted_ids, block_experts, num_padded = align_block_size(topk_ids, num_experts, tiles.block_m)
    swiglu = torch.empty(num_pairs, size, dtype=x.dtype, device=x.device)  # [T * k, I]
    weighted = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)  # [T * k, H]
    weights = topk_weights.reshape(-1)
    fp8 = isinstance(gate_up, Fp8Weight)
    precision = "ieee" if x.dtype == torch.float32 and not fp8 else "tf32"
    num_blocks = block_experts.numel()
    common = {
        "FP8": fp8,
        "PRECISION": precision,
        "BLOCK_M": tiles.block_m,
        "BLOCK_N": tiles.block_n,
        "BLOCK_K": tiles.block_k,
        "num_warps": tiles.num_warps,
        "num_stages": tiles.num_stages,
    }
    act = clamped_swiglu or ClampedSwiglu(alpha=1.0, limit=1.0)  # unread unless CLAMPED
    a, a_scale = quantize_rows(x) if fp8 else (x, weights)  # weights: unread without FP8
    w = expert_bytes(gate_up)
    _grouped_gemm_kernel[(num_blocks, triton.cdiv(size, tiles.block_n))](
        a, w, bias_or(gate_up_bias, w), a_scale, scale_or(gate_up), swiglu, weights,
        sorted_ids, block_experts, num_padded, size, num_experts, hidden, num_pairs,
        a.stride(0), w.stride(0), w.stride(1), bias_stride(gate_up_bias),
        scale_or(gate_up).stride(0), swiglu.stride(0), act.alpha, act.limit,
        PAIRS_PER_A_ROW=top_k, SILU_MUL=True, CLAMPED=clamped_swiglu is not None,
        ACTIVATION=activation, HAS_BIAS=gate_up_bias is not None, MUL_WEIGHT=False, **common,
    )  # fmt: skip
    a, a_scale = quantize_rows(swiglu) if fp8 else (swiglu, weights)
    w = expert_bytes(down)
    _grouped_gemm_kernel[(num_blocks, triton.cdiv(hidden, tiles.block_n))](
        a, w, bias_or(down_bias, w), a_scale, scale_or(down), weighted, weights,
        sorted_ids, block_experts, num_padded, hidden, num_experts, size, num_pairs,
        a.stride(0), w.stride(0), w.stride(1), bias_stride(down_bias),
        scale_or(down).stride(0), weighted.stride(0), act.alpha, act.limit,
        PAIRS_PER_A_ROW=1, SILU_MUL=False, CLAMPED=False, ACTIVATION=activation,
        HAS_BIAS=down_bias is not None, MUL_WEIGHT=True, **common,
    )  # fmt: skip
    # The combine: the k weighted outputs of each token, summed in float32.
    return weighted.view(num_tokens, top_k, hidden).float().sum(dim=1).to(x.dtype)


def _validate_bias(
    name: str, bias: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor | Fp8Weight
) -> None:
    """An expert bias is [E, N] of its weight's [E, N, K], in x's dtype, on its device, rows
    contiguous."""
    if bias is None:
        return
    shape = expert_bytes(weight).shape[:2]
    if (
        not isinstance(bias, torch.Tensor)
        or bias.shape != shape
        or bias.dtype != x.dtype
        or bias.device != x.device
        or bias.stride(-1) != 1
    ):
        raise KernelInputError(
            f"{name} must be a [{shape[0]}, {shape[1]}] {x.dtype} tensor on {x.device} with "
            "contiguous rows"
        )


def _validate(
    x: torch.Tensor,
    gate_up: torch.Tensor | Fp8Weight,
    down: torch.Tensor | Fp8Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> None:
    if isinstance(gate_up, Fp8Weight) != isinstance(down, Fp8Weight):
        raise KernelInputError("gate_up and down must both be Fp8Weights, or neither")
    fp8 = isinstance(gate_up, Fp8Weight)
    named = {"x": x, "gate_up": expert_bytes(gate_up), "down": expert_bytes(down),
             "topk_weights": topk_weights, "topk_ids": topk_ids}  # fmt: skip
    for name, tensor in named.items():
        if not isinstance(tensor, torch.Tensor):
            raise KernelInputError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    check_devices(named)
    gate_up_w, down_w = named["gate_up"], named["down"]
    if x.dim() != 2 or gate_up_w.dim() != 3 or down_w.dim() != 3:
        raise KernelInputError(
            f"x must be [T, H], gate_up [E, 2I, H], down [E, H, I]; got {tuple(x.shape)}, "
            f"{tuple(gate_up_w.shape)}, {tuple(down_w.shape)}"
        )
    num_experts, width, hidden = gate_up_w.shape
    if width % 2 or hidden != x.shape[1] or down_w.shape != (num_experts, hidden, width // 2):
        raise KernelInputError(
            f"gate_up {tuple(gate_up_w.shape)} and down {tuple(down_w.shape)} do not fit x "
            f"{tuple(x.shape)}: they must be [E, 2I, H] and [E, H, I]"
        )
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_ids.dtype.is_floating_point:
        raise KernelInputError(
            f"topk_ids must be [T, k] integers with T = {x.shape[0]}, got "
            f"{tuple(topk_ids.shape)} {topk_ids.dtype}"
        )
    if topk_weights.shape != topk_ids.shape or topk_weights.dtype != torch.float32:
        raise KernelInputError(
            f"topk_weights must be float32 of topk_ids' shape {tuple(topk_ids.shape)}, got "
            f"{tuple(topk_weights.shape)} {topk_weights.dtype}"
        )
    if x.dtype not in FLOAT_DTYPES:
        raise KernelInputError(f"x dtype {x.dtype} is not one of float16, bfloat16, float32")
    if x.dtype == torch.bfloat16 and triton_interprets() and not fp8:
        # Triton's interpreter multiplies bfloat16 tl.dot operands as raw integers; fail closed.
        raise KernelInputError("bfloat16 is not supported under TRITON_INTERPRET=1; use fp16/fp32")
    for name in ("gate_up", "down"):
        tensor = named[name]
        wanted = FP8_DTYPE if fp8 else x.dtype
        if tensor.dtype != wanted:
            raise KernelInputError(f"{name} dtype {tensor.dtype} is not {wanted} (x: {x.dtype})")
        if tensor.stride(-1) != 1:
            raise KernelInputError(
                f"{name} must be contiguous along its last dimension, got strides {tensor.stride()}"
            )
    if fp8:
        _validate_scales(gate_up, "gate_up", x.device)  # type: ignore[arg-type]
        _validate_scales(down, "down", x.device)  # type: ignore[arg-type]
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise KernelInputError(f"x rows must be contiguous, got strides {x.stride()}")
    if not topk_weights.is_contiguous():
        raise KernelInputError("topk_weights must be contiguous")


def _validate_scales(weight: Fp8Weight, name: str, device: torch.device) -> None:
    """An FP8 expert weight's scales: [E, N] float32, one per output channel, contiguous
    along N, on x's device; activations are quantized per token (no static input scale)."""
    shape = weight.weight.shape[:2]
    scale = weight.scale
    if (
        scale.shape != shape
        or scale.dtype != torch.float32
        or scale.device != device
        or (shape[1] > 1 and scale.stride(1) != 1)
    ):
        raise KernelInputError(
            f"{name}'s scale must be [{shape[0]}, {shape[1]}] float32 on {device}, contiguous "
            f"along its rows; got {tuple(scale.shape)} {scale.dtype} on {scale.device}"
        )
    if weight.input_scale is not None:
        raise KernelInputError(
            f"{name}: FP8 experts quantize activations per token; a static input_scale is not "
            "supported"
        )

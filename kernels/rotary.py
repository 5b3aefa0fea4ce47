"""Triton rotary position embedding (Hugging Face's "rotate half" layout), in place on q and k.

Semantics are those of `kernels.reference.rotary_embedding`: with x = [x1, x2] split at D/2,
out = x * cos + [-x2, x1] * sin, computed in float32 and rounded once to x's dtype. One program
rotates every query and key head of one token, so each token's cos/sin row is read once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.errors import KernelInputError
from kernels.launch_checks import FLOAT_DTYPES, check_devices
from kernels.pdl import launch_options, wait_for_previous

# Elements of one half-tile [heads, D/2] a program holds at once; more heads loop.
_MAX_TILE = 2048


@triton.jit
def rotate_heads(
    x_ptr,
    token,
    token_stride,
    head_stride,
    cos1,
    sin1,
    cos2,
    sin2,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Rotate heads [0, NUM_HEADS) of one token in place; cos*/sin*: [1, BLOCK_HALF] float32."""
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    for head_start in range(0, NUM_HEADS, BLOCK_HEADS):
        heads = head_start + tl.arange(0, BLOCK_HEADS)[:, None]
        mask = (heads < NUM_HEADS) & (cols < HALF)
        first = x_ptr + token * token_stride + heads * head_stride + cols
        y1, y2 = rotated_halves(first, mask, cos1, sin1, cos2, sin2, HALF)
        tl.store(first, y1, mask=mask)
        tl.store(first + HALF, y2, mask=mask)


@triton.jit
def rotated_halves(first, mask, cos1, sin1, cos2, sin2, HALF: tl.constexpr):
    """The two rotated halves of the head vectors whose first halves `first` points at, in
    their dtype (computed in float32, rounded once)."""
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    x1_32 = x1.to(tl.float32)
    x2_32 = x2.to(tl.float32)
    return (x1_32 * cos1 - x2_32 * sin1).to(x1.dtype), (x2_32 * cos2 + x1_32 * sin2).to(x1.dtype)


@triton.jit
def cos_sin_halves(cos_ptr, sin_ptr, token, cos_token_stride, sin_token_stride, cols, HALF):
    """One token's cos and sin rows as (cos1, sin1, cos2, sin2) halves, [1, BLOCK_HALF]. Both
    halves are loaded rather than assuming they repeat, so any table the reference accepts
    gives the reference's result."""
    col_mask = cols < HALF
    cos_row = cos_ptr + token * cos_token_stride + cols
    sin_row = sin_ptr + token * sin_token_stride + cols
    cos1 = tl.load(cos_row, mask=col_mask, other=0.0)
    cos2 = tl.load(cos_row + HALF, mask=col_mask, other=0.0)
    sin1 = tl.load(sin_row, mask=col_mask, other=0.0)
    sin2 = tl.load(sin_row + HALF, mask=col_mask, other=0.0)
    return cos1, sin1, cos2, sin2


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    q_token_stride,
    q_head_stride,
    k_token_stride,
    k_head_stride,
    cos_token_stride,
    sin_token_stride,
    # Head counts are fixed per model, so constexpr costs no recompiles and unrolls the loop.
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,  # head_dim // 2
    BLOCK_HALF: tl.constexpr,  # next power of two of HALF
    BLOCK_Q_HEADS: tl.constexpr,
    BLOCK_KV_HEADS: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    cos1, sin1, cos2, sin2 = cos_sin_halves(
        cos_ptr, sin_ptr, token, cos_token_stride, sin_token_stride, cols, HALF
    )
    rotate_heads(
        q_ptr,
        token,
        q_token_stride,
        q_head_stride,
        cos1,
        sin1,
        cos2,
        sin2,
        NUM_Q_HEADS,
        HALF,
        BLOCK_Q_HEADS,
        BLOCK_HALF,
    )
    rotate_heads(
        k_ptr,
        token,
        k_token_stride,
        k_head_stride,
        cos1,
        sin1,
        cos2,
        sin2,
        NUM_KV_HEADS,
        HALF,
        BLOCK_KV_HEADS,
        BLOCK_HALF,
    )


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by their positions IN PLACE and return them (the same tensors).

    In place to avoid allocating two activations per layer: the caller's unrotated q and k are
    overwritten (the reference returns fresh tensors with the same values).

    q: [T, Hq, D], k: [T, Hkv, D], same dtype, unit stride over D (token and head strides are
    free, so views of a fused qkv output work); cos, sin: [T, D] float32 with unit stride over
    D. D must be even. Raises `KernelInputError` for any shape, dtype, device or layout it
    cannot handle.
    """
    check_rotary_inputs(q, k, cos, sin)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_tokens == 0:
        return q, k
    half, block_half, block_q_heads, block_kv_heads = rotary_tiles(
        head_dim, num_q_heads, num_kv_heads
    )
    _rotary_kernel[(num_tokens,)](
        q,
        k,
        cos,
        sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        sin.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=half,
        BLOCK_HALF=block_half,
        BLOCK_Q_HEADS=block_q_heads,
        BLOCK_KV_HEADS=block_kv_heads,
        # Hq=32, D=128: a 32x64 half-tile is 2048 elements, 16 per thread with 4 warps.
        num_warps=4,
        **launch_options(q.device),
    )
    return q, k


def rotary_tiles(head_dim: int, num_q_heads: int, num_kv_heads: int) -> tuple[int, int, int, int]:
    """(HALF, BLOCK_HALF, BLOCK_Q_HEADS, BLOCK_KV_HEADS): the half-tiles of a launch, at most
    `_MAX_TILE` elements each; more heads loop."""
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    heads_per_tile = max(1, _MAX_TILE // block_half)
    return (
        half,
        block_half,
        min(triton.next_power_of_2(num_q_heads), heads_per_tile),
        min(triton.next_power_of_2(num_kv_heads), heads_per_tile),
    )


def check_rotary_inputs(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    named = {"q": q, "k": k, "cos": cos, "sin": sin}
    for name, tensor in named.items():
        if not isinstance(tensor, torch.Tensor):
            raise KernelInputError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    check_devices(named)
    for name, tensor in (("q", q), ("k", k)):
        if tensor.dim() != 3:
            raise KernelInputError(f"{name} must have shape [T, H, D], got {tuple(tensor.shape)}")
    num_tokens, _, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise KernelInputError(
            f"k shape {tuple(k.shape)} must match q {tuple(q.shape)} in tokens and head size"
        )
    if head_dim == 0 or head_dim % 2 != 0:
        raise KernelInputError(f"head size {head_dim} must be even and positive (rotate half)")
    for name, tensor in (("cos", cos), ("sin", sin)):
        if tensor.shape != (num_tokens, head_dim):
            raise KernelInputError(
                f"{name} must have shape ({num_tokens}, {head_dim}), got {tuple(tensor.shape)}"
            )
        if tensor.dtype != torch.float32:
            raise KernelInputError(f"{name} must be float32, got {tensor.dtype}")
        if tensor.stride(1) != 1:
            raise KernelInputError(
                f"{name} must have unit stride over D, got strides {tensor.stride()}"
            )
    if q.dtype not in FLOAT_DTYPES:
        raise KernelInputError(f"q dtype {q.dtype} is not one of float16, bfloat16, float32")
    if k.dtype != q.dtype:
        raise KernelInputError(f"k dtype {k.dtype} differs from q dtype {q.dtype}")
    for name, tensor in (("q", q), ("k", k)):
        if tensor.stride(2) != 1:
            raise KernelInputError(
                f"{name} must have unit stride over D, got strides {tensor.stride()}"
            )

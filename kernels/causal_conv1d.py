"""The causal depthwise convolution of Gated DeltaNet layers (with SiLU), in Triton, continuing
each sequence's convolution from its conv-state slot.

Same semantics as `kernels.ops.KernelOps.causal_conv1d`: output row i of a sequence is
    silu(bias + sum_j weight[:, j] * x[i - (K - 1) + j])
where positions before the sequence's first row of this pass come from its slot (the previous
pass's last K - 1 inputs) or are zeros when it has no initial state; afterwards the slot holds
the sequence's last K - 1 inputs.

One program per (sequence, BLOCK_D channels) walks its sequence BLOCK_T rows at a time: a decode
step (one row per sequence) and a prefill are the same kernel, and a program alone reads and
rewrites its slot's channels, so the slot is updated in place after a barrier that orders the
program's own reads of the old contents before its writes. The grid depends only on the batch
size and D (CUDA graphs); padding rows (a negative slot) write zeros and no state.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.errors import KernelInputError
from kernels.launch_checks import FLOAT_DTYPES, check_devices, check_recurrent_metadata
from kernels.ops import RecurrentStateMetadata
from kernels.pdl import launch_options, wait_for_previous

# Channels per program: Qwen3.6's conv dim (8192) gives 32 programs per sequence, enough for a
# batch-1 decode step to spread over the GPU; each row of a tile is 512 contiguous bytes.
BLOCK_D = 256
# Rows per prefill tile; decode tiles hold the one row.
PREFILL_BLOCK_T = 16


@triton.jit
def _causal_conv1d_kernel(
    x_ptr,  # [T, D]
    weight_ptr,  # [D, K]
    bias_ptr,  # [D] (read only when HAS_BIAS)
    conv_state_ptr,  # [num_slots, D, K - 1], contiguous
    out_ptr,  # [T, D]
    slots_ptr,  # [B] int32
    has_initial_ptr,  # [B] bool
    query_start_ptr,  # [B + 1] int32
    dim,
    stride_xt,
    stride_ot,
    KERNEL_SIZE: tl.constexpr,
    STATE_PAD: tl.constexpr,  # next power of two of K - 1
    HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent (kernels.pdl)
):
    wait_for_previous(PDL)
    seq = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < dim
    start = tl.load(query_start_ptr + seq)
    end = tl.load(query_start_ptr + seq + 1)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    # The flags as [BLOCK_D] vectors: Triton 3.9's interpreter refuses a scalar in a mask.
    live = tl.load(slots_ptr + seq + offs_d * 0) >= 0
    read_state = live & (tl.load(has_initial_ptr + seq + offs_d * 0) != 0)
    width: tl.constexpr = KERNEL_SIZE - 1
    slot_channels = conv_state_ptr + tl.maximum(slot, 0) * dim * width + offs_d * width  # [BLOCK_D]

    bias = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    offs_t = tl.arange(0, BLOCK_T)
    for tile_start in range(start, end, BLOCK_T):
        rows = tile_start + offs_t
        row_mask = (rows < end)[:, None] & d_mask[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32) + bias[None, :]
        for j in tl.static_range(KERNEL_SIZE):
            # Tap j reads position p = i - (K - 1) + j of the sequence: x's row start + p, or,
            # before the first row (p < 0), column K - 1 + p of the slot.
            pos = (rows - start - width + j)[:, None]
            from_x = tl.load(
                x_ptr + (start + pos) * stride_xt + offs_d[None, :],
                mask=row_mask & (pos >= 0),
                other=0.0,
            )
            from_state = tl.load(
                slot_channels[None, :] + (width + pos),
                mask=row_mask & (pos < 0) & read_state[None, :],
                other=0.0,
            )
            w = tl.load(weight_ptr + offs_d * KERNEL_SIZE + j, mask=d_mask, other=0.0)
            acc += (from_x.to(tl.float32) + from_state.to(tl.float32)) * w.to(tl.float32)[None, :]
        out = tl.where(live[None, :], acc * tl.sigmoid(acc), 0.0)
        tl.store(
            out_ptr + rows[:, None] * stride_ot + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_mask,
        )

    # The new state: column c is position L - (K - 1) + c, from x or (a sequence shorter than
    # K - 1) from the old state's column L + c.
    length = end - start
    offs_c = tl.arange(0, STATE_PAD)
    pos = (length - width + offs_c)[None, :]  # [1, STATE_PAD]
    col_mask = d_mask[:, None] & (offs_c < width)[None, :]
    new_from_x = tl.load(
        x_ptr + (start + pos) * stride_xt + offs_d[:, None],
        mask=col_mask & (pos >= 0),
        other=0.0,
    )
    new_from_state = tl.load(
        slot_channels[:, None] + (length + offs_c)[None, :],
        mask=col_mask & (pos < 0) & read_state[:, None],
        other=0.0,
    )
    tl.debug_barrier()  # every read of the old state above happens before the writes below
    tl.store(
        slot_channels[:, None] + offs_c[None, :],
        new_from_x + new_from_state,
        mask=col_mask & live[:, None],
    )


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    meta: RecurrentStateMetadata,
) -> torch.Tensor:
    """See `kernels.ops.KernelOps.causal_conv1d`."""
    _check_inputs(x, weight, bias, conv_state, meta)
    num_tokens, dim = x.shape
    kernel_size = weight.shape[1]
    out = torch.empty_like(x)
    num_seqs = meta.state_slots.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    grid = (num_seqs, triton.cdiv(dim, BLOCK_D))
    _causal_conv1d_kernel[grid](
        x,
        weight,
        bias if bias is not None else weight,  # never read without HAS_BIAS
        conv_state,
        out,
        meta.state_slots,
        meta.has_initial_state,
        meta.query_start_loc,
        dim,
        x.stride(0),
        out.stride(0),
        KERNEL_SIZE=kernel_size,
        STATE_PAD=triton.next_power_of_2(max(kernel_size - 1, 1)),
        HAS_BIAS=bias is not None,
        BLOCK_T=1 if meta.decode_only else PREFILL_BLOCK_T,
        BLOCK_D=BLOCK_D,
        num_warps=4,
        **launch_options(x.device),
    )
    return out


def _check_inputs(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    meta: RecurrentStateMetadata,
) -> None:
    named = {"x": x, "weight": weight, "conv_state": conv_state, "slots": meta.state_slots}
    if bias is not None:
        named["bias"] = bias
    check_devices(named)
    if x.dim() != 2 or x.dtype not in FLOAT_DTYPES or x.stride(1) != 1:
        raise KernelInputError(
            f"x must be [T, D] of {FLOAT_DTYPES} with contiguous rows, got {tuple(x.shape)} "
            f"{x.dtype} with strides {x.stride()}"
        )
    dim = x.shape[1]
    if weight.dim() != 2 or weight.shape[0] != dim or weight.shape[1] < 2:
        raise KernelInputError(f"weight must be [{dim}, K] with K >= 2, got {tuple(weight.shape)}")
    if not weight.is_contiguous():
        raise KernelInputError("weight must be contiguous")
    if bias is not None and (bias.shape != (dim,) or not bias.is_contiguous()):
        raise KernelInputError(f"bias must be a contiguous [{dim}] tensor, got {tuple(bias.shape)}")
    width = weight.shape[1] - 1
    if (
        conv_state.dim() != 3
        or conv_state.shape[1:] != (dim, width)
        or conv_state.dtype != x.dtype
        or not conv_state.is_contiguous()
    ):
        raise KernelInputError(
            f"conv_state must be a contiguous [num_slots, {dim}, {width}] {x.dtype} tensor, got "
            f"{tuple(conv_state.shape)} {conv_state.dtype}"
        )
    check_recurrent_metadata(meta)

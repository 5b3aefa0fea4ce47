"""The gated delta rule (Gated DeltaNet's linear attention) in Triton, on per-sequence state slots.

Same semantics as `kernels.ops.KernelOps.gated_delta_rule`: per token and value head, with q and
k L2-normalised and q scaled by Dk ** -0.5,
    S = exp(g) * S;  S = S + k^T (beta * (v - k S));  o = q S
on a flattened variable-length batch whose sequence b continues the [Dk, Dv] state of its slot.

Three kernels. The decode step and the chunked walk run one program per (sequence, value head,
Dv tile); a program owns its slot's [Dk, BLOCK_V] state tile, so programs never share a state
byte and it is updated in place:
1. `_recurrent_kernel` (decode): the recurrence token by token, the state tile in registers.
   A decode step reads and writes each state byte once, which bounds it (the state is
   Hv * Dk * Dv * 4 bytes per sequence per layer: 2 MiB for Qwen3.6's 32 x 128 x 128).
2. Prefill, the chunk form of fla's `chunk_gated_delta_rule` (Yang et al., "Gated Delta
   Networks", 2024, section 3.3), CHUNK tokens at a time on the tensor cores. Within a chunk,
   with gc the cumulative log-decay from the chunk's start and S0 the state before it, the
   delta rule's corrected values V' solve a unit lower-triangular system
       (I + L) V' = beta * V - beta * exp(gc) * K S0,
       L[i, j] = beta_i exp(gc_i - gc_j) (k_i . k_j) for j < i,
   solved with T = (I + L)^-1 (the UT transform) as V' = U - W S0, U = T (beta V),
   W = T (beta exp(gc) K). Then
       O = exp(gc) Q S0 + (Q K^T * exp(gc_i - gc_j), j <= i) V'
       S = exp(gc_last) S0 + (exp(gc_last - gc) K)^T V'.
   `_ut_transform_kernel` computes every chunk's T at once, one program per (chunk, value
   head), by forward substitution (CHUNK steps of row reductions: the slow part, so it runs
   for all chunks in parallel rather than on the sequential path). `_chunked_kernel` then walks
   each sequence's chunks in order (the inter-chunk recurrence) with the rest as matmuls.
   T takes num_chunks * Hv * CHUNK^2 * 4 bytes of scratch while the call runs (64 MiB for
   8192 prompt tokens at Qwen3.6's 32 value heads).

Padding rows (a negative slot) write zero outputs and no state. The decode step's grid depends
only on the batch size and the head shapes, never on lengths: each program reads its token
range from `query_start_loc` on the device, so a step captured in a CUDA graph stays correct
when the metadata is rewritten in place before replay. Prefill (never captured) builds its
chunk table from the host's `query_lens`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.errors import KernelInputError
from kernels.launch_checks import FLOAT_DTYPES, check_devices, check_recurrent_metadata
from kernels.ops import RecurrentStateMetadata
from kernels.pdl import launch_options, wait_for_previous

# As fla's `use_qk_l2norm_in_kernel` and transformers' l2norm: x * rsqrt(sum(x^2) + eps).
_L2NORM_EPS = tl.constexpr(1e-6)
# Tokens per chunk: 64 is fla's choice; the [CHUNK, CHUNK] products fill the tensor cores and the
# forward substitution (CHUNK steps) stays short.
CHUNK_SIZE = 32
# Dv columns per program. Decode: 32 gives Qwen3.6 (Hv 32, Dv 128) 128 programs per sequence,
# enough to fill an H100 at batch 1 with a [128, 32] float32 tile in registers. Prefill: 64
# keeps the [Dk, 64] state and the chunk's tiles in registers while 8 prompts still make
# 8 * Hv * 2 = 512 programs.
DECODE_BLOCK_V = 32
CHUNKED_BLOCK_V = 64
# Triton's default 3 stages of the chunk loop's float32 tiles need 263 KB of shared memory at
# Dk = Dv = 128 (Triton 3.6 on an H100, whose limit is 227 KB); one stage fits.
CHUNKED_STAGES = 2


@triton.jit
def _l2_normalised(x, axis: tl.constexpr):
    return x * tl.rsqrt(tl.sum(x * x, axis=axis, keep_dims=True) + _L2NORM_EPS)


@triton.jit
def _sequence_of_program(slots_ptr, has_initial_ptr, query_start_ptr, seq, lanes):
    """(first row, end row, slot as int64 (0 for padding), whether the slot is live, whether
    to read it). The flags are vectors over `lanes`: Triton 3.9's interpreter refuses a scalar
    in a mask."""
    start = tl.load(query_start_ptr + seq)
    end = tl.load(query_start_ptr + seq + 1)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    live = tl.load(slots_ptr + seq + lanes * 0) >= 0
    read_state = live & (tl.load(has_initial_ptr + seq + lanes * 0) != 0)
    return start, end, tl.maximum(slot, 0), live, read_state


@triton.jit
def _recurrent_kernel(
    q_ptr,  # [T, Hk, Dk]
    k_ptr,  # [T, Hk, Dk]
    v_ptr,  # [T, Hv, Dv]
    g_ptr,  # [T, Hv] float32
    beta_ptr,  # [T, Hv] float32
    state_ptr,  # [num_slots, Hv, Dk, Dv] float32, contiguous
    out_ptr,  # [T, Hv, Dv]
    slots_ptr,  # [B] int32
    has_initial_ptr,  # [B] bool
    query_start_ptr,  # [B + 1] int32
    scale,  # Dk ** -0.5
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_ot,
    stride_oh,
    NUM_V_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # Hv // Hk: value heads per key head
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_K: tl.constexpr,  # next power of two of DK
    BLOCK_V: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent (kernels.pdl)
):
    wait_for_previous(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    key_head = head // GROUP
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_mask = offs_k < DK
    v_mask = offs_v < DV
    start, end, slot, live, read_state = _sequence_of_program(
        slots_ptr, has_initial_ptr, query_start_ptr, seq, offs_v
    )

    # S: [BLOCK_K, BLOCK_V], this program's columns of the slot's [Dk, Dv] state.
    state_tile = (
        state_ptr + (slot * NUM_V_HEADS + head) * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
    )
    tile_mask = k_mask[:, None] & v_mask[None, :]
    s = tl.load(state_tile, mask=tile_mask & read_state[None, :], other=0.0)
    for t in range(start, end):
        q = tl.load(q_ptr + t * stride_qt + key_head * stride_qh + offs_k, mask=k_mask, other=0.0)
        k = tl.load(k_ptr + t * stride_kt + key_head * stride_kh + offs_k, mask=k_mask, other=0.0)
        v = tl.load(v_ptr + t * stride_vt + head * stride_vh + offs_v, mask=v_mask, other=0.0)
        q = _l2_normalised(q.to(tl.float32), 0) * scale
        k = _l2_normalised(k.to(tl.float32), 0)
        decay = tl.exp(tl.load(g_ptr + t * stride_gt + head))
        beta = tl.load(beta_ptr + t * stride_gt + head)
        s = s * decay
        # The delta rule: replace what S recalls for k (k S) by v, at rate beta.
        delta = (v.to(tl.float32) - tl.sum(k[:, None] * s, axis=0)) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(q[:, None] * s, axis=0)
        o = tl.where(live, o, 0.0)
        tl.store(
            out_ptr + t * stride_ot + head * stride_oh + offs_v,
            o.to(out_ptr.dtype.element_ty),
            mask=v_mask,
        )
    tl.store(state_tile, s, mask=tile_mask & live[None, :])


@triton.jit
def _chunk_keys(
    k_ptr, g_ptr, beta_ptr, rows, r_mask, offs_c, offs_k, k_mask, key_head, head,
    stride_kt, stride_kh, stride_gt,
):  # fmt: skip
    """A chunk's L2-normalised keys [CHUNK, BLOCK_K], its cumulative log-decay gc [CHUNK]
    from the chunk's start, the decay matrix exp(gc_i - gc_j) for j <= i (at most 1: g <= 0; 0
    above the diagonal) and beta [CHUNK]. Rows past the end load as k = 0, g = beta = 0: they
    change nothing."""
    k = tl.load(
        k_ptr + rows[:, None] * stride_kt + key_head * stride_kh + offs_k[None, :],
        mask=r_mask[:, None] & k_mask[None, :],
        other=0.0,
    )
    g = tl.load(g_ptr + rows * stride_gt + head, mask=r_mask, other=0.0)
    beta = tl.load(beta_ptr + rows * stride_gt + head, mask=r_mask, other=0.0)
    gc = tl.cumsum(g, axis=0)
    causal = offs_c[None, :] <= offs_c[:, None]
    decay = tl.exp(tl.where(causal, gc[:, None] - gc[None, :], float("-inf")))
    return _l2_normalised(k.to(tl.float32), 1), gc, decay, beta


@triton.jit
def _ut_transform_kernel(
    k_ptr,  # [T, Hk, Dk]
    g_ptr,  # [T, Hv] float32
    beta_ptr,  # [T, Hv] float32
    chunk_rows_ptr,  # [num_chunks, 2] int32: each chunk's first and end row
    t_ptr,  # [num_chunks, Hv, CHUNK, CHUNK] float32: T = (I + L)^-1 of each chunk and head
    stride_kt,
    stride_kh,
    stride_gt,
    NUM_V_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CHUNK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    offs_c = tl.arange(0, CHUNK)
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.load(chunk_rows_ptr + 2 * chunk) + offs_c
    r_mask = rows < tl.load(chunk_rows_ptr + 2 * chunk + 1)
    k, _, decay, beta = _chunk_keys(
        k_ptr, g_ptr, beta_ptr, rows, r_mask, offs_c, offs_k, offs_k < DK, head // GROUP, head,
        stride_kt, stride_kh, stride_gt,
    )  # fmt: skip
    rows_i = offs_c[:, None]
    kk = tl.dot(k, tl.trans(k), input_precision=DOT_PRECISION)  # [CHUNK, CHUNK]
    lower = tl.where(offs_c[None, :] < rows_i, kk * decay * beta[:, None], 0.0)  # L

    # Forward substitution, row by row: T[i, :] = e_i - sum_{j<i} L[i, j] T[j, :].
    t_inv = tl.where(rows_i == offs_c[None, :], 1.0, 0.0)
    for i in range(1, CHUNK):
        l_row = tl.sum(tl.where(rows_i == i, lower, 0.0), axis=0)  # L[i, :]
        t_row = tl.sum(l_row[:, None] * t_inv, axis=0)  # sum_j L[i, j] T[j, :]
        t_inv = tl.where(rows_i == i, t_inv - t_row[None, :], t_inv)
    block = (chunk * NUM_V_HEADS + head).to(tl.int64) * CHUNK * CHUNK
    tl.store(t_ptr + block + rows_i * CHUNK + offs_c[None, :], t_inv)


@triton.jit
def _chunked_kernel(
    q_ptr,  # [T, Hk, Dk]
    k_ptr,  # [T, Hk, Dk]
    v_ptr,  # [T, Hv, Dv]
    g_ptr,  # [T, Hv] float32
    beta_ptr,  # [T, Hv] float32
    state_ptr,  # [num_slots, Hv, Dk, Dv] float32, contiguous
    out_ptr,  # [T, Hv, Dv]
    slots_ptr,  # [B] int32
    has_initial_ptr,  # [B] bool
    query_start_ptr,  # [B + 1] int32
    scale,  # Dk ** -0.5
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_ot,
    stride_oh,
    t_ptr,  # [num_chunks, Hv, CHUNK, CHUNK] float32, from _ut_transform_kernel
    first_chunk_ptr,  # [B] int32: the index of each sequence's first chunk
    NUM_V_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    CHUNK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs, else "tf32"
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    key_head = head // GROUP
    offs_c = tl.arange(0, CHUNK)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_mask = offs_k < DK
    v_mask = offs_v < DV
    start, end, slot, live, read_state = _sequence_of_program(
        slots_ptr, has_initial_ptr, query_start_ptr, seq, offs_v
    )
    state_tile = (
        state_ptr + (slot * NUM_V_HEADS + head) * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
    )
    tile_mask = k_mask[:, None] & v_mask[None, :]
    # S0: [BLOCK_K, BLOCK_V]; after each chunk, the state after it.
    s = tl.load(state_tile, mask=tile_mask & read_state[None, :], other=0.0)

    t_tile = offs_c[:, None] * CHUNK + offs_c[None, :]
    chunk = tl.load(first_chunk_ptr + seq)
    for chunk_start in range(start, end, CHUNK):
        rows = chunk_start + offs_c
        r_mask = rows < end
        k, gc, decay, beta = _chunk_keys(
            k_ptr, g_ptr, beta_ptr, rows, r_mask, offs_c, offs_k, k_mask, key_head, head,
            stride_kt, stride_kh, stride_gt,
        )  # fmt: skip
        q = tl.load(
            q_ptr + rows[:, None] * stride_qt + key_head * stride_qh + offs_k[None, :],
            mask=r_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        q = _l2_normalised(q.to(tl.float32), 1) * scale  # [CHUNK, BLOCK_K]
        v = tl.load(
            v_ptr + rows[:, None] * stride_vt + head * stride_vh + offs_v[None, :],
            mask=r_mask[:, None] & v_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        t_inv = tl.load(t_ptr + (chunk * NUM_V_HEADS + head).to(tl.int64) * CHUNK * CHUNK + t_tile)
        chunk += 1

        w = tl.dot(
            t_inv, k * (beta * tl.exp(gc))[:, None], input_precision=DOT_PRECISION
        )  # [CHUNK, BLOCK_K]
        u = tl.dot(t_inv, v * beta[:, None], input_precision=DOT_PRECISION)  # [CHUNK, BLOCK_V]
        v_new = u - tl.dot(w, s, input_precision=DOT_PRECISION)  # V': [CHUNK, BLOCK_V]

        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * decay
        o = tl.dot(q * tl.exp(gc)[:, None], s, input_precision=DOT_PRECISION)
        o += tl.dot(qk, v_new, input_precision=DOT_PRECISION)
        o = tl.where(live[None, :], o, 0.0)
        tl.store(
            out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_v[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=r_mask[:, None] & v_mask[None, :],
        )
        gc_last = tl.sum(tl.where(offs_c == CHUNK - 1, gc, 0.0), axis=0)  # padding adds 0
        k_decayed = k * tl.exp(gc_last - gc)[:, None]
        s = s * tl.exp(gc_last) + tl.dot(tl.trans(k_decayed), v_new, input_precision=DOT_PRECISION)
    tl.store(state_tile, s, mask=tile_mask & live[None, :])


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    meta: RecurrentStateMetadata,
    *,
    chunk_size: int = CHUNK_SIZE,
    block_v: int | None = None,
    num_stages: int = CHUNKED_STAGES,
) -> torch.Tensor:
    """See `kernels.ops.KernelOps.gated_delta_rule`. A decode-only batch runs the recurrent
    kernel (what CUDA graphs capture); any other batch the chunked one, whose programs walk
    their sequence CHUNK tokens at a time (a decode row in a mixed batch is a one-row chunk).
    `chunk_size`, `block_v` and `num_stages` (the chunked kernel's software pipelining) are
    tuning knobs for the benchmark; the defaults are the choice.
    """
    _check_inputs(q, k, v, g, beta, state, meta)
    num_tokens, num_k_heads, dk = q.shape
    num_v_heads, dv = v.shape[1:]
    out = torch.empty_like(v)
    num_seqs = meta.state_slots.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_k = triton.next_power_of_2(max(dk, 16))  # tl.dot needs every dimension >= 16
    args = (
        q,
        k,
        v,
        g,
        beta,
        state,
        out,
        meta.state_slots,
        meta.has_initial_state,
        meta.query_start_loc,
        dk**-0.5,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        out.stride(0),
        out.stride(1),
    )
    shape = {
        "NUM_V_HEADS": num_v_heads,
        "GROUP": num_v_heads // num_k_heads,
        "DK": dk,
        "DV": dv,
        "BLOCK_K": block_k,
    }
    if meta.decode_only:
        block_v = block_v or min(DECODE_BLOCK_V, triton.next_power_of_2(dv))
        grid = (num_seqs, num_v_heads, triton.cdiv(dv, block_v))
        _recurrent_kernel[grid](
            *args, **shape, BLOCK_V=block_v, num_warps=4, **launch_options(q.device)
        )
        return out
    chunk_rows, first_chunk = _chunk_table(meta.query_lens, chunk_size, q.device)
    num_chunks = chunk_rows.shape[0]
    t_inv = torch.empty(num_chunks, num_v_heads, chunk_size, chunk_size, device=q.device)
    dot_precision = "ieee" if v.dtype == torch.float32 else "tf32"
    _ut_transform_kernel[(num_chunks, num_v_heads)](
        k, g, beta, chunk_rows, t_inv, k.stride(0), k.stride(1), g.stride(0),
        NUM_V_HEADS=num_v_heads, GROUP=num_v_heads // num_k_heads, DK=dk, BLOCK_K=block_k,
        CHUNK=chunk_size, DOT_PRECISION=dot_precision, num_warps=4,
    )  # fmt: skip
    block_v = block_v or min(CHUNKED_BLOCK_V, max(16, triton.next_power_of_2(dv)))
    grid = (num_seqs, num_v_heads, triton.cdiv(dv, block_v))
    _chunked_kernel[grid](
        *args,
        t_inv,
        first_chunk,
        **shape,
        BLOCK_V=block_v,
        CHUNK=chunk_size,
        DOT_PRECISION=dot_precision,
        num_warps=8,
        num_stages=num_stages,
    )
    return out


def _chunk_table(
    query_lens: list[int], chunk_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence's chunks as [num_chunks, 2] int32 (first row, end row), in order, and the
    index of each sequence's first chunk, [B] int32 (one small copy each)."""
    rows: list[tuple[int, int]] = []
    first_chunk = []
    start = 0
    for n in query_lens:
        first_chunk.append(len(rows))
        rows += [(c, min(c + chunk_size, start + n)) for c in range(start, start + n, chunk_size)]
        start += n
    table = torch.tensor(rows, dtype=torch.int32).view(-1, 2)
    return (
        table.to(device, non_blocking=True),
        torch.tensor(first_chunk, dtype=torch.int32).to(device, non_blocking=True),
    )


def _check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    meta: RecurrentStateMetadata,
) -> None:
    check_devices(
        {"q": q, "k": k, "v": v, "g": g, "beta": beta, "state": state, "slots": meta.state_slots}
    )
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise KernelInputError(
            f"q and k must be [T, Hk, Dk] and v [T, Hv, Dv], got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    num_tokens, num_k_heads, dk = q.shape
    num_v_heads, dv = v.shape[1:]
    if num_v_heads % num_k_heads:
        raise KernelInputError(
            f"value heads ({num_v_heads}) must be a multiple of key heads ({num_k_heads})"
        )
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if tensor.dtype not in FLOAT_DTYPES or tensor.stride(-1) != 1:
            raise KernelInputError(
                f"{name} must be {FLOAT_DTYPES} with a contiguous last dimension, got "
                f"{tensor.dtype} with strides {tensor.stride()}"
            )
    for name, tensor in (("g", g), ("beta", beta)):
        if tensor.shape != (num_tokens, num_v_heads) or tensor.dtype != torch.float32:
            raise KernelInputError(
                f"{name} must be [{num_tokens}, {num_v_heads}] float32, got "
                f"{tuple(tensor.shape)} {tensor.dtype}"
            )
    if g.stride() != beta.stride() or g.stride(1) != 1:
        raise KernelInputError("g and beta must be laid out alike, each row contiguous")
    if (
        state.dim() != 4
        or state.shape[1:] != (num_v_heads, dk, dv)
        or state.dtype != torch.float32
        or not state.is_contiguous()
    ):
        raise KernelInputError(
            f"state must be a contiguous [num_slots, {num_v_heads}, {dk}, {dv}] float32 tensor, "
            f"got {tuple(state.shape)} {state.dtype}"
        )
    check_recurrent_metadata(meta)
    if sum(meta.query_lens) != num_tokens or len(meta.query_lens) != meta.state_slots.shape[0]:
        raise KernelInputError(
            f"query_lens {meta.query_lens} must give each of the "
            f"{meta.state_slots.shape[0]} sequences its rows of the {num_tokens} tokens"
        )

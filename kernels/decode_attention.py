"""Paged decode attention (one new query token per sequence), split-KV flash-decoding in Triton.

Same semantics as `kernels.reference.paged_attention` with every `query_lens[b] == 1`: query
head h of sequence b attends to all `seq_lens[b]` cached tokens of KV head h // (Hq // Hkv), or
with a sliding window W to the last W of them.

Design (the flash-decoding scheme of vLLM and SGLang):
1. `_decode_split_kernel`, grid (B, Hkv, num_splits): one program per (sequence, KV head, split)
   holds all G = Hq // Hkv query heads of its KV head as one [G_PAD, D] tile, so each K/V byte is
   read once per KV head, not once per query head, and the scores are a `tl.dot`. It walks its
   split's tokens BLOCK_N at a time, gathering each token's cache slot through the block table,
   with an online softmax in float32.
2. `_combine_splits_kernel`, grid (B, Hq): merges the per-split partial outputs by their
   log-sum-exp. With one split the first kernel writes the output itself and this one is skipped.

An FP8 cache is read as `stored * scale` without a multiply per element (`kernels.
fp8_attention`): the [G_PAD, D] q tile is quantized per row once, each P tile as it is made,
and the stored e4m3 K tile enters the score product as loaded. V is read as int32 words whose
four byte planes, widened to float16 in registers, make four products of a quarter of D each
(`e4m3_planes`: the same products, without Triton's byte-wise transposition of an e4m3 tile).
The q row scales and K's scale join the score scale; V's (with P's) multiplies each split's
output once.

The grid depends only on (B, Hkv, num_splits), never on `seq_lens`' values: each program reads
its sequence length on the device and derives its token range there, so a launch captured in a
CUDA graph stays correct when `seq_lens` and `block_tables` are rewritten in place before replay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.errors import KernelInputError
from kernels.fp8_attention import (
    P_UNSCALE_C,
    dot_e4m3,
    e4m3_planes,
    fits_word_planes,
    interleave_planes,
    quantize_probabilities,
    quantize_q_rows,
    round_up_running_max,
)
from kernels.launch_checks import (
    FLOAT_DTYPES,
    check_kv_cache_encoding,
    check_paged_cache,
    triton_interprets,
)
from kernels.pdl import launch_options, wait_for_previous

# exp2 is the native instruction: scores are pre-scaled by log2(e), and exp2(s * log2 e) = exp(s).
_LOG2E = 1.4426950408889634
_LOG2E_C = tl.constexpr(_LOG2E)
# The combine kernel holds [num_splits, D] partials in registers; 64 splits of 256 floats fit.
MAX_NUM_SPLITS = 64
# A split shorter than this spends more on its launch share and the combine than it saves.
_MIN_TOKENS_PER_SPLIT = 256


# The block-table width varies from step to step outside CUDA graphs; specialized (== 1,
# divisible by 16) it would make three compiled variants, the later ones compiled while serving.
@triton.jit
def initial_softmax_state(
    sinks_ptr,
    heads,
    active,
    ROWS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    FP8_KV: tl.constexpr,
):
    """(m_i, l_i) of the online softmax before any key, for ROWS rows of query heads `heads`:
    a finite floor (so exp2(m_i - m_new) is never (-inf) - (-inf) = NaN) and 0; with sinks,
    where `active` (the rows whose state carries gpt-oss's sink), the head's sink logit in
    log2 units as the running maximum (FP8: rounded up to a whole number, as every running
    maximum is) and its exp2 share of the row sum. The sink takes probability mass and adds no
    value, as `kernels.reference.paged_attention`'s `sinks`."""
    m_i = tl.full([ROWS], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=active, other=0.0).to(tl.float32) * _LOG2E_C
        m_sink = round_up_running_max(sink) if FP8_KV else sink
        m_i = tl.where(active, m_sink, m_i)
        l_i = tl.where(active, tl.exp2(sink - m_sink), l_i)
    return m_i, l_i


def verify_sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> None:
    """Sinks are None or [Hq] contiguous on q's device, float32 or q's dtype."""
    if sinks is None:
        return
    if (
        sinks.shape != (q.shape[1],)
        or sinks.device != q.device
        or sinks.dtype not in (torch.float32, q.dtype)
        or not sinks.is_contiguous()
    ):
        raise KernelInputError(
            f"sinks must be a contiguous [{q.shape[1]}] float32 or {q.dtype} tensor on "
            f"{q.device}, got {tuple(sinks.shape)} {sinks.dtype} on {sinks.device}"
        )


@triton.jit(do_not_specialize=["max_blocks", "stride_btb"])
def _decode_split_kernel(
    q_ptr,  # [B, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_words_ptr,  # V_PLANES: the FP8 v_cache as int32 words [num_blocks, block_size, Hkv, D / 4]
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    out_ptr,  # [B, Hq, D] (DIRECT) or partial out [B, Hq, num_splits, D] float32
    lse_ptr,  # [B, Hq, num_splits] float32 (unused when DIRECT)
    k_scale_ptr,  # [1]: an FP8 cache's K scale (read only when FP8_KV)
    v_scale_ptr,  # [1]
    sinks_ptr,  # [Hq]: gpt-oss's attention sinks (read only when HAS_SINKS)
    num_rows_ptr,  # [1]: rows from this one on are not decode rows (read only when ROW_COUNT)
    qk_scale,  # softmax scale * log2(e)
    max_blocks,
    window,  # attend to the last `window` tokens; 0: to all of them
    stride_qb,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_btb,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    GROUP_SIZE: tl.constexpr,  # G = Hq // Hkv
    G_PAD: tl.constexpr,  # max(16, next_pow2(G)): tl.dot needs every dimension >= 16
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block (power of two)
    BLOCK_N: tl.constexpr,  # tokens per inner iteration
    NUM_SPLITS: tl.constexpr,
    DIRECT: tl.constexpr,  # NUM_SPLITS == 1: write the normalised output in out_ptr's dtype
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs, so scores are not rounded to tf32
    FP8_KV: tl.constexpr,  # the cache holds float8_e4m3fn values and their per-tensor scales
    EMULATE_ROUNDING: tl.constexpr,  # FP8_KV under the interpreter: see kernels.fp8_attention
    V_PLANES: tl.constexpr,  # FP8_KV: V read as words, P V in four byte planes (e4m3_planes)
    INTERPRETED: tl.constexpr,  # Triton's interpreter runs this (no inline assembly)
    HAS_SINKS: tl.constexpr,
    ROW_COUNT: tl.constexpr,  # only the first *num_rows_ptr rows are computed (and written)
    PDL: tl.constexpr,  # launched as a programmatic dependent (kernels.pdl)
):
    # Before the wait, only what no kernel just before this one writes: the lengths and tables
    # (a step's inputs) and the sinks (weights). q and the newest token's K and V come from the
    # kernel just before (kernels.pdl: that one waited for its own predecessor).
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # Clamp to what the block table can address: a corrupt length must never make the kernel read
    # past the table row (physical block ids themselves are the caller's contract).
    seq_len = tl.minimum(tl.load(seq_lens_ptr + seq), max_blocks * BLOCK_SIZE)
    # A windowed layer's query (position seq_len - 1) sees only the last `window` keys; the
    # splits share out those. Blocks before them are never read (they may have been freed).
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    # Split boundaries are multiples of BLOCK_N, so only a split's last tile is partial.
    tokens_per_split = tl.cdiv(tl.cdiv(seq_len - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = first + split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP_SIZE
    heads = kv_head * GROUP_SIZE + offs_g

    # The sink joins the state of split 0 only: the combine then counts it once (in its lse).
    first_split = tl.full([G_PAD], split, dtype=tl.int32) == 0
    m_i, l_i = initial_softmax_state(
        sinks_ptr, heads, g_mask & first_split, G_PAD, HAS_SINKS, FP8_KV
    )
    acc = tl.zeros([G_PAD, HEAD_DIM], dtype=tl.float32)
    # V_PLANES: the accumulator as four planes, column i of plane j being element 4i + j.
    QUARTER: tl.constexpr = HEAD_DIM // 4
    offs_w = tl.arange(0, QUARTER)
    acc0 = tl.zeros([G_PAD, QUARTER], dtype=tl.float32)
    acc1 = tl.zeros([G_PAD, QUARTER], dtype=tl.float32)
    acc2 = tl.zeros([G_PAD, QUARTER], dtype=tl.float32)
    acc3 = tl.zeros([G_PAD, QUARTER], dtype=tl.float32)

    wait_for_previous(PDL)
    # Past the count (read after the wait: every program waits, so the kernel ends only after
    # the one before it, as kernels.pdl has every kernel do). Nested: Triton compiles both sides
    # of an `and`, and the constexpr alone keeps the load out.
    if ROW_COUNT:  # noqa: SIM102
        if seq >= tl.load(num_rows_ptr):
            return
    # q: [G_PAD, D]; padding rows are zero, so their scores are finite and their output unused.
    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None],
        other=0.0,
    )

    v_scale = 1.0
    if FP8_KV:
        q, q_scale = quantize_q_rows(q, EMULATE_ROUNDING)
        k_scale = tl.load(k_scale_ptr).to(tl.float32)
        qk_scale = (q_scale * (qk_scale * k_scale))[:, None]  # [G_PAD, 1]: each head's own
        v_scale = tl.load(v_scale_ptr).to(tl.float32) * P_UNSCALE_C

    block_table_row = block_tables_ptr + seq * stride_btb
    for tile_start in range(start, end, BLOCK_N):
        tokens = tile_start + offs_n
        n_mask = tokens < end
        # Per-token gather: slot = block_tables[b, t // block_size] * block_size + t % block_size.
        # Works for BLOCK_N below, equal to or above block_size; masked tokens read nothing.
        block_ids = tl.load(block_table_row + tokens // BLOCK_SIZE, mask=n_mask, other=0)
        # int64: a large cache pool overflows int32 element offsets.
        block_ids = block_ids.to(tl.int64)
        in_block = tokens % BLOCK_SIZE

        # k^T: [D, BLOCK_N], loaded transposed so the score product needs no tl.trans.
        k_offsets = block_ids * stride_kb + in_block * stride_ks + kv_head * stride_kh
        k_t = tl.load(
            k_cache_ptr + k_offsets[None, :] + offs_d[:, None], mask=n_mask[None, :], other=0.0
        )
        if FP8_KV:
            scores = dot_e4m3(q, k_t, HEAD_DIM)
        else:
            scores = tl.dot(q, k_t, input_precision=DOT_PRECISION)
        scores = scores * qk_scale  # [G_PAD, BLOCK_N], in log2 units
        scores = tl.where(n_mask[None, :], scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        if FP8_KV:
            m_new = round_up_running_max(m_new)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)

        v_offsets = block_ids * stride_vb + in_block * stride_vs + kv_head * stride_vh
        # other=0: a masked row must be exactly zero, since p (0) * garbage could be NaN.
        if V_PLANES:
            # The same products as dot_e4m3's (e4m3 P and V, exact in float16, summed in
            # float32), each plane a quarter of D.
            words = tl.load(
                v_words_ptr + (v_offsets // 4)[:, None] + offs_w[None, :],
                mask=n_mask[:, None],
                other=0,
            )
            v0, v1, v2, v3 = e4m3_planes(words, INTERPRETED)
            p16 = quantize_probabilities(p, EMULATE_ROUNDING).to(tl.float16)
            acc0 = acc0 * alpha[:, None] + tl.dot(p16, v0)
            acc1 = acc1 * alpha[:, None] + tl.dot(p16, v1)
            acc2 = acc2 * alpha[:, None] + tl.dot(p16, v2)
            acc3 = acc3 * alpha[:, None] + tl.dot(p16, v3)
        else:
            v = tl.load(
                v_cache_ptr + v_offsets[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0
            )
            if FP8_KV:
                pv = dot_e4m3(quantize_probabilities(p, EMULATE_ROUNDING), v, BLOCK_N)
            else:
                pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            acc = acc * alpha[:, None] + pv
        m_i = m_new

    if V_PLANES:
        acc = interleave_planes(acc0, acc1, acc2, acc3, G_PAD, HEAD_DIM)

    # An empty split (or a seq_len 0 padding row) has l_i == 0: its output is 0 and its lse -inf,
    # which the combine step weighs as exp(-inf) = 0.
    has_tokens = l_i > 0.0
    out = acc * (v_scale / tl.where(has_tokens, l_i, 1.0))[:, None]
    if DIRECT:
        tl.store(
            out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None],
        )
    else:
        tl.store(
            out_ptr
            + seq * stride_ob
            + heads[:, None] * stride_oh
            + split * stride_os
            + offs_d[None, :],
            out,
            mask=g_mask[:, None],
        )
        lse = tl.where(has_tokens, m_i + tl.log2(tl.where(has_tokens, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + seq * stride_lb + heads * stride_lh + split, lse, mask=g_mask)


@triton.jit
def _combine_splits_kernel(
    partial_ptr,  # [B, Hq, num_splits, D] float32
    lse_ptr,  # [B, Hq, num_splits] float32, log2 domain
    out_ptr,  # [B, Hq, D]
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < NUM_SPLITS

    lse = tl.load(
        lse_ptr + seq * stride_lb + head * stride_lh + offs_s, mask=s_mask, other=float("-inf")
    )
    lse_max = tl.max(lse, axis=0)
    # All splits empty (a seq_len 0 row): every weight must come out 0, not exp2(-inf + inf).
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp2(lse - lse_max)  # [SPLITS_PAD], 0 for empty splits
    weight_sum = tl.sum(weights, axis=0)

    partial = tl.load(
        partial_ptr
        + seq * stride_pb
        + head * stride_ph
        + offs_s[:, None] * stride_ps
        + offs_d[None, :],
        mask=s_mask[:, None],
        other=0.0,
    )
    out = tl.sum(partial * weights[:, None], axis=0)
    out = out / tl.where(weight_sum > 0.0, weight_sum, 1.0)
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty)
    )


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Pick a split count: about two waves of programs, but at least ~256 tokens per split.

    The split kernel launches batch * num_kv_heads * splits programs. Returns the smallest power
    of two that reaches 2 * num_sms programs, capped so each split of the longest sequence keeps
    `_MIN_TOKENS_PER_SPLIT` tokens and at `MAX_NUM_SPLITS`; always in 1..64.
    """
    for name, value in (("batch", batch), ("num_kv_heads", num_kv_heads), ("num_sms", num_sms)):
        if value < 1:
            raise KernelInputError(f"choose_num_splits: {name} must be >= 1, got {value}")
    if max_seq_len < 0:
        raise KernelInputError(f"choose_num_splits: max_seq_len must be >= 0, got {max_seq_len}")
    max_by_length = max(1, max_seq_len // _MIN_TOKENS_PER_SPLIT)
    limit = min(MAX_NUM_SPLITS, 1 << (max_by_length.bit_length() - 1))  # power of two <= max
    num_splits = 1
    while num_splits < limit and batch * num_kv_heads * num_splits < 2 * num_sms:
        num_splits *= 2
    return num_splits


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    num_rows: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged KV cache: all of it, or
    with `sliding_window` W its last W tokens (the earlier blocks are never read).

    q: [B, Hq, D] (last dim contiguous); k_cache, v_cache: [num_blocks, block_size, Hkv, D]
    (last dim contiguous, other strides free); block_tables: [B, max_blocks] int32;
    seq_lens: [B] int32 on the device, each <= max_blocks * block_size (longer ones are clamped).
    A row with seq_len 0 is padding: its output is zeros and it reads no cache memory.
    The cache may instead be float8_e4m3fn, read as `stored * k_scale` (and v_scale): [1]
    tensors on the device, read there (so a CUDA graph captures them, not their values).
    sinks: None, or [Hq] (gpt-oss): each head's logit joins its softmax's denominator.
    num_rows: None, or a [1] int32 count on the device: only rows below it are computed and
    written, the others are left as they are (a prompt graph's mixed step, whose decode rows are
    counted on the device: `AttentionMetadata.device_decodes`). With one split only.
    Returns out: [B, Hq, D] in q's dtype (written into `out` when given), accumulated in float32.
    `config` overrides the tiles `pick_config` chooses (benchmarks).

    Preconditions the kernel cannot check without a device sync: block ids in the first
    cdiv(seq_len, block_size) entries of each row are valid indices into the cache.
    Raises KernelInputError for any shape, dtype, device or layout it cannot handle.
    """
    _verify_inputs(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, out)
    verify_window(sliding_window)
    verify_sinks(sinks, q)
    verify_count(num_rows, q, "num_rows")
    if num_rows is not None and num_splits != 1:
        raise KernelInputError(f"num_rows needs num_splits 1, got {num_splits}")
    fp8_kv = check_kv_cache_encoding(q.dtype, k_cache, v_cache, k_scale, v_scale)
    if out is None:
        out = torch.empty_like(q)
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if batch == 0:
        return out
    group_size = num_q_heads // num_kv_heads
    if config is None:
        config = pick_config(head_dim, fp8_kv)
    elif not (config.block_n >= 16 and config.block_n & (config.block_n - 1) == 0):
        raise KernelInputError(f"config.block_n must be a power of two >= 16, got {config}")
    direct = num_splits == 1
    if direct:
        partial, lse = out, out  # lse is unused when DIRECT
        stride_os, stride_lb, stride_lh = 0, 0, 0
    else:
        # Workspace, allocated per call: under CUDA-graph capture it comes from the graph's pool.
        partial = torch.empty(
            (batch, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        lse = torch.empty((batch, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
        stride_os, stride_lb, stride_lh = partial.stride(2), lse.stride(0), lse.stride(1)

    v_planes = fp8_kv and fits_word_planes(v_cache)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        v_cache.view(torch.int32) if v_planes else v_cache,
        block_tables,
        seq_lens,
        partial,
        lse,
        k_scale if fp8_kv else seq_lens,  # any pointer: not read unless FP8_KV
        v_scale if fp8_kv else seq_lens,
        seq_lens if sinks is None else sinks,  # any pointer: not read without sinks
        seq_lens if num_rows is None else num_rows,  # any pointer: not read without it
        scale * _LOG2E,
        block_tables.shape[1],
        sliding_window or 0,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        partial.stride(0),
        partial.stride(1),
        stride_os,
        stride_lb,
        stride_lh,
        GROUP_SIZE=group_size,
        G_PAD=max(16, triton.next_power_of_2(group_size)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=config.block_n,
        NUM_SPLITS=num_splits,
        DIRECT=direct,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FP8_KV=fp8_kv,
        EMULATE_ROUNDING=fp8_kv and triton_interprets(),
        V_PLANES=v_planes,
        INTERPRETED=triton_interprets(),
        HAS_SINKS=sinks is not None,
        ROW_COUNT=num_rows is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **launch_options(q.device),
    )
    if not direct:
        _combine_splits_kernel[(batch, num_q_heads)](
            partial,
            lse,
            out,
            partial.stride(0),
            partial.stride(1),
            partial.stride(2),
            lse.stride(0),
            lse.stride(1),
            out.stride(0),
            out.stride(1),
            NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim,
            num_warps=4,
            **launch_options(q.device),
        )
    return out


def verify_count(count: torch.Tensor | None, q: torch.Tensor, name: str) -> None:
    """A device-side count is None or a [1] int32 tensor on q's device."""
    if count is None:
        return
    if count.shape != (1,) or count.dtype != torch.int32 or count.device != q.device:
        raise KernelInputError(
            f"{name} must be a [1] int32 tensor on {q.device}, got {tuple(count.shape)} "
            f"{count.dtype} on {count.device}"
        )


def verify_window(sliding_window: int | None) -> None:
    """A window is None (none) or a positive int that fits the kernels' int32 positions."""
    if sliding_window is None:
        return
    if (
        isinstance(sliding_window, bool)
        or not isinstance(sliding_window, int)
        or not 1 <= sliding_window < 2**31
    ):
        raise KernelInputError(
            f"sliding_window must be None or a positive int, got {sliding_window!r}"
        )


@dataclass(frozen=True)
class DecodeConfig:
    """Tiles of the split kernel: BLOCK_N keys per step (a power of two, at least 16)."""

    block_n: int
    num_warps: int
    num_stages: int


def pick_config(head_dim: int, fp8_kv: bool = False) -> DecodeConfig:
    """The split kernel's tiles on H100.

    Decode attention is bandwidth-bound: BLOCK_N = 64 keeps a [64, D] K and V tile in flight per
    stage (16 KiB each at D = 128, bf16) with two stages, enough loads in flight to cover HBM
    latency while the registers hold the [G_PAD, D] float32 accumulator. D = 256 halves BLOCK_N
    to keep the same bytes per tile, and D = 512 (Gemma 4's global layers) halves it again, with
    8 warps to hold its accumulator without spilling (not yet timed on the H100). An FP8 cache
    at D <= 128, its V read in word planes, takes four stages of 64 keys (half the bytes of a
    bf16 tile): first of 18 in `bench/kernel_micro.py --sweep-attention decode` over e4m3
    (docs/BENCHMARKS.md, issue 17 round 13).
    """
    if head_dim > 256:
        return DecodeConfig(block_n=16, num_warps=8, num_stages=2)
    if fp8_kv and head_dim <= 128:
        return DecodeConfig(block_n=64, num_warps=4, num_stages=4)
    return DecodeConfig(block_n=32 if head_dim > 128 else 64, num_warps=4, num_stages=2)


def _verify_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    out: torch.Tensor | None,
) -> None:
    """Raise KernelInputError naming the first input the kernels cannot take as given."""
    # 1. Ranks and shapes.
    if q.dim() != 3:
        raise KernelInputError(f"q must be [B, Hq, D], got shape {tuple(q.shape)}")
    check_paged_cache(k_cache, v_cache)
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise KernelInputError(
            f"q head dim {head_dim} differs from cache head dim {cache_head_dim}"
        )
    if not _is_pow2_in(head_dim, 16, 512):
        raise KernelInputError(f"head dim must be a power of two in 16..512, got {head_dim}")
    if not _is_pow2_in(block_size, 16, 256):
        raise KernelInputError(f"block_size must be a power of two in 16..256, got {block_size}")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise KernelInputError(
            f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise KernelInputError(
            f"block_tables must be [B={batch}, max_blocks], got shape {tuple(block_tables.shape)}"
        )
    if seq_lens.shape != (batch,):
        raise KernelInputError(f"seq_lens must be [B={batch}], got shape {tuple(seq_lens.shape)}")
    if out is not None and out.shape != q.shape:
        raise KernelInputError(f"out shape {tuple(out.shape)} differs from q {tuple(q.shape)}")
    # 2. Dtypes.
    if q.dtype not in FLOAT_DTYPES:
        raise KernelInputError(f"q dtype must be float16, bfloat16 or float32, got {q.dtype}")
    if out is not None and out.dtype != q.dtype:
        raise KernelInputError(f"out dtype {out.dtype} differs from q dtype {q.dtype}")
    if block_tables.dtype != torch.int32:
        raise KernelInputError(f"block_tables must be int32, got {block_tables.dtype}")
    if seq_lens.dtype != torch.int32:
        raise KernelInputError(f"seq_lens must be int32, got {seq_lens.dtype}")
    # 3. Devices: everything on q's device, and that a CUDA device unless Triton interprets.
    named = {
        "q": q,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": block_tables,
        "seq_lens": seq_lens,
    }
    if out is not None:
        named["out"] = out
    for name, tensor in named.items():
        if tensor.device != q.device:
            raise KernelInputError(f"{name} is on {tensor.device}, q on {q.device}")
    if q.device.type != "cuda" and not triton_interprets():
        raise KernelInputError(f"tensors must be on a CUDA device, got {q.device}")
    if q.dtype == torch.bfloat16 and triton_interprets():
        # Triton's interpreter (3.9) multiplies bfloat16 tl.dot operands as raw integers and
        # returns garbage; fail closed rather than return wrong attention. bf16 runs on the GPU.
        raise KernelInputError("bfloat16 is not supported under TRITON_INTERPRET=1; use fp16/fp32")
    # 4. Layouts: the kernels index rows by stride but read each head vector as D contiguous values.
    for name, tensor in named.items():
        if tensor.dim() > 0 and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
            raise KernelInputError(
                f"{name} must be contiguous in its last dim, strides {tensor.stride()}"
            )
    # 5. Scalars.
    if (
        isinstance(num_splits, bool)
        or not isinstance(num_splits, int)
        or not 1 <= num_splits <= MAX_NUM_SPLITS
    ):
        raise KernelInputError(
            f"num_splits must be an int in 1..{MAX_NUM_SPLITS}, got {num_splits!r}"
        )
    if not math.isfinite(scale) or scale <= 0:
        raise KernelInputError(f"scale must be a finite positive number, got {scale!r}")


def _is_pow2_in(value: int, low: int, high: int) -> bool:
    return low <= value <= high and value & (value - 1) == 0

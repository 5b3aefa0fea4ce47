"""Paged prefill/extend attention in Triton: FlashAttention-2 over a block-table KV cache.

One launch serves a varlen batch in which every sequence brings `query_len >= 1` new tokens on
top of a cached prefix: a first prefill (no prefix), a chunked-prefill or prefix-cache extend
(prefix + chunk) and a decode row (`query_len == 1`) are all the same case. The semantics are
those of `kernels.reference.paged_attention`; the keys and values of the new tokens must already
be in the cache.

Work decomposition (why it looks the way it does):
- A program owns BLOCK_M "rows" of one sequence. With grouped-query attention the rows are
  (query token, query head) pairs of PACK heads that share one KV head, so every K/V tile read
  from the cache feeds PACK heads at once instead of being re-read by PACK programs.
- It walks the sequence's keys in BLOCK_N-token tiles through the block table, keeping an online
  softmax in float32 (exp2, with log2(e) folded into the scale).
- Tiles wholly below the causal limit of the program's FIRST row need no mask at all; only the
  few "diagonal" tiles between that limit and the limit of its LAST row are masked, and tiles
  past the last row's limit are never loaded. A sliding window adds the mirror image at the
  other end: tiles before the first row's window are never loaded, and those its rows' window
  edges cross are masked.
- With an FP8 cache (`kernels.fp8_attention`) the q tile is quantized per row once and each P
  tile as it is made; the e4m3 K tile goes into the score product (e4m3 tensor cores) as
  loaded, and V is read as int32 words whose four byte planes, widened to float16 in
  registers, make four P V products of a quarter of D (`e4m3_planes`: the same products,
  without Triton's byte-wise transposition of an e4m3 V tile, which made FP8 prefill
  attention slower than bf16's). The row scales of q and K's per-tensor scale join the score
  scale; V's scale (with P's) multiplies the output once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.decode_attention import (
    initial_softmax_state,
    verify_count,
    verify_sinks,
    verify_window,
)
from kernels.errors import KernelInputError
from kernels.fp8_attention import (
    P_UNSCALE_C,
    dot_e4m3,
    e4m3_planes,
    fits_word_planes,
    join_planes,
    quantize_probabilities,
    quantize_q_rows,
    round_up_running_max,
)
from kernels.launch_checks import (
    FLOAT_DTYPES,
    check_devices,
    check_kv_cache_encoding,
    check_paged_cache,
    triton_interprets,
)

__all__ = ["PrefillConfig", "paged_prefill_attention", "pick_config"]

_LOG2_E = 1.4426950408889634


@triton.jit
def _attend_key_tile(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    start_n,
    num_keys,
    window,
    lowest_key,
    k_cache_ptr,
    v_cache_ptr,
    v_words_ptr,
    block_table_row_ptr,
    kv_head,
    qk_scale,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_FP32: tl.constexpr,
    FP8_KV: tl.constexpr,
    EMULATE_ROUNDING: tl.constexpr,
    V_PLANES: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Fold keys [start_n, start_n + BLOCK_N) into the running softmax state of BLOCK_M rows.

    acc: [BLOCK_M, HEAD_DIM] f32 ([BLOCK_M, HEAD_DIM / 4, 2, 2] with V_PLANES: `join_planes`),
    m_i/l_i: [BLOCK_M] f32 (running max in log2 units, running sum), q: [BLOCK_M, HEAD_DIM]
    (e4m3 with FP8_KV), q_pos: [BLOCK_M] absolute position of each row's query, qk_scale: a
    scalar or [BLOCK_M, 1] (FP8_KV: each row's own).
    MASKED tiles may reach past a row's causal limit, below its window (`window` > 0) or past
    `num_keys`; unmasked ones may not. Keys below `lowest_key` (outside every row's window) are
    never loaded, nor their block-table entries: their blocks may have been freed.
    """
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    # Per-token gather through the block table, so BLOCK_N need not match the cache block size.
    # Block ids go to int64 before scaling by a stride: a large cache has > 2**31 elements.
    if MASKED:
        in_seq = (offs_n < num_keys) & (offs_n >= lowest_key)
        block_ids = tl.load(block_table_row_ptr + offs_n // BLOCK_SIZE, mask=in_seq, other=0)
    else:
        block_ids = tl.load(block_table_row_ptr + offs_n // BLOCK_SIZE)
    block_ids = block_ids.to(tl.int64)
    in_block = offs_n % BLOCK_SIZE

    # K is loaded already transposed, kT: [HEAD_DIM, BLOCK_N].
    k_ptrs = (
        k_cache_ptr
        + block_ids[None, :] * stride_kb
        + in_block[None, :] * stride_kt
        + kv_head * stride_kh
        + offs_d[:, None]
    )
    # v: [BLOCK_N, HEAD_DIM]
    v_ptrs = (
        v_cache_ptr
        + block_ids[:, None] * stride_vb
        + in_block[:, None] * stride_vt
        + kv_head * stride_vh
        + offs_d[None, :]
    )
    k_t = tl.load(k_ptrs, mask=in_seq[None, :], other=0.0) if MASKED else tl.load(k_ptrs)

    if FP8_KV:
        qk = dot_e4m3(q, k_t, HEAD_DIM)
    elif DOT_FP32:
        qk = tl.dot(q.to(tl.float32), k_t.to(tl.float32), input_precision="ieee")
    else:
        qk = tl.dot(q, k_t)
    qk = qk * qk_scale  # [BLOCK_M, BLOCK_N], in log2 units
    if MASKED:
        visible = (offs_n[None, :] <= q_pos[:, None]) & in_seq[None, :]
        visible &= (offs_n[None, :] > q_pos[:, None] - window) | (window == 0)
        qk = tl.where(visible, qk, float("-inf"))

    # m_i starts at a finite floor, not -inf: a row that sees no key of a tile (outside its
    # window, or a padding row) then gets p = 0 there, not a (-inf) - (-inf) NaN.
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    if FP8_KV:
        m_new = round_up_running_max(m_new)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)

    if V_PLANES:
        # V as int32 words in four byte planes (the decode kernel's reason: Triton 3.6
        # transposes an e4m3 V tile out of shared memory a byte at a time).
        offs_w = tl.arange(0, HEAD_DIM // 4)
        v_words = (
            v_words_ptr
            + (block_ids[:, None] * stride_vb + in_block[:, None] * stride_vt + kv_head * stride_vh)
            // 4
            + offs_w[None, :]
        )
        words = tl.load(v_words, mask=in_seq[:, None], other=0) if MASKED else tl.load(v_words)
        v0, v1, v2, v3 = e4m3_planes(words, INTERPRETED)
        p16 = quantize_probabilities(p, EMULATE_ROUNDING).to(tl.float16)
        pv = join_planes(tl.dot(p16, v0), tl.dot(p16, v1), tl.dot(p16, v2), tl.dot(p16, v3))
        acc = acc * alpha[:, None, None, None] + pv
    else:
        v = tl.load(v_ptrs, mask=in_seq[:, None], other=0.0) if MASKED else tl.load(v_ptrs)
        if FP8_KV:
            pv = dot_e4m3(quantize_probabilities(p, EMULATE_ROUNDING), v, BLOCK_N)
        elif DOT_FP32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


# The block-table width varies from step to step; specialized (== 1, divisible by 16) it would
# make three compiled variants, the later ones compiled while serving, seconds each. So does
# the alignment of the per-sequence pointers: a mixed step passes views past its decode rows
# (kernels.triton_ops), 16-byte aligned or not with the number of decodes, and the unused
# scale and sink pointers are such a view too. They are read a scalar at a time, so the hint
# buys nothing either.
@triton.jit(
    do_not_specialize=["max_blocks", "stride_bt"],
    do_not_specialize_on_alignment=[
        "block_tables_ptr",
        "seq_lens_ptr",
        "query_start_loc_ptr",
        "k_scale_ptr",
        "v_scale_ptr",
        "sinks_ptr",
        "first_seq_ptr",
    ],
)
def _paged_prefill_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    v_words_ptr,  # V_PLANES: the FP8 v_cache as int32 words [num_blocks, block_size, Hkv, D / 4]
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    k_scale_ptr,  # [1]: an FP8 cache's K scale (read only when FP8_KV)
    v_scale_ptr,  # [1]
    sinks_ptr,  # [Hq]: gpt-oss's attention sinks (read only when HAS_SINKS)
    first_seq_ptr,  # [1]: the sequences before this one are left out (read when SKIP_LEADING)
    qk_scale,
    max_blocks,
    window,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    GROUP: tl.constexpr,
    PACK: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    # Both matmuls on float32 operands with exact ("ieee", not tf32) products: float32 inputs,
    # and bfloat16 under the interpreter, whose bf16 tl.dot returns garbage (Triton 3.9).
    DOT_FP32: tl.constexpr,
    FP8_KV: tl.constexpr,  # the cache holds float8_e4m3fn values and their per-tensor scales
    EMULATE_ROUNDING: tl.constexpr,  # FP8_KV under the interpreter: see kernels.fp8_attention
    V_PLANES: tl.constexpr,  # FP8_KV: V read as words, P V in four byte planes (e4m3_planes)
    INTERPRETED: tl.constexpr,  # Triton's interpreter runs this (no inline assembly)
    HAS_SINKS: tl.constexpr,
    SKIP_LEADING: tl.constexpr,  # the sequences before *first_seq_ptr are another kernel's
):
    """Grid: (row tiles, Hq // PACK, B). Row r of a tile is query token r // PACK of the
    sequence, for query head (program's first head) + r % PACK."""
    # Last row tiles first: they see the most keys, so starting them early shortens the tail.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_h = tl.program_id(1)
    seq = tl.program_id(2)
    if SKIP_LEADING:  # noqa: SIM102 (as the decode kernel's count: the load only with it)
        if seq < tl.load(first_seq_ptr):
            return

    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if pid_m * BLOCK_M >= query_len * PACK:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    num_cached = seq_len - query_len

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    token = rows // PACK  # query index within this sequence
    head = pid_h * PACK + rows % PACK
    # PACK divides GROUP, so all heads of this program share one KV head.
    kv_head = (pid_h * PACK) // GROUP
    row_valid = token < query_len
    q_pos = num_cached + token

    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = (q_start + token).to(tl.int64)
    q_ptrs = q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_valid[:, None], other=0.0)

    v_scale = 1.0
    if FP8_KV:
        q, q_scale = quantize_q_rows(q, EMULATE_ROUNDING)
        k_scale = tl.load(k_scale_ptr).to(tl.float32)
        qk_scale = (q_scale * (qk_scale * k_scale))[:, None]  # [BLOCK_M, 1]
        v_scale = tl.load(v_scale_ptr).to(tl.float32) * P_UNSCALE_C

    m_i, l_i = initial_softmax_state(sinks_ptr, head, row_valid, BLOCK_M, HAS_SINKS, FP8_KV)
    if V_PLANES:
        acc = tl.zeros([BLOCK_M, HEAD_DIM // 4, 2, 2], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    first_token = (pid_m * BLOCK_M) // PACK
    last_token = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // PACK, query_len - 1)
    # Never read past the block-table row, whatever seq_len says (block ids themselves are the
    # caller's contract).
    num_keys = tl.minimum(seq_len, max_blocks * BLOCK_SIZE)
    # Keys below `unmasked_end` are visible to every row of the tile (and all < num_keys).
    unmasked_end = tl.minimum(num_cached + first_token + 1, num_keys) // BLOCK_N * BLOCK_N
    causal_end = tl.minimum(num_cached + last_token + 1, num_keys)
    # With a window: tiles from `window_start` hold keys some row sees; keys from `window_end`
    # are inside every row's window. Between them the window edge needs the mask.
    lowest_key = tl.where(window > 0, tl.maximum(num_cached + first_token - window + 1, 0), 0)
    window_start = lowest_key // BLOCK_N * BLOCK_N
    window_end = tl.where(
        window > 0,
        tl.cdiv(tl.maximum(num_cached + last_token - window + 1, 0), BLOCK_N) * BLOCK_N,
        0,
    )
    block_table_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt

    # Three runs of tiles, in key order: the window's edge (masked), the keys every row sees
    # (unmasked), the causal diagonal (masked). Without a window the first is empty.
    for start_n in range(window_start, tl.minimum(window_end, causal_end), BLOCK_N):
        acc, m_i, l_i = _attend_key_tile(
            acc, m_i, l_i, q, q_pos, start_n, num_keys, window, lowest_key,
            k_cache_ptr, v_cache_ptr, v_words_ptr, block_table_row_ptr, kv_head, qk_scale,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            BLOCK_SIZE, HEAD_DIM, BLOCK_N, True, DOT_FP32, FP8_KV, EMULATE_ROUNDING,
            V_PLANES, INTERPRETED,
        )  # fmt: skip
    for start_n in range(window_end, unmasked_end, BLOCK_N):
        acc, m_i, l_i = _attend_key_tile(
            acc, m_i, l_i, q, q_pos, start_n, num_keys, window, lowest_key,
            k_cache_ptr, v_cache_ptr, v_words_ptr, block_table_row_ptr, kv_head, qk_scale,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            BLOCK_SIZE, HEAD_DIM, BLOCK_N, False, DOT_FP32, FP8_KV, EMULATE_ROUNDING,
            V_PLANES, INTERPRETED,
        )  # fmt: skip
    for start_n in range(tl.maximum(unmasked_end, window_end), causal_end, BLOCK_N):
        acc, m_i, l_i = _attend_key_tile(
            acc, m_i, l_i, q, q_pos, start_n, num_keys, window, lowest_key,
            k_cache_ptr, v_cache_ptr, v_words_ptr, block_table_row_ptr, kv_head, qk_scale,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            BLOCK_SIZE, HEAD_DIM, BLOCK_N, True, DOT_FP32, FP8_KV, EMULATE_ROUNDING,
            V_PLANES, INTERPRETED,
        )  # fmt: skip

    if V_PLANES:
        acc = tl.reshape(acc, [BLOCK_M, HEAD_DIM])
    out = acc * (v_scale / l_i)[:, None]
    o_ptrs = out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


@dataclass(frozen=True)
class PrefillConfig:
    """Tiles of one launch: BLOCK_M rows (query token, head) per program, BLOCK_N keys per
    step (both powers of two, at least 16)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def pick_config(
    dtype: torch.dtype, head_dim: int, interpreted: bool, fp8_kv: bool
) -> PrefillConfig:
    """Tile sizes: H100-tuned on the GPU, small in the interpreter (which runs every program
    serially in numpy, so big tiles only add work on tiny test shapes).

    The GPU choices were the fastest of a small sweep on the H100 (Triton 3.6, bf16, causal
    prefill of 8 x 2048 tokens, 32 query / 8 KV heads; 2026-11-21): D=64 283, D=128 309,
    D=256 306 TFLOP/s. `bench/kernel_micro.py --sweep-attention` re-runs such a sweep.

    D=128 takes 32-key tiles: of 24 tiles swept on the H100 (Triton 3.6, 2026-11-28) they were
    the fastest for both caches at W2's prompt step (16 x 512: bf16 246 -> 194 us, FP8 272 ->
    243 us against 64-key tiles) and at 8 x 2048 (1,163 -> 1,004 and 1,170 -> 1,116 us). An FP8
    cache takes two stages, bf16 three.
    """
    if interpreted:
        return PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    if head_dim > 256:
        # D=512 (Gemma 4's global layers): a 32-row Q tile and one stage of 16-row K/V tiles
        # (64 KiB of bf16, 128 KiB of float32) fit shared memory; 8 warps hold the [32, 512]
        # float32 accumulator. Not yet timed on the H100.
        return PrefillConfig(block_m=32, block_n=16, num_warps=8, num_stages=1)
    if dtype == torch.float32 and not fp8_kv:
        # Twice the bytes per element and no fast tensor-core path: keep shared memory small.
        return PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    if head_dim <= 64:
        return PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
    if head_dim <= 128:
        return PrefillConfig(block_m=128, block_n=32, num_warps=4, num_stages=2 if fp8_kv else 3)
    # D=256: a 128-row Q tile plus staged K/V tiles of 256 columns overflow shared memory.
    return PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    first_seq: torch.Tensor | None = None,
    config: PrefillConfig | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context: all of it, or
    with `sliding_window` W the last W tokens up to each query's own (tiles wholly before a
    tile's windows are never read).

    q: [T, Hq, D] the new tokens of all B sequences, concatenated in batch order
    k_cache, v_cache: [num_blocks, block_size, Hkv, D], already holding the new tokens' K/V
    block_tables: [B, max_blocks] int32; token t of sequence b lives in slot
        block_tables[b, t // block_size] * block_size + t % block_size
    seq_lens: [B] int32, each sequence's total context after this step (prefix + new tokens)
    query_start_loc: [B + 1] int32, sequence b owns rows query_start_loc[b] : [b + 1] of q
    max_query_len: the largest query_len in the batch (sizes the grid without a device sync)
    scale: softmax scale, usually D ** -0.5
    sliding_window: None, or how many of the latest keys (its own included) a query sees
    out: optional [T, Hq, D] destination in q's dtype
    k_scale, v_scale: [1] tensors on the device, for a float8_e4m3fn cache (read as
        `stored * scale`); a cache in q's dtype ignores them
    sinks: None, or [Hq] (gpt-oss): each head's logit joins its softmax's denominator
    first_seq: None, or a [1] int32 count on the device: the sequences before it are left
        out, their rows of `out` as they were (a prompt graph's mixed step, whose decode rows
        the decode kernel computes: `AttentionMetadata.device_decodes`)
    config: overrides the tiles `pick_config` chooses (benchmarks)
    -> [T, Hq, D] in q's dtype; query i of sequence b sits at position
       seq_len_b - query_len_b + i and attends to keys 0 ..= that position.

    Shapes, dtypes, devices and layouts are checked (`KernelInputError`). The metadata VALUES
    are trusted, because reading them would stall on the GPU: query_len_b <= max_query_len and
    <= seq_len_b, query_start_loc[B] == T, and every block id the context needs lies in
    [0, num_blocks). A sequence with query_len 0 (a padding row) is skipped. Only the last dim
    of a tensor needs to be contiguous.
    """
    _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len)
    verify_window(sliding_window)
    verify_sinks(sinks, q)
    verify_count(first_seq, q, "first_seq")
    fp8_kv = check_kv_cache_encoding(q.dtype, k_cache, v_cache, k_scale, v_scale)
    if not (isinstance(scale, int | float) and math.isfinite(scale) and scale > 0):
        raise KernelInputError(f"scale must be a finite positive number, got {scale!r}")
    if out is None:
        out = torch.empty_like(q)
    else:
        _check_out(out, q)

    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out

    group = num_q_heads // num_kv_heads
    interpreted = triton_interprets()
    if config is None:
        config = pick_config(q.dtype, head_dim, interpreted, fp8_kv)
    else:
        _check_config(config)
    # Pack as many heads of a GQA group as divide it evenly into one program (the largest
    # power-of-two divisor, so PACK tiles BLOCK_M exactly).
    pack = min(group & -group, config.block_m)
    grid = (triton.cdiv(max_query_len * pack, config.block_m), num_q_heads // pack, num_seqs)
    v_planes = fp8_kv and fits_word_planes(v_cache)
    _paged_prefill_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        v_cache.view(torch.int32) if v_planes else v_cache,
        out,
        block_tables,
        seq_lens,
        query_start_loc,
        k_scale if fp8_kv else seq_lens,  # any pointer: not read unless FP8_KV
        v_scale if fp8_kv else seq_lens,
        seq_lens if sinks is None else sinks,  # any pointer: not read without sinks
        seq_lens if first_seq is None else first_seq,  # any pointer: not read without it
        scale * _LOG2_E,
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
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        GROUP=group,
        PACK=pack,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        DOT_FP32=not fp8_kv
        and (q.dtype == torch.float32 or (interpreted and q.dtype == torch.bfloat16)),
        FP8_KV=fp8_kv,
        EMULATE_ROUNDING=fp8_kv and interpreted,
        V_PLANES=v_planes,
        INTERPRETED=interpreted,
        HAS_SINKS=sinks is not None,
        SKIP_LEADING=first_seq is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def _check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
) -> None:
    """Raise KernelInputError unless the tensors can be handed to the kernel as they are."""
    if q.dim() != 3:
        raise KernelInputError(f"q must be [T, Hq, D], got shape {tuple(q.shape)}")
    check_paged_cache(k_cache, v_cache)
    if q.dtype not in FLOAT_DTYPES:
        raise KernelInputError(f"q dtype {q.dtype} unsupported; use float16, bfloat16 or float32")
    num_q_heads, head_dim = q.shape[1:]
    num_kv_heads, cache_head_dim = k_cache.shape[2:]
    if cache_head_dim != head_dim:
        raise KernelInputError(f"head_dim mismatch: q has {head_dim}, cache has {cache_head_dim}")
    if head_dim not in (16, 32, 64, 128, 256, 512):
        raise KernelInputError(f"head_dim must be a power of two in 16..512, got {head_dim}")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise KernelInputError(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if k_cache.shape[1] == 0:
        raise KernelInputError("block_size (k_cache dim 1) must be positive")

    for name, meta in (
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc),
    ):
        if meta.dtype != torch.int32:
            raise KernelInputError(f"{name} must be int32, got {meta.dtype}")
    if block_tables.dim() != 2:
        raise KernelInputError(
            f"block_tables must be [B, max_blocks], got shape {tuple(block_tables.shape)}"
        )
    if seq_lens.dim() != 1 or seq_lens.shape[0] != block_tables.shape[0]:
        raise KernelInputError(
            f"seq_lens must be [B] with B = {block_tables.shape[0]} (block_tables rows), "
            f"got shape {tuple(seq_lens.shape)}"
        )
    if query_start_loc.dim() != 1 or query_start_loc.shape[0] != seq_lens.shape[0] + 1:
        raise KernelInputError(
            f"query_start_loc must be [B + 1] = [{seq_lens.shape[0] + 1}], "
            f"got shape {tuple(query_start_loc.shape)}"
        )
    if isinstance(max_query_len, bool) or not isinstance(max_query_len, int):
        raise KernelInputError(f"max_query_len must be an int, got {type(max_query_len).__name__}")
    if q.shape[0] > 0 and not 1 <= max_query_len <= q.shape[0]:
        raise KernelInputError(
            f"max_query_len must be in 1..T = 1..{q.shape[0]}, got {max_query_len}"
        )

    check_devices(
        {
            "q": q,
            "k_cache": k_cache,
            "v_cache": v_cache,
            "block_tables": block_tables,
            "seq_lens": seq_lens,
            "query_start_loc": query_start_loc,
        }
    )
    for name, tensor in (
        ("q", q),
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc),
    ):
        if tensor.numel() > 0 and tensor.stride(-1) != 1:
            raise KernelInputError(
                f"{name} must be contiguous in its last dim, got strides {tensor.stride()}"
            )


def _check_config(config: PrefillConfig) -> None:
    for name in ("block_m", "block_n"):
        value = getattr(config, name)
        if not (isinstance(value, int) and value >= 16 and value & (value - 1) == 0):
            raise KernelInputError(f"config.{name} must be a power of two >= 16, got {value!r}")


def _check_out(out: torch.Tensor, q: torch.Tensor) -> None:
    if out.shape != q.shape or out.dtype != q.dtype:
        raise KernelInputError(
            f"out must be {tuple(q.shape)} {q.dtype} like q, got {tuple(out.shape)} {out.dtype}"
        )
    if out.device != q.device:
        raise KernelInputError(f"out is on {out.device} but q is on {q.device}")
    if out.numel() > 0 and out.stride(-1) != 1:
        raise KernelInputError(f"out must be contiguous in its last dim, got {out.stride()}")

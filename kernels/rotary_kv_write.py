"""One launch for what a decode layer does between its qkv projection and its attention: rotate
q and k by their positions and store the rotated keys and the values at their cache slots.

Semantics are `kernels.reference.rotary_write_kv`'s: `kernels.rotary`'s rotation (float32,
rounded once to q's dtype), then `kernels.kv_cache_write`'s store (a negative slot is padding
and skipped, a slot past the cache is dropped, an FP8 cache stores the rounded key divided by
its scale, saturated). q is rotated in place; k is not: the cache holds its rotation, and
nothing after the store reads k.

Why one kernel: at batch 1 each of the two took a launch of 1-2 µs of an H100's time per
layer, most of it ramp-up and waiting, not work (docs/BENCHMARKS.md); one program per token now
reads its cos/sin row once and writes each key once, to the cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_cache_write import FP8_MAX, check_kv_write_inputs, to_cache
from kernels.pdl import launch_options, wait_for_previous
from kernels.rotary import (
    check_rotary_inputs,
    cos_sin_halves,
    rotary_tiles,
    rotate_heads,
    rotated_halves,
)


# Slots and scales are read a scalar at a time (see kernels.kv_cache_write).
@triton.jit(do_not_specialize_on_alignment=["slot_mapping_ptr", "k_scale_ptr", "v_scale_ptr"])
def _rotary_write_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,  # [1] (read only when QUANTIZE)
    v_scale_ptr,  # [1]
    q_token_stride,
    q_head_stride,
    k_token_stride,
    k_head_stride,
    v_token_stride,
    v_head_stride,
    cos_token_stride,
    sin_token_stride,
    cache_elements,  # num_blocks * block_size * Hkv * D (int64 where it must be)
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,  # head_dim // 2
    BLOCK_HALF: tl.constexpr,
    BLOCK_Q_HEADS: tl.constexpr,
    BLOCK_KV_HEADS: tl.constexpr,
    QUANTIZE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    PDL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    # Before the wait, what no kernel just before this one writes (kernels.pdl: the one before
    # waited for its own predecessor): the step's cos and sin rows and slots. q, k and v are
    # the projection's, just before.
    cos1, sin1, cos2, sin2 = cos_sin_halves(
        cos_ptr, sin_ptr, token, cos_token_stride, sin_token_stride, cols, HALF
    )
    slot = tl.load(slot_mapping_ptr + token)
    wait_for_previous(PDL)
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
    # The cache is [slots, Hkv, D] contiguous: a slot holds NUM_KV_HEADS * 2 * HALF elements.
    # The bounds are tested on the offsets, not the scalar slot (Triton's interpreter mishandles
    # a scalar boolean broadcast into a vector mask): padding (slot < 0) and a slot past the
    # cache are skipped.
    slot_elements = NUM_KV_HEADS * 2 * HALF
    for head_start in range(0, NUM_KV_HEADS, BLOCK_KV_HEADS):
        heads = head_start + tl.arange(0, BLOCK_KV_HEADS)[:, None]
        mask = (heads < NUM_KV_HEADS) & (cols < HALF)
        in_slot = heads * 2 * HALF + cols
        cache_offs = slot * slot_elements + in_slot
        store_mask = mask & (cache_offs >= 0) & (cache_offs < cache_elements)
        k1, k2 = rotated_halves(
            k_ptr + token * k_token_stride + heads * k_head_stride + cols,
            mask,
            cos1,
            sin1,
            cos2,
            sin2,
            HALF,
        )
        k1 = to_cache(k1, k_scale_ptr, QUANTIZE, FP8_MAX, k_cache_ptr)
        k2 = to_cache(k2, k_scale_ptr, QUANTIZE, FP8_MAX, k_cache_ptr)
        tl.store(k_cache_ptr + cache_offs, k1, mask=store_mask)
        tl.store(k_cache_ptr + cache_offs + HALF, k2, mask=store_mask)
        v_first = v_ptr + token * v_token_stride + heads * v_head_stride + cols
        v1 = tl.load(v_first, mask=mask, other=0.0)
        v2 = tl.load(v_first + HALF, mask=mask, other=0.0)
        v1 = to_cache(v1, v_scale_ptr, QUANTIZE, FP8_MAX, v_cache_ptr)
        v2 = to_cache(v2, v_scale_ptr, QUANTIZE, FP8_MAX, v_cache_ptr)
        tl.store(v_cache_ptr + cache_offs, v1, mask=store_mask)
        tl.store(v_cache_ptr + cache_offs + HALF, v2, mask=store_mask)


def rotary_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q IN PLACE and return it; store rotate(k) and v at their slots of the cache.

    Takes what `kernels.rotary.rotary_embedding` and `kernels.kv_cache_write.write_kv_cache`
    take (q, k: [T, H, D]; cos, sin: [T, D] float32; v: [T, Hkv, D]; the caches
    [num_blocks, block_size, Hkv, D] in k's dtype or FP8 with its scales; slot_mapping: [T]
    int64). k itself is left as it was. Raises `KernelInputError` for anything either would
    refuse.
    """
    check_rotary_inputs(q, k, cos, sin)
    quantize = check_kv_write_inputs(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_tokens == 0:
        return q
    half, block_half, block_q_heads, block_kv_heads = rotary_tiles(
        head_dim, num_q_heads, num_kv_heads
    )
    _rotary_write_kv_kernel[(num_tokens,)](
        q,
        k,
        v,
        cos,
        sin,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale if quantize else slot_mapping,  # any pointer: not read unless QUANTIZE
        v_scale if quantize else slot_mapping,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        sin.stride(0),
        k_cache.numel(),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=half,
        BLOCK_HALF=block_half,
        BLOCK_Q_HEADS=block_q_heads,
        BLOCK_KV_HEADS=block_kv_heads,
        QUANTIZE=quantize,
        FP8_MAX=FP8_MAX,
        num_warps=4,
        **launch_options(q.device),
    )
    return q

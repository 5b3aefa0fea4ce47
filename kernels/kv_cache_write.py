"""Triton kernel that scatters each new token's key and value into the paged KV cache.

Semantics are those of `kernels.reference.write_kv_cache`: token t is stored at flat slot
`slot_mapping[t] = block_id * block_size + offset`; a negative slot marks a padding token (a
CUDA-graph batch padded to its captured size) and is skipped, so padding never touches the cache.
An FP8 cache stores each value divided by its tensor's scale (K's or V's), saturated to e4m3's
range: `kernels.reference.quantize_kv`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.errors import KernelInputError
from kernels.launch_checks import FLOAT_DTYPES, KV_CACHE_FP8, check_devices, check_kv_cache_encoding
from kernels.pdl import launch_options, wait_for_previous

# One program holds a whole token (all KV heads) in registers; beyond this it would spill.
_MAX_TOKEN_ELEMENTS = 16384
FP8_MAX = torch.finfo(KV_CACHE_FP8).max


@triton.jit
def to_cache(x, scale_ptr, QUANTIZE: tl.constexpr, FP8_MAX: tl.constexpr, cache_ptr):
    """x (a key or value tile in the model's dtype) as the cache stores it: as it is, or (an FP8
    cache) divided by the scale at `scale_ptr` and saturated."""
    if QUANTIZE:
        # Correctly rounded division (as torch's), so the stored bytes equal the reference's.
        x = tl.div_rn(x.to(tl.float32), tl.load(scale_ptr).to(tl.float32))
        # Saturate: converting a value beyond the finite range would give NaN (e4m3 has no inf).
        x = tl.clamp(x, -FP8_MAX, FP8_MAX)
    return x.to(cache_ptr.dtype.element_ty)


# The slots are read a scalar at a time: an alignment hint on them buys nothing, and a
# variant per alignment would be compiled while serving when a step's slots are a view at an
# odd offset (a tensor-parallel worker's window-group slots, split out of one broadcast).
@triton.jit(do_not_specialize_on_alignment=["slot_mapping_ptr", "k_scale_ptr", "v_scale_ptr"])
def _write_kv_cache_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,  # [1] (read only when QUANTIZE)
    v_scale_ptr,  # [1]
    k_token_stride,
    v_token_stride,
    cache_elements,  # num_blocks * block_size * TOKEN_ELEMENTS
    TOKEN_ELEMENTS: tl.constexpr,  # num_kv_heads * head_dim
    BLOCK: tl.constexpr,  # next power of two of TOKEN_ELEMENTS
    QUANTIZE: tl.constexpr,  # the cache is FP8: store x / scale, saturated
    FP8_MAX: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent (kernels.pdl)
):
    wait_for_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    offs = tl.arange(0, BLOCK)
    # Slot is int64, so `slot * TOKEN_ELEMENTS` cannot overflow on caches above 2**31 elements.
    cache_offs = slot * TOKEN_ELEMENTS + offs
    # For offs in [0, TOKEN_ELEMENTS) the bounds below hold exactly when 0 <= slot < num_slots:
    # padding (slot < 0) is skipped, and an out-of-range slot is dropped rather than written
    # outside the cache (checking slot values on the host would cost a device sync per step).
    # The test is on the offsets, not the scalar slot, because Triton's interpreter mishandles
    # a scalar boolean broadcast into a vector mask.
    mask = (offs < TOKEN_ELEMENTS) & (cache_offs >= 0) & (cache_offs < cache_elements)
    k = tl.load(k_ptr + token * k_token_stride + offs, mask=mask)
    v = tl.load(v_ptr + token * v_token_stride + offs, mask=mask)
    k = to_cache(k, k_scale_ptr, QUANTIZE, FP8_MAX, k_cache_ptr)
    v = to_cache(v, v_scale_ptr, QUANTIZE, FP8_MAX, v_cache_ptr)
    tl.store(k_cache_ptr + cache_offs, k, mask=mask)
    tl.store(v_cache_ptr + cache_offs, v, mask=mask)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store each token's key and value at its slot of the paged cache, in place.

    k, v: [T, Hkv, D], each token's [Hkv, D] contiguous (a token-strided view of a fused qkv
    output is fine); k_cache, v_cache: [num_blocks, block_size, Hkv, D], contiguous, in k's
    dtype or float8_e4m3fn; slot_mapping: [T] int64, contiguous. An FP8 cache needs k_scale and
    v_scale ([1] tensors on the device, read there, so a CUDA graph may capture them).

    Slots < 0 are padding and skipped. Slot values are not checked on the host (that would
    sync the device): a slot >= num_blocks * block_size is silently dropped instead of written
    out of bounds. Raises `KernelInputError` for any shape, dtype, device or layout it cannot
    handle.
    """
    quantize = check_kv_write_inputs(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    token_elements = num_kv_heads * head_dim
    block = triton.next_power_of_2(token_elements)
    # 8 elements per thread (16-byte fp16/bf16 accesses), 1 to 8 warps: Hkv=8, D=128 -> 4 warps.
    num_warps = max(1, min(8, block // 256))
    _write_kv_cache_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale if quantize else slot_mapping,  # any pointer: not read unless QUANTIZE
        v_scale if quantize else slot_mapping,
        k.stride(0),
        v.stride(0),
        k_cache.numel(),
        TOKEN_ELEMENTS=token_elements,
        BLOCK=block,
        QUANTIZE=quantize,
        FP8_MAX=FP8_MAX,
        num_warps=num_warps,
        **launch_options(k.device),
    )


def check_kv_write_inputs(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> bool:
    """Raise KernelInputError for anything the kernel cannot take; whether it quantizes."""
    named = {"k": k, "v": v, "k_cache": k_cache, "v_cache": v_cache, "slot_mapping": slot_mapping}
    for name, tensor in named.items():
        if not isinstance(tensor, torch.Tensor):
            raise KernelInputError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    check_devices(named)
    for name, tensor, ndim in (("k", k, 3), ("v", v, 3), ("k_cache", k_cache, 4)):
        if tensor.dim() != ndim:
            raise KernelInputError(
                f"{name} must have {ndim} dimensions, got shape {tuple(tensor.shape)}"
            )
    if v_cache.shape != k_cache.shape:
        raise KernelInputError(
            f"v_cache shape {tuple(v_cache.shape)} differs from k_cache {tuple(k_cache.shape)}"
        )
    if v.shape != k.shape:
        raise KernelInputError(f"v shape {tuple(v.shape)} differs from k {tuple(k.shape)}")
    if k.shape[1:] != k_cache.shape[2:]:
        raise KernelInputError(
            f"k heads and head size {tuple(k.shape[1:])} do not match the cache's "
            f"{tuple(k_cache.shape[2:])}"
        )
    if slot_mapping.shape != (k.shape[0],):
        raise KernelInputError(
            f"slot_mapping must have shape ({k.shape[0]},) (one slot per token), "
            f"got {tuple(slot_mapping.shape)}"
        )
    if k.dtype not in FLOAT_DTYPES:
        raise KernelInputError(f"k dtype {k.dtype} is not one of float16, bfloat16, float32")
    if v.dtype != k.dtype:
        raise KernelInputError(f"v dtype {v.dtype} differs from k dtype {k.dtype}")
    quantize = check_kv_cache_encoding(k.dtype, k_cache, v_cache, k_scale, v_scale)
    if slot_mapping.dtype != torch.int64:
        raise KernelInputError(f"slot_mapping must be int64, got {slot_mapping.dtype}")
    num_kv_heads, head_dim = k.shape[1:]
    if num_kv_heads * head_dim > _MAX_TOKEN_ELEMENTS:
        raise KernelInputError(
            f"num_kv_heads * head_dim = {num_kv_heads * head_dim} exceeds the "
            f"{_MAX_TOKEN_ELEMENTS} elements one program holds"
        )
    for name, tensor in (("k", k), ("v", v)):
        # The kernel reads a token as one flat run of Hkv * D elements.
        if tensor.stride(2) != 1 or (num_kv_heads > 1 and tensor.stride(1) != head_dim):
            raise KernelInputError(
                f"{name} must have each token's [Hkv, D] contiguous, got strides {tensor.stride()}"
            )
    for name, tensor in (
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("slot_mapping", slot_mapping),
    ):
        if not tensor.is_contiguous():
            raise KernelInputError(f"{name} must be contiguous, got strides {tensor.stride()}")
    return quantize

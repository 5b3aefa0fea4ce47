"""Checks every kernel launcher makes before handing tensors to Triton."""

from __future__ import annotations

import os

import torch

from kernels.errors import KernelInputError
from kernels.ops import RecurrentStateMetadata

# The floating-point types every kernel takes.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The one 8-bit KV-cache encoding (e4m3: 3 mantissa bits, finite range +-448; no infinities).
KV_CACHE_FP8 = torch.float8_e4m3fn


def triton_interprets() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1, as tests and CI
    without a GPU set it). Read at call time; Triton fixed its own choice when the kernels were
    defined."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_devices(named: dict[str, torch.Tensor]) -> None:
    """All tensors on one device, and that a CUDA device unless Triton interprets."""
    devices = {name: tensor.device for name, tensor in named.items()}
    if len(set(devices.values())) > 1:
        raise KernelInputError(f"tensors must share one device, got {devices}")
    device = next(iter(devices.values()))
    if device.type != "cuda" and not triton_interprets():
        raise KernelInputError(
            f"tensors are on {device}; the Triton kernels need CUDA tensors "
            "(use kernels.reference on the CPU)"
        )


def check_paged_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """k_cache and v_cache are [num_blocks, block_size, Hkv, D] and of one shape."""
    if k_cache.dim() != 4:
        raise KernelInputError(
            f"k_cache must be [num_blocks, block_size, Hkv, D], got shape {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise KernelInputError(
            f"v_cache shape {tuple(v_cache.shape)} differs from k_cache {tuple(k_cache.shape)}"
        )


def check_kv_cache_encoding(
    compute_dtype: torch.dtype,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> bool:
    """Whether the cache is FP8 (`KV_CACHE_FP8`), raising unless it is that or `compute_dtype`.

    An FP8 cache needs both scales, one-element floating-point tensors on the cache's device
    (a cache in the compute dtype ignores them). Their values are not read here: that would
    sync the device, and the engine sets them once, positive and finite.
    """
    if k_cache.dtype != v_cache.dtype:
        raise KernelInputError(
            f"k_cache dtype {k_cache.dtype} differs from v_cache dtype {v_cache.dtype}"
        )
    if k_cache.dtype == compute_dtype:
        return False
    if k_cache.dtype != KV_CACHE_FP8:
        raise KernelInputError(
            f"cache dtype {k_cache.dtype} must be {compute_dtype} (as q/k/v) or {KV_CACHE_FP8}"
        )
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(scale, torch.Tensor):
            raise KernelInputError(f"an {KV_CACHE_FP8} cache needs {name} as a tensor, got {scale}")
        if scale.numel() != 1 or not scale.dtype.is_floating_point:
            raise KernelInputError(
                f"{name} must be one floating-point value, got {tuple(scale.shape)} {scale.dtype}"
            )
        if scale.device != k_cache.device:
            raise KernelInputError(f"{name} is on {scale.device}, the cache on {k_cache.device}")
    return True


def check_recurrent_metadata(meta: RecurrentStateMetadata) -> None:
    """The per-sequence tensors of `meta` agree on the number of sequences."""
    num_seqs = meta.state_slots.shape[0]
    if meta.has_initial_state.shape != (num_seqs,) or meta.query_start_loc.shape != (num_seqs + 1,):
        raise KernelInputError(
            f"metadata for {num_seqs} sequences needs has_initial_state [{num_seqs}] and "
            f"query_start_loc [{num_seqs + 1}], got {tuple(meta.has_initial_state.shape)} and "
            f"{tuple(meta.query_start_loc.shape)}"
        )

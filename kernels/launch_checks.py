"""Checks every kernel launcher makes before handing tensors to Triton."""

from __future__ import annotations

import os

import torch

from kernels.errors import KernelInputError

# The floating-point types every kernel takes.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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

"""Which implementation of the kernel contract runs on a device."""

from __future__ import annotations

import importlib

import torch

from kernels.ops import KernelOps


def kernel_ops_for(device: torch.device | str) -> KernelOps:
    """Triton kernels on a CUDA device, the plain-torch reference everywhere else.

    The Triton module is imported only when asked for, so a CPU-only install never loads Triton.
    """
    if torch.device(device).type == "cuda":
        return importlib.import_module("kernels.triton_ops")  # type: ignore[return-value]
    return importlib.import_module("kernels.reference")  # type: ignore[return-value]

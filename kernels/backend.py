"""Which implementation of the kernel contract runs on a device."""

from __future__ import annotations

import importlib
from pathlib import Path

import torch

from kernels.ops import KernelOps


def kernel_ops_for(
    device: torch.device | str, *, triton_cache_dir: Path | None = None
) -> KernelOps:
    """Triton kernels on a CUDA device, the plain-torch reference everywhere else.

    The Triton module is imported only when asked for, so a CPU-only install never loads Triton.
    `triton_cache_dir`: where Triton keeps (and first looks for) the kernels it compiles, instead
    of its default `~/.triton/cache`: a cache made beforehand for this GPU and Triton version
    (an offline bundle's, docs/INSTALL.md) means the engine's start compiles nothing.
    """
    if torch.device(device).type != "cuda":
        return importlib.import_module("kernels.reference")  # type: ignore[return-value]
    if triton_cache_dir is not None:
        import triton

        Path(triton_cache_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
        triton.knobs.cache.dir = str(triton_cache_dir)
    return importlib.import_module("kernels.triton_ops")  # type: ignore[return-value]


def triton_cache_dir() -> Path:
    """Where Triton keeps and looks for compiled kernels now (`kernel_ops_for` may have moved
    it). Only for a CUDA process: it imports Triton."""
    import triton

    return Path(triton.knobs.cache.dir)


def triton_version() -> str:
    """The installed Triton's version. Only for a CUDA process: it imports Triton."""
    import triton

    return triton.__version__


def hash_triton() -> None:
    """Compute Triton's hash of itself now: part of every kernel's cache key, computed once per
    process at the first launch (reading and hashing its sources and libtriton, hundreds of
    MB, which release the GIL), so a thread can take it off the start's path. Only for a CUDA
    process: it imports Triton."""
    from triton.runtime.cache import triton_key

    triton_key()

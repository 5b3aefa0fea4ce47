"""The kernel package's error types: callers catch `KernelError` and nothing else."""

from __future__ import annotations


class KernelError(Exception):
    """Root of every error raised by Inferno's kernels."""


class KernelInputError(KernelError, ValueError):
    """A kernel was called with tensors it cannot handle (shape, dtype, device or layout)."""

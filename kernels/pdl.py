"""Programmatic dependent launch (Hopper and later): a kernel launched as a programmatic
dependent of the one before it in the stream starts while that one's last programs still run,
and must wait (`gdc_wait`) before it reads what they wrote. The decode step's kernels are short
(microseconds) and run back to back, so each launch's ramp-up overlapping the previous
kernel's tail is time the step saves; CUDA graphs keep the dependencies as programmatic edges.

A kernel takes part through a `PDL` constexpr: launched with `launch_options(device)`, it calls
`wait_for_previous(PDL)` before its first read of the previous kernel's output. Before it, a
kernel may read what nothing writes (the projections and norms first request weights) and what
kernels further back wrote (decode attention its lengths and block tables, the rotary its cos,
sin and slots): every kernel waits for the one before it and only then lets the next launch,
so once a kernel starts, all but the one just before it have finished.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels.launch_checks import triton_interprets

_disabled = False


def programmatic_launch(device: torch.device) -> bool:
    """Whether kernels on `device` may be launched as programmatic dependents: a Hopper or later
    GPU, compiled (Triton's interpreter has no grid dependency control), not `disabled()`."""
    return (
        not _disabled
        and device.type == "cuda"
        and not triton_interprets()
        and _hopper_or_later(device.index)
    )


def launch_options(device: torch.device) -> dict[str, bool]:
    """The `PDL` constexpr and Triton's `launch_pdl` option for a launch on `device`."""
    if programmatic_launch(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Launch in plain stream order while inside (benchmarks and tests compare the two; kernels
    captured in a CUDA graph keep the way they were launched)."""
    global _disabled
    previous, _disabled = _disabled, True
    try:
        yield
    finally:
        _disabled = previous


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Wait for the previous kernel's writes, then let the next kernel launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.cache
def _hopper_or_later(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9

"""Programmatic dependent launch (Hopper and later): a kernel launched as a programmatic
dependent of the one before it in the stream starts while that one's last programs still run,
and must wait (`gdc_wait`) before it reads what they wrote. The decode step's kernels are short
(microseconds) and run back to back, so each launch's ramp-up overlapping the previous
kernel's tail is time the step saves; CUDA graphs keep the dependencies as programmatic edges.

A kernel takes part through a `PDL` constexpr: launched with `launch_options(device)`, it calls
`wait_for_previous(PDL)` before its first read of another kernel's output (the projections
first request weights, which nothing writes). A kernel that only lets its successor launch
early calls `gdc_launch_dependents` under its own constexpr.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels.launch_checks import triton_interprets


def programmatic_launch(device: torch.device) -> bool:
    """Whether kernels on `device` may be launched as programmatic dependents: a Hopper or later
    GPU, compiled (Triton's interpreter has no grid dependency control)."""
    return device.type == "cuda" and not triton_interprets() and _hopper_or_later(device.index)


def launch_options(device: torch.device, enabled: bool = True) -> dict[str, bool]:
    """The `PDL` constexpr and Triton's `launch_pdl` option for a launch on `device`."""
    if enabled and programmatic_launch(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Wait for the previous kernel's writes, then let the next kernel launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.cache
def _hopper_or_later(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9

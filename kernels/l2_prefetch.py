"""A projection's weights read into the GPU's L2 cache while the small kernels before it run.

A batch-1 decode step streams every weight once and is bound by memory bandwidth, but between
the projections sit kernels that read almost nothing: after the qkv projection, rotary, the KV
write and decode attention (a few microseconds each at decode sizes), during which memory
idles. `concurrently(weight)` launches a kernel on a side stream that reads the leading bytes
of the projection to come (the o projection) while those kernels run on the main stream; the
lines it brings into L2 (50 MB on an H100) are then L2 hits for the projection, which streams
the rest from memory as before. The side stream joins the main one before the projection, so
every fork is joined within a layer and CUDA graph capture sees a closed fork/join.

The read is real (a load whose values are reduced into one word per program and stored, so the
compiler keeps it); what it stores means nothing. How much to prefetch (`DEFAULT_MAX_BYTES`) is
what the small kernels' time can fill at memory bandwidth: more would delay the projection,
which waits for the prefetch. `budget()` changes it for a while (benchmarks sweep it; 0 turns
the prefetch off).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from kernels.launch_checks import triton_interprets

# Bytes a prefetch reads at most: ~8 us of an H100's bandwidth, the time rotary, the KV write
# and decode attention take at batch 1 (docs/BENCHMARKS.md, "L2 prefetch").
DEFAULT_MAX_BYTES = 24 * 2**20
# 32-bit words each program reads per iteration (16 KiB: 32 words per thread at 4 warps, all
# loads of one iteration in flight together) and iterations per program.
_BLOCK = 4096
_ITERATIONS = 4

_max_bytes = DEFAULT_MAX_BYTES


@triton.jit
def _prefetch_kernel(src_ptr, sink_ptr, num_words, BLOCK: tl.constexpr, ITERATIONS: tl.constexpr):
    start = tl.program_id(0) * BLOCK * ITERATIONS
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(ITERATIONS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(src_ptr + offs, mask=offs < num_words, other=0)
    tl.store(sink_ptr + tl.program_id(0), tl.sum(acc, axis=0))


def prefetch(weight: torch.Tensor, max_bytes: int) -> torch.Tensor:
    """Read the leading `max_bytes` of `weight` (contiguous, any dtype; whole 32-bit words) on
    the current stream. Returns what the reads were reduced to: each program's sum of the
    int32 words it read, [programs] (tests check the right bytes were read)."""
    if not weight.is_contiguous():
        raise ValueError("a prefetched weight must be contiguous")
    raw = weight.reshape(-1).view(torch.uint8)
    words = raw[: min(raw.numel(), max_bytes) // 4 * 4].view(torch.int32)
    grid = triton.cdiv(words.numel(), _BLOCK * _ITERATIONS)
    sink = _sink(words.device, max_bytes)[:grid]
    if grid:
        _prefetch_kernel[(grid,)](words, sink, words.numel(), BLOCK=_BLOCK, ITERATIONS=_ITERATIONS)
    return sink


@contextlib.contextmanager
def concurrently(weight: torch.Tensor) -> Iterator[None]:
    """Prefetch the leading bytes of `weight` (the `budget()`) on a side stream while the
    kernels launched inside run; the current stream waits for it on leaving. Plain stream
    order, nothing prefetched, off CUDA, under Triton's interpreter, with a budget of 0, or for
    a weight that is not contiguous (a tensor-parallel shard may be a view): a prefetch only
    ever changes when bytes are read."""
    if (
        _max_bytes == 0
        or weight.device.type != "cuda"
        or triton_interprets()
        or not weight.is_contiguous()
    ):
        yield
        return
    main = torch.cuda.current_stream(weight.device)
    side = _side_stream(weight.device)
    _sink(weight.device, _max_bytes)  # made by the first call: on the main stream, not the side
    side.wait_stream(main)
    with torch.cuda.stream(side):
        prefetch(weight, _max_bytes)
    try:
        yield
    finally:
        main.wait_stream(side)


@contextlib.contextmanager
def budget(max_bytes: int) -> Iterator[None]:
    """Prefetch at most `max_bytes` per projection while inside, none with 0 (benchmarks
    compare; a CUDA graph keeps what was captured)."""
    global _max_bytes
    previous, _max_bytes = _max_bytes, max_bytes
    try:
        yield
    finally:
        _max_bytes = previous


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


@functools.cache
def _sink(device: torch.device, max_bytes: int) -> torch.Tensor:
    """Where a prefetch of up to `max_bytes` stores its sums: one buffer per device and budget,
    made by the first call (a warm-up forward's, eager, before any graph is captured)."""
    return torch.empty(
        triton.cdiv(max_bytes // 4, _BLOCK * _ITERATIONS), dtype=torch.int32, device=device
    )

"""Row-wise argmax of logits in two small launches: the greedy token of every row.

torch's argmax reduces each row in one thread block, which for a decode step's single row of a
128k vocabulary leaves 131 of the H100's 132 SMs idle: 28 µs per token at batch 1, measured
(docs/BENCHMARKS.md). Here each row is cut into tiles that many programs reduce at once, then one
program per row picks among the tiles' maxima: a few microseconds.

Semantics are torch.argmax's for finite and infinite values: the index of the first maximum
(ties go to the lowest index; a row of -inf gives 0). NaN ranks below everything, where torch
ranks it above: a NaN is a failed computation, never a token to choose.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.errors import KernelInputError
from kernels.launch_checks import check_devices
from kernels.pdl import launch_options, wait_for_previous

# Columns one program of the first pass reduces: 32 programs per row of Llama 3's 128,256.
_TILE = 4096


@triton.jit
def _tile_max_kernel(
    x_ptr, max_ptr, index_ptr, n, stride_row, num_tiles, TILE: tl.constexpr, PDL: tl.constexpr
):
    wait_for_previous(PDL)
    row = tl.program_id(0)
    tile = tl.program_id(1)
    offs = tile * TILE + tl.arange(0, TILE)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_row + offs, mask=offs < n, other=float("-inf"))
    x = x.to(tl.float32)
    x = tl.where(x == x, x, float("-inf"))  # NaN ranks last
    value, index = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(max_ptr + row * num_tiles + tile, value)
    tl.store(index_ptr + row * num_tiles + tile, tile * TILE + index)


@triton.jit
def _row_argmax_kernel(
    max_ptr, index_ptr, out_ptr, num_tiles, TILES_PAD: tl.constexpr, PDL: tl.constexpr
):
    wait_for_previous(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, TILES_PAD)
    mask = offs < num_tiles
    maxima = tl.load(max_ptr + row * num_tiles + offs, mask=mask, other=float("-inf"))
    # The first tile holding the row's maximum holds its first occurrence.
    _, tile = tl.max(maxima, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.load(index_ptr + row * num_tiles + tile).to(tl.int64))


def argmax_rows(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """logits: [N, V] floating point, last dim contiguous -> [N] int64, on logits' device
    (written into `out`, a contiguous [N] int64 tensor there, when given)."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise KernelInputError(
            f"logits must be a [N, V] tensor, got {getattr(logits, 'shape', logits)}"
        )
    if not logits.is_floating_point() or logits.stride(-1) != 1:
        raise KernelInputError(
            f"logits must be floating point and contiguous in V, got {logits.dtype} "
            f"with strides {logits.stride()}"
        )
    rows, n = logits.shape
    if n == 0:
        raise KernelInputError("argmax of an empty row")
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    elif out.shape != (rows,) or out.dtype != torch.int64 or not out.is_contiguous():
        raise KernelInputError(
            f"out must be a contiguous [{rows}] int64 tensor, got {tuple(out.shape)} {out.dtype}"
        )
    check_devices({"logits": logits, "out": out})
    if rows == 0:
        return out
    num_tiles = triton.cdiv(n, _TILE)
    maxima = torch.empty((rows, num_tiles), dtype=torch.float32, device=logits.device)
    indices = torch.empty((rows, num_tiles), dtype=torch.int32, device=logits.device)
    pdl = launch_options(logits.device)
    _tile_max_kernel[(rows, num_tiles)](
        logits, maxima, indices, n, logits.stride(0), num_tiles, TILE=_TILE, num_warps=8, **pdl
    )
    _row_argmax_kernel[(rows,)](
        maxima,
        indices,
        out,
        num_tiles,
        TILES_PAD=triton.next_power_of_2(num_tiles),
        num_warps=1,
        **pdl,
    )
    return out

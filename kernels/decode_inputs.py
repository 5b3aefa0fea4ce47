"""A decode step's inputs moved into the CUDA graphs' static buffers in one launch.

A captured graph reads its inputs from fixed addresses (`appliance.engine.cuda_graphs`), so each
step's inputs, uploaded to wherever the step's copy landed, must be moved there first. With a
torch operation per array that was five device-to-device copies, plus two indexing kernels
that put the tokens still being sampled by the step in flight (asynchronous scheduling) in
place: about 25 µs of a batch-1 step on an H100, a launch each, mostly ramp-up (docs/
BENCHMARKS.md, "Issue 17, round 5"). One program per row of the graph's batch moves a row of
every array, reads a pending token straight from the previous step's samples, and marks the
padding rows past the batch (slot -1: no KV write; length 0: no attention; state slot -1: no
recurrent state), which took one fill each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.errors import KernelInputError
from kernels.launch_checks import check_devices
from kernels.ops import DecodeInputs, PendingTokens


# The static buffers never move; a step's batch, table width and input addresses change every
# step, and none of them may choose a kernel variant (a compile in the middle of serving). The
# inputs are read a scalar or a short row at a time: their alignment buys nothing.
@triton.jit(
    do_not_specialize=["batch", "width", "out_table_stride", "sampled_stride", "sampled_col"],
    do_not_specialize_on_alignment=[
        "ids_ptr",
        "positions_ptr",
        "slots_ptr",
        "seq_lens_ptr",
        "tables_ptr",
        "window_slots_ptr",
        "window_tables_ptr",
        "state_slots_ptr",
        "sources_ptr",
        "sampled_ptr",
    ],
)
def _stage_kernel(
    ids_ptr,
    positions_ptr,
    slots_ptr,
    seq_lens_ptr,
    tables_ptr,
    window_slots_ptr,
    window_tables_ptr,
    state_slots_ptr,
    sources_ptr,
    sampled_ptr,
    out_ids_ptr,
    out_positions_ptr,
    out_slots_ptr,
    out_seq_lens_ptr,
    out_tables_ptr,
    out_window_slots_ptr,
    out_window_tables_ptr,
    out_state_slots_ptr,
    batch,
    width,
    out_table_stride,
    sampled_stride,
    sampled_col,
    PENDING: tl.constexpr,
    WINDOW: tl.constexpr,
    STATES: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    row = tl.program_id(0)
    if row < batch:
        token = tl.load(ids_ptr + row)
        if PENDING:
            source = tl.load(sources_ptr + row)
            if source >= 0:
                token = tl.load(sampled_ptr + source * sampled_stride + sampled_col)
        tl.store(out_ids_ptr + row, token)
        tl.store(out_positions_ptr + row, tl.load(positions_ptr + row))
        tl.store(out_slots_ptr + row, tl.load(slots_ptr + row))
        tl.store(out_seq_lens_ptr + row, tl.load(seq_lens_ptr + row))
        if WINDOW:
            tl.store(out_window_slots_ptr + row, tl.load(window_slots_ptr + row))
        if STATES:
            tl.store(out_state_slots_ptr + row, tl.load(state_slots_ptr + row))
        source_row = row.to(tl.int64) * width
        target_row = row.to(tl.int64) * out_table_stride
        for start in range(0, width, BLOCK_W):
            cols = start + tl.arange(0, BLOCK_W)
            mask = cols < width
            tl.store(
                out_tables_ptr + target_row + cols,
                tl.load(tables_ptr + source_row + cols, mask=mask),
                mask=mask,
            )
            if WINDOW:
                tl.store(
                    out_window_tables_ptr + target_row + cols,
                    tl.load(window_tables_ptr + source_row + cols, mask=mask),
                    mask=mask,
                )
    else:
        # Padding: the kernels skip the row (its ids and positions are read, never used).
        tl.store(out_slots_ptr + row, -1)
        tl.store(out_seq_lens_ptr + row, 0)
        if WINDOW:
            tl.store(out_window_slots_ptr + row, -1)
        if STATES:
            tl.store(out_state_slots_ptr + row, -1)


def stage_decode_inputs(
    inputs: DecodeInputs, static: DecodeInputs, size: int, pending: PendingTokens | None = None
) -> None:
    """Write a batch of B rows (`inputs`) into the first B rows of `static`, the graph's buffers
    (as long as the largest graph, tables as wide as the longest sequence may need), and mark
    rows B..size-1 as padding. `pending`: the rows whose token the step in flight samples (its
    sources are rows of `sampled`: the engine's own bookkeeping, not checked on the device)."""
    batch, width = inputs.block_tables.shape
    _check(inputs, static, size, pending)
    if size == 0:
        return
    tensors = {name: t for name, t in inputs._asdict().items() if t is not None}
    tensors |= {f"static {name}": t for name, t in static._asdict().items() if t is not None}
    if pending is not None:
        tensors |= pending._asdict()
    check_devices(tensors)
    window = inputs.window_slots is not None
    states = inputs.state_slots is not None
    # An absent array's pointer is never dereferenced (its constexpr is off).
    placeholder = static.slots
    _stage_kernel[(size,)](
        inputs.input_ids,
        inputs.positions,
        inputs.slots,
        inputs.seq_lens,
        inputs.block_tables,
        inputs.window_slots if window else placeholder,
        inputs.window_block_tables if window else placeholder,
        inputs.state_slots if states else placeholder,
        pending.sources if pending is not None else placeholder,
        pending.sampled if pending is not None else placeholder,
        static.input_ids,
        static.positions,
        static.slots,
        static.seq_lens,
        static.block_tables,
        static.window_slots if window else placeholder,
        static.window_block_tables if window else placeholder,
        static.state_slots if states else placeholder,
        batch,
        width,
        static.block_tables.stride(0),
        pending.sampled.stride(0) if pending is not None else 0,
        pending.sampled.shape[1] - 1 if pending is not None else 0,
        PENDING=pending is not None,
        WINDOW=window,
        STATES=states,
        BLOCK_W=128,
        num_warps=1,
    )


def _check(
    inputs: DecodeInputs, static: DecodeInputs, size: int, pending: PendingTokens | None
) -> None:
    """Shapes, dtypes and layouts the kernel's arithmetic assumes; a mismatch would read or
    write out of bounds, so it is refused."""
    if inputs.block_tables.dim() != 2 or static.block_tables.dim() != 2:
        raise KernelInputError("block tables must be [rows, width]")
    batch, width = inputs.block_tables.shape
    capacity, max_width = static.block_tables.shape
    if not batch <= size <= capacity or width > max_width:
        raise KernelInputError(
            f"a batch of {batch} rows and {width} blocks does not fit a graph of {size} rows "
            f"in buffers of {capacity} x {max_width}"
        )
    for name in DecodeInputs._fields:
        given, buffer = getattr(inputs, name), getattr(static, name)
        if given is None:
            continue
        if buffer is None:
            raise KernelInputError(f"{name} given, but the graphs have no buffer for it")
        expected = (batch, width) if given.dim() == 2 else (batch,)
        if (
            given.dtype != buffer.dtype
            or given.dim() != buffer.dim()
            or given.shape != expected
            or not given.is_contiguous()
        ):
            raise KernelInputError(
                f"{name} must be {buffer.dtype} {expected}, contiguous; got {given.dtype} "
                f"{tuple(given.shape)}"
            )
        if buffer.shape[0] < size or (buffer.dim() == 1 and buffer.stride(0) != 1):
            raise KernelInputError(f"the static {name} must hold {size} rows of unit stride")
    if (inputs.window_slots is None) != (inputs.window_block_tables is None):
        raise KernelInputError("the window group needs both its slots and its block tables")
    if static.block_tables.stride(1) != 1 or (
        inputs.window_block_tables is not None
        and static.window_block_tables.stride() != static.block_tables.stride()
    ):
        raise KernelInputError("the static block tables must be row-major with unit columns")
    if pending is not None:
        sources, sampled = pending
        if sources.dtype != torch.int64 or sources.shape != (batch,) or not sources.is_contiguous():
            raise KernelInputError(f"pending sources must be [{batch}] int64, contiguous")
        if sampled.dtype != torch.int64 or sampled.dim() != 2 or sampled.stride(1) != 1:
            raise KernelInputError("pending samples must be [S, n] int64, rows of unit stride")

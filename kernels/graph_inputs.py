"""A decode graph's inputs staged from one packed upload, inside the graph.

A CUDA graph reads its inputs from fixed buffers. Copying each input there (token ids,
positions, slots, lengths, block tables) and reading the tokens the previous step sampled
costs a handful of small launches per step, each a few microseconds of the device's time with
its gap: at batch 1 that is most of what a step spends outside its graph. Here the host writes
one packed int32 buffer at a fixed address (one host-to-device copy) and the graph's first
kernel spreads it into the inputs, reading a pending token from the sampled buffer the
previous replay wrote.

The packed layout (`PackedLayout`, whose `pack` writes it), in int32 words: a header [batch,
width, 0, 0]; then `capacity` words each of token ids, positions, slots, sources and sequence
lengths (rows past `batch` unread); then the batch's block tables, [batch, width] row-major. A
source >= 0 names the row of `sampled` whose token replaces the row's id (a token the host does
not have yet).
Rows from `batch` up to the graph's size are padding: slot -1 (no KV write) and length 0 (no
attention), as `appliance.engine.cuda_graphs` pads.

The kernel reads the header's batch and width on the device (its grid is the graph's size, its
loop over a row's table runs to the packed width), so a replay stays correct whatever batch (up
to its size) and width (up to its tables') the host packed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from kernels.errors import KernelInputError
from kernels.launch_checks import check_devices
from kernels.pdl import launch_options, wait_for_previous

# Block-table entries one program moves per iteration.
_TABLE_TILE = 256
HEADER_WORDS = 4
# The per-row fields after the header, in this order.
FIELDS = ("ids", "positions", "slots", "sources", "seq_lens")


@dataclass(frozen=True)
class PackedLayout:
    """Where each field of a packed upload for up to `capacity` rows lies, in int32 words."""

    capacity: int

    def offset(self, field: str) -> int:
        return HEADER_WORDS + FIELDS.index(field) * self.capacity

    @property
    def tables_offset(self) -> int:
        return HEADER_WORDS + len(FIELDS) * self.capacity

    def words(self, batch: int, width: int) -> int:
        """Words of a packed batch, its tables included."""
        return self.tables_offset + batch * width

    def pack(self, fields: dict[str, np.ndarray], tables: np.ndarray) -> np.ndarray:
        """One batch as int32 words: `fields` holds each of FIELDS, [batch] integers each
        (sources: a row of the sampled buffer, or -1), `tables` the [batch, width] block
        tables."""
        batch, width = tables.shape
        if not 1 <= batch <= self.capacity or set(fields) != set(FIELDS):
            raise KernelInputError(
                f"a packed batch is 1..{self.capacity} rows of {FIELDS}, got {batch} rows of "
                f"{tuple(fields)}"
            )
        packed = np.zeros(self.words(batch, width), np.int32)
        packed[:2] = batch, width
        for field, values in fields.items():
            offset = self.offset(field)
            packed[offset : offset + batch] = values
        packed[self.tables_offset :] = tables.ravel()
        return packed


@triton.jit
def _stage_kernel(
    packed_ptr,  # int32 words, as PackedLayout
    sampled_ptr,  # [>= max source + 1] int64: the previous replay's tokens
    ids_ptr,  # [size] int64
    positions_ptr,  # [size] int64
    slots_ptr,  # [size] int64
    seq_lens_ptr,  # [size] int32
    tables_ptr,  # [size, stride_table] int32
    stride_table,
    CAPACITY: tl.constexpr,
    TILE: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0)
    batch = tl.load(packed_ptr)
    width = tl.minimum(tl.load(packed_ptr + 1), stride_table)
    real = row < batch
    fields = packed_ptr + 4 + row  # HEADER_WORDS
    token = tl.load(fields, mask=real, other=0).to(tl.int64)
    source = tl.load(fields + 3 * CAPACITY, mask=real, other=-1)
    pending = tl.load(sampled_ptr + source, mask=source >= 0, other=0)
    tl.store(ids_ptr + row, tl.where(source >= 0, pending, token))
    tl.store(positions_ptr + row, tl.load(fields + CAPACITY, mask=real, other=0).to(tl.int64))
    tl.store(slots_ptr + row, tl.load(fields + 2 * CAPACITY, mask=real, other=-1).to(tl.int64))
    tl.store(seq_lens_ptr + row, tl.load(fields + 4 * CAPACITY, mask=real, other=0))
    # A padding row's table is never read (length 0): only real rows are copied.
    tables_in = packed_ptr + 4 + 5 * CAPACITY + row * width
    offs = tl.arange(0, TILE)
    for start in range(0, tl.where(real, width, 0), TILE):
        entries = start + offs
        mask = entries < width
        tl.store(
            tables_ptr + row * stride_table + entries,
            tl.load(tables_in + entries, mask=mask),
            mask=mask,
        )


def stage_decode_inputs(
    packed: torch.Tensor,
    layout: PackedLayout,
    sampled: torch.Tensor,
    ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
) -> None:
    """Spread `packed` (int32, `layout`) into a graph's inputs of `size = ids.shape[0]` rows:
    ids, positions, slots [size] int64, seq_lens [size] int32, block_tables [size, W] int32
    (the packed width clamped to W); `sampled` int64, the tokens sources name. `packed` holds
    `layout.words(size, W)` words at least, so no header the device reads makes the kernel
    read outside it; that the header's batch is at most `size` and each source names a row of
    `sampled` is the caller's contract (the kernel cannot check values it reads on the
    device)."""
    size = ids.shape[0]
    named = {
        "packed": packed,
        "sampled": sampled,
        "ids": ids,
        "positions": positions,
        "slots": slots,
        "seq_lens": seq_lens,
        "block_tables": block_tables,
    }
    check_devices(named)
    wanted = {
        "packed": torch.int32,
        "sampled": torch.int64,
        "ids": torch.int64,
        "positions": torch.int64,
        "slots": torch.int64,
        "seq_lens": torch.int32,
        "block_tables": torch.int32,
    }
    for name, dtype in wanted.items():
        tensor = named[name]
        if tensor.dtype != dtype or not tensor.is_contiguous():
            raise KernelInputError(f"{name} must be contiguous {dtype}, got {tensor.dtype}")
    if any(t.shape[0] != size for t in (positions, slots, seq_lens, block_tables)):
        raise KernelInputError("ids, positions, slots, seq_lens and block_tables differ in rows")
    width = block_tables.shape[1]
    if not 1 <= size <= layout.capacity or packed.numel() < layout.words(size, width):
        raise KernelInputError(
            f"{size} rows of {width} blocks do not fit a packed layout of capacity "
            f"{layout.capacity} in {packed.numel()} words"
        )
    _stage_kernel[(size,)](
        packed,
        sampled,
        ids,
        positions,
        slots,
        seq_lens,
        block_tables,
        block_tables.stride(0),
        CAPACITY=layout.capacity,
        TILE=_TABLE_TILE,
        num_warps=1,
        **launch_options(packed.device),
    )

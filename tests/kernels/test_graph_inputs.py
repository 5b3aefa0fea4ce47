"""A decode graph's inputs staged from one packed upload (`kernels.graph_inputs`).

Off the GPU the kernel runs in Triton's interpreter (tests/conftest.py). Every field of every
row is checked: real rows take the packed values (a pending token from the sampled buffer
instead), padding rows become slot -1 and length 0, and a row's table is copied up to the
packed width only.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.errors import KernelInputError
from kernels.graph_inputs import FIELDS, PackedLayout, stage_decode_inputs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _pack(layout: PackedLayout, rows: dict[str, list[int]], tables: np.ndarray, words: int):
    """The layout's own packing, in a device buffer of `words` (a graph's, sized for its
    widest tables: the tail past the batch's words is never read)."""
    packed = torch.zeros(words, dtype=torch.int32)
    words_of_batch = layout.pack({f: np.asarray(v) for f, v in rows.items()}, tables)
    packed[: words_of_batch.size] = torch.from_numpy(words_of_batch)
    return packed.to(DEVICE)


def _targets(size: int, width: int) -> dict[str, torch.Tensor]:
    """A graph's static inputs, filled with values no staging writes."""
    return {
        "ids": torch.full((size,), 77, dtype=torch.int64, device=DEVICE),
        "positions": torch.full((size,), 77, dtype=torch.int64, device=DEVICE),
        "slots": torch.full((size,), 77, dtype=torch.int64, device=DEVICE),
        "seq_lens": torch.full((size,), 77, dtype=torch.int32, device=DEVICE),
        "block_tables": torch.full((size, width), 77, dtype=torch.int32, device=DEVICE),
    }


def test_real_rows_take_their_values_and_padding_rows_become_empty() -> None:
    layout = PackedLayout(capacity=8)
    # Three real rows of a 4-row graph; row 1's token is pending, in row 5 of `sampled`.
    rows = {
        "ids": [11, 0, 13],
        "positions": [4, 300, 9],
        "slots": [68, 1900, 25],
        "sources": [-1, 5, -1],
        "seq_lens": [5, 301, 10],
    }
    tables = np.array([[4, 0, 0, 0, 0], [9, 8, 7, 6, 5], [1, 0, 0, 0, 0]], np.int32)
    width = 600  # the graph's table width (a long context's), far above the packed 5
    packed = _pack(layout, rows, tables, layout.words(4, width))
    sampled = torch.arange(100, 108, dtype=torch.int64, device=DEVICE)
    t = _targets(4, width)
    stage_decode_inputs(packed, layout, sampled, **t)
    assert t["ids"].tolist() == [11, 105, 13, 0]
    assert t["positions"].tolist() == [4, 300, 9, 0]
    assert t["slots"].tolist() == [68, 1900, 25, -1]
    assert t["seq_lens"].tolist() == [5, 301, 10, 0]
    assert t["block_tables"][:3, :5].tolist() == tables.tolist()
    # Past the packed width, and the padding row's table, stay as they were: never read.
    assert (t["block_tables"][:3, 5:] == 77).all() and (t["block_tables"][3] == 77).all()


def test_a_table_longer_than_one_tile_is_copied_whole() -> None:
    layout = PackedLayout(capacity=2)
    tables = np.arange(2 * 700, dtype=np.int32).reshape(2, 700)
    rows = {"ids": [1, 2], "positions": [0, 0], "slots": [0, 0], "sources": [-1, -1],
            "seq_lens": [1, 1]}  # fmt: skip
    packed = _pack(layout, rows, tables, layout.words(2, 700))
    t = _targets(2, 700)
    stage_decode_inputs(packed, layout, torch.zeros(2, dtype=torch.int64, device=DEVICE), **t)
    assert torch.equal(t["block_tables"].cpu(), torch.from_numpy(tables))


def test_a_batch_it_cannot_pack_is_refused() -> None:
    layout = PackedLayout(capacity=2)
    fields = {f: np.zeros(3, np.int64) for f in FIELDS}
    with pytest.raises(KernelInputError, match=r"1\.\.2 rows"):
        layout.pack(fields, np.zeros((3, 4), np.int32))
    with pytest.raises(KernelInputError, match=r"1\.\.2 rows"):
        layout.pack({"ids": np.zeros(2, np.int64)}, np.zeros((2, 4), np.int32))


def test_inputs_it_cannot_stage_are_refused() -> None:
    layout = PackedLayout(capacity=4)
    sampled = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    t = _targets(4, 16)
    short = torch.zeros(layout.words(4, 16) - 1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(KernelInputError, match="do not fit"):
        stage_decode_inputs(short, layout, sampled, **t)
    packed = torch.zeros(layout.words(4, 16), dtype=torch.int32, device=DEVICE)
    with pytest.raises(KernelInputError, match="do not fit"):
        stage_decode_inputs(packed, PackedLayout(capacity=2), sampled, **t)
    with pytest.raises(KernelInputError, match=r"slots must be contiguous torch\.int64"):
        stage_decode_inputs(packed, layout, sampled, **{**t, "slots": t["slots"].int()})
    with pytest.raises(KernelInputError, match="differ in rows"):
        stage_decode_inputs(packed, layout, sampled, **{**t, "seq_lens": t["seq_lens"][:3]})

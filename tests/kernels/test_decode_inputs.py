"""A decode step's inputs into the graphs' static buffers (`kernels.decode_inputs`): every row and
column the batch owns written, pending tokens read from the step in flight's samples, padding
rows marked, and nothing else touched.

Off the GPU the kernel runs in Triton's interpreter (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from kernels.decode_inputs import stage_decode_inputs
from kernels.errors import KernelInputError
from kernels.ops import DecodeInputs, PendingTokens

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CAPACITY, MAX_WIDTH = 8, 300  # wider than one 128-column tile of the kernel's loop
STALE = 99  # what every static buffer holds before a step


def _static(window: bool = False, states: bool = False) -> DecodeInputs:
    def full(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.full(shape, STALE, dtype=dtype, device=DEVICE)

    return DecodeInputs(
        full(CAPACITY, dtype=torch.int64),
        full(CAPACITY, dtype=torch.int64),
        full(CAPACITY, dtype=torch.int64),
        full(CAPACITY, dtype=torch.int32),
        full(CAPACITY, MAX_WIDTH, dtype=torch.int32),
        full(CAPACITY, dtype=torch.int64) if window else None,
        full(CAPACITY, MAX_WIDTH, dtype=torch.int32) if window else None,
        full(CAPACITY, dtype=torch.int32) if states else None,
    )


def _batch(rows: int, width: int, window: bool = False, states: bool = False) -> DecodeInputs:
    def arange(start: int, dtype: torch.dtype, *shape: int) -> torch.Tensor:
        count = rows * (shape[0] if shape else 1)
        values = torch.arange(start, start + count, dtype=dtype, device=DEVICE)
        return values.view(rows, *shape) if shape else values

    return DecodeInputs(
        arange(1000, torch.int64),
        arange(2000, torch.int64),
        arange(3000, torch.int64),
        arange(4000, torch.int32),
        arange(5000, torch.int32, width),
        arange(6000, torch.int64) if window else None,
        arange(70000, torch.int32, width) if window else None,
        arange(8000, torch.int32) if states else None,
    )


@pytest.mark.parametrize("window", [False, True])
@pytest.mark.parametrize("states", [False, True])
def test_the_batch_rows_are_copied_the_padding_marked_and_the_rest_untouched(
    window: bool, states: bool
) -> None:
    rows, width, size = 3, 260, 5
    inputs, static = _batch(rows, width, window, states), _static(window, states)
    stage_decode_inputs(inputs, static, size)
    for name, given in inputs._asdict().items():
        if given is None:
            continue
        buffer = getattr(static, name)
        if buffer.dim() == 2:
            assert torch.equal(buffer[:rows, :width], given), name
            assert (buffer[:rows, width:] == STALE).all(), f"{name}: columns past the width"
        else:
            assert torch.equal(buffer[:rows], given), name
        assert (buffer[size:] == STALE).all(), f"{name}: rows past the graph's size"
    # Padding rows: no KV write, no attention, no recurrent state; their ids are never used.
    assert static.slots[rows:size].tolist() == [-1, -1]
    assert static.seq_lens[rows:size].tolist() == [0, 0]
    if window:
        assert static.window_slots[rows:size].tolist() == [-1, -1]
    if states:
        assert static.state_slots[rows:size].tolist() == [-1, -1]


def test_pending_tokens_come_from_the_last_column_of_the_samples_in_flight() -> None:
    inputs, static = _batch(4, 2), _static()
    sampled = torch.tensor([[10, 11], [20, 21], [30, 31]], device=DEVICE)
    sources = torch.tensor([-1, 2, 0, 1], device=DEVICE)
    stage_decode_inputs(inputs, static, 4, PendingTokens(sources, sampled))
    assert static.input_ids[:4].tolist() == [1000, 31, 11, 21]


def test_a_batch_that_fills_the_graph_has_no_padding() -> None:
    inputs, static = _batch(CAPACITY, 1), _static()
    stage_decode_inputs(inputs, static, CAPACITY)
    assert torch.equal(static.slots, inputs.slots)
    assert torch.equal(static.seq_lens, inputs.seq_lens)


@pytest.mark.parametrize(
    ("change", "size", "message"),
    [
        ({}, 2, "does not fit a graph of 2 rows"),
        ({}, CAPACITY + 1, "does not fit"),
        ({"slots": torch.zeros(3, dtype=torch.int32)}, 3, "slots must be torch.int64"),
        ({"positions": torch.zeros(4, dtype=torch.int64)}, 3, "positions must be"),
        ({"block_tables": torch.zeros(3, MAX_WIDTH + 1, dtype=torch.int32)}, 3, "does not fit"),
        ({"state_slots": torch.zeros(3, dtype=torch.int32)}, 3, "no buffer for it"),
        ({"window_slots": torch.zeros(3, dtype=torch.int64)}, 3, "no buffer for it"),
    ],
)
def test_inputs_that_would_read_or_write_out_of_bounds_are_refused(
    change: dict[str, torch.Tensor], size: int, message: str
) -> None:
    change = {name: value.to(DEVICE) for name, value in change.items()}
    inputs = _batch(3, 2)._replace(**change)
    with pytest.raises(KernelInputError, match=message):
        stage_decode_inputs(inputs, _static(), size)


def test_pending_tokens_of_another_shape_are_refused() -> None:
    sampled = torch.zeros(3, 1, dtype=torch.int64, device=DEVICE)
    for sources in (torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int32)):
        with pytest.raises(KernelInputError, match="pending sources"):
            stage_decode_inputs(
                _batch(3, 2), _static(), 3, PendingTokens(sources.to(DEVICE), sampled)
            )
    with pytest.raises(KernelInputError, match="pending samples"):
        stage_decode_inputs(
            _batch(3, 2),
            _static(),
            3,
            PendingTokens(
                torch.zeros(3, dtype=torch.int64, device=DEVICE),
                torch.zeros(2, 3, dtype=torch.int64, device=DEVICE).t(),  # columns of unit stride
            ),
        )

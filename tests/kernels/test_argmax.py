"""The greedy token's kernel (`kernels.argmax`) against torch.argmax, ties and infinities included.

Off the GPU the kernels run in Triton's interpreter (tests/conftest.py) on rows of a few tiles.
"""

from __future__ import annotations

import pytest
import torch

from kernels.argmax import argmax_rows
from kernels.errors import KernelInputError

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("vocab", [1, 4095, 4096, 9000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_matches_torch_on_random_rows(vocab: int, dtype: torch.dtype) -> None:
    torch.manual_seed(vocab)
    logits = torch.randn(5, vocab, device=DEVICE).to(dtype)
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))


def test_ties_go_to_the_first_index_across_and_within_tiles() -> None:
    logits = torch.zeros(3, 9000, device=DEVICE)
    logits[0, [8000, 5000, 4097]] = 7.0  # three tiles hold the maximum: the first is in tile 1
    logits[1, [4100, 4099]] = 3.0  # within one tile
    logits[2, [0, 8999]] = 1.0  # the first and the last column
    assert argmax_rows(logits).tolist() == [4097, 4099, 0]


def test_infinities_rank_as_torch_ranks_them() -> None:
    logits = torch.full((3, 5000), float("-inf"), device=DEVICE)
    logits[1, 4500] = -1e30  # the only finite value, in the partial last tile
    logits[2, [10, 4200]] = float("inf")
    assert argmax_rows(logits).tolist() == [0, 4500, 10]
    assert argmax_rows(logits).tolist() == logits.argmax(dim=-1).tolist()


def test_a_row_view_with_a_stride_is_read_by_its_stride() -> None:
    torch.manual_seed(0)
    wide = torch.randn(4, 6000, device=DEVICE)
    rows = wide[:, :5000]  # each row starts 6000 apart
    assert torch.equal(argmax_rows(rows), rows.argmax(dim=-1))


def test_no_rows_gives_no_tokens_and_bad_input_is_refused() -> None:
    assert argmax_rows(torch.zeros(0, 10, device=DEVICE)).shape == (0,)
    with pytest.raises(KernelInputError, match="empty row"):
        argmax_rows(torch.zeros(2, 0, device=DEVICE))
    with pytest.raises(KernelInputError, match=r"\[N, V\]"):
        argmax_rows(torch.zeros(10, device=DEVICE))
    with pytest.raises(KernelInputError, match="contiguous"):
        argmax_rows(torch.zeros(10, 4, device=DEVICE).t())
    with pytest.raises(KernelInputError, match="floating point"):
        argmax_rows(torch.zeros(2, 4, dtype=torch.int64, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 256])
def test_argmax_rows_at_llama3s_vocabulary(rows: int) -> None:
    torch.manual_seed(rows)
    logits = torch.randn(rows, 128256, device="cuda")
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))


def test_nan_never_wins() -> None:
    """A NaN is a failed computation: never the token chosen (torch.argmax would choose it)."""
    logits = torch.zeros(2, 5000, device=DEVICE)
    logits[0, 3] = float("nan")
    logits[0, 4700] = 0.5
    logits[1, :] = float("nan")
    logits[1, 4999] = -2.0
    assert argmax_rows(logits).tolist() == [4700, 4999]


def test_argmax_rows_writes_into_out_and_refuses_a_wrong_one() -> None:
    logits = torch.randn(3, 5000, device=DEVICE)
    out = torch.full((3,), -1, dtype=torch.int64, device=DEVICE)
    assert argmax_rows(logits, out=out) is out
    assert torch.equal(out, logits.argmax(dim=-1))
    strided = torch.zeros(6, dtype=torch.int64, device=DEVICE)[::2]
    for bad in (out[:2], out.to(torch.int32), strided):
        with pytest.raises(KernelInputError, match="out must be"):
            argmax_rows(logits, out=bad)

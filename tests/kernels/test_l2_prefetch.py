"""The L2 prefetch (`kernels.l2_prefetch`): it reads exactly the bytes asked for, and on the GPU
runs beside the kernels inside its block, in eager mode and in a CUDA graph, without changing
any result."""

from __future__ import annotations

import contextlib

import pytest
import torch

import kernels.reference
import kernels.triton_ops
from kernels import l2_prefetch
from kernels import linear as skinny

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
WORDS_PER_PROGRAM = l2_prefetch._BLOCK * l2_prefetch._ITERATIONS


def _program_sums(weight: torch.Tensor, max_bytes: int) -> torch.Tensor:
    """Each program's int32 sum (wrapping) of the words it should read."""
    raw = weight.reshape(-1).view(torch.uint8)
    words = raw[: min(raw.numel(), max_bytes) // 4 * 4].view(torch.int32).long()
    sums = [chunk.sum() for chunk in words.split(WORDS_PER_PROGRAM)]
    wrapped = [(int(s) + 2**31) % 2**32 - 2**31 for s in sums]
    return torch.tensor(wrapped, dtype=torch.int32)


@pytest.mark.parametrize(
    ("shape", "dtype", "max_bytes"),
    [
        ((40, 1000), torch.bfloat16, l2_prefetch.DEFAULT_MAX_BYTES),  # all: one and a part
        ((40, 1000), torch.bfloat16, 10_002),  # cut inside a program, not a whole word
        ((3, 8), torch.float8_e4m3fn, 1 << 20),  # FP8, smaller than one program's read
        ((64, 1024), torch.bfloat16, 3 * 4 * WORDS_PER_PROGRAM),  # exactly 3 programs
    ],
)
def test_prefetch_reads_the_leading_bytes_asked_for(shape, dtype, max_bytes):
    torch.manual_seed(0)
    weight = torch.randn(shape, device=DEVICE).to(dtype)
    sums = l2_prefetch.prefetch(weight, max_bytes)
    torch.testing.assert_close(sums.cpu(), _program_sums(weight.cpu(), max_bytes))


def test_a_view_that_is_not_contiguous_is_refused():
    weight = torch.zeros(8, 16, dtype=torch.bfloat16, device=DEVICE)[:, :8]
    with pytest.raises(ValueError, match="contiguous"):
        l2_prefetch.prefetch(weight, 1 << 20)


def test_only_a_one_row_projection_is_prefetched_for():
    """At one row attention reads little and the projection streams its weights; with more
    rows, or on the reference, nothing is forked."""
    weight = torch.zeros(8, 16, dtype=torch.bfloat16, device=DEVICE)
    assert isinstance(kernels.reference.weight_prefetch(weight, 1), contextlib.nullcontext)
    assert isinstance(kernels.triton_ops.weight_prefetch(weight, 2), contextlib.nullcontext)
    assert not isinstance(kernels.triton_ops.weight_prefetch(weight, 1), contextlib.nullcontext)


def _decode_like_chain(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A few small kernels, then the projection the prefetch is for."""
    with l2_prefetch.concurrently(weight):
        h = torch.nn.functional.silu(x) * 2 + 1
    return skinny.linear(h, weight)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_beside_a_chain_eager_and_in_a_cuda_graph_nothing_changes(dtype):
    torch.manual_seed(1)
    weight = torch.randn(4096, 4096, device="cuda", dtype=dtype)  # 32-64 MiB: beyond the budget
    x = torch.randn(1, 4096, device="cuda", dtype=dtype)
    with l2_prefetch.budget(0):
        expected = _decode_like_chain(x, weight)
    torch.testing.assert_close(_decode_like_chain(x, weight), expected, rtol=0, atol=0)
    _decode_like_chain(x, weight)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # fails if the side stream were not joined before its end
        out = _decode_like_chain(x, weight)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)

"""The skinny projection kernels against `kernels.reference`, on fresh random inputs.

Without a GPU they run in Triton's interpreter on tiny shapes; the `gpu` cases use the 8B
model's projections (qkv 6144 × 4096, o 4096 × 4096, gate/up 28672 × 4096, down 4096 × 14336,
the 128256-row output projection) at every batch the kernel takes.
"""

from __future__ import annotations

import contextlib
import zlib

import pytest
import torch

from kernels import reference, triton_ops
from kernels.errors import KernelInputError
from kernels.linear import (
    MAX_ROWS,
    LinearConfig,
    gelu_tanh_mul_linear,
    linear,
    silu_mul_linear,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _on_device(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE)


# Both sides accumulate in float32 in different orders, then round once to the output dtype.
TOLERANCE = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.float16: {"atol": 4e-3, "rtol": 4e-3},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
}
# Tiles that do not divide the tiny test shapes, so the masked edges run too.
SMALL_TILES = LinearConfig(block_n=16, block_k=32, num_warps=4, num_stages=2)
SMALL_FMA_TILES = LinearConfig(block_n=4, block_k=32, num_warps=4, num_stages=2, fma=True)


def _inputs(
    rows: int, n: int, k: int, dtype: torch.dtype, device: str, *, bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    torch.manual_seed(zlib.crc32(repr((rows, n, k, dtype, bias)).encode()))
    x = torch.randn(rows, k, device=device).to(dtype)
    # Outputs of about unit size, as a real layer's are.
    weight = (torch.randn(n, k, device=device) * k**-0.5).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    return x, weight, b


@pytest.mark.parametrize(
    ("rows", "n", "k", "dtype", "bias"),
    [
        (1, 48, 64, torch.float32, False),
        (3, 40, 72, torch.float32, True),  # N and K off the tiles
        (16, 33, 96, torch.float16, True),
        (7, 64, 50, torch.float16, False),
    ],
)
def test_linear_matches_reference(
    rows: int, n: int, k: int, dtype: torch.dtype, bias: bool
) -> None:
    x, weight, b = _inputs(rows, n, k, dtype, DEVICE, bias=bias)

    out = linear(x, weight, b, config=SMALL_TILES)

    torch.testing.assert_close(out, reference.linear(x, weight, b), **TOLERANCE[dtype])


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("n", "k"), [(40, 96), (37, 50)])
def test_single_row_on_the_cuda_cores_matches_reference(n: int, k: int, bias: bool) -> None:
    x, weight, b = _inputs(1, n, k, torch.float16, DEVICE, bias=bias)
    gate_up = torch.cat([x * 4, -x], dim=1)  # gates well into both tails of SiLU

    out = linear(x, weight, b, config=SMALL_FMA_TILES)
    fused = silu_mul_linear(gate_up, weight, config=SMALL_FMA_TILES)
    geglu = gelu_tanh_mul_linear(gate_up, weight, config=SMALL_FMA_TILES)

    torch.testing.assert_close(out, reference.linear(x, weight, b), **TOLERANCE[torch.float16])
    torch.testing.assert_close(
        fused, reference.silu_mul_linear(gate_up, weight), **TOLERANCE[torch.float16]
    )
    torch.testing.assert_close(
        geglu, reference.gelu_tanh_mul_linear(gate_up, weight), **TOLERANCE[torch.float16]
    )


def test_the_default_tiles_of_every_batch_size_match_reference() -> None:
    for rows in range(1, MAX_ROWS + 1):
        x, weight, b = _inputs(rows, 24, 64, torch.float32, DEVICE, bias=True)
        torch.testing.assert_close(
            linear(x, weight, b), reference.linear(x, weight, b), **TOLERANCE[torch.float32]
        )
    gate_up = torch.randn(1, 128, device=DEVICE)
    torch.testing.assert_close(
        silu_mul_linear(gate_up, weight),
        reference.silu_mul_linear(gate_up, weight),
        **TOLERANCE[torch.float32],
    )


def test_linear_reads_strided_rows_of_a_wider_tensor() -> None:
    # The attention output reshaped from [T, H, D] and slices of fused outputs have row strides
    # wider than K.
    wide, weight, _ = _inputs(4, 24, 80, torch.float32, DEVICE, bias=False)
    x = wide[:, :64]
    weight = weight[:, :64].contiguous()

    out = linear(x, weight, config=SMALL_TILES)

    torch.testing.assert_close(out, reference.linear(x, weight, None), **TOLERANCE[torch.float32])


def test_batches_above_the_row_limit_are_routed_to_the_matmul() -> None:
    x, weight, b = _inputs(MAX_ROWS + 1, 24, 32, torch.float32, DEVICE, bias=True)
    gate_up = torch.cat([x, -x], dim=1)

    with pytest.raises(KernelInputError, match="at most 16"):
        linear(x, weight, b)
    torch.testing.assert_close(
        triton_ops.linear(x, weight, b), reference.linear(x, weight, b), atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(
        triton_ops.silu_mul_linear(gate_up, weight),
        reference.silu_mul_linear(gate_up, weight),
        atol=1e-5,
        rtol=1e-5,
    )


def test_empty_batch_and_empty_reduction() -> None:
    weight = torch.randn(8, 16, device=DEVICE)
    assert linear(torch.empty(0, 16, device=DEVICE), weight).shape == (0, 8)
    bias = torch.randn(8, device=DEVICE)
    out = linear(torch.empty(2, 0, device=DEVICE), torch.empty(8, 0, device=DEVICE), bias)
    assert torch.equal(out, bias.expand(2, 8))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: linear(_on_device(2, 8), _on_device(4, 16)), r"x must have shape \[M, 16\]"),
        (lambda: linear(_on_device(2, 8), _on_device(4, 8, 1)), "weight must have shape"),
        (
            lambda: linear(_on_device(2, 8), _on_device(4, 8).half()),
            "weight dtype torch.float16 differs",
        ),
        (
            lambda: linear(_on_device(2, 8), _on_device(4, 8), _on_device(5)),
            r"bias must have shape \(4,\)",
        ),
        (lambda: linear(_on_device(2, 8), _on_device(8, 4).t()), "contiguous"),
        (lambda: linear(_on_device(2, 8).int(), _on_device(4, 8).int()), "dtype torch.int32"),
        (lambda: silu_mul_linear(_on_device(1, 8), _on_device(4, 8)), r"\[M, 16\]"),
        (lambda: silu_mul_linear(_on_device(2, 16), _on_device(4, 8)), "one row of x, got 2"),
        (
            lambda: silu_mul_linear(_on_device(1, 16), _on_device(4, 8), config=SMALL_TILES),
            "an fma config",
        ),
        (lambda: linear([[1.0]], _on_device(1, 1)), "x must be a torch.Tensor"),
        (
            lambda: linear(_on_device(2, 8), _on_device(4, 8), config=SMALL_FMA_TILES),
            "one row of x, got 2",
        ),
    ],
)
def test_launcher_rejects_bad_input(call, message: str) -> None:
    with pytest.raises(KernelInputError, match=message):
        call()


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter-only limitation")
def test_bfloat16_is_refused_under_the_interpreter() -> None:
    x, weight, _ = _inputs(2, 16, 32, torch.bfloat16, DEVICE, bias=False)
    with pytest.raises(KernelInputError, match="bfloat16"):
        linear(x, weight)


# --- GPU: the 8B model's projections -----------------------------------------------------------

SERVING_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (128256, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 16])
@pytest.mark.parametrize(("n", "k"), SERVING_SHAPES)
def test_linear_matches_reference_at_serving_shapes(
    n: int, k: int, rows: int, dtype: torch.dtype
) -> None:
    x, weight, b = _inputs(rows, n, k, dtype, "cuda", bias=n == 6144)  # Qwen2's qkv bias
    torch.testing.assert_close(
        linear(x, weight, b), reference.linear(x, weight, b), **TOLERANCE[dtype]
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_silu_mul_linear_matches_reference_at_serving_shapes(dtype: torch.dtype) -> None:
    x, weight, _ = _inputs(1, 4096, 14336, dtype, "cuda", bias=False)
    gate_up = torch.cat([x * 4, -x], dim=1)
    torch.testing.assert_close(
        silu_mul_linear(gate_up, weight),
        reference.silu_mul_linear(gate_up, weight),
        **TOLERANCE[dtype],
    )


@pytest.mark.gpu
def test_linear_replays_in_a_cuda_graph_after_inputs_change() -> None:
    x, weight, b = _inputs(4, 6144, 4096, torch.bfloat16, "cuda", bias=True)
    linear(x, weight, b)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear(x, weight, b)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, reference.linear(x, weight, b), **TOLERANCE[torch.bfloat16])


@pytest.mark.gpu
def test_programmatic_launches_in_a_cuda_graph_read_what_the_kernel_before_wrote() -> None:
    """A decode layer's chain (norm, qkv projection, rotary, KV write, split decode attention
    and its combine, o projection, norm, gate/up, fused down) replayed from one CUDA graph with
    programmatic dependent launches gives, bit for bit, what the same kernels give captured in
    plain stream order: each dependent waited for its input. (Were a wait missing, a kernel
    would start on the previous replay's activations.)"""
    from kernels import pdl
    from kernels.decode_attention import paged_decode_attention
    from kernels.kv_cache_write import write_kv_cache
    from kernels.rmsnorm import add_rms_norm
    from kernels.rotary import rotary_embedding

    if not pdl.programmatic_launch(torch.device(DEVICE)):
        pytest.skip("programmatic dependent launch needs Hopper or later")
    hidden, heads, kv_heads, head_dim, inter = 4096, 32, 8, 128, 14336
    q_width, kv_width = heads * head_dim, kv_heads * head_dim
    dtype = torch.bfloat16
    norm_w = torch.rand(hidden, device=DEVICE, dtype=dtype) + 0.5
    qkv_w = _on_device(q_width + 2 * kv_width, hidden).to(dtype) * hidden**-0.5
    o_w = _on_device(hidden, q_width).to(dtype) * q_width**-0.5
    gate_up_w = _on_device(2 * inter, hidden).to(dtype) * hidden**-0.5
    down_w = _on_device(hidden, inter).to(dtype) * inter**-0.5
    cos = torch.rand(1, head_dim, device=DEVICE)
    sin = torch.rand(1, head_dim, device=DEVICE)
    x = torch.randn(1, hidden, device=DEVICE, dtype=dtype)
    residual = torch.randn(1, hidden, device=DEVICE, dtype=dtype)
    caches = [torch.randn(64, 16, kv_heads, head_dim, device=DEVICE, dtype=dtype) for _ in "kv"]
    block_tables = torch.arange(64, dtype=torch.int32, device=DEVICE)[None, :]
    seq_lens = torch.tensor([700], dtype=torch.int32, device=DEVICE)
    slot = torch.tensor([699], dtype=torch.int64, device=DEVICE)

    def layer() -> tuple[torch.Tensor, ...]:
        normed, res = add_rms_norm(x, residual.clone(), norm_w, 1e-5)
        qkv = linear(normed, qkv_w)
        q, k, v = qkv.split([q_width, kv_width, kv_width], dim=1)
        q, k, v = (t.view(1, -1, head_dim) for t in (q, k, v))
        rotary_embedding(q, k, cos, sin)
        write_kv_cache(k, v, *caches, slot)
        attn = paged_decode_attention(
            q, *caches, block_tables, seq_lens, head_dim**-0.5, num_splits=4
        )
        normed2, res = add_rms_norm(linear(attn.view(1, q_width), o_w), res, norm_w, 1e-5)
        gate_up = linear(normed2, gate_up_w)
        return qkv, attn, silu_mul_linear(gate_up, down_w), res

    outputs = {}
    for plain in (True, False):
        with pdl.disabled() if plain else contextlib.nullcontext():
            layer()  # compile outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = layer()
        outputs[plain] = []
        for seed in range(3):  # new inputs for each replay
            torch.manual_seed(seed)
            x.copy_(torch.randn_like(x))
            residual.copy_(torch.randn_like(residual))
            graph.replay()
            outputs[plain].append([t.clone() for t in captured])
    for plain, dependent in zip(outputs[True], outputs[False], strict=True):
        for a, b in zip(plain, dependent, strict=True):
            assert torch.equal(a, b)

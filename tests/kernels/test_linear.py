"""The skinny projection kernels against `kernels.reference`, on fresh random inputs.

Without a GPU they run in Triton's interpreter on tiny shapes; the `gpu` cases use the 8B
model's projections (qkv 6144 × 4096, o 4096 × 4096, gate/up 28672 × 4096, down 4096 × 14336,
the 128256-row output projection) at every batch the kernel takes.
"""

from __future__ import annotations

import contextlib
import zlib
from dataclasses import replace

import pytest
import torch

from kernels import reference, triton_ops
from kernels.errors import KernelInputError
from kernels.linear import (
    MAX_ROWS,
    LinearConfig,
    gelu_tanh_mul_linear,
    linear,
    rms_norm_linear,
    silu_mul_linear,
)
from kernels.ops import PreNorm
from kernels.rmsnorm import add_rms_norm, rms_norm

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


# --- one row norming its own input (rms_norm_linear) ------------------------------------------


def _norm_case(
    n: int, k: int, dtype: torch.dtype, norm_dtype: torch.dtype, device: str, *, bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(x, residual, norm weight, weight, bias): one un-normed row and its residual."""
    x, weight, b = _inputs(1, n, k, dtype, device, bias=bias)
    residual = (torch.randn(1, k, device=device) * 3).to(dtype)
    # About 1 (Llama's learned scales), or Gemma's float32 `1 + w`.
    norm_weight = (1.0 + 0.2 * torch.randn(k, device=device)).to(norm_dtype)
    return x, residual, norm_weight, weight, b


def _unfused(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    b: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the decode step runs without the fusion: the norm's kernel (on a copy of the
    residual, which it updates in place), then the projection (the reference's, in float32,
    rounded once: the GEMV's own accuracy is tested above). Returns (output, new residual)."""
    if residual is None:
        normed, new_residual = rms_norm(x, norm_weight, 1e-5), x
    else:
        normed, new_residual = add_rms_norm(x, residual.clone(), norm_weight, 1e-5)
    out = reference.linear(normed.float(), weight.float(), None if b is None else b.float())
    return out.to(x.dtype), new_residual


@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize(
    ("dtype", "norm_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),  # Gemma's and Qwen3.5's `1 + w`, scaled in float32
    ],
)
def test_one_row_norming_its_own_input_matches_the_norm_kernel_then_the_projection(
    dtype: torch.dtype, norm_dtype: torch.dtype, residual: bool
) -> None:
    n, k = 37, 80  # off SMALL_FMA_TILES' 4 × 32: masked edges in N and in K
    x, res, norm_weight, weight, b = _norm_case(n, k, dtype, norm_dtype, DEVICE, bias=True)
    res_before = res.clone()
    residual_out = torch.full_like(res, float("nan"))
    norm = PreNorm(norm_weight, 1e-5, res, residual_out) if residual else PreNorm(norm_weight, 1e-5)

    out = rms_norm_linear(x, norm, weight, b, config=SMALL_FMA_TILES)

    expected, expected_residual = _unfused(x, res if residual else None, norm_weight, weight, b)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    assert torch.equal(res, res_before), "the old residual is read, never written"
    if residual:
        # Every element written (by one program), each one rounding of the exact sum, as the
        # norm kernel's.
        torch.testing.assert_close(residual_out, expected_residual, atol=0, rtol=0)
    else:
        assert residual_out.isnan().all()


def test_one_row_norming_its_own_input_with_the_default_tiles_matches_reference() -> None:
    x, res, norm_weight, weight, _ = _norm_case(24, 64, torch.float32, torch.float32, DEVICE,
                                                bias=False)  # fmt: skip
    residual_out = torch.empty_like(res)
    out = rms_norm_linear(x, PreNorm(norm_weight, 1e-6, res, residual_out), weight)
    normed, new_residual = reference.add_rms_norm(x, res, norm_weight, 1e-6)
    torch.testing.assert_close(
        out, reference.linear(normed, weight, None), **TOLERANCE[torch.float32]
    )
    torch.testing.assert_close(residual_out, new_residual, atol=0, rtol=0)


def test_the_norm_fails_the_comparison_if_the_residual_were_not_added() -> None:
    """The tolerance above is far below what a norm of x alone would give."""
    x, res, norm_weight, weight, _ = _norm_case(24, 64, torch.float32, torch.float32, DEVICE,
                                                bias=False)  # fmt: skip
    out = rms_norm_linear(x, PreNorm(norm_weight, 1e-5), weight, config=SMALL_FMA_TILES)
    added, _ = _unfused(x, res, norm_weight, weight, None)
    assert (out - added).abs().max() > 100 * TOLERANCE[torch.float32]["atol"]


@pytest.mark.parametrize("rows", [1, 3])
def test_triton_ops_norm_then_project_any_rows_as_the_reference(rows: int) -> None:
    """One row in one launch; more rows through the norm's kernel and `linear`, the caller's
    residual left as it was in both."""
    torch.manual_seed(rows)
    x, res = torch.randn(rows, 48, device=DEVICE), torch.randn(rows, 48, device=DEVICE)
    norm_weight, weight = torch.rand(48, device=DEVICE) + 0.5, _on_device(20, 48) * 48**-0.5
    b = _on_device(20)
    res_before, residual_out = res.clone(), torch.empty_like(res)
    norm = PreNorm(norm_weight, 1e-5, res, residual_out)

    out = triton_ops.rms_norm_linear(x, norm, weight, b)

    reference_out = torch.empty_like(res)
    expected = reference.rms_norm_linear(x, replace(norm, residual_out=reference_out), weight, b)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])
    torch.testing.assert_close(residual_out, reference_out, atol=0, rtol=0)
    assert torch.equal(res, res_before)


def _norm(residual: torch.Tensor | None = None, out: torch.Tensor | None = None) -> PreNorm:
    return PreNorm(torch.ones(8, device=DEVICE), 1e-5, residual, out)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: rms_norm_linear(_on_device(2, 8), _norm(), _on_device(4, 8)),
            "one row of x, got 2",
        ),
        (
            lambda: rms_norm_linear(_on_device(1, 8), _norm(_on_device(1, 8)), _on_device(4, 8)),
            "come together",
        ),
        (
            lambda: rms_norm_linear(
                _on_device(1, 8), _norm(*[_on_device(1, 8)] * 2), _on_device(4, 8)
            ),
            "must not be the residual",
        ),
        (
            lambda: rms_norm_linear(
                _on_device(1, 8), _norm(_on_device(1, 8), _on_device(1, 9)), _on_device(4, 8)
            ),
            "residual_out shape",
        ),
        (
            lambda: rms_norm_linear(
                _on_device(1, 8).half(),
                PreNorm(torch.ones(8, device=DEVICE, dtype=torch.bfloat16), 1e-5),
                _on_device(4, 8).half(),
            ),
            "not of x's dtype",
        ),
        (
            lambda: rms_norm_linear(_on_device(1, 8), _norm(), _on_device(0, 8)),
            "at least one output feature",
        ),
        (
            lambda: rms_norm_linear(
                _on_device(1, 8), _norm(), _on_device(4, 8), config=SMALL_TILES
            ),
            "an fma config",
        ),
    ],
)
def test_norming_projection_rejects_bad_input(call, message: str) -> None:
    with pytest.raises(KernelInputError, match=message):
        call()


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
@pytest.mark.parametrize("norm_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("n", [6144, 28672])  # the 8B model's qkv and gate/up
def test_one_row_norming_its_own_input_matches_the_unfused_kernels_at_serving_shapes(
    n: int, residual: bool, norm_dtype: torch.dtype
) -> None:
    x, res, norm_weight, weight, b = _norm_case(
        n, 4096, torch.bfloat16, norm_dtype, "cuda", bias=n == 6144
    )
    residual_out = torch.empty_like(res)
    norm = PreNorm(norm_weight, 1e-5, res, residual_out) if residual else PreNorm(norm_weight, 1e-5)

    out = rms_norm_linear(x, norm, weight, b)

    if residual:
        normed, new_residual = add_rms_norm(x, res.clone(), norm_weight, 1e-5)
        assert torch.equal(residual_out, new_residual)
    else:
        normed = rms_norm(x, norm_weight, 1e-5)
    torch.testing.assert_close(out, linear(normed, weight, b), **TOLERANCE[torch.bfloat16])


@pytest.mark.gpu
def test_norming_projections_replay_in_a_cuda_graph_with_programmatic_launches() -> None:
    """The links of a decode layer that change (o projection, gate/up norming o's output plus
    the residual, the fused down projection, the next layer's qkv norming that plus the
    residual the gate/up wrote) replayed from one CUDA graph: with programmatic dependent
    launches bit for bit what plain stream order gives (a missed wait would read the previous
    replay's rows), and both what the norm kernels and plain projections give."""
    from kernels import pdl

    hidden, inter, q_width = 4096, 14336, 6144
    dtype = torch.bfloat16
    norm_w = torch.rand(hidden, device="cuda", dtype=dtype) + 0.5
    o_w = _on_device(hidden, 4096).to(dtype) * 4096**-0.5
    gate_up_w = _on_device(2 * inter, hidden).to(dtype) * hidden**-0.5
    down_w = _on_device(hidden, inter).to(dtype) * inter**-0.5
    qkv_w = _on_device(q_width, hidden).to(dtype) * hidden**-0.5
    attn = torch.randn(1, 4096, device="cuda", dtype=dtype)
    residual = torch.randn(1, hidden, device="cuda", dtype=dtype)

    def fused() -> tuple[torch.Tensor, ...]:
        after_attention = torch.empty_like(residual)
        norm = PreNorm(norm_w, 1e-5, residual, after_attention)
        gate_up = rms_norm_linear(linear(attn, o_w), norm, gate_up_w)
        after_mlp = torch.empty_like(residual)
        norm = PreNorm(norm_w, 1e-5, after_attention, after_mlp)
        down = silu_mul_linear(gate_up, down_w)
        return gate_up, down, rms_norm_linear(down, norm, qkv_w), after_mlp

    def unfused() -> tuple[torch.Tensor, ...]:
        normed, res = add_rms_norm(linear(attn, o_w), residual.clone(), norm_w, 1e-5)
        gate_up = linear(normed, gate_up_w)
        down = silu_mul_linear(gate_up, down_w)
        normed, res = add_rms_norm(down, res, norm_w, 1e-5)
        return gate_up, down, linear(normed, qkv_w), res

    outputs = {}
    for plain in (True, False):
        with pdl.disabled() if plain else contextlib.nullcontext():
            fused()  # compile outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = fused()
        outputs[plain] = []
        for seed in range(3):  # new inputs for each replay
            torch.manual_seed(seed)
            attn.copy_(torch.randn_like(attn))
            residual.copy_(torch.randn_like(residual))
            graph.replay()
            outputs[plain].append([t.clone() for t in captured])
            if not plain:
                for ours, theirs in zip(captured, unfused(), strict=True):
                    torch.testing.assert_close(ours, theirs, **TOLERANCE[dtype])
    for plain, dependent in zip(outputs[True], outputs[False], strict=True):
        for a, b in zip(plain, dependent, strict=True):
            assert torch.equal(a, b)


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

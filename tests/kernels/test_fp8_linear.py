"""The FP8 projection kernels against `kernels.reference` (and `kernels.fp8`): W8A8 from two
rows on, weight-only (the dequantized weight's product with x as it is) for one row.

Without a GPU the products run in Triton's interpreter on tiny shapes (and large batches in
torch's CPU `_scaled_mm`, called as on the GPU), fed rows quantized by the reference: the
interpreter's own float32 -> float8 conversion is wrong (it rounds 124.3 to 64 and mishandles
subnormals, Triton 3.9), so the quantization kernel, whose output is that conversion, is
checked on the GPU only, where the hardware converts, and compiled for sm_90 here. The `gpu`
cases use the 8B model's projections at one row, a tensor-core tile of rows and a
prefill-sized batch (cuBLASLt's FP8 matmul), and capture them in a CUDA graph as the engine
does.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib

import pytest
import torch

from kernels import fp8, fp8_linear, reference, rmsnorm, triton_ops
from kernels.activation import gelu_tanh_and_mul
from kernels.errors import KernelInputError
from kernels.ops import Fp8Rows, Fp8Weight

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Both sides sum the same exact FP8 products in different orders, then round once; the reference
# in float32, cuBLASLt's large-batch path in the tensor cores' own accumulator along K (fast
# accumulation, kernels.fp8_linear), within these bounds at the 8B model's shapes on the GPU.
TOLERANCE = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.float16: {"atol": 4e-3, "rtol": 4e-3},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
}
# The 8B model's projections: qkv, gate/up and down (N, K).
LLAMA_8B = [(6144, 4096), (28672, 4096), (4096, 14336)]


def _weight(n: int, k: int, device: str, seed: int) -> Fp8Weight:
    generator = torch.Generator(device).manual_seed(seed)
    # Rows of different magnitudes, so the per-channel scales matter.
    magnitudes = torch.rand(n, 1, device=device, generator=generator) + 0.1
    dense = torch.randn(n, k, device=device, generator=generator) * magnitudes * k**-0.5
    return Fp8Weight(*fp8.quantize_rows(dense))


def _case(rows: int, n: int, k: int, dtype: torch.dtype, *, bias: bool) -> tuple:
    seed = zlib.crc32(repr((rows, n, k, dtype, bias)).encode())
    generator = torch.Generator(DEVICE).manual_seed(seed)
    x = torch.randn(rows, k, device=DEVICE, generator=generator).to(dtype)
    b = torch.randn(n, device=DEVICE, generator=generator).to(dtype) if bias else None
    return x, _weight(n, k, DEVICE, seed), b


def _reference_product(xq, x_scale, weight: Fp8Weight, bias, dtype) -> torch.Tensor:
    out = (xq.float() @ weight.weight.float().T) * x_scale[:, None] * weight.scale[None, :]
    return (out if bias is None else out + bias.float()).to(dtype)


def _weight_only_product(x, weight: Fp8Weight, bias) -> torch.Tensor:
    """One row's semantics: x, unquantized, times the dequantized weight, summed in float32."""
    out = (x.float() @ weight.weight.float().T) * weight.scale[None, :]
    return (out if bias is None else out + bias.float()).to(x.dtype)


def _expected(x, weight: Fp8Weight, bias) -> torch.Tensor:
    if x.shape[0] == 1:
        return _weight_only_product(x, weight, bias)
    return reference.linear(x, weight, bias)


@pytest.mark.parametrize(
    ("n", "k", "dtype", "bias"),
    [
        (48, 64, torch.float32, False),
        (37, 50, torch.float16, True),  # N and K off the tiles
        (40, 2 * 1024, torch.float32, True),  # K over several tiles
    ],
)
def test_one_row_multiplies_the_fp8_weight_by_x_unquantized(n, k, dtype, bias) -> None:
    x, weight, b = _case(1, n, k, dtype, bias=bias)
    out = fp8_linear.linear(x, weight, b)
    torch.testing.assert_close(out, _weight_only_product(x, weight, b), **TOLERANCE[dtype])
    # Not W8A8: x's own quantization would move the result by more than the tolerance.
    assert not torch.allclose(out, reference.linear(x, weight, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("ours", "activation"),
    [
        (fp8_linear.silu_mul_linear, reference.silu_and_mul),
        (fp8_linear.gelu_tanh_mul_linear, reference.gelu_tanh_and_mul),
    ],
)
def test_one_row_down_projection_applies_the_activation_to_x_unquantized(ours, activation) -> None:
    n, k = 24, 40
    generator = torch.Generator(DEVICE).manual_seed(11)
    gate_up = torch.randn(1, 2 * k, device=DEVICE, generator=generator) * 3
    weight = _weight(n, k, DEVICE, seed=11)
    out = ours(gate_up, weight)
    expected = _weight_only_product(activation(gate_up), weight, None)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


@pytest.mark.gpu  # the quantization kernel's float8 conversion (module docstring)
def test_several_rows_of_the_gelu_down_projection_are_w8a8() -> None:
    """The activation kernel's product, then W8A8 (the product of torch's GELU may round an
    ulp apart, and its quantization a whole e4m3 step: compared from the same product)."""
    generator = torch.Generator().manual_seed(3)
    x = (torch.randn(20, 2 * 48, generator=generator) * 3).to(DEVICE, torch.bfloat16)
    weight = _weight(32, 48, DEVICE, seed=3)
    out = fp8_linear.gelu_tanh_mul_linear(x, weight)
    expected = reference.linear(gelu_tanh_and_mul(x), weight, None)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize(
    ("rows", "n", "k", "dtype", "bias"),
    [
        (1, 48, 64, torch.float32, False),  # the GEMV on the CUDA cores
        (1, 37, 50, torch.float16, True),  # N and K off the tiles
        (3, 40, 72, torch.float32, True),  # the tensor-core tile
        (16, 33, 96, torch.bfloat16, False),
        (21, 24, 40, torch.float16, True),  # more rows than a tile, widths cuBLASLt refuses
        (20, 48, 32, torch.bfloat16, True),  # torch._scaled_mm (on the CPU too)
    ],
)
def test_products_of_quantized_rows_match_reference(rows, n, k, dtype, bias) -> None:
    x, weight, b = _case(rows, n, k, dtype, bias=bias)
    xq, x_scale = fp8.quantize_rows(x)

    out = fp8_linear.project(xq, x_scale, weight, b, dtype)

    expected = _reference_product(xq, x_scale, weight, b, dtype)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


def test_reference_linear_is_the_product_of_its_quantized_rows() -> None:
    x, weight, b = _case(5, 24, 40, torch.float32, bias=True)
    xq, x_scale = fp8.quantize_rows(x)
    expected = _reference_product(xq, x_scale, weight, b, torch.float32)
    torch.testing.assert_close(reference.linear(x, weight, b), expected, rtol=1e-6, atol=1e-6)
    static = torch.tensor([0.01], device=DEVICE)
    xq, x_scale = fp8.quantize_rows(x, static)
    assert (x_scale == 0.01).all() and xq.float().abs().max() <= fp8.FP8_MAX


def test_weights_must_be_fp8_with_a_float32_scale_per_output_channel() -> None:
    x, weight, _ = _case(1, 8, 16, torch.float32, bias=False)
    for bad, named in [
        (Fp8Weight(weight.weight.float(), weight.scale), "float8_e4m3fn"),
        (Fp8Weight(weight.weight, weight.scale[:4]), r"scale must be \[8\] float32"),
        (Fp8Weight(weight.weight, weight.scale.half()), r"scale must be \[8\] float32"),
    ]:
        with pytest.raises(KernelInputError, match=named):
            fp8_linear.linear(x, bad)
    with pytest.raises(KernelInputError, match=r"x must have shape \[M, 16\]"):
        fp8_linear.linear(x[:, :8], weight)


@pytest.mark.parametrize("silu_mul", [False, True])
@pytest.mark.parametrize("k", [1200, 2 * 16384 + 6], ids=["one-pass", "two-pass"])
def test_quantization_scales_match_reference(silu_mul: bool, k: int) -> None:
    """The scales (the interpreter computes them exactly; only its float8 conversion is off),
    of rows read once (up to 16,384 values, held in registers) and of wider ones read twice in
    tiles (the largest magnitude in the last tile, so a pass that skipped it would differ)."""
    x, _, _ = _case(5, 8, k, torch.float32, bias=False)
    x[:, -1] = 100.0
    q, scale = fp8_linear.quantize_rows(x, silu_mul=silu_mul)
    _, expected = fp8.quantize_rows(reference.silu_and_mul(x) if silu_mul else x)
    assert q.shape == (5, k // 2 if silu_mul else k) and q.dtype == fp8.FP8_DTYPE
    torch.testing.assert_close(scale, expected, rtol=1e-6, atol=0)
    static = torch.tensor([0.25], device=DEVICE)
    _, scale = fp8_linear.quantize_rows(x, silu_mul=silu_mul, static_scale=static)
    assert (scale == 0.25).all()


def _assert_quantized_alike(q: torch.Tensor, scale: torch.Tensor, x: torch.Tensor) -> None:
    """The kernel's quantization of x against the reference's: bit for bit. (Both take the
    exact maximum, divide it correctly rounded, multiply each value by the scale's correctly
    rounded reciprocal and round to nearest even.)"""
    q_ref, scale_ref = fp8.quantize_rows(x)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def _assert_dequantized_alike(q: torch.Tensor, scale: torch.Tensor, x: torch.Tensor) -> None:
    """Where the kernel computes x itself (SiLU·mul, whose exp may round a bfloat16 ulp apart
    from torch's), the values it stands for are within one e4m3 step of the reference's."""
    q_ref, scale_ref = fp8.quantize_rows(x)
    ours, theirs = q.float() * scale[:, None], q_ref.float() * scale_ref[:, None]
    step = theirs.abs() * 2**-3 + scale_ref[:, None] * 2**-9
    assert ((ours - theirs).abs() <= 1.01 * step).all()


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 256])
@pytest.mark.parametrize(("n", "k"), LLAMA_8B)
def test_projections_of_the_8b_model_match_reference_on_the_gpu(rows, n, k) -> None:
    x, weight, _ = _case(rows, n, k, torch.bfloat16, bias=False)
    q, scale = fp8_linear.quantize_rows(x)
    _assert_quantized_alike(q, scale, x)
    out = triton_ops.linear(x, weight, None)
    expected = _expected(x, weight, None)
    # cuBLASLt (256 rows) rounds to bfloat16 as the reference does; a quantized input one
    # step apart moves an output by far less than this.
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 256])
def test_fused_silu_mul_down_projection_matches_reference_on_the_gpu(rows) -> None:
    n, k = LLAMA_8B[2]
    generator = torch.Generator(DEVICE).manual_seed(rows)
    gate_up = torch.randn(rows, 2 * k, device=DEVICE, generator=generator).to(torch.bfloat16)
    weight = _weight(n, k, DEVICE, seed=rows)
    q, scale = fp8_linear.quantize_rows(gate_up, silu_mul=True)
    _assert_dequantized_alike(q, scale, reference.silu_and_mul(gate_up))
    out = triton_ops.silu_mul_linear(gate_up, weight)
    if rows == 1:
        expected = _weight_only_product(reference.silu_and_mul(gate_up), weight, None)
    else:
        expected = reference.silu_mul_linear(gate_up, weight)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.bfloat16])


# --- The norm before a projection, its rows quantized in its own launch ---------------------------


def _norm_case(rows: int, hidden: int, dtype: torch.dtype, weight_dtype: torch.dtype, seed: int):
    generator = torch.Generator(DEVICE).manual_seed(seed)
    x = torch.randn(rows, hidden, device=DEVICE, generator=generator).to(dtype)
    residual = (torch.randn(rows, hidden, device=DEVICE, generator=generator) * 4).to(dtype)
    weight = (torch.rand(hidden, device=DEVICE, generator=generator) + 0.5).to(weight_dtype)
    return x, residual, weight


# (rows, hidden, x dtype, weight dtype): Llama's norm; a float32 `1 + w` weight (scaled in
# float32, rounded once to x's dtype); a weight of another half dtype (float32 output, which
# is quantized unrounded); the 8B model's hidden size at a decode step's and a prompt step's
# rows (bfloat16: the GPU only, as the interpreter truncates its casts).
_NORM_CASES = [
    (5, 100, torch.float16, torch.float16),
    (3, 64, torch.float16, torch.float32),
    (4, 48, torch.float16, torch.bfloat16),
    (2, 32, torch.float32, torch.float32),
    pytest.param(512, 4096, torch.bfloat16, torch.bfloat16, marks=pytest.mark.gpu),
    pytest.param(8192, 4096, torch.bfloat16, torch.bfloat16, marks=pytest.mark.gpu),
    pytest.param(300, 3072, torch.bfloat16, torch.float32, marks=pytest.mark.gpu),
]


@pytest.mark.parametrize(("rows", "hidden", "dtype", "weight_dtype"), _NORM_CASES)
@pytest.mark.parametrize("static", [False, True], ids=["per-row", "static"])
def test_a_norm_quantized_in_its_launch_is_the_norm_then_the_quantizer(
    rows, hidden, dtype, weight_dtype, static
) -> None:
    """The fused kernel's FP8 rows and scales are the quantization kernel's of the unfused
    norm's output, and its residual that norm's. The arithmetic is the same, but the compiler
    may sum a row's squares in another order than in the norm alone, so a normed value within
    a rounding of a midpoint between two of x's dtype can round the other way and its FP8
    value land a step apart: on an H200 2 of the 33.5 M values at 8,192 x 4,096 did; under the
    interpreter (whose float8 conversion both sides share) none."""
    x, residual, weight = _norm_case(rows, hidden, dtype, weight_dtype, seed=rows + hidden)
    static_scale = torch.tensor([0.05], device=DEVICE) if static else None
    normed, expected_residual = rmsnorm.add_rms_norm(x, residual.clone(), weight, 1e-5)
    q, scale = fp8_linear.quantize_rows(normed, static_scale=static_scale)

    quantized, new_residual = rmsnorm.add_rms_norm_fp8(
        x, residual.clone(), weight, 1e-5, static_scale
    )

    assert torch.equal(new_residual, expected_residual)
    assert quantized.dtype == normed.dtype and quantized.shape == (rows, hidden)
    assert torch.equal(quantized.scale, scale)
    apart = quantized.q.view(torch.uint8) != q.view(torch.uint8)
    # Quantized without its rounding to x's dtype, one bfloat16 value in 60 would differ.
    assert apart.float().mean() <= 1e-5, f"{int(apart.sum())} values differ"
    ours, theirs = quantized.q.float(), q.float()
    assert ((ours - theirs).abs() <= theirs.abs() * 2**-3 + 2**-9).all()
    if DEVICE == "cuda" and not static:  # the unfused side is the reference's quantization
        _assert_quantized_alike(q, scale, normed)


def test_the_backend_quantizes_in_the_norm_wherever_the_projection_would(monkeypatch) -> None:
    """`triton_ops.add_rms_norm` with `quantize_for` returns FP8 rows for more than one row
    (one row is multiplied unquantized, so it stays as it is); the projection of those rows
    launches no quantization of its own and gives the unfused projection's output exactly."""
    x, residual, norm_weight = _norm_case(20, 64, torch.float16, torch.float16, seed=5)
    weight = _weight(48, 64, DEVICE, seed=5)
    bias = torch.randn(48, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(6))
    bias = bias.to(torch.float16)
    one, _ = triton_ops.add_rms_norm(x[:1], residual[:1].clone(), norm_weight, 1e-5, weight)
    assert isinstance(one, torch.Tensor)
    launches: list[int] = []
    quantizer = fp8_linear.quantize_rows
    monkeypatch.setattr(
        fp8_linear, "quantize_rows", lambda *a, **k: launches.append(1) or quantizer(*a, **k)
    )
    for rows in (3, 20):  # the tensor-core tile, and torch._scaled_mm's path
        normed, _ = triton_ops.add_rms_norm(x[:rows], residual[:rows].clone(), norm_weight, 1e-5)
        expected = triton_ops.linear(normed, weight, bias)
        quantized, _ = triton_ops.add_rms_norm(
            x[:rows], residual[:rows].clone(), norm_weight, 1e-5, weight
        )
        assert isinstance(quantized, Fp8Rows)
        before = len(launches)
        out = triton_ops.linear(quantized, weight, bias)
        assert len(launches) == before and torch.equal(out, expected), rows
    assert launches, "the unfused projections quantized their rows themselves"


def test_the_reference_norm_quantized_for_a_projection_gives_its_product() -> None:
    x, residual, norm_weight = _norm_case(6, 40, torch.float32, torch.float32, seed=9)
    for weight in (
        _weight(24, 40, DEVICE, seed=9),
        Fp8Weight(
            *fp8.quantize_rows(torch.randn(24, 40, device=DEVICE)),
            torch.tensor([0.02], device=DEVICE),
        ),
    ):
        normed, expected_residual = reference.add_rms_norm(x, residual, norm_weight, 1e-5)
        rows, new_residual = reference.add_rms_norm(x, residual, norm_weight, 1e-5, weight)
        assert isinstance(rows, Fp8Rows) and torch.equal(new_residual, expected_residual)
        assert torch.equal(
            reference.linear(rows, weight, None), reference.linear(normed, weight, None)
        )


def test_quantized_rows_are_refused_where_they_do_not_belong() -> None:
    x, residual, norm_weight = _norm_case(4, 32, torch.float32, torch.float32, seed=2)
    weight = _weight(16, 32, DEVICE, seed=2)
    rows, _ = rmsnorm.add_rms_norm_fp8(x, residual, norm_weight, 1e-5)
    with pytest.raises(KernelInputError, match="for an FP8 projection, not a dense one"):
        triton_ops.linear(rows, weight.weight.float(), None)
    with pytest.raises(KernelInputError, match="one row is projected unquantized"):
        fp8_linear.linear(rows[:1], weight)
    with pytest.raises(KernelInputError, match=r"x must have shape \[M, 16\]"):
        fp8_linear.linear(rows, _weight(16, 16, DEVICE, seed=2))
    with pytest.raises(KernelInputError, match=r"static_scale must be \[1\] float32"):
        rmsnorm.add_rms_norm_fp8(
            x, residual, norm_weight, 1e-5, torch.tensor([0.1, 0.2], device=DEVICE)
        )


@pytest.mark.gpu
def test_static_input_scale_and_bias_match_reference_on_the_gpu() -> None:
    x, weight, b = _case(32, 1024, 512, torch.bfloat16, bias=True)
    weight = Fp8Weight(weight.weight, weight.scale, torch.tensor([0.02], device=DEVICE))
    for rows in (1, 8, 32):
        torch.testing.assert_close(
            triton_ops.linear(x[:rows], weight, b),
            _expected(x[:rows], weight, b),
            **TOLERANCE[torch.bfloat16],
        )


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_fp8_projections_replay_in_a_cuda_graph(rows) -> None:
    """As the engine captures them: a projection of rows it quantizes itself, the fused down
    projection, and one of rows the norm before it quantized (`quantize_for`)."""
    n, k = 2048, 1024
    x, weight, _ = _case(rows, n, k, torch.bfloat16, bias=False)
    gate_up = torch.cat([x, x.flip(1)], dim=1)
    down = _weight(n, k, DEVICE, seed=7)
    residual, norm_weight = torch.randn_like(x), torch.rand(k, device=DEVICE).to(x.dtype) + 0.5

    def forward():
        normed, _ = triton_ops.add_rms_norm(x, residual, norm_weight, 1e-5, weight)
        return (
            triton_ops.linear(x, weight, None),
            triton_ops.silu_mul_linear(gate_up, down),
            triton_ops.linear(normed, weight, None),
        )

    forward()  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, fused, after_norm = forward()
    x.copy_(torch.randn_like(x))
    gate_up.copy_(torch.randn_like(gate_up))
    before = residual.clone()
    graph.replay()
    torch.testing.assert_close(out, _expected(x, weight, None), **TOLERANCE[torch.bfloat16])
    product = reference.silu_and_mul(gate_up)
    torch.testing.assert_close(fused, _expected(product, down, None), **TOLERANCE[torch.bfloat16])
    normed, expected_residual = reference.add_rms_norm(x, before, norm_weight, 1e-5)
    assert torch.equal(residual, expected_residual)
    expected = _expected(normed, weight, None)
    torch.testing.assert_close(after_norm, expected, **TOLERANCE[torch.bfloat16])


# Compiles the kernels for an H100 (sm_90) ahead of time; Triton's own compiler and ptxas need
# no GPU. Run in a fresh process: under TRITON_INTERPRET=1 the kernels are not compilable.
_COMPILE_FOR_HOPPER = """
import re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import fp8_linear as k, linear, rmsnorm

common = {"x_scale_ptr": "*fp32", "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32", "b_ptr": "*bf16",
          "out_ptr": "*bf16", "HAS_BIAS": "constexpr", "EVEN_K": "constexpr",
          "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
kernels = [
    (k._quantize_rows_kernel,
     {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "static_scale_ptr": "*fp32",
      "k": "i32", "x_row_stride": "i32", "q_row_stride": "i32", "SILU_MUL": "constexpr",
      "STATIC": "constexpr", "ONE_PASS": "constexpr", "BLOCK_K": "constexpr"},
     {"SILU_MUL": True, "STATIC": False, "ONE_PASS": True, "BLOCK_K": 16384}),
    (k._quantize_rows_kernel,
     {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "static_scale_ptr": "*fp32",
      "k": "i32", "x_row_stride": "i32", "q_row_stride": "i32", "SILU_MUL": "constexpr",
      "STATIC": "constexpr", "ONE_PASS": "constexpr", "BLOCK_K": "constexpr"},
     {"SILU_MUL": False, "STATIC": False, "ONE_PASS": False, "BLOCK_K": 4096}),
    (linear._gemv_kernel,
     {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32", "b_ptr": "*bf16",
      "out_ptr": "*bf16", "n": "i32", "k": "i32", "w_row_stride": "i32",
      "HAS_BIAS": "constexpr", "ACTIVATION": "constexpr", "SCALED": "constexpr",
      "EVEN_K": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
      "PDL": "constexpr"},
     {"HAS_BIAS": True, "ACTIVATION": "gelu_tanh", "SCALED": True, "EVEN_K": False,
      "BLOCK_N": 4, "BLOCK_K": 2048, "PDL": True}),
    (k._fp8_skinny_kernel,
     {"xq_ptr": "*fp8e4nv", **common, "rows": "i32", "n": "i32", "k": "i32",
      "x_row_stride": "i32", "w_row_stride": "i32", "out_row_stride": "i32",
      "BLOCK_M": "constexpr"},
     {"HAS_BIAS": True, "EVEN_K": False, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256}),
    (rmsnorm._add_rms_norm_kernel,
     {"x_ptr": "*bf16", "residual_ptr": "*bf16", "weight_ptr": "*bf16", "out_ptr": "*fp8e4nv",
      "scale_ptr": "*fp32", "static_scale_ptr": "*fp32", "x_row_stride": "i32",
      "residual_row_stride": "i32", "out_row_stride": "i32", "eps": "fp32",
      "HIDDEN": "constexpr", "BLOCK": "constexpr", "ROUND_NORMED": "constexpr",
      "QUANTIZE": "constexpr", "ROUND_TO_X": "constexpr", "STATIC": "constexpr",
      "PDL": "constexpr"},
     {"HIDDEN": 4096, "BLOCK": 4096, "ROUND_NORMED": True, "QUANTIZE": True,
      "ROUND_TO_X": True, "STATIC": False, "PDL": True}),
]
for fn, signature, constexprs in kernels:
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"], fn
    if fn in (k._quantize_rows_kernel, rmsnorm._add_rms_norm_kernel):
        ptx = compiled.asm["ptx"]
        print(sorted(set(re.findall(r"cvt\\.rn\\.satfinite\\.e4m3x2\\.f32|div\\.rn\\.f32", ptx))))
        print("divisions", ptx.count("div.rn.f32"))
"""


def test_the_kernels_compile_for_hopper_with_exact_division_and_rounding() -> None:
    """What the interpreter cannot show: the kernels compile for sm_90, and the quantization
    (read in one pass and in two, and the norm's in its own launch) divides correctly rounded
    and converts to e4m3 rounding to nearest even, saturating, which the GPU test's
    bit-for-bit comparison with torch relies on; and it divides twice a row (the scale, its
    reciprocal), never once a value (a division a value held the SiLU·mul quantization at 62%
    of copy bandwidth: kernels.fp8)."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    result = subprocess.run(
        [sys.executable, "-c", _COMPILE_FOR_HOPPER],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # Once per quantizer compiled: the one-pass (SiLU·mul), the two-pass, and the norm's.
    each = ["['cvt.rn.satfinite.e4m3x2.f32', 'div.rn.f32']", "divisions 2"]
    assert result.stdout.split("\n")[:6] == each * 3

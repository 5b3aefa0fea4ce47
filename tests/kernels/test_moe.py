"""The fused MoE kernel against the per-expert loop of `kernels.reference.fused_moe`.

Without a GPU the kernels run in Triton's interpreter on tiny shapes, with tiles that do not
divide them (masked edges) and a BLOCK_M that pads every expert's run, through both paths:
the grouped GEMMs (`MoeTiles`) and the per-pair GEMVs (`kernels.moe_gemv`'s `GemvTiles`); the
`gpu` cases use Qwen3-30B-A3B's expert shapes (128 experts, top 8, H 2048, I 768) at decode and
prefill sizes, with the table's tiles.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from kernels import fp8, moe, reference
from kernels.errors import KernelInputError
from kernels.moe import (
    DECODE_TILES,
    LONG_PREFILL_TILES,
    PREFILL_TILES,
    MoeTiles,
    align_block_size,
    fused_moe,
    tiles_for,
)
from kernels.moe_gemv import GEMV_TILES, GemvTiles
from kernels.moe_spec import ClampedSwiglu
from kernels.ops import Fp8Weight

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Both sides accumulate in float32 in different orders, then round where the reference does.
TOLERANCE = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.float16: {"atol": 4e-3, "rtol": 4e-3},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
}
SMALL_TILES = MoeTiles(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2)
SMALL_GEMV_TILES = GemvTiles(block_n=16, down_block_n=8, block_k=16)
BOTH_PATHS = pytest.mark.parametrize(
    "tiles", [SMALL_TILES, SMALL_GEMV_TILES], ids=["grouped", "gemv"]
)


def _inputs(num_tokens: int, num_experts: int, top_k: int, hidden: int, size: int,
            dtype: torch.dtype, *, skew: bool = False):  # fmt: skip
    """Random weights with outputs of about unit size, and each token's k distinct experts
    (drawn at random, or with `skew` most tokens on expert 0, as a hot expert)."""
    torch.manual_seed(zlib.crc32(repr((num_tokens, num_experts, top_k, hidden, size)).encode()))
    x = torch.randn(num_tokens, hidden, device=DEVICE).to(dtype)
    gate_up = (torch.randn(num_experts, 2 * size, hidden, device=DEVICE) * hidden**-0.5).to(dtype)
    down = (torch.randn(num_experts, hidden, size, device=DEVICE) * size**-0.5).to(dtype)
    scores = torch.rand(num_tokens, num_experts, device=DEVICE)
    if skew:
        scores[:, 0] += 1.0
    weights, ids = scores.softmax(-1).topk(top_k, dim=-1)
    return x, gate_up, down, weights.contiguous(), ids


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "hidden", "size", "dtype", "skew"),
    [
        (1, 8, 2, 32, 24, torch.float32, False),  # decode: one block per chosen expert
        (5, 8, 2, 48, 40, torch.float32, False),  # some experts unused, H and I off the tiles
        (37, 4, 2, 32, 16, torch.float16, True),  # a hot expert spanning several blocks
        (20, 6, 3, 24, 20, torch.float32, False),
    ],
)
@BOTH_PATHS
def test_fused_moe_matches_the_per_expert_loop(num_tokens, num_experts, top_k, hidden, size,
                                               dtype, skew, tiles):  # fmt: skip
    x, gate_up, down, weights, ids = _inputs(num_tokens, num_experts, top_k, hidden, size, dtype,
                                             skew=skew)  # fmt: skip
    ours = fused_moe(x, gate_up, down, weights, ids, tiles=tiles)
    expected = reference.fused_moe(x, gate_up, down, weights, ids)
    torch.testing.assert_close(ours, expected, **TOLERANCE[dtype])


@BOTH_PATHS
def test_the_comparison_would_fail_if_a_routing_weight_were_dropped(tiles):
    x, gate_up, down, weights, ids = _inputs(5, 8, 2, 32, 16, torch.float32)
    ours = fused_moe(x, gate_up, down, torch.ones_like(weights), ids, tiles=tiles)
    expected = reference.fused_moe(x, gate_up, down, weights, ids)
    assert (ours - expected).abs().max() > 100 * TOLERANCE[torch.float32]["atol"]


def _gpt_oss_options(gate_up: torch.Tensor, down: torch.Tensor, limit: float) -> dict:
    """gpt-oss's biases (half-unit, so they show) and its clamped SwiGLU at `limit`."""
    generator = torch.Generator().manual_seed(7)
    return {
        "gate_up_bias": (0.5 * torch.randn(gate_up.shape[:2], generator=generator)).to(
            DEVICE, gate_up.dtype
        ),
        "down_bias": (0.5 * torch.randn(down.shape[:2], generator=generator)).to(
            DEVICE, down.dtype
        ),
        "clamped_swiglu": ClampedSwiglu(alpha=1.702, limit=limit),
    }


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "hidden", "size", "dtype"),
    [(1, 8, 2, 32, 24, torch.float32), (20, 6, 3, 24, 20, torch.float32),
     (37, 4, 2, 32, 16, torch.float16)],
)  # fmt: skip
@BOTH_PATHS
def test_gpt_oss_experts_match_the_per_expert_loop(num_tokens, num_experts, top_k, hidden, size,
                                                   dtype, tiles):  # fmt: skip
    """Biased experts and the clamped SwiGLU, at a limit (0.8) that the gate and up values
    cross both ways; and the comparison fails without the clamp."""
    x, gate_up, down, weights, ids = _inputs(num_tokens, num_experts, top_k, hidden, size, dtype)
    options = _gpt_oss_options(gate_up, down, limit=0.8)
    ours = fused_moe(x, gate_up, down, weights, ids, tiles, **options)
    expected = reference.fused_moe(x, gate_up, down, weights, ids, **options)
    torch.testing.assert_close(ours, expected, **TOLERANCE[dtype])
    unclamped = {**options, "clamped_swiglu": ClampedSwiglu(alpha=1.702, limit=100.0)}
    loose = reference.fused_moe(x, gate_up, down, weights, ids, **unclamped)
    assert (loose - expected).abs().max() > 10 * TOLERANCE[dtype]["atol"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@BOTH_PATHS
def test_gelu_tanh_experts_match_the_per_expert_loop(dtype, tiles):
    """Gemma 4's experts gate with tanh-approximated GELU; the comparison fails with SiLU."""
    x, gate_up, down, weights, ids = _inputs(20, 6, 2, 32, 24, dtype)
    ours = fused_moe(x, gate_up, down, weights, ids, tiles, activation="gelu_tanh")
    expected = reference.fused_moe(x, gate_up, down, weights, ids, activation="gelu_tanh")
    torch.testing.assert_close(ours, expected, **TOLERANCE[dtype])
    silu = reference.fused_moe(x, gate_up, down, weights, ids)
    assert (silu - expected).abs().max() > 10 * TOLERANCE[dtype]["atol"]


def test_align_groups_pairs_by_expert_in_padded_blocks():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]], device=DEVICE)  # pairs 0..5
    sorted_ids, block_experts, num_padded = align_block_size(ids, num_experts=4, block_m=4)
    # expert 0: pairs 1, 4; expert 2: pairs 0, 2, 5; expert 3: pair 3; each run padded to 4.
    pad = 6
    assert num_padded.tolist() == [12]
    assert sorted_ids[:12].tolist() == [1, 4, pad, pad, 0, 2, 5, pad, 3, pad, pad, pad]
    assert (sorted_ids[12:] == pad).all()
    assert block_experts[:3].tolist() == [0, 2, 3]
    assert (block_experts[3:] == 4).all(), "blocks past the real ones name no expert"


def test_align_groups_pairs_of_other_ranks_experts_last_as_expert_e():
    ids = torch.tensor([[2, -1], [-1, 0], [-1, 2]], device=DEVICE)  # pairs 0..5
    sorted_ids, block_experts, num_padded = align_block_size(ids, num_experts=4, block_m=4)
    # expert 0: pair 3; expert 2: pairs 0, 5; held elsewhere (-1): pairs 1, 2, 4, as expert 4.
    pad = 6
    assert num_padded.tolist() == [12]
    assert sorted_ids[:12].tolist() == [3, pad, pad, pad, 0, 5, pad, pad, 1, 2, 4, pad]
    assert block_experts[:3].tolist() == [0, 2, 4]
    assert (block_experts[3:] == 4).all()


@pytest.mark.parametrize(
    ("num_tokens", "num_local", "top_k", "dtype"),
    [(1, 4, 2, torch.float32), (20, 3, 3, torch.float32), (37, 2, 2, torch.float16)],
)
@BOTH_PATHS
def test_pairs_of_experts_held_elsewhere_add_nothing(num_tokens, num_local, top_k, dtype, tiles):
    """Expert parallelism: a rank holds experts first .. first + num_local - 1 of 8 and sees
    the others' ids as -1. Its output is the loop's over its own experts only (the other
    pairs' weights zeroed), with and without gpt-oss's biases; and the two ranks' outputs sum
    to the whole layer's."""
    x, gate_up, down, weights, ids = _inputs(num_tokens, 8, top_k, 32, 24, dtype)
    options = _gpt_oss_options(gate_up, down, limit=0.8)
    whole = reference.fused_moe(x, gate_up, down, weights, ids, **options)
    total = torch.zeros_like(whole, dtype=torch.float32)
    for first in (0, num_local):
        experts = slice(first, first + num_local)
        here = (ids >= first) & (ids < first + num_local)
        local_ids = torch.where(here, ids - first, -1)
        local = {**options, "gate_up_bias": options["gate_up_bias"][experts],
                 "down_bias": options["down_bias"][experts]}  # fmt: skip
        ours = fused_moe(x, gate_up[experts], down[experts], weights, local_ids, tiles,
                         **local)  # fmt: skip
        only_here = torch.where(here, weights, 0.0)
        expected = reference.fused_moe(x, gate_up, down, only_here, ids, **options)
        torch.testing.assert_close(ours, expected, **TOLERANCE[dtype])
        torch.testing.assert_close(
            reference.fused_moe(x, gate_up[experts], down[experts], weights, local_ids, **local),
            expected, **TOLERANCE[dtype],
        )  # fmt: skip
        total += ours.float()
    if 2 * num_local == 8:
        torch.testing.assert_close(total.to(dtype), whole, **TOLERANCE[dtype])


def test_the_table_takes_the_gemv_path_for_a_few_pairs_only():
    assert tiles_for(1, 8, 128) == GEMV_TILES  # Qwen3-30B-A3B's decode at batch 1
    assert tiles_for(4, 8, 128) == GEMV_TILES
    assert isinstance(tiles_for(5, 8, 128), MoeTiles)  # 40 pairs: grouping pays
    assert isinstance(tiles_for(4, 2, 6), MoeTiles)  # more pairs than experts
    assert tiles_for(512, 8, 128) == PREFILL_TILES  # 32 pairs per expert
    assert tiles_for(2048, 8, 128) == LONG_PREFILL_TILES  # 128


def test_no_tokens_give_an_empty_output():
    x, gate_up, down, weights, ids = _inputs(0, 4, 2, 16, 16, torch.float32)
    assert fused_moe(x, gate_up, down, weights, ids).shape == (0, 16)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"down": torch.zeros(4, 16, 8)}, "down"),
        ({"topk_weights": torch.ones(3, 2, dtype=torch.float64)}, "topk_weights"),
        ({"topk_ids": torch.zeros(3, 2)}, "topk_ids"),
        ({"x": torch.zeros(3, 16, dtype=torch.float16)}, "dtype"),
        ({"gate_up_bias": torch.zeros(4, 16)}, "gate_up_bias"),
        ({"down_bias": torch.zeros(4, 16, dtype=torch.float16)}, "down_bias"),
    ],
)
def test_fused_moe_refuses_inputs_it_cannot_handle(change, named):
    args = {"x": torch.zeros(3, 16), "gate_up": torch.zeros(4, 32, 16),
            "down": torch.zeros(4, 16, 16), "topk_weights": torch.ones(3, 2),
            "topk_ids": torch.zeros(3, 2, dtype=torch.int64)}  # fmt: skip
    args = {name: t.to(DEVICE) for name, t in {**args, **change}.items()}
    with pytest.raises(KernelInputError, match=named):
        fused_moe(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 8, 512])
def test_gpt_oss_experts_match_the_loop_at_gpt_oss_20b_shapes_on_the_gpu(num_tokens):
    """gpt-oss-20b's experts: 32 experts, top 4, H = I = 2880 (not a multiple of the tiles),
    bf16, its biases and its clamped SwiGLU at its limit 7."""
    x, gate_up, down, weights, ids = _inputs(num_tokens, 32, 4, 2880, 2880, torch.bfloat16)
    options = _gpt_oss_options(gate_up, down, limit=7.0)
    expected = reference.fused_moe(x, gate_up, down, weights, ids, **options)
    for tiles in (None, GEMV_TILES, DECODE_TILES, PREFILL_TILES, LONG_PREFILL_TILES):
        ours = fused_moe(x, gate_up, down, weights, ids, tiles, **options)
        torch.testing.assert_close(ours, expected, **TOLERANCE[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 8, 64, 512, 2048])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_moe_matches_the_loop_at_qwen3_30b_shapes_on_the_gpu(num_tokens, dtype):
    x, gate_up, down, weights, ids = _inputs(num_tokens, 128, 8, 2048, 768, dtype)
    expected = reference.fused_moe(x, gate_up, down, weights, ids)
    for tiles in (None, GEMV_TILES, DECODE_TILES, PREFILL_TILES, LONG_PREFILL_TILES):
        ours = fused_moe(x, gate_up, down, weights, ids, tiles=tiles)
        torch.testing.assert_close(ours, expected, **TOLERANCE[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 8, 512])
def test_gelu_tanh_experts_match_the_loop_at_gemma4_moe_sized_shapes_on_the_gpu(num_tokens):
    """Gemma 4's GELU-tanh experts at a 26B-A4B-sized block (128 experts, top 8, H 2816 and
    I 704: neither a multiple of the prefill tiles' 128), bf16."""
    x, gate_up, down, weights, ids = _inputs(num_tokens, 128, 8, 2816, 704, torch.bfloat16)
    expected = reference.fused_moe(x, gate_up, down, weights, ids, activation="gelu_tanh")
    for tiles in (None, GEMV_TILES, DECODE_TILES, PREFILL_TILES, LONG_PREFILL_TILES):
        ours = fused_moe(x, gate_up, down, weights, ids, tiles, activation="gelu_tanh")
        torch.testing.assert_close(ours, expected, **TOLERANCE[torch.bfloat16])


# FP8 experts. On the CPU the grouped path's activations are quantized by the reference
# (`kernels.fp8.quantize_rows`): Triton's interpreter converts float32 to e4m3 wrongly (see
# tests/kernels/test_fp8_linear.py), and its quantization kernel is checked on the GPU there.
# Against the loop on the dequantized weights in float32, the GEMV path (weight-only) differs
# only in summation order; the grouped path (W8A8) also rounds x and the act(gate) * up rows
# to e4m3: at most 2**-4 of each value (half a unit of 3 mantissa bits), about 2**-4 / sqrt(3)
# in RMS, so under 6% of the output's RMS through both roundings; 10% bounds it.
FP8_RELATIVE_RMS = 0.10
# Against the reference's own W8A8 loop only summation order differs, but a last-bit difference
# in an act(gate) * up value can move it across an e4m3 rounding boundary (a step of 2^-4), so
# an element or two may differ by a step: 1% of the output's RMS allows that, not a lost scale.
W8A8_RELATIVE_RMS = 0.01


@pytest.fixture
def reference_activation_quantization(monkeypatch):
    if DEVICE == "cpu":
        monkeypatch.setattr(moe, "quantize_rows", fp8.quantize_rows)


def _fp8_experts(weight: torch.Tensor) -> Fp8Weight:
    """[E, N, K] -> the same experts in e4m3 with a scale per output channel ([E, N])."""
    num_experts, n, k = weight.shape
    q, scale = fp8.quantize_rows(weight.reshape(-1, k))
    return Fp8Weight(q.view(num_experts, n, k), scale.view(num_experts, n))


def _dequantized(weight: Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
    return (weight.weight.float() * weight.scale[..., None]).to(dtype)


def _assert_w8a8(ours: torch.Tensor, w8a8: torch.Tensor) -> None:
    error = (ours.float() - w8a8.float()).square().mean().sqrt()
    assert error <= W8A8_RELATIVE_RMS * w8a8.float().square().mean().sqrt(), error


def _assert_within_fp8_bound(ours: torch.Tensor, exact: torch.Tensor, tiles) -> None:
    if isinstance(tiles, GemvTiles):  # weight-only: the dequantized product itself
        torch.testing.assert_close(ours, exact.to(ours.dtype), **TOLERANCE[ours.dtype])
        return
    error = (ours.float() - exact).square().mean().sqrt()
    assert error <= FP8_RELATIVE_RMS * exact.square().mean().sqrt(), error


@pytest.mark.usefixtures("reference_activation_quantization")
@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "hidden", "size", "dtype", "skew"),
    [
        (1, 8, 2, 32, 24, torch.float32, False),
        (5, 8, 2, 48, 40, torch.float32, False),
        (37, 4, 2, 32, 16, torch.float16, True),
    ],
)
@BOTH_PATHS
def test_fp8_experts_match_the_loop_on_their_dequantized_weights(num_tokens, num_experts, top_k,
                                                                 hidden, size, dtype, skew,
                                                                 tiles):  # fmt: skip
    """Both paths within FP8's bound of the float32 loop on the dequantized weights; the
    grouped (W8A8) path also within W8A8_RELATIVE_RMS of the reference's W8A8 loop."""
    x, gate_up, down, weights, ids = _inputs(num_tokens, num_experts, top_k, hidden, size, dtype,
                                             skew=skew)  # fmt: skip
    gate_up_q, down_q = _fp8_experts(gate_up), _fp8_experts(down)
    ours = fused_moe(x, gate_up_q, down_q, weights, ids, tiles)
    exact = reference.fused_moe(x.float(), _dequantized(gate_up_q, torch.float32),
                                _dequantized(down_q, torch.float32), weights, ids)  # fmt: skip
    _assert_within_fp8_bound(ours, exact, tiles)
    if isinstance(tiles, MoeTiles):
        _assert_w8a8(ours, reference.fused_moe(x, gate_up_q, down_q, weights, ids))


@pytest.mark.usefixtures("reference_activation_quantization")
@BOTH_PATHS
def test_fp8_comparison_would_fail_without_the_channel_scales(tiles):
    x, gate_up, down, weights, ids = _inputs(5, 8, 2, 32, 16, torch.float32)
    gate_up_q, down_q = _fp8_experts(gate_up), _fp8_experts(down)
    unscaled = Fp8Weight(down_q.weight, torch.ones_like(down_q.scale))
    ours = fused_moe(x, gate_up_q, unscaled, weights, ids, tiles)
    exact = reference.fused_moe(x, _dequantized(gate_up_q, torch.float32),
                                _dequantized(down_q, torch.float32), weights, ids)  # fmt: skip
    assert (ours - exact).abs().max() > 10 * exact.abs().max()


@pytest.mark.usefixtures("reference_activation_quantization")
@pytest.mark.parametrize("num_tokens", [1, 20])
@BOTH_PATHS
def test_fp8_gpt_oss_experts_held_in_part_match_the_loop(num_tokens, tiles):
    """gpt-oss's biases and clamped SwiGLU on FP8 experts, on a rank holding experts 4..7 of 8
    (the others' ids -1): the loop on the dequantized weights over its experts only."""
    x, gate_up, down, weights, ids = _inputs(num_tokens, 8, 3, 32, 24, torch.float32)
    options = _gpt_oss_options(gate_up, down, limit=0.8)
    held = slice(4, 8)
    local_ids = torch.where(ids >= 4, ids - 4, -1)
    local = {**options, "gate_up_bias": options["gate_up_bias"][held],
             "down_bias": options["down_bias"][held]}  # fmt: skip
    gate_up_q, down_q = _fp8_experts(gate_up[held]), _fp8_experts(down[held])
    ours = fused_moe(x, gate_up_q, down_q, weights, local_ids, tiles, **local)
    exact = reference.fused_moe(x, _dequantized(gate_up_q, torch.float32),
                                _dequantized(down_q, torch.float32), weights, local_ids,
                                **local)  # fmt: skip
    _assert_within_fp8_bound(ours, exact, tiles)
    if isinstance(tiles, MoeTiles):
        _assert_w8a8(ours, reference.fused_moe(x, gate_up_q, down_q, weights, local_ids, **local))


@pytest.mark.usefixtures("reference_activation_quantization")
@BOTH_PATHS
def test_fp8_gelu_tanh_experts_match_the_loop(tiles):
    """Gemma 4's GELU-tanh gate on FP8 experts."""
    x, gate_up, down, weights, ids = _inputs(3, 8, 2, 32, 24, torch.float32)
    gate_up_q, down_q = _fp8_experts(gate_up), _fp8_experts(down)
    ours = fused_moe(x, gate_up_q, down_q, weights, ids, tiles, activation="gelu_tanh")
    exact = reference.fused_moe(x, _dequantized(gate_up_q, torch.float32),
                                _dequantized(down_q, torch.float32), weights, ids,
                                activation="gelu_tanh")  # fmt: skip
    _assert_within_fp8_bound(ours, exact, tiles)


def test_fused_moe_refuses_fp8_experts_it_cannot_handle():
    x, gate_up, down, weights, ids = _inputs(3, 4, 2, 16, 8, torch.float32)
    gate_up_q, down_q = _fp8_experts(gate_up), _fp8_experts(down)
    with pytest.raises(KernelInputError, match="both be Fp8Weights"):
        fused_moe(x, gate_up_q, down, weights, ids)
    flat = Fp8Weight(down_q.weight, down_q.scale[:, :4])
    with pytest.raises(KernelInputError, match="down's scale"):
        fused_moe(x, gate_up_q, flat, weights, ids)
    static = Fp8Weight(down_q.weight, down_q.scale, torch.ones(1, device=DEVICE))
    with pytest.raises(KernelInputError, match="static input_scale"):
        fused_moe(x, gate_up_q, static, weights, ids)


def _gpu_fp8_case(num_tokens, num_experts, top_k, hidden, size, options=None):
    x, gate_up, down, weights, ids = _inputs(num_tokens, num_experts, top_k, hidden, size,
                                             torch.bfloat16)  # fmt: skip
    options = options(gate_up, down) if options else {}
    gate_up_q, down_q = _fp8_experts(gate_up), _fp8_experts(down)
    exact = reference.fused_moe(x.float(), _dequantized(gate_up_q, torch.float32),
                                _dequantized(down_q, torch.float32), weights, ids,
                                **{k: v.float() if isinstance(v, torch.Tensor) else v
                                   for k, v in options.items()})  # fmt: skip
    for tiles in (None, GEMV_TILES, DECODE_TILES, PREFILL_TILES, LONG_PREFILL_TILES):
        ours = fused_moe(x, gate_up_q, down_q, weights, ids, tiles, **options)
        if isinstance(tiles, GemvTiles):  # weight-only, rounded to bf16 where the loop rounds
            bf16 = reference.fused_moe(x, _dequantized(gate_up_q, torch.bfloat16),
                                       _dequantized(down_q, torch.bfloat16), weights, ids,
                                       **options)  # fmt: skip
            torch.testing.assert_close(ours, bf16, **TOLERANCE[torch.bfloat16])
        else:
            _assert_within_fp8_bound(ours, exact, MoeTiles(16, 16, 16, 4, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 64, 512, 2048])
def test_fp8_experts_match_the_loop_at_qwen3_30b_shapes_on_the_gpu(num_tokens):
    _gpu_fp8_case(num_tokens, 128, 8, 2048, 768)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 8, 512])
def test_fp8_gpt_oss_experts_match_the_loop_at_gpt_oss_20b_shapes_on_the_gpu(num_tokens):
    _gpu_fp8_case(num_tokens, 32, 4, 2880, 2880,
                  lambda gate_up, down: _gpt_oss_options(gate_up, down, limit=7.0))  # fmt: skip

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

from kernels import reference
from kernels.errors import KernelInputError
from kernels.moe import (
    DECODE_TILES,
    PREFILL_TILES,
    MoeTiles,
    align_block_size,
    fused_moe,
    tiles_for,
)
from kernels.moe_gemv import GEMV_TILES, GemvTiles
from kernels.ops import ClampedSwiglu

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
    assert tiles_for(4096, 8, 128) == PREFILL_TILES


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
    for tiles in (None, GEMV_TILES, DECODE_TILES, PREFILL_TILES):
        ours = fused_moe(x, gate_up, down, weights, ids, tiles, **options)
        torch.testing.assert_close(ours, expected, **TOLERANCE[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 8, 64, 512, 2048])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_moe_matches_the_loop_at_qwen3_30b_shapes_on_the_gpu(num_tokens, dtype):
    x, gate_up, down, weights, ids = _inputs(num_tokens, 128, 8, 2048, 768, dtype)
    expected = reference.fused_moe(x, gate_up, down, weights, ids)
    for tiles in (None, GEMV_TILES, DECODE_TILES, PREFILL_TILES):
        ours = fused_moe(x, gate_up, down, weights, ids, tiles=tiles)
        torch.testing.assert_close(ours, expected, **TOLERANCE[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 8, 512])
def test_gelu_tanh_experts_match_the_loop_at_gemma4_moe_sized_shapes_on_the_gpu(num_tokens):
    """Gemma 4's GELU-tanh experts at a 26B-A4B-sized block (128 experts, top 8, H 2816 and
    I 704: neither a multiple of the prefill tiles' 128), bf16."""
    x, gate_up, down, weights, ids = _inputs(num_tokens, 128, 8, 2816, 704, torch.bfloat16)
    expected = reference.fused_moe(x, gate_up, down, weights, ids, activation="gelu_tanh")
    for tiles in (None, GEMV_TILES, DECODE_TILES, PREFILL_TILES):
        ours = fused_moe(x, gate_up, down, weights, ids, tiles, activation="gelu_tanh")
        torch.testing.assert_close(ours, expected, **TOLERANCE[torch.bfloat16])

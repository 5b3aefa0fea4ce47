"""gpt-oss's attention sinks in the reference attention (the CPU path), against transformers'
own GptOss eager attention, and in the FP8-cache arithmetic."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import kernels.reference as ref
from kernels.launch_checks import KV_CACHE_FP8
from kernels.ops import AttentionMetadata

BLOCK_SIZE = 8
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 16
SEQ_LEN, QUERY_LEN = 37, 12  # a chunk: the last 12 of 37 tokens, the cache over 5 blocks
BLOCKS = [3, 0, 4, 1, 2]  # physically scattered


def _case(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(QUERY_LEN, NUM_HEADS, HEAD_DIM, generator=generator)
    k = torch.randn(SEQ_LEN, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    v = torch.randn(SEQ_LEN, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    sinks = 3.0 + torch.randn(NUM_HEADS, generator=generator)  # a third or more of the mass
    positions = torch.arange(SEQ_LEN)
    slots = torch.tensor(BLOCKS)[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    meta = AttentionMetadata.build(slots, torch.tensor([BLOCKS]), [SEQ_LEN], [QUERY_LEN])
    return q, k, v, sinks, slots, meta


def _cache(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (len(BLOCKS), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


def _transformers(q, k, v, sinks, scale: float, window: int | None) -> torch.Tensor:
    """transformers' GptOss eager attention on the whole sequence, the chunk's rows kept."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    q_pos = torch.arange(SEQ_LEN - QUERY_LEN, SEQ_LEN)[:, None]
    k_pos = torch.arange(SEQ_LEN)[None, :]
    seen = k_pos <= q_pos
    if window is not None:
        seen &= k_pos > q_pos - window
    mask = torch.zeros(seen.shape).masked_fill(~seen, float("-inf"))[None, None]
    module = SimpleNamespace(num_key_value_groups=NUM_HEADS // NUM_KV_HEADS, sinks=sinks)
    module.training = False
    out, _ = eager_attention_forward(
        module,
        q.transpose(0, 1)[None],  # [1, Hq, Tq, D]
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        mask,
        scaling=scale,
    )
    return out[0]  # [Tq, Hq, D]


@pytest.mark.parametrize("window", [None, 10])
def test_reference_attention_with_sinks_matches_transformers_gpt_oss(window):
    q, k, v, sinks, slots, meta = _case()
    k_cache, v_cache = _cache(torch.float32)
    ref.write_kv_cache(k, v, k_cache, v_cache, slots)
    scale = HEAD_DIM**-0.5
    ours = ref.paged_attention(q, k_cache, v_cache, meta, scale, window, sinks=sinks)
    theirs = _transformers(q, k, v, sinks, scale, window)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    without = ref.paged_attention(q, k_cache, v_cache, meta, scale, window)
    assert (without - theirs).abs().max() > 0.05, "the sinks should take probability mass"


def test_fp8_cache_attention_with_sinks_errs_no_more_than_without():
    """q and P rounded to e4m3 cost a few percent (test_fp8_attention bounds it); the sinks,
    joining the row maximum and the row sums, must add nothing to that."""
    q, k, v, sinks, slots, meta = _case(seed=1)
    scale, k_scale, v_scale = HEAD_DIM**-0.5, torch.tensor([0.02]), torch.tensor([0.015])
    k8, v8 = _cache(KV_CACHE_FP8)
    ref.write_kv_cache(k, v, k8, v8, slots, k_scale, v_scale)
    # The exact attention over the very keys and values the FP8 cache holds.
    k_exact, v_exact = k8.float() * k_scale, v8.float() * v_scale
    errors = []
    for with_sinks in (None, sinks):
        fp8 = ref.paged_attention(q, k8, v8, meta, scale, None, k_scale, v_scale, with_sinks)
        exact = ref.paged_attention(q, k_exact, v_exact, meta, scale, sinks=with_sinks)
        errors.append((fp8.float() - exact).abs().max().item())
    assert errors[1] < 1.5 * errors[0] and errors[1] < 0.06, f"FP8 errors {errors}"
    no_sinks = ref.paged_attention(q, k_exact, v_exact, meta, scale)
    assert (no_sinks - exact).abs().max() > 5 * errors[1], "the sinks should matter more"

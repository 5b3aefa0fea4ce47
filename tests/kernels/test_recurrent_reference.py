"""The reference linear-attention ops (`kernels.reference.causal_conv1d`, `gated_delta_rule`)
against transformers' own Qwen3.5 functions, applied to each sequence alone.

One flat batch holds sequences of different lengths, some continuing from a state left in
their slot by an earlier pass (`has_initial_state`), some starting fresh over a slot full of
stale values, beside padding rows (slot -1) that must output zeros and write nothing. Value
heads are twice the key heads (GQA, as Qwen3.6's 32 value over 16 key heads).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    causal_conv1d_fn,
    causal_conv1d_update,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from kernels import reference
from kernels.ops import RecurrentStateMetadata

NUM_SLOTS = 6
# (query_len, slot, has_initial_state); slot -1 is a padding row.
BATCH = [(7, 4, False), (1, 0, True), (13, 2, True), (1, -1, False), (3, 5, False), (1, 1, True)]
DECODE_BATCH = [(1, 3, True), (1, -1, False), (1, 0, True)]


def _meta(batch: list[tuple[int, int, bool]]) -> RecurrentStateMetadata:
    lens = [n for n, _, _ in batch]
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return RecurrentStateMetadata(
        state_slots=torch.tensor([s for _, s, _ in batch], dtype=torch.int32),
        has_initial_state=torch.tensor([h for _, _, h in batch]),
        query_start_loc=starts,
        query_lens=lens,
        decode_only=all(n == 1 for n in lens),
    )


def _rows(batch: list[tuple[int, int, bool]]):
    start = 0
    for n, slot, has_initial in batch:
        yield slice(start, start + n), slot, has_initial
        start += n


@pytest.mark.parametrize("batch", [BATCH, DECODE_BATCH], ids=["mixed", "decode"])
def test_causal_conv1d_matches_transformers_per_sequence(batch):
    torch.manual_seed(0)
    channels, width = 12, 4
    num_tokens = sum(n for n, _, _ in batch)
    x = torch.randn(num_tokens, channels)
    weight, bias = torch.randn(channels, width), torch.randn(channels)
    state = torch.randn(NUM_SLOTS, channels, width - 1)  # stale values in every slot
    before = state.clone()

    out = reference.causal_conv1d(x, weight, bias, state, _meta(batch))

    used = set()
    for rows, slot, has_initial in _rows(batch):
        if slot < 0:
            assert not out[rows].any(), "a padding row outputs zeros"
            continue
        used.add(slot)
        xs = x[rows].t()[None]  # [1, D, n]
        if has_initial:
            conv_state = before[slot][None].clone()
            expected = causal_conv1d_update(xs, conv_state, weight, bias, "silu")
        else:
            expected = causal_conv1d_fn(xs, weight, bias, activation="silu")
            conv_state = F.pad(xs, (width - 1, 0))[..., -(width - 1) :]
        torch.testing.assert_close(out[rows], expected[0].t(), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(state[slot], conv_state[0], atol=0, rtol=0)
    for slot in set(range(NUM_SLOTS)) - used:
        assert torch.equal(state[slot], before[slot]), f"slot {slot} is nobody's: unchanged"


def _delta_inputs(num_tokens: int):
    torch.manual_seed(1)
    num_k_heads, num_v_heads, key_dim, value_dim = 2, 4, 8, 6
    q = torch.randn(num_tokens, num_k_heads, key_dim)
    k = torch.randn(num_tokens, num_k_heads, key_dim)
    v = torch.randn(num_tokens, num_v_heads, value_dim)
    g = -F.softplus(torch.randn(num_tokens, num_v_heads))  # log-decay <= 0
    beta = torch.rand(num_tokens, num_v_heads)
    state = torch.randn(NUM_SLOTS, num_v_heads, key_dim, value_dim)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("batch", [BATCH, DECODE_BATCH], ids=["mixed", "decode"])
@pytest.mark.parametrize("theirs", [torch_recurrent_gated_delta_rule, torch_chunk_gated_delta_rule])
def test_gated_delta_rule_matches_transformers_per_sequence(batch, theirs):
    num_tokens = sum(n for n, _, _ in batch)
    q, k, v, g, beta, state = _delta_inputs(num_tokens)
    before = state.clone()

    out = reference.gated_delta_rule(q, k, v, g, beta, state, _meta(batch))

    used = set()
    for rows, slot, has_initial in _rows(batch):
        if slot < 0:
            assert not out[rows].any(), "a padding row outputs zeros"
            continue
        used.add(slot)
        kwargs = {"chunk_size": 4} if theirs is torch_chunk_gated_delta_rule else {}
        expected, final = theirs(
            q[rows][None], k[rows][None], v[rows][None], g[rows][None], beta[rows][None],
            initial_state=before[slot][None].clone() if has_initial else None,
            output_final_state=True, use_qk_l2norm_in_kernel=True, **kwargs,
        )  # fmt: skip
        torch.testing.assert_close(out[rows], expected[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state[slot], final[0], atol=1e-5, rtol=1e-5)
    for slot in set(range(NUM_SLOTS)) - used:
        assert torch.equal(state[slot], before[slot]), f"slot {slot} is nobody's: unchanged"


def test_gated_delta_rule_continues_a_sequence_split_over_passes():
    """A 13-token prompt in one pass equals the same prompt as 5 + 8 tokens, the second pass
    starting from the state the first left (chunked prefill)."""
    q, k, v, g, beta, state = _delta_inputs(13)
    whole = reference.gated_delta_rule(q, k, v, g, beta, state.clone(), _meta([(13, 0, False)]))
    first = reference.gated_delta_rule(*(t[:5] for t in (q, k, v, g, beta)), state,
                                       _meta([(5, 0, False)]))  # fmt: skip
    second = reference.gated_delta_rule(*(t[5:] for t in (q, k, v, g, beta)), state,
                                        _meta([(8, 0, True)]))  # fmt: skip
    torch.testing.assert_close(torch.cat([first, second]), whole, atol=1e-6, rtol=1e-6)

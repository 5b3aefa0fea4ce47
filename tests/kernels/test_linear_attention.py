"""The linear-attention kernels (`kernels.causal_conv1d`, `kernels.gated_delta_rule`) against
transformers' own Qwen3.5 functions (`causal_conv1d_fn`, `causal_conv1d_update`,
`torch_recurrent_gated_delta_rule`), applied sequence by sequence to each slot's state.

On the CPU the kernels run in Triton's interpreter on tiny shapes, in float32 and float16 (the
3.9 interpreter computes bfloat16 `tl.dot` wrongly); the `gpu` tests run Qwen3.6-35B-A3B's
shapes (16 key heads x 128, 32 value heads x 128, conv kernel 4: Qwen3_5MoeTextConfig's
defaults) in bfloat16, and a decode step replayed in a CUDA graph.

Tolerances, against the float32 reference on the same (rounded) inputs, relative to the
largest reference value (a normalised q over Dk ** 0.5 makes outputs small, about 0.05 at
Qwen3.6's shapes, where a fixed absolute tolerance would pass zeros): float32 1e-4 (the
chunked form sums in another order than the token loop); float16 2e-3 (one output ulp);
bfloat16 1e-2 (one ulp, and the chunked kernel's products in tf32: emulated in torch at
Qwen3.6's shapes over 2,048 tokens, tf32 operands cost 3e-3 of the largest output and 7e-4 of
the largest state entry). States are float32 always; their tolerance is the inputs'.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    causal_conv1d_fn,
    causal_conv1d_update,
    torch_recurrent_gated_delta_rule,
)

from kernels import triton_ops
from kernels.errors import KernelInputError
from kernels.ops import RecurrentStateMetadata

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}
NUM_SLOTS = 6


def assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """Every element within tol * |expected| + tol * max |expected|."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual.float(), expected, atol=tol * scale, rtol=tol)


def make_meta(
    query_lens: list[int], slots: list[int], has_initial: list[bool], device: str = DEVICE
) -> RecurrentStateMetadata:
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return RecurrentStateMetadata(
        state_slots=torch.tensor(slots, dtype=torch.int32, device=device),
        has_initial_state=torch.tensor(has_initial, dtype=torch.bool, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        query_lens=query_lens,
        decode_only=all(n == 1 for n in query_lens),
    )


def sequences(meta: RecurrentStateMetadata) -> list[tuple[slice, int, bool]]:
    """(rows, slot, has_initial_state) of each sequence."""
    starts = meta.query_start_loc.tolist()
    return [
        (slice(starts[b], starts[b + 1]), slot, has_initial)
        for b, (slot, has_initial) in enumerate(
            zip(meta.state_slots.tolist(), meta.has_initial_state.tolist(), strict=True)
        )
    ]


# --- the gated delta rule ---


@dataclass(frozen=True)
class DeltaRuleCase:
    q: torch.Tensor  # [T, Hk, Dk]
    k: torch.Tensor  # [T, Hk, Dk]
    v: torch.Tensor  # [T, Hv, Dv]
    g: torch.Tensor  # [T, Hv] float32, <= 0
    beta: torch.Tensor  # [T, Hv] float32 in (0, 1)
    state: torch.Tensor  # [num_slots, Hv, Dk, Dv] float32
    meta: RecurrentStateMetadata

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' token loop per sequence: (outputs [T, Hv, Dv], states afterwards)."""
        out = torch.zeros(self.v.shape, dtype=torch.float32, device=self.v.device)
        state = self.state.clone()
        # Each value head's own key head, as GQA reads it (h // (Hv / Hk)): older transformers
        # (the GPU machine's) take only as many key heads as value heads.
        q, k = (x.repeat_interleave(self.v.shape[1] // x.shape[1], dim=1) for x in (self.q, self.k))
        for rows, slot, has_initial in sequences(self.meta):
            if slot < 0:
                continue
            o, final = torch_recurrent_gated_delta_rule(
                *(x[rows][None].float() for x in (q, k, self.v, self.g, self.beta)),
                initial_state=state[slot][None] if has_initial else None,
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
            )
            out[rows] = o[0]
            state[slot] = final[0]
        return out, state


def make_delta_rule_case(
    query_lens: list[int],
    slots: list[int],
    has_initial: list[bool],
    *,
    num_k_heads: int = 2,
    num_v_heads: int = 4,
    k_dim: int = 16,
    v_dim: int = 32,
    dtype: torch.dtype = torch.float32,
    num_slots: int = NUM_SLOTS,
    seed: int = 0,
) -> DeltaRuleCase:
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(query_lens)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    # Decays as the model makes them: -exp(A) * softplus(a + dt_bias), so mostly near 0.
    g = -torch.exp(rand(num_v_heads) * 0.5) * F.softplus(rand(num_tokens, num_v_heads))
    return DeltaRuleCase(
        q=rand(num_tokens, num_k_heads, k_dim).to(DEVICE, dtype),
        k=rand(num_tokens, num_k_heads, k_dim).to(DEVICE, dtype),
        v=rand(num_tokens, num_v_heads, v_dim).to(DEVICE, dtype),
        g=g.to(DEVICE),
        beta=torch.sigmoid(rand(num_tokens, num_v_heads)).to(DEVICE),
        state=(rand(num_slots, num_v_heads, k_dim, v_dim) * 0.1).to(DEVICE),
        meta=make_meta(query_lens, slots, has_initial),
    )


def assert_delta_rule_matches(case: DeltaRuleCase, **knobs: int) -> None:
    expected_out, expected_state = case.reference()
    state = case.state.clone()
    out = triton_ops.gated_delta_rule(
        case.q, case.k, case.v, case.g, case.beta, state, case.meta, **knobs
    )
    tol = TOLERANCE[case.v.dtype]
    assert out.dtype == case.v.dtype
    assert_close_to_scale(out, expected_out, tol)
    # Every slot: the batch's are updated, the others untouched (padding rows write nothing).
    assert_close_to_scale(state, expected_state, tol)


# Sequences of different lengths in one batch (a single-token one, and lengths that end one
# row before, on and one row after a chunk boundary), scattered over the slots, with and
# without initial state.
PREFILL_LENS = [1, 16, 17]
PREFILL_SLOTS = [0, 5, 1]
PREFILL_INITIAL = [True, True, False]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_chunked_prefill_of_ragged_batch_matches_transformers(dtype: torch.dtype) -> None:
    case = make_delta_rule_case(
        PREFILL_LENS, PREFILL_SLOTS, PREFILL_INITIAL, num_k_heads=1, num_v_heads=2, dtype=dtype
    )
    assert not case.meta.decode_only
    assert_delta_rule_matches(case, chunk_size=16, block_v=16)  # two chunks, two Dv tiles


def test_chunked_prefill_with_default_chunk_crosses_a_chunk_boundary() -> None:
    case = make_delta_rule_case([70, 3], [2, 0], [True, False], num_k_heads=1, num_v_heads=2)
    assert_delta_rule_matches(case)


def test_chunked_prefill_with_as_many_key_as_value_heads_and_padding_row() -> None:
    case = make_delta_rule_case(
        [9, 4, 6], [1, -1, 2], [True, False, False], num_k_heads=4, num_v_heads=4, v_dim=16
    )
    expected_out, _ = case.reference()
    assert expected_out[9:13].abs().max() == 0  # the padding row's outputs are zeros
    assert_delta_rule_matches(case, chunk_size=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_step_with_padding_rows_matches_transformers(dtype: torch.dtype) -> None:
    case = make_delta_rule_case(
        [1, 1, 1, 1, 1], [2, -1, 0, 5, -1], [True, False, True, False, False], dtype=dtype
    )
    assert case.meta.decode_only
    assert_delta_rule_matches(case, block_v=16)  # two Dv tiles per value head


def test_prefill_then_decode_steps_continue_the_state_of_a_whole_sequence_run() -> None:
    whole = make_delta_rule_case([20], [4], [False], seed=1)
    expected_out, expected_state = whole.reference()
    state = whole.state.clone()
    out = [triton_ops.gated_delta_rule(
        whole.q[:17], whole.k[:17], whole.v[:17], whole.g[:17], whole.beta[:17], state,
        make_meta([17], [4], [False]), chunk_size=16,
    )]  # fmt: skip
    for t in range(17, 20):
        rows = slice(t, t + 1)
        out.append(triton_ops.gated_delta_rule(
            whole.q[rows], whole.k[rows], whole.v[rows], whole.g[rows], whole.beta[rows], state,
            make_meta([1], [4], [True]),
        ))  # fmt: skip
    assert_close_to_scale(torch.cat(out), expected_out, 1e-4)
    assert_close_to_scale(state, expected_state, 1e-4)


def test_delta_rule_rejects_g_not_float32_naming_it() -> None:
    case = make_delta_rule_case([2], [0], [False])
    with pytest.raises(KernelInputError, match=r"^g must be"):
        triton_ops.gated_delta_rule(
            case.q, case.k, case.v, case.g.half(), case.beta, case.state, case.meta
        )


def test_delta_rule_rejects_state_of_another_head_shape() -> None:
    case = make_delta_rule_case([2], [0], [False])
    with pytest.raises(KernelInputError, match=r"^state must be"):
        triton_ops.gated_delta_rule(
            case.q, case.k, case.v, case.g, case.beta, case.state[:, :2].contiguous(), case.meta
        )


def test_delta_rule_rejects_metadata_of_another_batch_size() -> None:
    case = make_delta_rule_case([2, 1], [0, 1], [False, False])
    meta = make_meta([3], [0], [False])
    meta = RecurrentStateMetadata(
        state_slots=case.meta.state_slots,
        has_initial_state=meta.has_initial_state,
        query_start_loc=case.meta.query_start_loc,
        query_lens=case.meta.query_lens,
        decode_only=False,
    )
    with pytest.raises(KernelInputError, match="has_initial_state"):
        triton_ops.gated_delta_rule(case.q, case.k, case.v, case.g, case.beta, case.state, meta)


# --- the causal convolution ---


@dataclass(frozen=True)
class ConvCase:
    x: torch.Tensor  # [T, D]
    weight: torch.Tensor  # [D, K]
    bias: torch.Tensor | None  # [D]
    conv_state: torch.Tensor  # [num_slots, D, K - 1]
    meta: RecurrentStateMetadata

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' convolution per sequence: (outputs [T, D], states afterwards)."""
        weight, bias = self.weight.float(), None if self.bias is None else self.bias.float()
        out = torch.zeros(self.x.shape, dtype=torch.float32, device=self.x.device)
        state = self.conv_state.float().clone()  # updated in place below
        for rows, slot, has_initial in sequences(self.meta):
            if slot < 0:
                continue
            x = self.x[rows].float().T[None]  # [1, D, L]
            if has_initial:
                out[rows] = causal_conv1d_update(x, state[slot][None], weight, bias, "silu")[0].T
                continue
            out[rows] = causal_conv1d_fn(x, weight, bias, activation="silu")[0].T
            fresh = torch.zeros_like(state[slot][None])
            causal_conv1d_update(x, fresh, weight, bias)  # only for the state it leaves
            state[slot] = fresh[0]
        return out, state


def make_conv_case(
    query_lens: list[int],
    slots: list[int],
    has_initial: list[bool],
    *,
    dim: int = 48,
    kernel_size: int = 4,
    dtype: torch.dtype = torch.float32,
    with_bias: bool = False,
    num_slots: int = NUM_SLOTS,
) -> ConvCase:
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    return ConvCase(
        x=rand(sum(query_lens), dim),
        weight=rand(dim, kernel_size) * 0.5,
        bias=rand(dim) if with_bias else None,
        conv_state=rand(num_slots, dim, kernel_size - 1),
        meta=make_meta(query_lens, slots, has_initial),
    )


def assert_conv_matches(case: ConvCase) -> None:
    expected_out, expected_state = case.reference()
    conv_state = case.conv_state.clone()
    out = triton_ops.causal_conv1d(case.x, case.weight, case.bias, conv_state, case.meta)
    tol = TOLERANCE[case.x.dtype]
    assert_close_to_scale(out, expected_out, tol)
    assert_close_to_scale(conv_state, expected_state, tol)


@pytest.mark.parametrize(("dtype", "with_bias"), [(torch.float32, False), (torch.float16, True)])
def test_conv_prefill_of_ragged_batch_matches_transformers(
    dtype: torch.dtype, with_bias: bool
) -> None:
    # Sequences shorter than K - 1 keep part of their old state (or of the zeros before them).
    case = make_conv_case(
        [5, 1, 2, 20, 3], [3, 0, 5, 1, 4], [False, True, False, True, True],
        dtype=dtype, with_bias=with_bias, dim=300,  # two channel blocks, the second partial
    )  # fmt: skip
    assert_conv_matches(case)


def test_conv_decode_step_with_padding_rows_matches_transformers() -> None:
    case = make_conv_case([1, 1, 1, 1], [4, -1, 1, 2], [True, False, True, False], with_bias=True)
    assert case.meta.decode_only
    assert_conv_matches(case)


def test_conv_rejects_state_in_another_dtype_naming_it() -> None:
    case = make_conv_case([2], [0], [False])
    with pytest.raises(KernelInputError, match=r"^conv_state must be"):
        triton_ops.causal_conv1d(case.x, case.weight, None, case.conv_state.half(), case.meta)


# --- Qwen3.6-35B-A3B's shapes on the GPU ---

QWEN36 = {"num_k_heads": 16, "num_v_heads": 32, "k_dim": 128, "v_dim": 128}
QWEN36_CONV_DIM = 2 * 16 * 128 + 32 * 128  # q, k and v go through the convolution together


@pytest.mark.gpu
@pytest.mark.parametrize("has_initial", [False, True])
def test_prefill_at_qwen36_shapes_matches_transformers(has_initial: bool) -> None:
    lens = [1, 63, 64, 65, 700, 2048]
    slots = [7, 2, 0, 5, 3, 9]
    case = make_delta_rule_case(
        lens, slots, [has_initial] * len(lens), dtype=torch.bfloat16, num_slots=10, **QWEN36
    )
    assert_delta_rule_matches(case)
    conv = make_conv_case(
        lens, slots, [has_initial] * len(lens), dim=QWEN36_CONV_DIM, dtype=torch.bfloat16,
        num_slots=10,
    )  # fmt: skip
    assert_conv_matches(conv)


@pytest.mark.gpu
def test_decode_batch_with_padding_rows_at_qwen36_shapes_matches_transformers() -> None:
    slots = [s if s % 5 else -1 for s in range(64)]  # every fifth row is padding
    case = make_delta_rule_case(
        [1] * 64, slots, [s % 3 != 0 for s in range(64)], dtype=torch.bfloat16, num_slots=64,
        **QWEN36,
    )  # fmt: skip
    assert_delta_rule_matches(case)
    conv = make_conv_case(
        [1] * 64, slots, [s % 3 != 0 for s in range(64)], dim=QWEN36_CONV_DIM,
        dtype=torch.bfloat16, num_slots=64,
    )  # fmt: skip
    assert_conv_matches(conv)


@pytest.mark.gpu
def test_decode_step_replayed_in_cuda_graph_follows_rewritten_inputs() -> None:
    """Captured once, replayed after the inputs and the metadata are rewritten in place (new
    tokens, other slots, a padding row): the replay gives what an eager step gives."""
    num_seqs = 8
    first = make_delta_rule_case([1] * num_seqs, list(range(num_seqs)), [True] * num_seqs,
                                 dtype=torch.bfloat16, num_slots=16, **QWEN36)  # fmt: skip
    conv = make_conv_case([1] * num_seqs, list(range(num_seqs)), [True] * num_seqs,
                          dim=QWEN36_CONV_DIM, dtype=torch.bfloat16, num_slots=16)  # fmt: skip
    static = {name: getattr(first, name).clone() for name in ("q", "k", "v", "g", "beta")}
    x, conv_state, state, meta = (
        conv.x.clone(),
        conv.conv_state.clone(),
        first.state.clone(),
        first.meta,
    )

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        mixed = triton_ops.causal_conv1d(x, conv.weight, None, conv_state, meta)
        o = triton_ops.gated_delta_rule(static["q"], static["k"], static["v"], static["g"],
                                        static["beta"], state, meta)  # fmt: skip
        return mixed, o

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mixed_out, delta_out = step()

    second = make_delta_rule_case([1] * num_seqs, [9, 3, -1, 12, 0, 15, 1, 4],
                                  [True, False, False, True, True, True, False, True],
                                  dtype=torch.bfloat16, num_slots=16, seed=7, **QWEN36)  # fmt: skip
    for name, tensor in static.items():
        tensor.copy_(getattr(second, name))
    x.copy_(torch.randn_like(x))
    meta.state_slots.copy_(second.meta.state_slots)
    meta.has_initial_state.copy_(second.meta.has_initial_state)
    expected_state, expected_conv_state = state.clone(), conv_state.clone()
    expected_delta = triton_ops.gated_delta_rule(
        *(static[n] for n in ("q", "k", "v", "g", "beta")), expected_state, second.meta
    )
    expected_mixed = triton_ops.causal_conv1d(
        x, conv.weight, None, expected_conv_state, second.meta
    )
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(delta_out, expected_delta) and torch.equal(mixed_out, expected_mixed)
    assert torch.equal(state, expected_state) and torch.equal(conv_state, expected_conv_state)

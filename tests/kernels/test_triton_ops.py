"""The Triton backend's attention routing (`kernels.triton_ops.paged_attention`) against the
reference: a mixed batch's leading decode rows go through the decode kernel, the rest through
the prefill kernel, and together they give the reference's output; with the decode rows
counted on the device (a prompt graph's metadata), the same output to the bit (Triton's
interpreter on the CPU, tiny shapes; the kernels themselves are tested in their own files)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kernels import triton_ops
from kernels.ops import AttentionMetadata
from kernels.reference import paged_attention, quantize_kv

from .fp8_attention_bounds import assert_fp8_attention_close
from .test_prefill_attention import TOLERANCE, make_case

# Three decode rows first (as the scheduler places running sequences), then a prompt chunk, an
# extend over a cached prefix and one more decode row that stays with the prefill kernel.
QUERY_LENS = [1, 1, 1, 9, 5, 1]
NUM_CACHED = [20, 3, 40, 0, 17, 33]


@pytest.fixture
def decode_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of query rows of each decode-kernel launch."""
    calls: list[int] = []
    launch = triton_ops.paged_decode_attention

    def recording(q: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(q.shape[0])
        return launch(q, *args, **kwargs)

    monkeypatch.setattr(triton_ops, "paged_decode_attention", recording)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mixed_batch_runs_leading_decodes_in_the_decode_kernel_and_matches_reference(
    dtype: torch.dtype, decode_calls: list[int]
) -> None:
    case = make_case(QUERY_LENS, NUM_CACHED, num_q_heads=8, num_kv_heads=2, head_dim=16,
                     dtype=dtype)  # fmt: skip
    assert case.meta.num_leading_decodes == 3 and not case.meta.decode_only
    out = triton_ops.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert decode_calls == [3]
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), case.reference(), atol=tol, rtol=tol)


def test_mixed_batch_over_fp8_cache_with_a_window_stays_within_its_bounds(
    decode_calls: list[int],
) -> None:
    case = make_case(QUERY_LENS, NUM_CACHED, num_q_heads=4, num_kv_heads=1, head_dim=16,
                     dtype=torch.float16)  # fmt: skip
    device = case.q.device
    scales = {"k_scale": torch.tensor([0.02], device=device),
              "v_scale": torch.tensor([0.5], device=device)}  # fmt: skip
    k_fp8 = quantize_kv(case.k_cache, scales["k_scale"])
    v_fp8 = quantize_kv(case.v_cache, scales["v_scale"])
    window = 16
    out = triton_ops.paged_attention(case.q, k_fp8, v_fp8, case.meta, case.scale, window, **scales)
    assert decode_calls == [3]
    fp8_reference = paged_attention(case.q.float(), k_fp8, v_fp8, case.meta, case.scale, window,
                                    **scales)  # fmt: skip
    exact = replace(
        case, k_cache=k_fp8.float() * scales["k_scale"], v_cache=v_fp8.float() * scales["v_scale"]
    ).reference(window)
    assert_fp8_attention_close(out, fp8_reference, exact, output_atol=TOLERANCE[torch.float16])


def test_batch_opening_with_a_prefill_runs_only_the_prefill_kernel(
    decode_calls: list[int],
) -> None:
    case = make_case([4, 1, 1], [0, 10, 20], num_q_heads=4, num_kv_heads=2, head_dim=16,
                     dtype=torch.float32)  # fmt: skip
    assert case.meta.num_leading_decodes == 0
    out = triton_ops.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert decode_calls == []
    torch.testing.assert_close(out, case.reference(), atol=1e-5, rtol=1e-5)


def test_mixed_batch_with_attention_sinks_gives_them_to_both_kernels(
    decode_calls: list[int],
) -> None:
    case = make_case(QUERY_LENS, NUM_CACHED, num_q_heads=8, num_kv_heads=2, head_dim=16,
                     dtype=torch.float32)  # fmt: skip
    sinks = 3.0 + torch.randn(8, generator=torch.Generator().manual_seed(5)).to(case.q.device)
    out = triton_ops.paged_attention(
        case.q, case.k_cache, case.v_cache, case.meta, case.scale, 9, sinks=sinks
    )
    assert decode_calls == [3]
    torch.testing.assert_close(out, case.reference(9, sinks), atol=1e-5, rtol=1e-5)


def _counted_on_the_device(meta: AttentionMetadata, count: int) -> AttentionMetadata:
    """`meta` as a prompt graph's: the decode rows counted on the device, the host's count not
    read (set past every row, so a backend that read it would go wrong)."""
    device_decodes = torch.tensor([count], dtype=torch.int32, device=meta.seq_lens_t.device)
    return replace(meta, device_decodes=device_decodes, num_leading_decodes=len(meta.query_lens))


@pytest.mark.parametrize(
    ("query_lens", "num_cached"),
    [(QUERY_LENS, NUM_CACHED), ([4, 1, 1], [0, 10, 20]), ([1, 1], [5, 40])],
    ids=["mixed", "prefill-first", "decodes-only"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_rows_counted_on_the_device_give_the_host_routing_bit_for_bit(
    query_lens: list[int], num_cached: list[int], dtype: torch.dtype, decode_calls: list[int]
) -> None:
    case = make_case(query_lens, num_cached, num_q_heads=8, num_kv_heads=2, head_dim=16,
                     dtype=dtype)  # fmt: skip
    meta = replace(case.meta, decode_only=False)  # as a prompt graph captures it
    host = triton_ops.paged_attention(case.q, case.k_cache, case.v_cache, meta, case.scale)
    decode_calls.clear()
    counted = _counted_on_the_device(meta, case.meta.num_leading_decodes)
    out = triton_ops.paged_attention(case.q, case.k_cache, case.v_cache, counted, case.scale)
    assert decode_calls == [len(query_lens)]  # the decode kernel spans every sequence
    assert torch.equal(out, host)


def test_decode_rows_counted_on_the_device_over_fp8_with_a_window_and_sinks() -> None:
    case = make_case(QUERY_LENS, NUM_CACHED, num_q_heads=4, num_kv_heads=1, head_dim=16,
                     dtype=torch.float16)  # fmt: skip
    device = case.q.device
    layer = {
        "k_scale": torch.tensor([0.02], device=device),
        "v_scale": torch.tensor([0.5], device=device),
        "sinks": 3.0 + torch.randn(4, generator=torch.Generator().manual_seed(5)).to(device),
    }
    k_fp8 = quantize_kv(case.k_cache, layer["k_scale"])
    v_fp8 = quantize_kv(case.v_cache, layer["v_scale"])
    host = triton_ops.paged_attention(case.q, k_fp8, v_fp8, case.meta, case.scale, 16, **layer)
    counted = _counted_on_the_device(case.meta, 3)
    out = triton_ops.paged_attention(case.q, k_fp8, v_fp8, counted, case.scale, 16, **layer)
    assert torch.equal(out, host)

"""The fused rotary + KV-cache store (`kernels.rotary_kv_write`) against the reference's two
steps (`kernels.reference.rotary_write_kv`): the rotated q in place, the rotated keys and the
values in the cache, padding and out-of-range slots skipped, FP8 bytes equal.

Off the GPU the kernel runs in Triton's interpreter (tests/conftest.py) on tiny shapes.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kernels import reference
from kernels.rotary_kv_write import rotary_write_kv
from tests.kernels.test_elementwise import DEVICE, TOLERANCE, _llama_cos_sin, _seed


def _inputs(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, device):
    """q, k, v as views of one fused qkv output, as the model makes them."""
    qkv = torch.randn(
        num_tokens, num_q_heads + 2 * num_kv_heads, head_dim, dtype=dtype, device=device
    )
    q = qkv[:, :num_q_heads]
    k = qkv[:, num_q_heads : num_q_heads + num_kv_heads]
    v = qkv[:, num_q_heads + num_kv_heads :]
    return q, k, v


def _check(
    num_tokens: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    *,
    padding: int = 0,
) -> None:
    _seed("rope-kv", num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, padding)
    q, k, v = _inputs(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, device)
    cos, sin = _llama_cos_sin(num_tokens, head_dim, device)
    block_size = 16
    num_blocks = num_tokens // block_size + 2
    cache = torch.randn(
        2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device
    )
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    slots[:padding] = -1
    k_before = k.clone()
    expected_cache = cache.clone()
    q_expected = reference.rotary_write_kv(
        q.clone(), k.clone(), v, cos, sin, *expected_cache, slots
    )

    q_out = rotary_write_kv(q, k, v, cos, sin, *cache, slots)

    assert q_out is q
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(q, q_expected, **tolerance)
    torch.testing.assert_close(cache, expected_cache, **tolerance)
    assert torch.equal(k, k_before)  # the cache holds the rotation, k does not


@pytest.mark.parametrize(
    ("num_tokens", "num_q_heads", "num_kv_heads", "head_dim"),
    [(1, 2, 1, 16), (5, 3, 1, 32), (33, 4, 2, 16)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotary_write_kv_matches_the_reference_two_steps(
    num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    _check(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, DEVICE)


def test_padding_and_slots_past_the_cache_are_never_written() -> None:
    _seed("rope-kv-slots")
    q, k, v = _inputs(4, 2, 2, 16, torch.float32, DEVICE)
    cos, sin = _llama_cos_sin(4, 16, DEVICE)
    k_cache = torch.zeros(2, 16, 2, 16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([-1, 32, 10**6, -5], device=DEVICE)  # 32 slots in the cache

    rotary_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots)

    assert not k_cache.any() and not v_cache.any()


def test_an_fp8_cache_stores_the_references_bytes() -> None:
    """Values that are e4m3 values times the scales (the interpreter converts those exactly,
    as tests/kernels/test_elementwise.py's FP8 write says), some past e4m3's range."""
    _seed("rope-kv-fp8")
    num_tokens, heads, head_dim = 9, 2, 32
    q, k, v = _inputs(num_tokens, 4, heads, head_dim, torch.float32, DEVICE)
    # cos = 1, sin = 0: the rotation keeps k's values, so the stored bytes are exact.
    cos = torch.ones(num_tokens, head_dim, device=DEVICE)
    sin = torch.zeros(num_tokens, head_dim, device=DEVICE)
    k_scale, v_scale = torch.tensor([0.0625], device=DEVICE), torch.tensor([2.0], device=DEVICE)
    k.copy_((10 * torch.randn_like(k)).to(torch.float8_e4m3fn).float() * k_scale)
    k[0, 0, :2] = torch.tensor([1e4, -1e4])  # far past the range
    v.copy_((10 * torch.randn_like(v)).to(torch.float8_e4m3fn).float() * v_scale)
    shape = (2, 16, heads, head_dim)
    caches = [torch.zeros(shape, dtype=torch.float8_e4m3fn, device=DEVICE) for _ in range(4)]
    slots = torch.randperm(32, device=DEVICE)[:num_tokens]
    reference.rotary_write_kv(
        q.clone(), k, v, cos, sin, caches[0], caches[1], slots, k_scale, v_scale
    )

    rotary_write_kv(q, k, v, cos, sin, caches[2], caches[3], slots, k_scale, v_scale)

    assert (caches[2].float().abs() == 448).any()  # saturated, not NaN
    for got, expected in ((caches[2], caches[0]), (caches[3], caches[1])):
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("num_tokens", "num_q_heads", "num_kv_heads", "head_dim", "dtype"),
    [
        *itertools.product([1, 5, 300], [32], [8], [128], [torch.bfloat16, torch.float16]),
        (33, 9, 3, 64, torch.bfloat16),  # SmolLM2-135M
        (33, 64, 8, 128, torch.float32),  # more query heads than one tile
        (7, 8, 1, 96, torch.bfloat16),  # half of D not a power of two
    ],
)
def test_rotary_write_kv_matches_the_reference_at_serving_shapes(
    num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    _check(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, "cuda", padding=1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rotary_write_kv_rounds_to_fp8_bytes_equal_to_the_reference_on_gpu(
    dtype: torch.dtype,
) -> None:
    """Random values (FP8 rounding included): the rotated key is rounded to the model's dtype
    before it is quantized, as the reference's two steps round it."""
    torch.manual_seed(0)
    q, k, v = _inputs(257, 32, 8, 128, dtype, "cuda")
    k.mul_(20)
    cos, sin = _llama_cos_sin(257, 128, "cuda")
    scales = torch.tensor([0.05], device="cuda"), torch.tensor([0.5], device="cuda")
    shape = (20, 16, 8, 128)
    caches = [torch.zeros(shape, dtype=torch.float8_e4m3fn, device="cuda") for _ in range(4)]
    slots = torch.randperm(320, device="cuda")[:257]
    reference.rotary_write_kv(q.clone(), k, v, cos, sin, caches[0], caches[1], slots, *scales)

    rotary_write_kv(q, k, v, cos, sin, caches[2], caches[3], slots, *scales)

    for got, expected in ((caches[2], caches[0]), (caches[3], caches[1])):
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.gpu
def test_a_cache_past_two_to_the_31_elements_is_written_at_its_last_slot() -> None:
    """32 KV heads of 128 (4,096 elements a slot) and 524,304 slots: 2**31 + 65,536 elements
    in each FP8 cache (2 GiB). The last slot's offset needs 64 bits, as does the bound."""
    torch.manual_seed(0)
    q, k, v = _inputs(1, 32, 32, 128, torch.bfloat16, "cuda")
    cos, sin = _llama_cos_sin(1, 128, "cuda")
    shape = (32769, 16, 32, 128)
    k_cache = torch.zeros(shape, dtype=torch.float8_e4m3fn, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    assert k_cache.numel() > 2**31
    scales = torch.ones(1, device="cuda"), torch.ones(1, device="cuda")
    last = torch.tensor([32769 * 16 - 1], device="cuda")

    rotary_write_kv(q, k, v, cos, sin, k_cache, v_cache, last, *scales)

    expected = v[0].float().to(torch.float8_e4m3fn)
    assert torch.equal(v_cache[-1, -1].view(torch.uint8), expected.view(torch.uint8))
    assert k_cache[-1, -1].float().abs().sum() > 0

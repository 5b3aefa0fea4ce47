"""The non-attention Triton kernels against `kernels.reference`, on fresh random inputs.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py), so the unmarked cases
are tiny; the `gpu` cases cover serving shapes (Llama-3-8B: H=4096, Hkv=8, D=128, I=14336).
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Callable

import pytest
import torch

from kernels import reference
from kernels.activation import gelu_tanh_and_mul, silu_and_mul
from kernels.errors import KernelInputError
from kernels.kv_cache_write import write_kv_cache
from kernels.rmsnorm import add_rms_norm, rms_norm
from kernels.rotary import rotary_embedding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# The kernels round where the reference rounds, so differences are float32 evaluation order
# (FMA, exp, rsqrt) that can flip the last bit of a half-precision result.
TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 1e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1e-2, "rtol": 2e-2},
}


# Triton's interpreter (3.6 and 3.9) truncates float32 -> bfloat16 casts where the GPU rounds to
# nearest even, so off-GPU a bfloat16 rounding step can differ from torch's by one unit.
INTERPRETED = not torch.cuda.is_available()


def _assert_close(
    actual: torch.Tensor, expected: torch.Tensor, rounded_to: torch.dtype | None = None
) -> None:
    """Compare at the tolerance of `rounded_to`, the narrowest dtype rounded through."""
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, **TOLERANCE[rounded_to or expected.dtype])


def _seed(*params: object) -> None:
    """Fresh inputs per case, reproducible from the case's parameters."""
    torch.manual_seed(zlib.crc32(repr(params).encode()))


# --- write_kv_cache ---------------------------------------------------------------------------


def _check_write_kv_cache(
    num_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: str
) -> None:
    _seed("kv", num_tokens, num_kv_heads, head_dim, dtype)
    block_size = 16
    num_blocks = num_tokens // block_size + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    # k and v are token-strided views of a fused qkv output, as the model produces them.
    qkv = torch.randn(num_tokens, 3, num_kv_heads, head_dim, dtype=dtype, device=device)
    k, v = qkv[:, 1], qkv[:, 2]
    # Scattered distinct slots, with about a quarter of the tokens padding.
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    padding = torch.rand(num_tokens, device=device) < 0.25
    slot_mapping = torch.where(padding, torch.full_like(slots, -1), slots)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    reference.write_kv_cache(k, v, k_expected, v_expected, slot_mapping)

    write_kv_cache(k, v, k_cache, v_cache, slot_mapping)

    # A copy is exact; every slot not written, padding's included, keeps its old value.
    torch.testing.assert_close(k_cache, k_expected, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, v_expected, atol=0, rtol=0)


@pytest.mark.parametrize(
    ("num_tokens", "num_kv_heads", "head_dim", "dtype"),
    [(1, 1, 16, torch.float32), (5, 2, 32, torch.float16), (33, 2, 16, torch.bfloat16)],
)
def test_write_kv_cache_matches_reference(
    num_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    _check_write_kv_cache(num_tokens, num_kv_heads, head_dim, dtype, DEVICE)


def test_write_kv_cache_skips_all_padding_tokens() -> None:
    k = torch.randn(5, 2, 16, device=DEVICE)
    k_cache = torch.randn(2, 4, 2, 16, device=DEVICE)
    v_cache = torch.randn(2, 4, 2, 16, device=DEVICE)
    k_before, v_before = k_cache.clone(), v_cache.clone()

    write_kv_cache(k, k.clone(), k_cache, v_cache, torch.full((5,), -1, device=DEVICE))

    assert torch.equal(k_cache, k_before)
    assert torch.equal(v_cache, v_before)


def test_write_kv_cache_drops_out_of_range_slot_instead_of_writing_past_the_cache() -> None:
    k = torch.randn(2, 1, 16, device=DEVICE)
    k_cache = torch.zeros(2, 4, 1, 16, device=DEVICE)
    v_cache = torch.zeros(2, 4, 1, 16, device=DEVICE)

    write_kv_cache(k, k, k_cache, v_cache, torch.tensor([3, 8], device=DEVICE))

    assert torch.equal(k_cache.view(8, 16)[3], k[0, 0])
    assert torch.count_nonzero(k_cache.view(8, 16)[torch.arange(8, device=DEVICE) != 3]) == 0


@pytest.mark.gpu
def test_write_kv_cache_compiles_one_variant_for_slots_at_any_offset() -> None:
    """A step's slots may be a view at any offset (one split out of a tensor-parallel
    broadcast): a variant per alignment would be compiled while serving."""
    from kernels.kv_cache_write import _write_kv_cache_kernel as kernel

    k = torch.randn(3, 2, 16, device=DEVICE)
    slots = torch.tensor([0, 5, 7, 0, 5], device=DEVICE)  # views of 3 at 0, 8 and 16 bytes
    compiled = None
    for offset in (0, 1, 2):
        view = slots[offset : offset + 3]
        k_cache = torch.zeros(2, 4, 2, 16, device=DEVICE)
        write_kv_cache(k, k, k_cache, k_cache.clone(), view)
        for token, slot in enumerate(view.tolist()):
            assert torch.equal(k_cache.view(8, 2, 16)[slot], k[token])
        compiled = compiled or len(kernel.device_caches[torch.cuda.current_device()][0])
    assert len(kernel.device_caches[torch.cuda.current_device()][0]) == compiled


def test_write_kv_cache_accepts_no_tokens() -> None:
    empty = torch.empty(0, 2, 16, device=DEVICE)
    cache = torch.zeros(1, 4, 2, 16, device=DEVICE)
    write_kv_cache(
        empty, empty, cache, cache.clone(), torch.empty(0, dtype=torch.int64, device=DEVICE)
    )
    assert torch.count_nonzero(cache) == 0


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("num_tokens", "num_kv_heads", "head_dim", "dtype"),
    [
        *itertools.product([1, 7, 64, 257, 8192], [8], [128], [torch.bfloat16, torch.float16]),
        (513, 1, 64, torch.bfloat16),
        (100, 4, 256, torch.float32),
    ],
)
def test_write_kv_cache_matches_reference_at_serving_shapes(
    num_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    _check_write_kv_cache(num_tokens, num_kv_heads, head_dim, dtype, "cuda")


def _check_write_fp8_kv_cache(
    num_tokens: int, dtype: torch.dtype, device: str, *, representable: bool
) -> None:
    """Stored bytes equal `reference.quantize_kv`'s, at scales that put some values past e4m3's
    +-448 (saturated, never NaN).

    `representable`: every value in range is an e4m3 value times its (power-of-two) scale, so
    nothing is rounded. Triton's 3.9 interpreter rounds float -> e4m3 wrongly (a value that
    rounds up to a power of two comes out at half of it), but converts exact values exactly;
    so on the CPU this checks the kernel's scales, slots and saturation, and the rounding
    itself (round to nearest even, as torch) is checked on the GPU with random values.
    """
    _seed("kv-fp8", num_tokens, dtype, representable)
    block_size, num_kv_heads, head_dim = 16, 2, 32
    num_blocks = num_tokens // block_size + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.zeros(shape, dtype=torch.float8_e4m3fn, device=device)
    v_cache = torch.zeros(shape, dtype=torch.float8_e4m3fn, device=device)
    k_scale = torch.tensor([0.0625], device=device)  # |k| / k_scale > 448 for |k| > 28
    v_scale = torch.tensor([2.0], device=device)
    qkv = 10 * torch.randn(num_tokens, 3, num_kv_heads, head_dim, device=device)
    if representable:
        fp8 = qkv.to(torch.float8_e4m3fn).float()
        qkv = torch.stack((fp8[:, 0], fp8[:, 1] * k_scale, fp8[:, 2] * v_scale), dim=1)
        qkv[:, 1] *= 1 + 31 * (torch.rand_like(qkv[:, 1]) < 0.2)  # some past the range
    qkv[0, 1, 0, :2] = torch.tensor([1e4, -float("inf")])  # far past the range
    qkv = qkv.to(dtype)
    k, v = qkv[:, 1], qkv[:, 2]
    slot_mapping = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    reference.write_kv_cache(k, v, k_expected, v_expected, slot_mapping, k_scale, v_scale)

    write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    assert k_cache.view(-1, head_dim)[slot_mapping[0] * num_kv_heads, :2].tolist() == [448, -448]
    assert (k_cache.float().abs() == 448).sum() > 2
    for got, expected in ((k_cache, k_expected), (v_cache, v_expected)):
        assert not got.float().isnan().any()
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize(("num_tokens", "dtype"), [(5, torch.float32), (33, torch.float16)])
def test_write_kv_cache_stores_fp8_values_scaled_and_saturated(
    num_tokens: int, dtype: torch.dtype
) -> None:
    _check_write_fp8_kv_cache(num_tokens, dtype, DEVICE, representable=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_write_kv_cache_rounds_to_fp8_bytes_equal_to_reference_on_gpu(dtype: torch.dtype) -> None:
    _check_write_fp8_kv_cache(257, dtype, "cuda", representable=False)


# --- rms_norm / add_rms_norm ------------------------------------------------------------------


def _check_rms_norm(
    num_tokens: int, hidden: int, dtype: torch.dtype, weight_dtype: torch.dtype, device: str
) -> None:
    _seed("rms", num_tokens, hidden, dtype, weight_dtype)
    # A row-strided view: the kernel must not assume packed rows.
    x = torch.randn(num_tokens, hidden + 8, dtype=dtype, device=device)[:, :hidden] * 3
    weight = torch.randn(hidden, dtype=weight_dtype, device=device)

    expected = reference.rms_norm(x, weight, 1e-6)
    _assert_close(rms_norm(x, weight, 1e-6), expected, rounded_to=dtype)


def _check_add_rms_norm(num_tokens: int, hidden: int, dtype: torch.dtype, device: str) -> None:
    _seed("add_rms", num_tokens, hidden, dtype)
    x = torch.randn(num_tokens, hidden, dtype=dtype, device=device)
    residual = torch.randn(num_tokens, hidden, dtype=dtype, device=device)
    weight = torch.randn(hidden, dtype=dtype, device=device)
    x_before = x.clone()
    expected_normed, expected_residual = reference.add_rms_norm(x, residual, weight, 1e-5)

    normed, new_residual = add_rms_norm(x, residual, weight, 1e-5)

    assert new_residual is residual
    if INTERPRETED and dtype == torch.bfloat16:
        _assert_close(residual, expected_residual)
    else:
        # The sum is one rounding of an exact float32 addition, as in the reference: bit-exact.
        torch.testing.assert_close(residual, expected_residual, atol=0, rtol=0)
    _assert_close(normed, expected_normed)
    assert torch.equal(x, x_before)


@pytest.mark.parametrize(("num_tokens", "hidden"), [(1, 64), (5, 96), (33, 64)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_reference(num_tokens: int, hidden: int, dtype: torch.dtype) -> None:
    _check_rms_norm(num_tokens, hidden, dtype, dtype, DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_float32_weight_scales_in_float32_and_rounds_once_like_the_reference(dtype) -> None:
    """Gemma's and Qwen3.5's `1 + w` norms: the output is in x's dtype, the float32 product
    rounded once (not the normed row first, as for a weight in x's dtype)."""
    _check_rms_norm(5, 96, dtype, torch.float32, DEVICE)
    _seed("rms-f32", dtype)
    x = torch.randn(7, 96, dtype=dtype, device=DEVICE) * 3
    residual = torch.randn(7, 96, dtype=dtype, device=DEVICE)
    weight = 1.0 + 0.1 * torch.randn(96, device=DEVICE)
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    once = (normed * weight).to(dtype)
    ours = rms_norm(x, weight, 1e-6)
    assert ours.dtype == dtype
    # The row's statistics are summed in another order than torch's (an ulp of float32 apart),
    # so an element may round the other way: equal within the dtype's tolerance, and nearer
    # the once-rounded product than rounding the normed row first comes.
    _assert_close(ours, once, rounded_to=dtype)
    if dtype == torch.float16 or DEVICE == "cuda":  # the interpreter's bf16 casts truncate
        twice = (weight.to(dtype) * normed.to(dtype)).to(dtype)
        off = (ours.float() - once.float()).abs().sum()
        assert off < (twice.float() - once.float()).abs().sum(), "rounded like Llama's norm"
    fused, _ = add_rms_norm(x, residual.clone(), weight, 1e-6)
    expected, _ = reference.add_rms_norm(x, residual, weight, 1e-6)
    assert fused.dtype == dtype
    _assert_close(fused, expected, rounded_to=dtype)


def test_the_reference_norm_of_a_float32_one_plus_w_is_transformers_qwen3_5_norm() -> None:
    """transformers' zero-centred RMSNorm in bf16 (`x * (1 + w.float())`, rounded once), bit
    for bit, given the loader's float32 `1 + w`."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    _seed("rms-qwen3.5")
    norm = Qwen3_5RMSNorm(96, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(0.3 * torch.randn(96))
    norm = norm.to(torch.bfloat16)
    x = torch.randn(9, 96).to(torch.bfloat16) * 3
    weight = 1.0 + norm.weight.float()
    torch.testing.assert_close(reference.rms_norm(x, weight, 1e-6), norm(x), atol=0, rtol=0)


def test_rms_norm_writes_into_given_out() -> None:
    x = torch.randn(5, 96, device=DEVICE)
    weight = torch.randn(96, device=DEVICE)
    out = torch.empty(5, 96, device=DEVICE)

    assert rms_norm(x, weight, 1e-6, out=out) is out
    _assert_close(out, reference.rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize(("num_tokens", "hidden"), [(1, 64), (5, 96), (33, 96)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_matches_reference_and_updates_residual_in_place(
    num_tokens: int, hidden: int, dtype: torch.dtype
) -> None:
    _check_add_rms_norm(num_tokens, hidden, dtype, DEVICE)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("num_tokens", "hidden", "dtype"),
    [
        *itertools.product([1, 3, 64, 1000, 8192], [4096], [torch.bfloat16, torch.float16]),
        (17, 576, torch.bfloat16),  # SmolLM2-135M
        (17, 5000, torch.float32),
        (4, 16384, torch.bfloat16),
    ],
)
def test_rms_norms_match_reference_at_serving_shapes(
    num_tokens: int, hidden: int, dtype: torch.dtype
) -> None:
    _check_rms_norm(num_tokens, hidden, dtype, dtype, "cuda")
    _check_add_rms_norm(num_tokens, hidden, dtype, "cuda")


# --- rotary_embedding -------------------------------------------------------------------------


def _llama_cos_sin(num_tokens: int, head_dim: int, device: str) -> tuple[torch.Tensor, ...]:
    """Hugging Face's table: frequencies repeated over both halves, at scattered positions."""
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=device) / head_dim))
    positions = torch.randint(0, 8192, (num_tokens,), device=device).float()
    angles = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


def _check_rotary(
    num_tokens: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
) -> None:
    _seed("rope", num_tokens, num_q_heads, num_kv_heads, head_dim, dtype)
    # q and k are views of the fused qkv projection output, as the model produces them.
    qkv = torch.randn(
        num_tokens, num_q_heads + 2 * num_kv_heads, head_dim, dtype=dtype, device=device
    )
    q, k = qkv[:, :num_q_heads], qkv[:, num_q_heads : num_q_heads + num_kv_heads]
    v_before = qkv[:, num_q_heads + num_kv_heads :].clone()
    cos, sin = _llama_cos_sin(num_tokens, head_dim, device)
    q_expected, k_expected = reference.rotary_embedding(q, k, cos, sin)

    q_out, k_out = rotary_embedding(q, k, cos, sin)

    assert q_out is q and k_out is k
    _assert_close(q, q_expected)
    _assert_close(k, k_expected)
    assert torch.equal(qkv[:, num_q_heads + num_kv_heads :], v_before)


@pytest.mark.parametrize(
    ("num_tokens", "num_q_heads", "num_kv_heads", "head_dim"),
    [(1, 2, 1, 16), (5, 3, 1, 32), (33, 4, 2, 16)],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding_matches_reference_in_place(
    num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    _check_rotary(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, DEVICE)


def test_rotary_embedding_uses_both_halves_of_a_non_repeating_table() -> None:
    q = torch.randn(5, 2, 16, device=DEVICE)
    k = torch.randn(5, 1, 16, device=DEVICE)
    cos, sin = torch.randn(5, 16, device=DEVICE), torch.randn(5, 16, device=DEVICE)
    q_expected, k_expected = reference.rotary_embedding(q, k, cos, sin)

    rotary_embedding(q, k, cos, sin)

    _assert_close(q, q_expected)
    _assert_close(k, k_expected)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("num_tokens", "num_q_heads", "num_kv_heads", "head_dim", "dtype"),
    [
        *itertools.product([1, 5, 128, 8192], [32], [8], [128], [torch.bfloat16, torch.float16]),
        (33, 9, 3, 64, torch.bfloat16),  # SmolLM2-135M
        (33, 64, 8, 128, torch.float32),  # more heads than one tile: the head loop runs twice
        (7, 8, 1, 96, torch.bfloat16),  # half of D not a power of two
    ],
)
def test_rotary_embedding_matches_reference_at_serving_shapes(
    num_tokens: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> None:
    _check_rotary(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, "cuda")


# --- gated activations (silu_and_mul, gelu_tanh_and_mul) --------------------------------------

GATED = {
    "silu": (silu_and_mul, reference.silu_and_mul),
    "gelu_tanh": (gelu_tanh_and_mul, reference.gelu_tanh_and_mul),
}


def _check_gated(
    activation: str, num_tokens: int, intermediate: int, dtype: torch.dtype, device: str
) -> None:
    _seed(activation, num_tokens, intermediate, dtype)
    # Gates well into both tails (GELU's cube and SiLU's exp overflow there).
    x = torch.randn(num_tokens, 2 * intermediate, dtype=dtype, device=device) * 4
    ours, theirs = GATED[activation]
    _assert_close(ours(x), theirs(x))


# exp(-g) overflows to inf in the tails, where the activation is then -0, as intended.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("activation", sorted(GATED))
@pytest.mark.parametrize(("num_tokens", "intermediate"), [(1, 64), (5, 96), (33, 64), (2, 1100)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_activations_match_reference(
    activation: str, num_tokens: int, intermediate: int, dtype: torch.dtype
) -> None:
    _check_gated(activation, num_tokens, intermediate, dtype, DEVICE)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_gated_activations_stay_finite_far_into_the_tails() -> None:
    gate = torch.tensor([[-1e4, -100.0, -30.0, 0.0, 30.0, 100.0, 1e4, 3.0]], device=DEVICE)
    x = torch.cat([gate, torch.ones_like(gate)], dim=1)
    for ours, theirs in GATED.values():
        out = ours(x)
        assert torch.isfinite(out).all()
        _assert_close(out, theirs(x))


def test_silu_and_mul_writes_into_given_out() -> None:
    x = torch.randn(5, 192, device=DEVICE)
    out = torch.empty(5, 96, device=DEVICE)

    assert silu_and_mul(x, out=out) is out
    _assert_close(out, reference.silu_and_mul(x))


@pytest.mark.gpu
@pytest.mark.parametrize("activation", sorted(GATED))
@pytest.mark.parametrize(
    ("num_tokens", "intermediate", "dtype"),
    [
        *itertools.product([1, 3, 64, 1000, 8192], [14336], [torch.bfloat16, torch.float16]),
        (17, 1536, torch.bfloat16),  # SmolLM2-135M
        (9, 15360, torch.bfloat16),  # Gemma-3-12B
        (17, 1000, torch.float32),
    ],
)
def test_gated_activations_match_reference_at_serving_shapes(
    activation: str, num_tokens: int, intermediate: int, dtype: torch.dtype
) -> None:
    _check_gated(activation, num_tokens, intermediate, dtype, "cuda")


# --- input validation -------------------------------------------------------------------------


def _t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=DEVICE)


def _slots(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int64, device=DEVICE)


BAD_CALLS: dict[str, tuple[Callable[[], object], str]] = {
    # write_kv_cache
    "kv_k_not_tensor": (
        lambda: write_kv_cache([0.0], _t(2, 1, 16), _t(1, 4, 1, 16), _t(1, 4, 1, 16), _slots(2)),
        "k must be a torch.Tensor",
    ),
    "kv_k_2d": (
        lambda: write_kv_cache(_t(2, 16), _t(2, 16), _t(1, 4, 1, 16), _t(1, 4, 1, 16), _slots(2)),
        "k must have 3 dimensions",
    ),
    "kv_v_shape": (
        lambda: write_kv_cache(
            _t(2, 1, 16), _t(3, 1, 16), _t(1, 4, 1, 16), _t(1, 4, 1, 16), _slots(2)
        ),
        "v shape",
    ),
    "kv_head_dim_mismatch": (
        lambda: write_kv_cache(
            _t(2, 1, 32), _t(2, 1, 32), _t(1, 4, 1, 16), _t(1, 4, 1, 16), _slots(2)
        ),
        "do not match the cache",
    ),
    "kv_v_cache_shape": (
        lambda: write_kv_cache(
            _t(2, 1, 16), _t(2, 1, 16), _t(1, 4, 1, 16), _t(2, 4, 1, 16), _slots(2)
        ),
        "v_cache shape",
    ),
    "kv_slot_count": (
        lambda: write_kv_cache(
            _t(2, 1, 16), _t(2, 1, 16), _t(1, 4, 1, 16), _t(1, 4, 1, 16), _slots(3)
        ),
        "one slot per token",
    ),
    "kv_slot_dtype": (
        lambda: write_kv_cache(
            _t(2, 1, 16),
            _t(2, 1, 16),
            _t(1, 4, 1, 16),
            _t(1, 4, 1, 16),
            _slots(2).to(torch.int32),
        ),
        "slot_mapping must be int64",
    ),
    "kv_int_dtype": (
        lambda: write_kv_cache(
            _t(2, 1, 16, dtype=torch.int8),
            _t(2, 1, 16, dtype=torch.int8),
            _t(1, 4, 1, 16, dtype=torch.int8),
            _t(1, 4, 1, 16, dtype=torch.int8),
            _slots(2),
        ),
        "k dtype torch.int8 is not one of",
    ),
    "kv_cache_dtype": (
        lambda: write_kv_cache(
            _t(2, 1, 16),
            _t(2, 1, 16),
            _t(1, 4, 1, 16, dtype=torch.float16),
            _t(1, 4, 1, 16),
            _slots(2),
        ),
        "k_cache dtype torch.float16 differs from v_cache",
    ),
    "kv_fp8_cache_without_scales": (
        lambda: write_kv_cache(
            _t(2, 1, 16),
            _t(2, 1, 16),
            _t(1, 4, 1, 16, dtype=torch.float8_e4m3fn),
            _t(1, 4, 1, 16, dtype=torch.float8_e4m3fn),
            _slots(2),
        ),
        "needs k_scale",
    ),
    "kv_fp8_scale_per_head": (
        lambda: write_kv_cache(
            _t(2, 2, 16),
            _t(2, 2, 16),
            _t(1, 4, 2, 16, dtype=torch.float8_e4m3fn),
            _t(1, 4, 2, 16, dtype=torch.float8_e4m3fn),
            _slots(2),
            _t(2),
            _t(1),
        ),
        "k_scale must be one floating-point value",
    ),
    "kv_int8_cache": (
        lambda: write_kv_cache(
            _t(2, 1, 16),
            _t(2, 1, 16),
            _t(1, 4, 1, 16, dtype=torch.int8),
            _t(1, 4, 1, 16, dtype=torch.int8),
            _slots(2),
        ),
        "cache dtype torch.int8 must be torch.float32",
    ),
    "kv_k_head_strided": (
        lambda: write_kv_cache(
            _t(2, 2, 32)[:, :, :16], _t(2, 2, 16), _t(1, 4, 2, 16), _t(1, 4, 2, 16), _slots(2)
        ),
        "k must have each token's",
    ),
    "kv_cache_not_contiguous": (
        lambda: write_kv_cache(
            _t(2, 2, 16),
            _t(2, 2, 16),
            _t(1, 2, 4, 16).transpose(1, 2),
            _t(1, 4, 2, 16),
            _slots(2),
        ),
        "k_cache must be contiguous",
    ),
    "kv_mixed_devices": (
        lambda: write_kv_cache(
            _t(2, 1, 16),
            _t(2, 1, 16),
            torch.zeros(1, 4, 1, 16, device="meta"),
            _t(1, 4, 1, 16),
            _slots(2),
        ),
        "must share one device",
    ),
    # rms_norm / add_rms_norm
    "rms_x_3d": (lambda: rms_norm(_t(2, 3, 64), _t(64), 1e-6), "x must have shape"),
    "rms_x_dtype": (
        lambda: rms_norm(_t(2, 64, dtype=torch.float64), _t(64), 1e-6),
        "x dtype torch.float64",
    ),
    "rms_weight_shape": (lambda: rms_norm(_t(2, 64), _t(32), 1e-6), "weight must have shape"),
    "rms_weight_dtype": (
        lambda: rms_norm(_t(2, 64), _t(64, dtype=torch.int32), 1e-6),
        "weight dtype torch.int32",
    ),
    "rms_column_strided": (
        lambda: rms_norm(_t(64, 2).t(), _t(64), 1e-6),
        "x rows must be contiguous",
    ),
    "rms_negative_eps": (lambda: rms_norm(_t(2, 64), _t(64), -1.0), "eps must be"),
    "rms_out_dtype": (
        lambda: rms_norm(_t(2, 64), _t(64), 1e-6, out=_t(2, 64, dtype=torch.float16)),
        "out dtype torch.float16 must be torch.float32",
    ),
    "rms_out_shape": (lambda: rms_norm(_t(2, 64), _t(64), 1e-6, out=_t(3, 64)), "out shape"),
    "rms_mixed_devices": (
        lambda: rms_norm(_t(2, 64), torch.zeros(64, device="meta"), 1e-6),
        "must share one device",
    ),
    "add_rms_residual_shape": (
        lambda: add_rms_norm(_t(2, 64), _t(3, 64), _t(64), 1e-6),
        "residual shape",
    ),
    "add_rms_residual_dtype": (
        lambda: add_rms_norm(_t(2, 64), _t(2, 64, dtype=torch.bfloat16), _t(64), 1e-6),
        "residual dtype torch.bfloat16 differs",
    ),
    # rotary_embedding
    "rope_q_2d": (
        lambda: rotary_embedding(_t(2, 32), _t(2, 1, 32), _t(2, 32), _t(2, 32)),
        "q must have shape",
    ),
    "rope_odd_head_dim": (
        lambda: rotary_embedding(_t(2, 2, 15), _t(2, 1, 15), _t(2, 15), _t(2, 15)),
        "must be even",
    ),
    "rope_k_tokens": (
        lambda: rotary_embedding(_t(2, 2, 16), _t(3, 1, 16), _t(2, 16), _t(2, 16)),
        "k shape",
    ),
    "rope_cos_shape": (
        lambda: rotary_embedding(_t(2, 2, 16), _t(2, 1, 16), _t(2, 8), _t(2, 16)),
        "cos must have shape",
    ),
    "rope_sin_dtype": (
        lambda: rotary_embedding(
            _t(2, 2, 16), _t(2, 1, 16), _t(2, 16), _t(2, 16, dtype=torch.bfloat16)
        ),
        "sin must be float32",
    ),
    "rope_k_dtype": (
        lambda: rotary_embedding(
            _t(2, 2, 16), _t(2, 1, 16, dtype=torch.float16), _t(2, 16), _t(2, 16)
        ),
        "k dtype torch.float16 differs",
    ),
    "rope_q_strided_over_d": (
        lambda: rotary_embedding(_t(2, 2, 32)[..., ::2], _t(2, 1, 16), _t(2, 16), _t(2, 16)),
        "q must have unit stride over D",
    ),
    # silu_and_mul
    "silu_x_1d": (lambda: silu_and_mul(_t(64)), "x must have shape"),
    "silu_odd_width": (lambda: silu_and_mul(_t(2, 63)), "must be even"),
    "silu_x_dtype": (lambda: silu_and_mul(_t(2, 64, dtype=torch.int64)), "x dtype torch.int64"),
    "silu_column_strided": (lambda: silu_and_mul(_t(64, 2).t()), "x rows must be contiguous"),
    "silu_out_shape": (lambda: silu_and_mul(_t(2, 64), out=_t(2, 64)), "out must have shape"),
    "silu_out_dtype": (
        lambda: silu_and_mul(_t(2, 64), out=_t(2, 32, dtype=torch.bfloat16)),
        "out dtype torch.bfloat16 differs",
    ),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_launcher_rejects_bad_input_naming_the_problem(case: str) -> None:
    call, message = BAD_CALLS[case]
    with pytest.raises(KernelInputError, match=message):
        call()


def test_launchers_refuse_cpu_tensors_outside_the_interpreter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.zeros(2, 64)
    with pytest.raises(KernelInputError, match="need CUDA tensors"):
        silu_and_mul(x)
    with pytest.raises(KernelInputError, match="need CUDA tensors"):
        rms_norm(x, torch.ones(64), 1e-6)

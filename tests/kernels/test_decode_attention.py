"""Paged decode attention (Triton) against the plain-torch reference, on fresh random inputs.

On CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1) on tiny
shapes, in float32 and float16: the 3.9 interpreter computes bfloat16 `tl.dot` wrongly, so
bfloat16 is covered by the `gpu` tests only (and refused under the interpreter, tested below).

Tolerances, against a float32 reference on the same (rounded) inputs:
- float32: 1e-5 abs/rel (the kernel's dots run in IEEE fp32, not tf32);
- float16: 4e-3 abs/rel (probabilities rounded to fp16 before the P @ V product, one output ulp);
- bfloat16: 3e-2 abs/rel (the same with 8 mantissa bits instead of 11).
An FP8 cache is read on the FP8 tensor cores, q and the softmax probabilities quantized to e4m3:
compared with the reference on the same cache (which quantizes them the same way) and with exact
attention on the dequantized values, within the bounds of `fp8_attention_bounds`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest
import torch

import kernels.decode_attention as decode_attention
from kernels.decode_attention import DecodeConfig, choose_num_splits, paged_decode_attention
from kernels.errors import KernelInputError
from kernels.fp8_attention import fits_word_planes
from kernels.ops import AttentionMetadata
from kernels.reference import paged_attention, quantize_kv

from .fp8_attention_bounds import assert_fp8_attention_close

# The small cases run on the GPU too when there is one (the launcher refuses CPU tensors there).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@dataclass(frozen=True)
class DecodeCase:
    q: torch.Tensor  # [B, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32, on the device
    seq_lens_host: list[int]
    scale: float


def make_case(
    seq_lens: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int = 16,
    device: str = DEVICE,
    seed: int = 0,
) -> DecodeCase:
    """Random q and caches; each sequence gets its blocks from a random permutation of the pool,
    so its blocks are scattered, and unused table entries point at block 0."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    max_blocks = max([*blocks_per_seq, 1])
    num_blocks = sum(blocks_per_seq) + 2
    perm = torch.randperm(num_blocks, generator=gen, dtype=torch.int32)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_seq):
        block_tables[b, :n] = perm[used : used + n]
        used += n
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return DecodeCase(
        q=torch.randn(len(seq_lens), num_q_heads, head_dim, generator=gen).to(device, dtype),
        k_cache=torch.randn(cache_shape, generator=gen).to(device, dtype),
        v_cache=torch.randn(cache_shape, generator=gen).to(device, dtype),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        seq_lens_host=list(seq_lens),
        scale=head_dim**-0.5,
    )


def run_kernel(case: DecodeCase, num_splits: int, **kwargs: object) -> torch.Tensor:
    return paged_decode_attention(
        case.q,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.seq_lens,
        case.scale,
        num_splits=num_splits,
        **kwargs,
    )


def with_fp8_cache(case: DecodeCase) -> tuple[DecodeCase, dict[str, torch.Tensor]]:
    """The case with its caches quantized to e4m3 at scales other than 1 (so a kernel that
    skipped or swapped them fails), and the dequantized case the reference reads."""
    device = case.q.device
    scales = {
        "k_scale": torch.tensor([0.02], device=device),
        "v_scale": torch.tensor([0.5], device=device),
    }
    k_fp8 = quantize_kv(case.k_cache, scales["k_scale"])
    v_fp8 = quantize_kv(case.v_cache, scales["v_scale"])
    return replace(case, k_cache=k_fp8, v_cache=v_fp8), scales


def dequantized(case: DecodeCase, scales: dict[str, torch.Tensor]) -> DecodeCase:
    return replace(
        case,
        k_cache=case.k_cache.float() * scales["k_scale"],
        v_cache=case.v_cache.float() * scales["v_scale"],
    )


def reference_output(
    case: DecodeCase,
    sliding_window: int | None = None,
    fp8_scales: dict[str, torch.Tensor] | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference in float32 on the non-padding rows; padding rows (seq_len 0) are zeros.
    With `fp8_scales` the case's caches are FP8 and read as such (q and P quantized)."""
    rows = [b for b, n in enumerate(case.seq_lens_host) if n > 0]
    expected = torch.zeros(case.q.shape, dtype=torch.float32, device=case.q.device)
    if rows:
        meta = AttentionMetadata.build(
            torch.full((len(rows),), -1, dtype=torch.int64, device=case.q.device),
            case.block_tables[rows],
            [case.seq_lens_host[b] for b in rows],
            [1] * len(rows),
        )
        caches = (case.k_cache, case.v_cache)
        expected[rows] = paged_attention(
            case.q[rows].float(),
            *(caches if fp8_scales else (cache.float() for cache in caches)),
            meta,
            case.scale,
            sliding_window,
            **(fp8_scales or {}),
            sinks=sinks,
        )
    return expected


def assert_fp8_cache_attention_close(case: DecodeCase, num_splits: int) -> None:
    """The kernel on the case's caches quantized to e4m3 (at scales other than 1, so a kernel
    that skipped or swapped them fails) against the reference on that cache and exact
    attention on the dequantized values."""
    fp8_case, scales = with_fp8_cache(case)
    out = run_kernel(fp8_case, num_splits, **scales)
    assert out.dtype == case.q.dtype
    assert_fp8_attention_close(
        out,
        reference_output(fp8_case, fp8_scales=scales),
        reference_output(dequantized(fp8_case, scales)),
        output_atol=TOLERANCE[case.q.dtype],
    )


def assert_matches_reference(
    case: DecodeCase, out: torch.Tensor, sliding_window: int | None = None
) -> None:
    assert out.dtype == case.q.dtype
    tol = TOLERANCE[case.q.dtype]
    expected = reference_output(case, sliding_window)
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def poison_before_windows(case: DecodeCase, window: int) -> DecodeCase:
    """A copy whose keys and values are NaN at every position before each sequence's window:
    the kernel must never read them (the block manager may have freed those blocks)."""
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    block_size = k_cache.shape[1]
    tables = case.block_tables.tolist()
    for b, seq_len in enumerate(case.seq_lens_host):
        for pos in range(max(seq_len - window, 0)):
            k_cache[tables[b][pos // block_size], pos % block_size] = float("nan")
            v_cache[tables[b][pos // block_size], pos % block_size] = float("nan")
    return replace(case, k_cache=k_cache, v_cache=v_cache)


# Ragged lengths around block boundaries (block_size 16), a zero-length padding row, and one long
# enough for several tiles per split (the online-softmax rescale) and an empty third split.
CPU_SEQ_LENS = [1, 16, 17, 0, 32, 200]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads"), [(4, 1), (2, 2), (8, 1)], ids=["gqa4", "mha", "gqa8"]
)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attention_matches_reference_on_ragged_batch(
    dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, num_splits: int
) -> None:
    case = make_case(
        CPU_SEQ_LENS, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=32, dtype=dtype
    )
    assert_matches_reference(case, run_kernel(case, num_splits))


@pytest.mark.parametrize("window", [1, 16, 33])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_windowed_decode_matches_reference_and_reads_nothing_before_the_window(
    window: int, num_splits: int
) -> None:
    case = make_case(CPU_SEQ_LENS, num_q_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float32)
    out = run_kernel(poison_before_windows(case, window), num_splits, sliding_window=window)
    assert_matches_reference(case, out, sliding_window=window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("head_dim", [32, 64], ids=["v-tile", "v-word-planes"])
def test_decode_attention_over_fp8_cache_quantizes_q_and_p_as_the_reference_does(
    dtype: torch.dtype, num_splits: int, head_dim: int
) -> None:
    """At head_dim 64 V is read as int32 words in four byte planes (kernels.fp8_attention's
    e4m3_planes); below, as one e4m3 tile."""
    case = make_case(CPU_SEQ_LENS, num_q_heads=4, num_kv_heads=2, head_dim=head_dim, dtype=dtype)
    assert_fp8_cache_attention_close(case, num_splits)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_fp8_v_word_planes_give_the_e4m3_tiles_output(num_splits: int) -> None:
    """The same FP8 cache read through V's word planes and, from a copy that starts one byte
    into its buffer (no longer on a word: the launcher falls back), as one e4m3 tile: the same
    products, so the same output. A plane stored to the wrong columns, or a byte taken from the
    wrong end of its word, would differ here."""
    case, scales = with_fp8_cache(
        make_case(CPU_SEQ_LENS, num_q_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float32)
    )
    v_cache = case.v_cache
    buffer = torch.empty(v_cache.numel() + 1, dtype=v_cache.dtype, device=v_cache.device)
    unaligned = buffer[1:].view(v_cache.shape)
    unaligned.copy_(v_cache)
    assert fits_word_planes(v_cache)
    assert not fits_word_planes(unaligned)
    planes = run_kernel(case, num_splits, **scales)
    tile = run_kernel(replace(case, v_cache=unaligned), num_splits, **scales)
    # The same products, summed in float32 in another order on the GPU's tensor cores.
    torch.testing.assert_close(planes, tile, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 33])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attention_with_sinks_matches_reference(window: int | None, num_splits: int) -> None:
    """gpt-oss's sinks: in split 0's softmax state only, so the combine counts each once; an
    empty split and a padding row as without them; the FP8 cache's arithmetic too."""
    case = make_case(CPU_SEQ_LENS, num_q_heads=4, num_kv_heads=1, head_dim=32, dtype=torch.float32)
    sinks = 3.0 + torch.randn(4, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    out = run_kernel(case, num_splits, sliding_window=window, sinks=sinks)
    expected = reference_output(case, window, sinks=sinks)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert (expected - reference_output(case, window)).abs().max() > 0.05, "sinks should matter"
    fp8_case, scales = with_fp8_cache(case)
    out = run_kernel(fp8_case, num_splits, sliding_window=window, sinks=sinks, **scales)
    assert_fp8_attention_close(
        out,
        reference_output(fp8_case, window, fp8_scales=scales, sinks=sinks),
        reference_output(dequantized(fp8_case, scales), window, sinks=sinks),
        output_atol=TOLERANCE[torch.float32],
    )


def test_decode_attention_matches_reference_with_head_dim_16_and_large_blocks() -> None:
    # block_size 64 > BLOCK_N tiles of a different size, and more splits than some sequences have
    # tiles.
    case = make_case(
        [3, 64, 65, 130],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        dtype=torch.float32,
        block_size=64,
    )
    assert_matches_reference(case, run_kernel(case, num_splits=4))


def test_decode_attention_matches_reference_at_head_dim_512() -> None:
    """Gemma 4's global layers: heads of 512 (their own tiles), one KV head for several."""
    case = make_case([1, 40, 17], num_q_heads=4, num_kv_heads=1, head_dim=512,
                     dtype=torch.float32)  # fmt: skip
    assert_matches_reference(case, run_kernel(case, num_splits=2))


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 4, 16])
def test_decode_attention_matches_reference_on_gpu_at_gemma4_global_heads(
    num_splits: int,
) -> None:
    # Gemma-4-31B's global layers: 32 query heads, 4 KV heads of 512, contexts up to 4096.
    case = make_case(_gpu_seq_lens(13, seed=5), num_q_heads=32, num_kv_heads=4, head_dim=512,
                     dtype=torch.bfloat16, device="cuda", seed=512)  # fmt: skip
    assert_matches_reference(case, run_kernel(case, num_splits))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_padding_rows_write_zeros_and_read_no_cache_memory(num_splits: int) -> None:
    case = make_case(
        [0, 17, 0], num_q_heads=4, num_kv_heads=1, head_dim=16, dtype=torch.float32, seed=1
    )
    # A padding row's table holds ids far outside the pool: any read through it would fault.
    case.block_tables[0] = 2**30
    case.block_tables[2] = 2**30
    out = torch.full_like(case.q, float("nan"))
    result = run_kernel(case, num_splits, out=out)
    assert result is out
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    assert_matches_reference(case, out)


@pytest.mark.parametrize("count", [0, 2, 4])
def test_a_row_count_on_the_device_computes_the_rows_below_it_and_leaves_the_rest(
    count: int,
) -> None:
    case = make_case([5, 17, 30, 2], num_q_heads=4, num_kv_heads=2, head_dim=16,
                     dtype=torch.float16)  # fmt: skip
    full = run_kernel(case, 1)
    out = torch.full_like(case.q, 7.0)
    num_rows = torch.tensor([count], dtype=torch.int32, device=case.q.device)
    run_kernel(case, 1, out=out, num_rows=num_rows)
    assert torch.equal(out[:count], full[:count])
    assert bool((out[count:] == 7.0).all())


class _GridRecorder:
    """Stands in for a Triton kernel: records each launch grid, then launches the real kernel."""

    def __init__(self, kernel: object, grids: list[tuple[int, ...]]) -> None:
        self.kernel = kernel
        self.grids = grids

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., object]:
        self.grids.append(grid)
        return self.kernel[grid]


def test_launch_grid_ignores_seq_lens_values_rewritten_in_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # CUDA-graph replay re-runs the recorded launches with the same grids after seq_lens and
    # block_tables are rewritten in place: the kernel must derive everything else on the device.
    grids: list[tuple[int, ...]] = []
    for name in ("_decode_split_kernel", "_combine_splits_kernel"):
        recorder = _GridRecorder(getattr(decode_attention, name), grids)
        monkeypatch.setattr(decode_attention, name, recorder)
    case = make_case(
        [5, 40, 0], num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, seed=2
    )
    out = torch.empty_like(case.q)
    run_kernel(case, num_splits=2, out=out)
    assert_matches_reference(case, out)
    first_grids = list(grids)

    case.seq_lens.copy_(torch.tensor([33, 1, 17], dtype=torch.int32, device=DEVICE))
    case.block_tables.copy_(case.block_tables.flip(0))
    case.block_tables[0, :3] = torch.tensor([1, 0, 2], dtype=torch.int32, device=DEVICE)
    case = replace(case, seq_lens_host=[33, 1, 17])
    grids.clear()
    run_kernel(case, num_splits=2, out=out)
    assert grids == first_grids
    assert_matches_reference(case, out)


def test_choose_num_splits_fills_two_waves_without_short_splits() -> None:
    # Batch 1, 8 KV heads, 132 SMs: 33+ splits wanted, but 4096 tokens allow only 16 of 256.
    assert choose_num_splits(1, 8, 4096, 132) == 16
    assert choose_num_splits(1, 8, 1 << 20, 132) == 64
    # Batch 64 x 8 KV heads is already 512 programs, about four waves.
    assert choose_num_splits(64, 8, 4096, 132) == 1
    assert choose_num_splits(4, 8, 4096, 132) == 16
    assert choose_num_splits(8, 8, 100, 132) == 1
    assert choose_num_splits(1, 1, 0, 132) == 1
    for batch in (1, 3, 17, 256):
        splits = choose_num_splits(batch, 8, 8192, 132)
        assert 1 <= splits <= 64
        assert splits & (splits - 1) == 0


def test_choose_num_splits_rejects_nonpositive_sizes() -> None:
    with pytest.raises(KernelInputError, match="num_sms"):
        choose_num_splits(1, 8, 4096, 0)


# Validation: each corruption of a valid call must raise KernelInputError naming the problem.
Mutation = Callable[[dict], None]


def _valid_call() -> dict:
    case = make_case([5, 17], num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float16)
    return {
        "q": case.q,
        "k_cache": case.k_cache,
        "v_cache": case.v_cache,
        "block_tables": case.block_tables,
        "seq_lens": case.seq_lens,
        "scale": case.scale,
        "num_splits": 2,
    }


def _set(key: str, make: Callable[[dict], object]) -> Mutation:
    def mutate(call: dict) -> None:
        call[key] = make(call)

    return mutate


def _set_caches(make: Callable[[torch.Tensor], torch.Tensor]) -> Mutation:
    def mutate(call: dict) -> None:
        call["k_cache"] = make(call["k_cache"])
        call["v_cache"] = make(call["v_cache"])

    return mutate


BAD_INPUTS: dict[str, tuple[Mutation, str]] = {
    "q_rank": (_set("q", lambda c: c["q"][0]), "q must be"),
    "sinks_length": (_set("sinks", lambda c: torch.zeros(3, device=c["q"].device)), "sinks must"),
    "sinks_dtype": (
        _set("sinks", lambda c: torch.zeros(4, dtype=torch.float64, device=c["q"].device)),
        "sinks must",
    ),
    "cache_rank": (_set("k_cache", lambda c: c["k_cache"][0]), "k_cache must be"),
    "v_shape": (_set("v_cache", lambda c: c["v_cache"][:1]), "v_cache shape"),
    "head_dim_mismatch": (_set("q", lambda c: c["q"].repeat(1, 1, 2)), "head dim"),
    "head_dim_not_pow2": (
        _set("q", lambda c: torch.zeros(2, 4, 24, dtype=torch.float16, device=DEVICE)),
        "head dim",
    ),
    "block_size": (_set_caches(lambda cache: cache.reshape(-1, 8, 2, 16)), "block_size"),
    "heads_not_multiple": (_set("q", lambda c: c["q"][:, :3]), "multiple of KV heads"),
    "q_int_dtype": (_set("q", lambda c: c["q"].to(torch.int16)), "q dtype"),
    "cache_dtype": (_set("k_cache", lambda c: c["k_cache"].float()), "k_cache dtype"),
    "block_tables_int64": (
        _set("block_tables", lambda c: c["block_tables"].long()),
        "block_tables must be int32",
    ),
    "block_tables_rows": (
        _set("block_tables", lambda c: c["block_tables"][:1]),
        "block_tables must be",
    ),
    "seq_lens_int64": (_set("seq_lens", lambda c: c["seq_lens"].long()), "seq_lens must be int32"),
    "seq_lens_shape": (_set("seq_lens", lambda c: c["seq_lens"][None]), "seq_lens must be"),
    "out_shape": (_set("out", lambda c: torch.empty_like(c["q"])[:1]), "out shape"),
    "out_dtype": (
        _set("out", lambda c: torch.empty_like(c["q"], dtype=torch.float32)),
        "out dtype",
    ),
    "device": (_set("seq_lens", lambda c: c["seq_lens"].to("meta")), "seq_lens is on"),
    "q_last_dim_strided": (
        _set("q", lambda c: torch.zeros(2, 4, 32, dtype=torch.float16, device=DEVICE)[..., ::2]),
        "q must be contiguous",
    ),
    "cache_last_dim_strided": (
        _set("v_cache", lambda c: c["v_cache"].repeat_interleave(2, -1)[..., ::2]),
        "v_cache must be contiguous",
    ),
    "num_splits_zero": (_set("num_splits", lambda c: 0), "num_splits"),
    "num_splits_too_many": (_set("num_splits", lambda c: 65), "num_splits"),
    "scale_nan": (_set("scale", lambda c: float("nan")), "scale"),
    "fp8_without_scales": (
        _set_caches(lambda cache: cache.to(torch.float8_e4m3fn)),
        "needs k_scale",
    ),
    "config_block_n": (_set("config", lambda c: DecodeConfig(24, 4, 2)), "config.block_n"),
    "num_rows_with_splits": (
        _set("num_rows", lambda c: torch.ones(1, dtype=torch.int32, device=DEVICE)),
        "num_rows needs num_splits 1",
    ),
    "num_rows_int64": (
        _set("num_rows", lambda c: torch.ones(1, dtype=torch.int64, device=DEVICE)),
        "num_rows must be",
    ),
    "num_rows_shape": (
        _set("num_rows", lambda c: torch.ones(2, dtype=torch.int32, device=DEVICE)),
        "num_rows must be",
    ),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_launcher_rejects_bad_input(name: str) -> None:
    mutate, message = BAD_INPUTS[name]
    call = _valid_call()
    mutate(call)
    with pytest.raises(KernelInputError, match=message):
        paged_decode_attention(**call)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter-only limitation")
def test_bfloat16_is_refused_under_the_interpreter() -> None:
    call = _valid_call()
    for key in ("q", "k_cache", "v_cache"):
        call[key] = call[key].bfloat16()
    with pytest.raises(KernelInputError, match="bfloat16"):
        paged_decode_attention(**call)


# --- GPU: realistic shapes -------------------------------------------------------------------


def _gpu_seq_lens(batch: int, seed: int) -> list[int]:
    """Ragged lengths up to 4096: block boundaries, one off them, 1, and random values."""
    gen = torch.Generator().manual_seed(seed)
    special = [4096, 1, 16, 17, 4095, 2048, 15, 1000]
    rand = torch.randint(1, 4097, (batch,), generator=gen).tolist()
    return [special[i] if i < len(special) else rand[i] for i in range(batch)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads"), [(8, 8), (32, 8), (32, 4)], ids=["mha", "gqa4", "gqa8"]
)
@pytest.mark.parametrize(("batch", "num_splits"), [(1, 16), (5, 1), (13, 4), (64, 3)])
def test_decode_attention_matches_reference_on_gpu(
    dtype: torch.dtype,
    head_dim: int,
    num_q_heads: int,
    num_kv_heads: int,
    batch: int,
    num_splits: int,
) -> None:
    case = make_case(
        _gpu_seq_lens(batch, seed=batch),
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device="cuda",
        seed=batch + head_dim,
    )
    assert_matches_reference(case, run_kernel(case, num_splits))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("batch", "num_splits"), [(1, 16), (13, 4), (64, 1)])
def test_decode_attention_over_fp8_cache_stays_within_its_bounds_on_gpu(
    dtype: torch.dtype, batch: int, num_splits: int
) -> None:
    case = make_case(
        _gpu_seq_lens(batch, seed=batch),
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        dtype=dtype,
        device="cuda",
        seed=batch,
    )
    assert_fp8_cache_attention_close(case, num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [32, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_matches_reference_on_gpu_with_other_block_sizes(
    block_size: int, dtype: torch.dtype
) -> None:
    case = make_case(
        [1, block_size, block_size + 1, 3000, 0],
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        dtype=dtype,
        block_size=block_size,
        device="cuda",
    )
    assert_matches_reference(case, run_kernel(case, num_splits=8))


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 8])
def test_decode_attention_replays_in_a_cuda_graph_after_inputs_change(num_splits: int) -> None:
    case = make_case(
        _gpu_seq_lens(8, seed=3),
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        dtype=torch.bfloat16,
        device="cuda",
    )
    out = torch.empty_like(case.q)
    run_kernel(case, num_splits, out=out)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_kernel(case, num_splits, out=out)

    new_lens = [0, 4096, 3, 16, 1777, 1, 0, 32]
    case.seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32, device="cuda"))
    case.block_tables.copy_(case.block_tables.flip(0))
    case.q.normal_()
    graph.replay()
    torch.cuda.synchronize()
    assert_matches_reference(replace(case, seq_lens_host=new_lens), out)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("num_splits", [1, 4, 16])
def test_windowed_decode_matches_reference_on_gpu_in_bfloat16(
    head_dim: int, num_splits: int
) -> None:
    # Gemma 3's local layers: head_dim 256, a 1024-token window over contexts up to 4096.
    case = make_case(
        _gpu_seq_lens(13, seed=7),
        num_q_heads=16,
        num_kv_heads=8,
        head_dim=head_dim,
        dtype=torch.bfloat16,
        device="cuda",
        seed=head_dim,
    )
    out = run_kernel(poison_before_windows(case, 1024), num_splits, sliding_window=1024)
    assert_matches_reference(case, out, sliding_window=1024)

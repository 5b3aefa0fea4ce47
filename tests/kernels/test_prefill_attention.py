"""Paged prefill/extend attention (Triton) against the plain-torch reference, on fresh random
inputs.

On CPU the kernel runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1) on tiny
ragged batches that mix a first prefill, an extend over a cached prefix and a decode-like row.
The interpreter computes bfloat16 `tl.dot` wrongly (Triton 3.9), so there the kernel upcasts
bfloat16 operands to float32: the CPU bfloat16 tests check paging, masking and the softmax, and
the `gpu` tests check the real bfloat16 tensor-core path.

Every cache slot a sequence does not own (unallocated blocks, the tail of its last block) holds
NaN, so any read past a sequence's context shows up as a NaN in the output.

Tolerances, against a float32 reference on the same (rounded) inputs:
- float32: 1e-5 abs/rel (both matmuls run in IEEE fp32, not tf32);
- float16: 4e-3 abs/rel (probabilities rounded to fp16 before P @ V, one output ulp);
- bfloat16: 3e-2 abs/rel (the same with 8 mantissa bits instead of 11).
An FP8 cache is read on the FP8 tensor cores, q and the softmax probabilities quantized to e4m3:
compared with the reference on the same cache (which quantizes them the same way) and with exact
attention on the dequantized values, within the bounds of `fp8_attention_bounds`.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest
import torch

from kernels.errors import KernelInputError
from kernels.launch_checks import triton_interprets
from kernels.ops import AttentionMetadata
from kernels.prefill_attention import PrefillConfig, paged_prefill_attention
from kernels.reference import paged_attention, quantize_kv

from .fp8_attention_bounds import (
    WORST_VS_FP8_REFERENCE,
    assert_fp8_attention_close,
    fp8_score_sums_worst,
)

TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class PrefillCase:
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    meta: AttentionMetadata
    scale: float
    seed: int  # reported on a mismatch, to replay the exact inputs

    def run(self, **overrides: object) -> torch.Tensor:
        args = {
            "q": self.q,
            "k_cache": self.k_cache,
            "v_cache": self.v_cache,
            "block_tables": self.block_tables,
            "seq_lens": self.seq_lens,
            "query_start_loc": self.query_start_loc,
            "max_query_len": self.meta.max_query_len,
            "scale": self.scale,
        }
        args.update(overrides)
        return paged_prefill_attention(**args)

    def reference(
        self, sliding_window: int | None = None, sinks: torch.Tensor | None = None
    ) -> torch.Tensor:
        """float32 reference on the same rounded inputs: [T, Hq, D] float32."""
        return paged_attention(
            self.q.float(),
            self.k_cache.float(),
            self.v_cache.float(),
            self.meta,
            self.scale,
            sliding_window,
            sinks=sinks,
        )


def make_case(
    query_lens: list[int],
    num_cached: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int = 16,
    device: str = DEVICE,
    seed: int | None = None,
) -> PrefillCase:
    """A random batch whose sequence b has num_cached[b] cached tokens plus query_lens[b] new
    ones. Blocks come from a random permutation of a pool with spare blocks, so they are
    scattered; unused table entries point at a spare block. Slots no sequence owns hold NaN."""
    seed = random.randrange(2**31) if seed is None else seed
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(num_cached, query_lens, strict=True)]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    perm = torch.randperm(num_blocks, generator=gen, dtype=torch.int32)
    # The last two blocks of the permutation are spares: padding entries and poison.
    block_tables = torch.full((len(seq_lens), max([*blocks_per_seq, 1]) + 1), int(perm[-1]))
    block_tables = block_tables.to(torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    used = 0
    for b, (seq_len, n) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
        block_tables[b, :n] = perm[used : used + n]
        used += n
        slots = torch.arange(seq_len)
        blocks = block_tables[b, slots // block_size].long()
        k_cache[blocks, slots % block_size] = torch.randn(
            seq_len, num_kv_heads, head_dim, generator=gen
        )
        v_cache[blocks, slots % block_size] = torch.randn(
            seq_len, num_kv_heads, head_dim, generator=gen
        )
    q = torch.randn(sum(query_lens), num_q_heads, head_dim, generator=gen)

    block_tables = block_tables.to(device)
    meta = AttentionMetadata.build(
        torch.zeros(sum(query_lens), dtype=torch.int64, device=device),
        block_tables,
        seq_lens,
        query_lens,
    )
    return PrefillCase(
        q=q.to(device, dtype),
        k_cache=k_cache.to(device, dtype),
        v_cache=v_cache.to(device, dtype),
        block_tables=block_tables,
        seq_lens=meta.seq_lens_t,
        query_start_loc=meta.query_start_loc,
        meta=meta,
        scale=head_dim**-0.5,
        seed=seed,
    )


def assert_matches_reference(
    case: PrefillCase, out: torch.Tensor, sliding_window: int | None = None
) -> None:
    assert out.dtype == case.q.dtype
    assert out.shape == case.q.shape
    tol = TOLERANCE[case.q.dtype]
    torch.testing.assert_close(
        out.float(),
        case.reference(sliding_window),
        atol=tol,
        rtol=tol,
        msg=lambda detail: f"{detail}\nreplay with make_case(..., seed={case.seed})",
    )


def check_fp8_cache(
    case: PrefillCase, sliding_window: int | None = None, sinks: torch.Tensor | None = None
) -> None:
    """Quantize the case's caches to e4m3 at scales other than 1 (a kernel that skipped or
    swapped them fails) and compare with the reference on that cache and with exact attention
    on the dequantized values."""
    device = case.q.device
    scales = {"k_scale": torch.tensor([0.02], device=device),
              "v_scale": torch.tensor([0.5], device=device)}  # fmt: skip
    k_fp8 = quantize_kv(case.k_cache, scales["k_scale"])
    v_fp8 = quantize_kv(case.v_cache, scales["v_scale"])
    fp8_case = replace(case, k_cache=k_fp8, v_cache=v_fp8)
    out = fp8_case.run(sliding_window=sliding_window, sinks=sinks, **scales)
    assert out.dtype == case.q.dtype
    fp8_reference = paged_attention(
        case.q.float(), k_fp8, v_fp8, case.meta, case.scale, sliding_window, **scales, sinks=sinks
    )
    dequantized = replace(
        case, k_cache=k_fp8.float() * scales["k_scale"], v_cache=v_fp8.float() * scales["v_scale"]
    )
    exact = dequantized.reference(sliding_window, sinks)
    # Compiled for the GPU, the score product runs on FP8 tensor cores (from head_dim 32 up:
    # kernels.fp8_attention.dot_e4m3); the interpreter's sums are float32.
    float32_sums = triton_interprets() or case.q.shape[-1] < 32
    assert_fp8_attention_close(
        out,
        fp8_reference,
        exact,
        output_atol=TOLERANCE[case.q.dtype],
        score_sums_worst=0.0 if float32_sums else fp8_score_sums_worst(dequantized.v_cache),
    )


# (query_lens, num_cached): a one-token first prefill, an extend, a chunk after a full block;
# then the same lengths paired so there is a decode row, a pure prefill and an extend whose
# context ends off a block boundary.
RAGGED_BATCHES = [
    pytest.param([1, 5, 17], [0, 3, 16], id="prefill1-extend-chunk"),
    pytest.param([1, 5, 17], [16, 0, 3], id="decode-prefill-extend"),
]


@pytest.mark.parametrize(("query_lens", "num_cached"), RAGGED_BATCHES)
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(2, 2), (4, 1), (8, 1)])
@pytest.mark.parametrize("head_dim", [16, 32])
def test_matches_reference_on_ragged_batch_float32(
    query_lens: list[int], num_cached: list[int], num_q_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    case = make_case(
        query_lens,
        num_cached,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=torch.float32,
    )
    assert_matches_reference(case, case.run())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("query_lens", "num_cached"), RAGGED_BATCHES)
def test_matches_reference_in_half_precision(
    dtype: torch.dtype, query_lens: list[int], num_cached: list[int]
) -> None:
    case = make_case(
        query_lens, num_cached, num_q_heads=8, num_kv_heads=2, head_dim=32, dtype=dtype
    )
    assert_matches_reference(case, case.run())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("query_lens", "num_cached"), RAGGED_BATCHES)
def test_fp8_cache_attention_quantizes_q_and_p_as_the_reference_does(
    dtype: torch.dtype, query_lens: list[int], num_cached: list[int]
) -> None:
    case = make_case(
        query_lens, num_cached, num_q_heads=8, num_kv_heads=2, head_dim=32, dtype=dtype
    )
    check_fp8_cache(case)


@pytest.mark.parametrize("head_dim", [16, 64], ids=["v-tile", "v-word-planes"])
def test_fp8_cache_attention_over_many_key_tiles_with_a_window(head_dim: int) -> None:
    """Several key tiles per row (the running maximum rises from tile to tile, so P is
    quantized against different maxima), a padding sequence and a window edge. At head_dim 64
    V is read as int32 words in four byte planes (kernels.fp8_attention's e4m3_planes)."""
    case = make_case(
        [40, 0, 3], [45, 0, 70], num_q_heads=4, num_kv_heads=1, head_dim=head_dim,
        dtype=torch.float16,
    )  # fmt: skip
    check_fp8_cache(case)
    check_fp8_cache(case, sliding_window=37)


def test_fp8_v_word_planes_give_the_e4m3_tiles_output() -> None:
    """The same FP8 cache read through V's word planes and, from a copy one byte into its
    buffer (off a word: the launcher falls back), as one e4m3 tile: the same products, so the
    same output (masked and unmasked tiles, a padding sequence, grouped heads)."""
    case = make_case(
        [40, 0, 3, 17], [45, 0, 70, 16], num_q_heads=8, num_kv_heads=2, head_dim=64,
        dtype=torch.float32,
    )  # fmt: skip
    scales = {"k_scale": torch.tensor([0.02], device=case.q.device),
              "v_scale": torch.tensor([0.5], device=case.q.device)}  # fmt: skip
    k_fp8 = quantize_kv(case.k_cache, scales["k_scale"])
    v_fp8 = quantize_kv(case.v_cache, scales["v_scale"])
    buffer = torch.empty(v_fp8.numel() + 1, dtype=v_fp8.dtype, device=v_fp8.device)
    unaligned = buffer[1:].view(v_fp8.shape)
    unaligned.copy_(v_fp8)
    planes = replace(case, k_cache=k_fp8, v_cache=v_fp8).run(**scales)
    tile = replace(case, k_cache=k_fp8, v_cache=unaligned).run(**scales)
    if triton_interprets():
        torch.testing.assert_close(planes, tile, atol=1e-6, rtol=1e-6)
    else:
        # On sm_90 the tile's product is an e4m3 wgmma, whose sums across K keep fewer bits
        # than the planes' float16 wgmma: a rare element moves by about a P weight's rounding
        # step (measured on the H100: worst 0.004-0.016, mean under 1e-5). A plane in the wrong
        # columns would move most elements by the values themselves.
        apart = (planes.float() - tile.float()).abs()
        assert apart.max() <= WORST_VS_FP8_REFERENCE and apart.mean() <= 1e-4, apart.max()


@pytest.mark.parametrize("sliding_window", [None, 7])
def test_matches_reference_with_attention_sinks(sliding_window: int | None) -> None:
    """gpt-oss's sinks start each row's softmax state: a row whose window or causal limit hides
    most keys still gives the sink its share; the FP8 cache's arithmetic too."""
    case = make_case(
        [1, 5, 17], [16, 0, 3], num_q_heads=8, num_kv_heads=2, head_dim=16, dtype=torch.float32
    )
    sinks = 3.0 + torch.randn(8, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    out = case.run(sliding_window=sliding_window, sinks=sinks)
    expected = case.reference(sliding_window, sinks)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert (expected - case.reference(sliding_window)).abs().max() > 0.05, "sinks should matter"
    check_fp8_cache(case, sliding_window, sinks)


@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(4, 4), (8, 2), (8, 1)])
def test_matches_reference_with_block_size_8(num_q_heads: int, num_kv_heads: int) -> None:
    case = make_case(
        [1, 5, 17],
        [16, 3, 0],
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=16,
        dtype=torch.float32,
        block_size=8,
    )
    assert_matches_reference(case, case.run())


@pytest.mark.parametrize(
    ("query_lens", "num_cached"),
    [
        pytest.param([16, 1, 32], [0, 15, 16], id="ends-on-boundary"),
        pytest.param([15, 2, 16], [2, 15, 17], id="ends-one-past-or-before"),
    ],
)
def test_matches_reference_at_block_boundaries(
    query_lens: list[int], num_cached: list[int]
) -> None:
    case = make_case(
        query_lens, num_cached, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32
    )
    assert_matches_reference(case, case.run())


@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads"),
    [pytest.param(6, 2, id="group3-one-head-per-program"), pytest.param(12, 2, id="group6-pack2")],
)
def test_matches_reference_with_group_not_a_power_of_two(
    num_q_heads: int, num_kv_heads: int
) -> None:
    case = make_case(
        [1, 5, 17],
        [16, 0, 3],
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=16,
        dtype=torch.float32,
    )
    assert_matches_reference(case, case.run())


def test_matches_reference_over_many_key_tiles() -> None:
    """A long prefix and a chunk spanning several query tiles: unmasked and diagonal tiles both."""
    case = make_case(
        [40, 3], [45, 70], num_q_heads=2, num_kv_heads=1, head_dim=16, dtype=torch.float32
    )
    assert_matches_reference(case, case.run())


def test_skips_padding_sequence_with_no_queries() -> None:
    case = make_case(
        [5, 0, 3], [3, 0, 20], num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32
    )
    assert_matches_reference(case, case.run())


@pytest.mark.parametrize("first", [0, 2, 3])
def test_a_first_sequence_on_the_device_leaves_the_ones_before_it_out(first: int) -> None:
    case = make_case([1, 1, 6, 3], [9, 30, 0, 17], num_q_heads=4, num_kv_heads=2, head_dim=16,
                     dtype=torch.float16)  # fmt: skip
    full = case.run()
    out = torch.full_like(case.q, 7.0)
    case.run(out=out, first_seq=torch.tensor([first], dtype=torch.int32, device=case.q.device))
    skipped = sum(case.meta.query_lens[:first])  # the rows of the sequences left out
    assert bool((out[:skipped] == 7.0).all())
    assert torch.equal(out[skipped:], full[skipped:])


def test_ignores_cache_slots_past_each_context() -> None:
    """Every slot outside the contexts is NaN (see make_case): one stray read poisons a row."""
    case = make_case(
        [3, 9], [2, 20], num_q_heads=4, num_kv_heads=4, head_dim=16, dtype=torch.float32
    )
    assert torch.isnan(case.k_cache).any()
    assert torch.isfinite(case.run()).all()


def test_accepts_strided_views_and_writes_into_out() -> None:
    """q sliced from a fused qkv projection, caches from one [num_blocks, 2, ...] tensor, out a
    view into a wider buffer: only the last dim is contiguous."""
    base = make_case(
        [1, 5, 17], [16, 0, 3], num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32
    )
    num_tokens, num_q_heads, head_dim = base.q.shape
    qkv = torch.randn(num_tokens, num_q_heads + 4, head_dim, device=DEVICE)
    qkv[:, :num_q_heads] = base.q
    kv = torch.stack((base.k_cache, base.v_cache), dim=1)  # [num_blocks, 2, bs, Hkv, D]
    wide = torch.zeros(num_tokens, num_q_heads, 2 * head_dim, device=DEVICE)
    case = replace(base, q=qkv[:, :num_q_heads], k_cache=kv[:, 0], v_cache=kv[:, 1])
    assert not case.q.is_contiguous() and not case.k_cache.is_contiguous()

    out = case.run(out=wide[..., :head_dim])

    assert out.data_ptr() == wide.data_ptr()
    assert_matches_reference(case, out)
    assert (wide[..., head_dim:] == 0).all()


def _tiny_case() -> PrefillCase:
    return make_case(
        [1, 5], [3, 0], num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32
    )


# Each entry: (id, overrides of the valid tiny case, words the error message must contain).
BAD_INPUTS: list[tuple[str, Callable[[PrefillCase], dict[str, object]], str]] = [
    ("q-2d", lambda c: {"q": c.q[:, 0]}, "q must be [T, Hq, D]"),
    ("cache-3d", lambda c: {"k_cache": c.k_cache[0]}, "k_cache must be"),
    ("v-shape", lambda c: {"v_cache": c.v_cache[:-1]}, "v_cache shape"),
    ("q-float64", lambda c: {"q": c.q.double()}, "q dtype"),
    ("cache-dtype", lambda c: {"k_cache": c.k_cache.half()}, "k_cache dtype"),
    ("head-dim-mismatch", lambda c: {"q": torch.cat((c.q, c.q), -1)}, "head_dim mismatch"),
    (
        "head-dim-not-pow2",
        lambda c: {
            "q": c.q[..., :12].contiguous(),
            "k_cache": c.k_cache[..., :12].contiguous(),
            "v_cache": c.v_cache[..., :12].contiguous(),
        },
        "power of two",
    ),
    ("gqa-ratio", lambda c: {"q": c.q[:, :3]}, "multiple of num_kv_heads"),
    ("block-tables-int64", lambda c: {"block_tables": c.block_tables.long()}, "block_tables"),
    ("seq-lens-int64", lambda c: {"seq_lens": c.seq_lens.long()}, "seq_lens must be int32"),
    (
        "query-start-int64",
        lambda c: {"query_start_loc": c.query_start_loc.long()},
        "query_start_loc must be int32",
    ),
    ("block-tables-1d", lambda c: {"block_tables": c.block_tables[0]}, "block_tables must be"),
    ("seq-lens-length", lambda c: {"seq_lens": c.seq_lens[:1]}, "seq_lens must be [B]"),
    (
        "query-start-length",
        lambda c: {"query_start_loc": c.query_start_loc[:-1]},
        "query_start_loc must be [B + 1]",
    ),
    ("max-query-len-zero", lambda c: {"max_query_len": 0}, "max_query_len"),
    ("max-query-len-past-t", lambda c: {"max_query_len": 7}, "max_query_len"),
    ("max-query-len-float", lambda c: {"max_query_len": 5.0}, "max_query_len must be an int"),
    (
        "q-last-dim-strided",
        lambda c: {"q": torch.stack((c.q, c.q), -1).flatten(-2)[..., ::2]},
        "q must be contiguous in its last dim",
    ),
    (
        "cache-last-dim-strided",
        lambda c: {"k_cache": c.k_cache.transpose(-1, -2).contiguous().transpose(-1, -2)},
        "k_cache must be contiguous in its last dim",
    ),
    ("scale-nan", lambda c: {"scale": float("nan")}, "scale"),
    ("scale-negative", lambda c: {"scale": -1.0}, "scale"),
    ("out-dtype", lambda c: {"out": torch.empty_like(c.q, dtype=torch.float16)}, "out must be"),
    ("out-shape", lambda c: {"out": c.q[:-1].clone()}, "out must be"),
    ("mixed-devices", lambda c: {"seq_lens": c.seq_lens.to("meta")}, "one device"),
    ("config-block-m", lambda c: {"config": PrefillConfig(24, 16, 4, 1)}, "config.block_m"),
    ("config-block-n", lambda c: {"config": PrefillConfig(16, 8, 4, 1)}, "config.block_n"),
    (
        "first-seq-int64",
        lambda c: {"first_seq": torch.zeros(1, dtype=torch.int64, device=c.q.device)},
        "first_seq must be a [1] int32 tensor",
    ),
    (
        "first-seq-shape",
        lambda c: {"first_seq": torch.zeros((), dtype=torch.int32, device=c.q.device)},
        "first_seq must be a [1] int32 tensor",
    ),
]


@pytest.mark.parametrize(
    ("overrides", "message"), [pytest.param(o, m, id=i) for i, o, m in BAD_INPUTS]
)
def test_rejects_bad_input_naming_the_problem(
    overrides: Callable[[PrefillCase], dict[str, object]], message: str
) -> None:
    case = _tiny_case()
    with pytest.raises(KernelInputError, match=re.escape(message)):
        case.run(**overrides(case))


def test_rejects_cpu_tensors_without_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    case = make_case(
        [2], [1], num_q_heads=2, num_kv_heads=1, head_dim=16, dtype=torch.float32, device="cpu"
    )
    with pytest.raises(KernelInputError, match="CUDA"):
        case.run()


def test_input_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="scale"):
        _tiny_case().run(scale=0.0)


# ---------------------------------------------------------------------------------------------
# GPU: realistic sizes, bfloat16 and float16 on the tensor cores.


def _gpu_batch(layout: str, rng: random.Random) -> tuple[list[int], list[int]]:
    """(query_lens, num_cached) of one named batch layout, drawn afresh from rng."""
    if layout == "prefill-8x2048":
        return [2048] * 8, [0] * 8
    if layout == "extend-ragged":
        return [rng.randint(1, 2048) for _ in range(8)], [rng.randint(0, 1000) for _ in range(8)]
    if layout == "mixed-with-decode":
        return [1, 1, 300, 1500, 1, 777], [rng.randint(0, 1000) for _ in range(6)]
    assert layout == "block-boundaries"
    return [16, 17, 15, 1, 64, 33], [0, 16, 31, 15, 1000 - 1000 % 16, 1]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "layout", ["prefill-8x2048", "extend-ragged", "mixed-with-decode", "block-boundaries"]
)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_reference_on_gpu(
    layout: str, group: int, head_dim: int, dtype: torch.dtype
) -> None:
    seed = random.randrange(2**31)
    query_lens, num_cached = _gpu_batch(layout, random.Random(seed))
    case = make_case(
        query_lens,
        num_cached,
        num_q_heads=8,
        num_kv_heads=8 // group,
        head_dim=head_dim,
        dtype=dtype,
        device="cuda",
        seed=seed,
    )
    assert_matches_reference(case, case.run())


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["prefill-8x2048", "extend-ragged", "mixed-with-decode"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fp8_cache_attention_stays_within_its_bounds_on_gpu(
    layout: str, dtype: torch.dtype, head_dim: int
) -> None:
    seed = random.randrange(2**31)
    query_lens, num_cached = _gpu_batch(layout, random.Random(seed))
    case = make_case(
        query_lens,
        num_cached,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=head_dim,
        dtype=dtype,
        device="cuda",
        seed=seed,
    )
    check_fp8_cache(case)


@pytest.mark.gpu
def test_fp8_cache_attention_with_gemma_windows_on_gpu() -> None:
    """head_dim 256 (its own tile sizes) and a 1024-token window crossing the chunks."""
    case = make_case([1500, 300, 1, 700], [0, 900, 3000, 200], num_q_heads=8, num_kv_heads=4,
                     head_dim=256, dtype=torch.bfloat16, device="cuda")  # fmt: skip
    check_fp8_cache(case, sliding_window=1024)


def test_matches_reference_at_head_dim_512() -> None:
    """Gemma 4's global layers: heads of 512, chunks after cached context."""
    case = make_case([5, 17, 1], [16, 0, 3], num_q_heads=4, num_kv_heads=1, head_dim=512,
                     dtype=torch.float32)  # fmt: skip
    assert_matches_reference(case, case.run())


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [32, 256, 512])
def test_matches_reference_on_gpu_at_edge_head_dims(head_dim: int) -> None:
    case = make_case(
        [300, 1, 700],
        [500, 900, 0],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=head_dim,
        dtype=torch.bfloat16,
        device="cuda",
    )
    assert_matches_reference(case, case.run())


@pytest.mark.gpu
def test_matches_reference_on_gpu_in_float32() -> None:
    case = make_case(
        [500, 1, 64],
        [100, 300, 0],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=128,
        dtype=torch.float32,
        device="cuda",
    )
    assert_matches_reference(case, case.run())


def _poison_before_windows(case: PrefillCase, window: int) -> PrefillCase:
    """A copy whose keys and values are NaN at every position before the first query's window,
    which the kernel must then never read: the block manager may have freed those blocks and
    handed them to other sequences."""
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    block_size = k_cache.shape[1]
    tables = case.block_tables.tolist()
    lengths = zip(case.meta.seq_lens, case.meta.query_lens, strict=True)
    for b, (seq_len, query_len) in enumerate(lengths):
        unseen = max(seq_len - query_len - window + 1, 0)
        for pos in range(unseen):
            block = tables[b][pos // block_size]
            k_cache[block, pos % block_size] = float("nan")
            v_cache[block, pos % block_size] = float("nan")
    return replace(case, k_cache=k_cache, v_cache=v_cache)


# (query_lens, num_cached): a first prefill longer than the window, an extend whose chunk
# crosses the window edge, a decode row far past it, and one short of it.
WINDOWED_BATCH = ([70, 9, 1, 3], [0, 150, 200, 2])


@pytest.mark.parametrize("window", [1, 16, 37])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(2, 2), (4, 1)])
def test_windowed_attention_matches_reference_and_reads_nothing_before_the_window(
    window: int, num_q_heads: int, num_kv_heads: int
) -> None:
    query_lens, num_cached = WINDOWED_BATCH
    case = make_case(
        query_lens,
        num_cached,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=16,
        dtype=torch.float32,
    )
    out = _poison_before_windows(case, window).run(sliding_window=window)
    assert_matches_reference(case, out, sliding_window=window)


def test_a_window_wider_than_every_context_changes_nothing() -> None:
    case = make_case([20, 3], [0, 30], num_q_heads=2, num_kv_heads=1, head_dim=16,
                     dtype=torch.float32)  # fmt: skip
    torch.testing.assert_close(case.run(sliding_window=1000), case.run(), atol=0, rtol=0)


@pytest.mark.parametrize("window", [0, -3, 2.5, True])
def test_rejects_a_window_that_is_not_a_positive_int(window: object) -> None:
    with pytest.raises(KernelInputError, match="sliding_window"):
        _tiny_case().run(sliding_window=window)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("window", [512, 1024])
def test_windowed_attention_matches_reference_on_gpu_in_bfloat16(
    head_dim: int, window: int
) -> None:
    # Gemma 3's shapes: head_dim 256, 1024-token windows; chunks crossing the window edge.
    case = make_case(
        [1500, 300, 1, 700],
        [0, 900, 3000, 200],
        num_q_heads=8,
        num_kv_heads=4,
        head_dim=head_dim,
        dtype=torch.bfloat16,
        device="cuda",
    )
    out = _poison_before_windows(case, window).run(sliding_window=window)
    assert_matches_reference(case, out, sliding_window=window)


@pytest.mark.gpu
def test_one_compiled_variant_serves_every_block_table_width() -> None:
    """Serving meets block tables of every width; a variant specialized on the width (1, a
    multiple of 16, other) would be compiled at its first step while serving, seconds during
    which every request waits (issue 17: TTFT p99 2 s at 10 req/s, from the first mixed step)."""
    from kernels.prefill_attention import _paged_prefill_attention_kernel as kernel

    def num_compiled() -> int:
        kernel_cache = kernel.device_caches[torch.cuda.current_device()][0]
        return len(kernel_cache)

    before = None
    for num_cached in (0, 255, 256, 511):  # tables of 1, 16, 17 and 32 blocks
        case = make_case(
            [1, 40],
            [num_cached, 3],
            num_q_heads=8,
            num_kv_heads=2,
            head_dim=128,
            dtype=torch.bfloat16,
            device="cuda",
        )
        assert_matches_reference(case, case.run())
        before = num_compiled() if before is None else before
    assert num_compiled() == before


@pytest.mark.gpu
def test_one_compiled_variant_serves_lengths_and_tables_at_any_offset() -> None:
    """A mixed step passes the prefill kernel its sequences' lengths, start rows and block
    tables as views past its decode rows (`kernels.triton_ops.paged_attention`), so those
    pointers are 16-byte aligned only when the decodes are a multiple of 4 (of 4 and the
    tables' width): a variant specialized on alignment would be compiled while serving, the
    first time a step has another number of decodes (issue 17, W3 on the H100)."""
    from kernels.prefill_attention import _paged_prefill_attention_kernel as kernel

    def num_compiled() -> int:
        return len(kernel.device_caches[torch.cuda.current_device()][0])

    case = make_case(
        [1, 40],
        [37, 3],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=128,
        dtype=torch.bfloat16,
        device="cuda",
    )
    expected = case.run()
    before = num_compiled()
    for offset in (1, 2, 3):

        def past(t: torch.Tensor, offset: int = offset) -> torch.Tensor:
            return torch.cat([t[:1].expand(offset, *t.shape[1:]), t])[offset:]

        out = case.run(
            block_tables=past(case.block_tables),
            seq_lens=past(case.seq_lens),
            query_start_loc=past(case.query_start_loc),
        )
        assert torch.equal(out, expected)
    assert num_compiled() == before

"""Kernel micro-benchmarks against the measured ceilings of the same run (GPU machine).

Each kernel is first checked against its plain-torch reference on fresh random inputs, then
timed with `triton.testing.do_bench` (median). Decode attention reports KV bytes read per
second against the copy bandwidth; prefill attention reports FLOP/s against the bf16 matmul
rate. Shapes are those of PERFORMANCE.md (Llama-3.1-8B heads: 32 query, 8 KV, head dim 128).
The skinny projections (decode batches of at most 16 rows) report weight bytes streamed per
second against the copy bandwidth, beside cuBLAS on the same shapes; `--sweep-linear` also
times a grid of tile configurations and prints the fastest per shape. The FP8 (W8A8)
projections (`kernels.fp8_linear`: at one row the weight-only FP8 GEMV, at more per-token
activation quantization, then the FP8-in-registers skinny kernel or cuBLASLt's FP8 matmul) are
timed as the engine runs them beside the bf16 path on the same shapes at 1, 16, 256, 512 (W2's
decode steps) and 8,192 rows (its prompt steps); `--fp8-only` times just those, and
`--sweep-fp8` first times a grid of the one-row GEMV's tiles on FP8 weights and prints the
fastest per shape.

`--fp8-kv` times the attention kernels over a bf16 and an FP8 (e4m3) KV cache at W2's shapes:
decode of 256 sequences at 768 tokens of context, prefill of 8 × 2048 new tokens without and
over a 1024-token cached prefix, and a W2 mixed step (256 decode rows beside 15 prompts of 512
tokens) through the prefill kernel alone and as the engine routes it (decode rows through the
decode kernel), each checked first against `kernels.reference` (the FP8 runs against its FP8
arithmetic), and the KV write of 256 and 8192 tokens. Decode and the write report bytes per
second against copy bandwidth, prefill FLOP/s against the bf16 and FP8 matmul rates.
`--sweep-attention` also times a grid of tiles for both kernels and both caches at those
shapes and prints the fastest.

    python bench/kernel_micro.py [--sweep-linear] [--fp8-only] [--sweep-fp8] [--fp8-kv]
                                 [--sweep-attention [both|decode|prefill]]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import subprocess
from collections.abc import Callable

import torch
import triton

from kernels import fp8, pdl, reference, triton_ops
from kernels.activation import silu_and_mul
from kernels.decode_attention import DecodeConfig, choose_num_splits, paged_decode_attention
from kernels.linear import LinearConfig, gemv, linear, silu_mul_linear
from kernels.ops import AttentionMetadata, Fp8Weight
from kernels.prefill_attention import PrefillConfig, paged_prefill_attention
from kernels.rmsnorm import add_rms_norm

HQ, HKV, D, BLOCK = 32, 8, 128, 16
DTYPE = torch.bfloat16


def ceilings() -> tuple[float, float]:
    src = torch.empty(2**30, dtype=DTYPE, device="cuda").normal_()
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300)
    a = torch.randn(8192, 8192, dtype=DTYPE, device="cuda")
    mm_ms = triton.testing.do_bench(lambda: a @ a, warmup=50, rep=300)
    return 4 * src.numel() / (copy_ms * 1e-3), 2 * 8192**3 / (mm_ms * 1e-3)


def print_header() -> tuple[float, float]:
    """Print what the run's figures were measured on (device, torch and triton versions, the
    commit: INFERNO_COMMIT or git's) and the ceilings measured now; return those ceilings
    (copy bytes/s, bf16 matmul FLOP/s)."""
    props = torch.cuda.get_device_properties(0)
    commit = (
        os.environ.get("INFERNO_COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
    )
    print(f"device {props.name}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"commit {commit}")
    copy_bw, matmul_rate = ceilings()
    print(f"ceilings: copy {copy_bw / 1e12:.2f} TB/s, bf16 matmul {matmul_rate / 1e12:.0f} TFLOP/s")
    return copy_bw, matmul_rate


def paged_inputs(seq_lens: list[int], query_lens: list[int]):
    """Random q and a KV pool with each sequence's blocks scattered over it."""
    blocks_per_seq = [-(-n // BLOCK) for n in seq_lens]
    num_blocks = sum(blocks_per_seq)
    order = torch.randperm(num_blocks).tolist()
    tables, start = [], 0
    for n in blocks_per_seq:
        tables.append(order[start : start + n])
        start += n
    width = max(blocks_per_seq)
    block_tables = torch.tensor(
        [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device="cuda"
    )
    k_cache = torch.randn(num_blocks, BLOCK, HKV, D, dtype=DTYPE, device="cuda")
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(sum(query_lens), HQ, D, dtype=DTYPE, device="cuda")
    slots = torch.zeros(sum(query_lens), dtype=torch.int64, device="cuda")
    meta = AttentionMetadata.build(slots, block_tables, seq_lens=seq_lens, query_lens=query_lens)
    return q, k_cache, v_cache, meta


def check(name: str, ours: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float = 0.0) -> None:
    """Every element within atol + rtol * |reference|, or the run stops."""
    err = (ours.float() - ref.float()).abs()
    excess = (err - rtol * ref.float().abs()).max().item()
    status = "ok" if excess <= atol else "MISMATCH"
    print(f"check {name}: max abs error {err.max().item():.3g} {status}", flush=True)
    if excess > atol:
        raise SystemExit(f"{name} disagrees with its reference (atol {atol}, rtol {rtol})")


def decode(copy_bw: float, batch: int = 64, context: int = 4096) -> str:
    q, k_cache, v_cache, meta = paged_inputs([context] * batch, [1] * batch)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = choose_num_splits(batch, HKV, context, sms)
    scale = D**-0.5

    def run() -> torch.Tensor:
        return paged_decode_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens_t, scale, num_splits=splits
        )

    check(
        "decode attention", run(), reference.paged_attention(q, k_cache, v_cache, meta, scale), 3e-2
    )
    ms = triton.testing.do_bench(run, warmup=25, rep=200)
    kv_bytes = 2 * batch * context * HKV * D * k_cache.element_size()
    rate = kv_bytes / (ms * 1e-3)
    return (
        f"| decode attention, batch {batch}, context {context}, {splits} split(s) | "
        f"{ms * 1e3:.0f} µs | {rate / 1e12:.2f} TB/s KV read = {rate / copy_bw:.0%} of copy | "
        "goal ≥ 80% |"
    )


def prefill(matmul_rate: float, batch: int = 8, length: int = 2048) -> str:
    q, k_cache, v_cache, meta = paged_inputs([length] * batch, [length] * batch)
    scale = D**-0.5

    def run() -> torch.Tensor:
        return paged_prefill_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens_t, meta.query_start_loc,
            max_query_len=length, scale=scale,
        )  # fmt: skip

    check(
        "prefill attention",
        run(),
        reference.paged_attention(q, k_cache, v_cache, meta, scale),
        3e-2,
    )
    ms = triton.testing.do_bench(run, warmup=25, rep=200)
    # Causal: half of the S x S score and value products, 2 matmuls of 2 FLOP each.
    flops = batch * HQ * 2 * 2 * D * length * length / 2
    rate = flops / (ms * 1e-3)
    return (
        f"| prefill attention, {batch} × {length}, causal | {ms * 1e3:.0f} µs | "
        f"{rate / 1e12:.0f} TFLOP/s = {rate / matmul_rate:.0%} of matmul | |"
    )


def fp8_matmul_rate() -> float:
    """FLOP/s of cuBLASLt's FP8 matmul (8192³, per-tensor scales): FP8 attention's ceiling."""
    a = torch.randn(8192, 8192, device="cuda").to(fp8.FP8_DTYPE)
    b = torch.randn(8192, 8192, device="cuda").to(fp8.FP8_DTYPE).T  # column-major, as required
    one = torch.ones((), device="cuda")
    ms = triton.testing.do_bench(
        lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=DTYPE),
        warmup=50,
        rep=300,
    )
    return 2 * 8192**3 / (ms * 1e-3)


class KvCaches:
    """One batch's q and metadata over a bf16 cache and the same cache in e4m3 (scale 1: the
    random values are far inside e4m3's range)."""

    def __init__(self, seq_lens: list[int], query_lens: list[int]) -> None:
        self.q, self.k_cache, self.v_cache, self.meta = paged_inputs(seq_lens, query_lens)
        self.scales = {
            "k_scale": torch.ones(1, device="cuda"),
            "v_scale": torch.ones(1, device="cuda"),
        }
        self.k_fp8 = reference.quantize_kv(self.k_cache, self.scales["k_scale"])
        self.v_fp8 = reference.quantize_kv(self.v_cache, self.scales["v_scale"])

    def caches(self, fp8_kv: bool) -> dict[str, torch.Tensor]:
        if fp8_kv:
            return {"k_cache": self.k_fp8, "v_cache": self.v_fp8, **self.scales}
        return {"k_cache": self.k_cache, "v_cache": self.v_cache}

    def check(self, name: str, out: torch.Tensor, fp8_kv: bool) -> None:
        """bf16: the reference's bf16 tolerance. FP8: the kernels' bound against exact attention
        over the dequantized cache (tests/kernels/fp8_attention_bounds.py's, plus bf16
        rounding); the distance from the reference's FP8 arithmetic is printed beside it."""
        ref = reference.paged_attention(self.q, meta=self.meta, scale=D**-0.5,
                                        **self.caches(fp8_kv))  # fmt: skip
        if not fp8_kv:
            check(f"{name}, bf16 KV", out, ref, 3e-2)
            return
        exact = reference.paged_attention(
            self.q.float(), self.k_fp8.float(), self.v_fp8.float(), self.meta, D**-0.5
        )
        apart = (out.float() - ref.float()).abs()
        print(f"  {name}, FP8 KV, from the FP8 reference: max {apart.max().item():.3g}, "
              f"mean {apart.mean().item():.3g}")  # fmt: skip
        check(f"{name}, FP8 KV, against exact attention", out, exact, 0.3 + 2e-2)


def decode_kv(
    copy_bw: float, fp8_kv: bool, batch: int = 256, context: int = 768,
    config: DecodeConfig | None = None, inputs: KvCaches | None = None,
) -> tuple[float, str]:  # fmt: skip
    """(ms, table row) of decode attention over one cache kind at W2's decode shape."""
    inputs = inputs or KvCaches([context] * batch, [1] * batch)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = choose_num_splits(batch, HKV, context, sms)
    caches = inputs.caches(fp8_kv)

    def run() -> torch.Tensor:
        return paged_decode_attention(
            inputs.q,
            block_tables=inputs.meta.block_tables,
            seq_lens=inputs.meta.seq_lens_t,
            scale=D**-0.5,
            num_splits=splits,
            config=config,
            **caches,
        )

    if config is None:
        inputs.check("decode attention", run(), fp8_kv)
    ms = triton.testing.do_bench(run, warmup=25, rep=200)
    kv_bytes = 2 * batch * context * HKV * D * caches["k_cache"].element_size()
    rate = kv_bytes / (ms * 1e-3)
    return ms, (
        f"| decode attention, {batch} × {context}, {'FP8' if fp8_kv else 'bf16'} KV, "
        f"{splits} split(s) | {ms * 1e3:.0f} µs | "
        f"{rate / 1e12:.2f} TB/s KV read = {rate / copy_bw:.0%} of copy |"
    )


def causal_pairs(query_lens: list[int], seq_lens: list[int]) -> int:
    """(query, key) pairs a causal batch attends: query i of a sequence sees its prefix and
    new tokens up to its own."""
    pairs = 0
    for query_len, seq_len in zip(query_lens, seq_lens, strict=True):
        cached = seq_len - query_len
        pairs += query_len * cached + query_len * (query_len + 1) // 2
    return pairs


def prefill_kv(
    rates: tuple[float, float], fp8_kv: bool, seq_lens: list[int], query_lens: list[int],
    label: str, config: PrefillConfig | None = None, inputs: KvCaches | None = None,
    routed: bool = False,
) -> tuple[float, str]:  # fmt: skip
    """(ms, table row) of the prefill kernel over one cache kind; rates: bf16 and FP8 matmul.
    `routed`: as the engine runs it (`triton_ops.paged_attention`: a mixed batch's leading
    decode rows through the decode kernel)."""
    inputs = inputs or KvCaches(seq_lens, query_lens)
    caches = inputs.caches(fp8_kv)

    def run() -> torch.Tensor:
        if routed:
            return triton_ops.paged_attention(inputs.q, meta=inputs.meta, scale=D**-0.5, **caches)
        return paged_prefill_attention(
            inputs.q, block_tables=inputs.meta.block_tables, seq_lens=inputs.meta.seq_lens_t,
            query_start_loc=inputs.meta.query_start_loc, max_query_len=max(query_lens),
            scale=D**-0.5, config=config, **caches,
        )  # fmt: skip

    if config is None:
        inputs.check(f"prefill attention, {label}", run(), fp8_kv)
    ms = triton.testing.do_bench(run, warmup=25, rep=200)
    # Two products (QK^T and PV) of 2 FLOP per multiply-add over every attended pair.
    rate = HQ * 4 * D * causal_pairs(query_lens, seq_lens) / (ms * 1e-3)
    ceiling = rates[1] if fp8_kv else rates[0]
    how = "decode rows routed to the decode kernel" if routed else "prefill kernel alone"
    return ms, (
        f"| prefill attention, {label}, {'FP8' if fp8_kv else 'bf16'} KV, {how} | "
        f"{ms * 1e3:.0f} µs | "
        f"{rate / 1e12:.0f} TFLOP/s = {rate / ceiling:.0%} of "
        f"{'FP8' if fp8_kv else 'bf16'} matmul |"
    )


def kv_write(copy_bw: float, fp8_kv: bool, tokens: int) -> str:
    """The KV-cache write of one step's tokens (scattered slots), checked byte for byte
    against the reference's, reported as bytes moved per second against copy bandwidth."""
    k = torch.randn(tokens, HKV, D, dtype=DTYPE, device="cuda")
    v = torch.randn_like(k)
    cache_dtype = fp8.FP8_DTYPE if fp8_kv else DTYPE
    shape = (2 * tokens // BLOCK, BLOCK, HKV, D)
    caches = [torch.zeros(shape, dtype=cache_dtype, device="cuda") for _ in range(4)]
    slots = torch.randperm(shape[0] * BLOCK, device="cuda")[:tokens]
    scales = {"k_scale": torch.tensor([0.7], device="cuda"),
              "v_scale": torch.tensor([0.3], device="cuda")} if fp8_kv else {}  # fmt: skip
    reference.write_kv_cache(k, v, caches[0], caches[1], slots, **scales)
    triton_ops.write_kv_cache(k, v, caches[2], caches[3], slots, **scales)
    same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in ((caches[0], caches[2]), (caches[1], caches[3])))  # fmt: skip
    print(f"check KV write, {tokens} tokens: {'ok' if same else 'MISMATCH'}", flush=True)
    if not same:
        raise SystemExit("the KV write kernel disagrees with its reference")
    ms = triton.testing.do_bench(
        lambda: triton_ops.write_kv_cache(k, v, caches[2], caches[3], slots, **scales),
        warmup=25,
        rep=200,
    )
    moved = 2 * tokens * HKV * D * (k.element_size() + caches[2].element_size())
    rate = moved / (ms * 1e-3)
    return (
        f"| KV write, {tokens} tokens, {'FP8' if fp8_kv else 'bf16'} KV | {ms * 1e3:.1f} µs | "
        f"{rate / 1e12:.2f} TB/s = {rate / copy_bw:.0%} of copy |"
    )


# W2's shapes (PERFORMANCE.md): (label, seq_lens, query_lens) through the prefill kernel.
W2_PREFILLS = [
    ("16 × 512 (a prompt step)", [512] * 16, [512] * 16),
    ("8 × 2048", [2048] * 8, [2048] * 8),
    ("8 × 2048 over a 1024 prefix", [3072] * 8, [2048] * 8),
    ("mixed: 256 decode rows at 768 + 15 × 512", [768] * 256 + [512] * 15, [1] * 256 + [512] * 15),
]


def attention_fp8_kv(copy_bw: float, rates: tuple[float, float]) -> list[str]:
    """Each W2 attention shape over a bf16 then an FP8 cache, and the FP8 speed-up; the KV
    write of a decode step's and a prefill step's tokens."""
    rows = [kv_write(copy_bw, fp8_kv, tokens) for tokens in (256, 8192) for fp8_kv in (False, True)]
    inputs = KvCaches([768] * 256, [1] * 256)
    timed = [decode_kv(copy_bw, fp8_kv, inputs=inputs) for fp8_kv in (False, True)]
    rows += [row for _, row in timed] + [
        f"| FP8 KV speed-up, decode | {timed[0][0] / timed[1][0]:.2f}× | |"
    ]
    for label, seq_lens, query_lens in W2_PREFILLS:
        inputs = KvCaches(seq_lens, query_lens)
        timed = [prefill_kv(rates, fp8_kv, seq_lens, query_lens, label, inputs=inputs)
                 for fp8_kv in (False, True)]  # fmt: skip
        rows += [row for _, row in timed]
        rows.append(f"| FP8 KV speed-up, {label} | {timed[0][0] / timed[1][0]:.2f}× | |")
        if query_lens[0] == 1:  # a mixed step: also as the engine runs it
            rows += [prefill_kv(rates, fp8_kv, seq_lens, query_lens, label, inputs=inputs,
                                routed=True)[1] for fp8_kv in (False, True)]  # fmt: skip
    return rows


# Around the chosen tiles (14 and 18 compiled variants per cache kind, a few minutes in all).
PREFILL_SWEEP = [
    PrefillConfig(128, block_n, warps, stages)
    for block_n, warps, stages in itertools.product((32, 64, 128), (4, 8), (2, 3))
] + [PrefillConfig(64, 64, 4, stages) for stages in (2, 3)]
DECODE_SWEEP = [
    DecodeConfig(block_n, warps, stages)
    for block_n, warps, stages in itertools.product((64, 128, 256), (4, 8), (2, 3, 4))
]


def sweep_attention(copy_bw: float, rates: tuple[float, float], kernels: str) -> None:
    """Print the three fastest tiles of each kernel ("decode", "prefill" or "both") and cache
    kind at W2's shapes."""
    decode_inputs = KvCaches([768] * 256, [1] * 256)
    # A prompt step's and a long extend's, each cache kind over the same inputs.
    shapes = () if kernels == "decode" else (W2_PREFILLS[0], W2_PREFILLS[2])
    prefills = [(shape, KvCaches(*shape[1:])) for shape in shapes]
    for fp8_kv in (False, True):
        kind = "FP8" if fp8_kv else "bf16"
        if kernels != "prefill":
            decode = functools.partial(decode_kv, copy_bw, fp8_kv, inputs=decode_inputs)
            print_fastest(f"decode 256 × 768, {kind} KV", DECODE_SWEEP, decode)
        if kernels == "decode":
            continue
        for (label, seq_lens, query_lens), inputs in prefills:
            prefill = functools.partial(prefill_kv, rates, fp8_kv, seq_lens, query_lens, label,
                                        inputs=inputs)  # fmt: skip
            print_fastest(f"prefill {label}, {kind} KV", PREFILL_SWEEP, prefill)


def print_fastest(
    name: str,
    configs: list[DecodeConfig] | list[PrefillConfig],
    time_one: Callable[..., tuple[float, str]],
) -> None:
    timed = []
    for config in configs:
        try:
            timed.append((time_one(config=config)[0], config))
        except Exception as exc:  # a tile that does not fit shared memory or registers
            print(f"  {name} {config}: {type(exc).__name__}", flush=True)
    for ms, config in sorted(timed, key=lambda t: t[0])[:3]:
        print(f"  sweep {name}: {ms * 1e3:.0f} µs {config}", flush=True)


def norm(copy_bw: float, tokens: int = 8192, hidden: int = 4096) -> str:
    x = torch.randn(tokens, hidden, dtype=DTYPE, device="cuda")
    residual = torch.randn_like(x)
    w = torch.randn(hidden, dtype=DTYPE, device="cuda")
    ref_out, ref_res = reference.add_rms_norm(x, residual.clone(), w, 1e-5)
    out, res = add_rms_norm(x, residual.clone(), w, 1e-5)
    # The normalized value is rounded to bfloat16 before the weight scales it, so one unit of
    # that rounding (up to 2^-7 of values up to 4) can show at any size of the result.
    check("add_rms_norm", out, ref_out, 3e-2, rtol=2**-7)
    check("add_rms_norm residual", res, ref_res, 3e-2, rtol=2**-7)
    ms = triton.testing.do_bench(lambda: add_rms_norm(x, residual, w, 1e-5), warmup=25, rep=200)
    moved = 4 * x.numel() * x.element_size()  # read x and residual, write residual and output
    rate = moved / (ms * 1e-3)
    return (
        f"| add_rms_norm, {tokens} × {hidden} | {ms * 1e3:.0f} µs | "
        f"{rate / 1e12:.2f} TB/s = {rate / copy_bw:.0%} of copy | |"
    )


# The 8B model's projections: (name, N, K); "down" takes the gate/up output and applies SiLU·mul
# (fused into the kernel at one row, a separate activation kernel otherwise).
PROJECTIONS = [
    ("qkv", 6144, 4096),
    ("o", 4096, 4096),
    ("gate_up", 28672, 4096),
    ("down + SiLU·mul", 4096, 14336),
    ("lm_head", 128256, 4096),
]
TENSOR_CORE_SWEEP = [
    LinearConfig(block_n, block_k, warps, stages)
    for block_n, block_k, warps, stages in itertools.product(
        (16, 32, 64), (128, 256, 512), (4, 8), (3, 4)
    )
]
FMA_SWEEP = [
    LinearConfig(block_n, block_k, warps, stages, fma=True)
    for block_n, block_k, warps, stages in itertools.product(
        (2, 4, 8, 16), (256, 512, 1024), (4, 8), (2, 3, 4)
    )
]
FP8_FMA_SWEEP = [
    LinearConfig(block_n, block_k, warps, stages, fma=True)
    for block_n, block_k, warps, stages in itertools.product(
        (2, 4, 8), (1024, 2048, 4096), (4, 8), (3, 4)
    )
]
# Back-to-back launches, each on its own copy of the weights: none is served from L2 and the
# launch latency hides behind the previous kernel, as inside a decode step's CUDA graph.
COPIES = 4


def graph_time(make: Callable[[torch.Tensor], Callable[[], object]], weights: list) -> float:
    """Median ms per launch of `make(w)()` for each w, replayed from one CUDA graph."""
    fns = [make(w) for w in weights]
    for fn in fns:
        fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    return triton.testing.do_bench(graph.replay, warmup=5, rep=60) / len(fns)


def projection(name: str, n: int, k: int, rows: int, copy_bw: float, sweep: bool) -> str:
    fused = name.startswith("down")
    x = torch.randn(rows, 2 * k if fused else k, dtype=DTYPE, device="cuda")
    weights = [torch.randn(n, k, dtype=DTYPE, device="cuda") * k**-0.5 for _ in range(COPIES)]
    ref_x = reference.silu_and_mul(x) if fused else x

    def tiles(config: LinearConfig) -> Callable[[torch.Tensor], Callable[[], object]]:
        kernel = silu_mul_linear if fused else linear
        return lambda w: lambda: kernel(x, w, config=config)

    def engine(w: torch.Tensor) -> Callable[[], object]:  # what the decode step runs
        if fused:
            return lambda: triton_ops.silu_mul_linear(x, w)
        return lambda: triton_ops.linear(x, w, None)

    def cublas(w: torch.Tensor) -> Callable[[], object]:  # what it ran before kernels.linear
        if fused:
            return lambda: torch.nn.functional.linear(silu_and_mul(x), w)
        return lambda: torch.nn.functional.linear(x, w)

    check(f"{name} M={rows}", engine(weights[0])(), reference.linear(ref_x, weights[0], None), 5e-2)
    weight_bytes = n * k * DTYPE.itemsize
    cublas_ms = graph_time(cublas, weights)
    chosen_ms = graph_time(engine, weights)
    candidates = (FMA_SWEEP if rows == 1 else []) + ([] if fused else TENSOR_CORE_SWEEP)
    if sweep:
        timed = []
        for config in candidates:
            try:
                timed.append((graph_time(tiles(config), weights), config))
            except Exception as exc:  # a tile that does not fit shared memory or registers
                print(f"  {name} M={rows} {config}: {type(exc).__name__}", flush=True)
        for ms, config in sorted(timed, key=lambda t: t[0])[:3]:
            rate = weight_bytes / (ms * 1e-3)
            print(f"  sweep {name} M={rows}: {ms * 1e3:.1f} µs {rate / copy_bw:.0%} {config}")
    chosen, base = weight_bytes / (chosen_ms * 1e-3), weight_bytes / (cublas_ms * 1e-3)
    no_pdl = ""
    if rows == 1:
        with pdl.disabled():
            plain_ms = graph_time(engine, weights)
        no_pdl = f"; without programmatic launch {plain_ms * 1e3:.1f} µs"
    return (
        f"| {name} {n} × {k}, M = {rows} | {chosen_ms * 1e3:.1f} µs | "
        f"{chosen / 1e12:.2f} TB/s of weights = {chosen / copy_bw:.0%} of copy | "
        f"cuBLAS {cublas_ms * 1e3:.1f} µs = {base / copy_bw:.0%}{no_pdl} |"
    )


FP8_PROJECTIONS = [
    ("qkv", 6144, 4096),
    ("o", 4096, 4096),
    ("gate_up", 28672, 4096),
    ("down + SiLU·mul", 4096, 14336),
]


def sweep_fp8_gemv(name: str, n: int, k: int, copy_bw: float) -> None:
    """The one-row FP8 GEMV's tiles on the engine's shapes: the three fastest per shape."""
    fused = name.startswith("down")
    x = torch.randn(1, 2 * k if fused else k, dtype=DTYPE, device="cuda")
    dense = [torch.randn(n, k, dtype=DTYPE, device="cuda") * k**-0.5 for _ in range(COPIES)]
    weights = [Fp8Weight(*fp8.quantize_rows(w)) for w in dense]
    out = torch.empty(1, n, dtype=DTYPE, device="cuda")

    def tiles(config: LinearConfig) -> Callable[[Fp8Weight], Callable[[], object]]:
        activation = "silu" if fused else ""
        return lambda w: (
            lambda: gemv(
                x, w.weight, None, out, activation=activation, config=config, scale=w.scale
            )
        )

    timed = []
    for config in FP8_FMA_SWEEP:
        try:
            timed.append((graph_time(tiles(config), weights), config))
        except Exception as exc:  # a tile that does not fit shared memory or registers
            print(f"  fp8 {name}: {config}: {type(exc).__name__}", flush=True)
    for ms, config in sorted(timed, key=lambda t: t[0])[:3]:
        rate = (n * k + 4 * n) / (ms * 1e-3)
        print(f"  sweep fp8 {name} M=1: {ms * 1e3:.1f} µs {rate / copy_bw:.0%} {config}")
    best = min(timed, key=lambda t: t[0])[1]
    with pdl.disabled():
        ms = graph_time(tiles(best), weights)
    print(f"  sweep fp8 {name} M=1: {ms * 1e3:.1f} µs without programmatic dependent launch")


def fp8_projection(name: str, n: int, k: int, rows: int, copy_bw: float) -> str:
    """The engine's FP8 projection (activation quantization included) against its bf16 one."""
    fused = name.startswith("down")
    x = torch.randn(rows, 2 * k if fused else k, dtype=DTYPE, device="cuda")
    dense = [torch.randn(n, k, dtype=DTYPE, device="cuda") * k**-0.5 for _ in range(COPIES)]
    weights = [Fp8Weight(*fp8.quantize_rows(w)) for w in dense]

    def engine(w: torch.Tensor | Fp8Weight) -> Callable[[], object]:
        if fused:
            return lambda: triton_ops.silu_mul_linear(x, w)
        return lambda: triton_ops.linear(x, w, None)

    ref_x = reference.silu_and_mul(x) if fused else x
    # One row is weight-only (kernels.fp8_linear): the dequantized weight's product.
    w0 = weights[0]
    ref_w = w0.weight.to(DTYPE) * w0.scale[:, None].to(DTYPE) if rows == 1 else w0
    check(f"fp8 {name} M={rows}", engine(w0)(), reference.linear(ref_x, ref_w, None), 5e-2, 5e-2)
    fp8_ms = graph_time(engine, weights)
    bf16_ms = graph_time(engine, dense)
    fp8_bytes = n * k + 4 * n
    rate = fp8_bytes / (fp8_ms * 1e-3)
    flops = 2 * rows * n * k
    return (
        f"| FP8 {name} {n} × {k}, M = {rows} | {fp8_ms * 1e3:.1f} µs | "
        f"{rate / 1e12:.2f} TB/s of weights = {rate / copy_bw:.0%} of copy, "
        f"{flops / (fp8_ms * 1e-3) / 1e12:.0f} TFLOP/s | "
        f"bf16 {bf16_ms * 1e3:.1f} µs: FP8 is {bf16_ms / fp8_ms:.2f}× |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sweep-linear", action="store_true")
    parser.add_argument("--fp8-only", action="store_true")
    parser.add_argument("--sweep-fp8", action="store_true")
    parser.add_argument("--fp8-kv", action="store_true", help="only the attention kernels, "
                        "bf16 against FP8 KV cache, at W2's shapes")  # fmt: skip
    parser.add_argument("--sweep-attention", nargs="?", const="both",
                        choices=["both", "decode", "prefill"])  # fmt: skip
    args = parser.parse_args()
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))  # fresh inputs every run
    copy_bw, matmul_rate = print_header()
    if args.fp8_kv or args.sweep_attention:
        rates = (matmul_rate, fp8_matmul_rate())
        print(f"ceiling: FP8 matmul {rates[1] / 1e12:.0f} TFLOP/s")
        if args.sweep_attention:
            sweep_attention(copy_bw, rates, args.sweep_attention)
        print("\n| kernel and shape | median time | achieved |\n|---|---|---|")
        print("\n".join(attention_fp8_kv(copy_bw, rates)))
        return
    if args.sweep_fp8:
        for name, n, k in FP8_PROJECTIONS:
            sweep_fp8_gemv(name, n, k, copy_bw)
    rows = []
    if not args.fp8_only:
        rows += [
            decode(copy_bw),
            decode(copy_bw, batch=1, context=4096),
            prefill(matmul_rate),
            norm(copy_bw),
        ]
        for rows_per_batch in (1, 8):
            for name, n, k in PROJECTIONS:
                rows.append(projection(name, n, k, rows_per_batch, copy_bw, args.sweep_linear))
    for rows_per_batch in (1, 16, 256, 512, 8192):
        for name, n, k in FP8_PROJECTIONS:
            rows.append(fp8_projection(name, n, k, rows_per_batch, copy_bw))
    print("\n| kernel and shape | median time | achieved | goal |\n|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()

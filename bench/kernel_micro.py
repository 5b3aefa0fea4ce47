"""Kernel micro-benchmarks against the measured ceilings of the same run (GPU machine).

Each kernel is first checked against its plain-torch reference on fresh random inputs, then
timed with `triton.testing.do_bench` (median). Decode attention reports KV bytes read per
second against the copy bandwidth; prefill attention reports FLOP/s against the bf16 matmul
rate. Shapes are those of PERFORMANCE.md (Llama-3.1-8B heads: 32 query, 8 KV, head dim 128).

    python bench/kernel_micro.py
"""

from __future__ import annotations

import os
import subprocess

import torch
import triton

from kernels import reference
from kernels.decode_attention import choose_num_splits, paged_decode_attention
from kernels.ops import AttentionMetadata
from kernels.prefill_attention import paged_prefill_attention
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


def check(name: str, ours: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    err = (ours.float() - ref.float()).abs().max().item()
    status = "ok" if err <= tol else "MISMATCH"
    print(f"check {name}: max abs error {err:.3g} (tolerance {tol}) {status}", flush=True)
    if err > tol:
        raise SystemExit(f"{name} disagrees with its reference")


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


def norm(copy_bw: float, tokens: int = 8192, hidden: int = 4096) -> str:
    x = torch.randn(tokens, hidden, dtype=DTYPE, device="cuda")
    residual = torch.randn_like(x)
    w = torch.randn(hidden, dtype=DTYPE, device="cuda")
    ref_out, ref_res = reference.add_rms_norm(x, residual.clone(), w, 1e-5)
    out, res = add_rms_norm(x, residual.clone(), w, 1e-5)
    check("add_rms_norm", out, ref_out, 3e-2)
    check("add_rms_norm residual", res, ref_res, 3e-2)
    ms = triton.testing.do_bench(lambda: add_rms_norm(x, residual, w, 1e-5), warmup=25, rep=200)
    moved = 4 * x.numel() * x.element_size()  # read x and residual, write residual and output
    rate = moved / (ms * 1e-3)
    return (
        f"| add_rms_norm, {tokens} × {hidden} | {ms * 1e3:.0f} µs | "
        f"{rate / 1e12:.2f} TB/s = {rate / copy_bw:.0%} of copy | |"
    )


def main() -> None:
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))  # fresh inputs every run
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
    rows = [
        decode(copy_bw),
        decode(copy_bw, batch=1, context=4096),
        prefill(matmul_rate),
        norm(copy_bw),
    ]
    print("\n| kernel and shape | median time | achieved | goal |\n|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()

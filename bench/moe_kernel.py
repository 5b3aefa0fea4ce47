"""The fused MoE kernel (`kernels.moe`) against the per-expert loop, on the GPU.

Qwen3-30B-A3B's experts (128, top 8, H 2048, I 768) in bf16, random weights and routing. Each
batch is first checked against `kernels.reference.fused_moe`, then both are timed with
`triton.testing.do_bench` (median). Decode-sized batches are timed as the engine runs them,
replayed in a CUDA graph (the launches' CPU cost hidden), and report the expert bytes a step
reads (each chosen expert's gate/up and down once) per second against the copy bandwidth
measured in the same run; prefill batches are timed eagerly and report FLOP/s against the
bf16 matmul rate. `--sweep` times a grid of tiles per batch (the GEMV path's too, where the
table could pick it) and prints the fastest, for the tiles in kernels/moe.py and
kernels/moe_gemv.py.

`--fp8` quantizes the experts to FP8 (e4m3, a scale per output channel) and times the FP8
kernels (the GEMV path weight-only, the grouped GEMMs W8A8) against the bf16 kernels on the
original weights and the per-expert loop on the dequantized weights (bf16), each batch first
checked against that loop within FP8's error; the decode rate counts the FP8 bytes.

`--routing` times the routing instead (`kernels.moe_routing`, one launch, against
`kernels.reference.route_experts`'s torch ops on the GPU) for three routers of E experts, top
k, at 1, 16, 512 and 8192 tokens (the first two replayed in CUDA graphs, as decode steps run).

    python bench/moe_kernel.py [--sweep] [--fp8] [--batches 1,4,16,64,512,2048,8192]
                               [--experts 128 --top-k 8 --hidden 2048 --size 768]
    python bench/moe_kernel.py --routing [--experts 256 --top-k 8]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton
from kernel_micro import ceilings  # bench/, the script's own directory

from kernels import reference
from kernels.fp8 import quantize_rows
from kernels.moe import MoeTiles, fused_moe, tiles_for
from kernels.moe_gemv import GEMV_MAX_PAIRS, GemvTiles
from kernels.moe_routing import route_experts
from kernels.moe_spec import Router
from kernels.ops import Fp8Weight

DTYPE = torch.bfloat16
DECODE_BATCHES = (1, 4, 16, 64)
PREFILL_BATCHES = (512, 2048, 8192)
ROUTING_BATCHES = (1, 16, 512, 8192)
# The routers timed by --routing (kernels.moe_spec.Router's fields beside E and k).
ROUTERS = {
    "softmax, renormalised (Mixtral, Qwen3-MoE)": {"renormalize": True},
    "top-k, then softmax (gpt-oss)": {"score_after_topk": True, "logit_bias": True},
    "sigmoid, 8 groups (DeepSeek-V3)": {
        "scoring": "sigmoid",
        "renormalize": True,
        "selection_bias": True,
        "num_groups": 8,
        "topk_groups": 4,
        "scaling_factor": 2.5,
    },
}


def inputs(num_tokens: int, experts: int, top_k: int, hidden: int, size: int):
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=DTYPE)
    gate_up = torch.randn(experts, 2 * size, hidden, device="cuda", dtype=DTYPE) * hidden**-0.5
    down = torch.randn(experts, hidden, size, device="cuda", dtype=DTYPE) * size**-0.5
    scores = torch.randn(num_tokens, experts, device="cuda").softmax(-1)
    weights, ids = scores.topk(top_k, dim=-1)
    return x, gate_up, down, weights.contiguous(), ids


def fp8_experts(weight: torch.Tensor) -> tuple[Fp8Weight, torch.Tensor]:
    """[E, N, K] bf16 -> (the experts in e4m3 with per-channel scales, their dequantized bf16)."""
    num_experts, n, k = weight.shape
    q, scale = quantize_rows(weight.reshape(-1, k))
    fp8 = Fp8Weight(q.view(num_experts, n, k), scale.view(num_experts, n))
    return fp8, (q.float() * scale[:, None]).view(num_experts, n, k).to(weight.dtype)


def time_ms(fn, graphed: bool = False) -> float:
    """Median ms of fn; `graphed`: of a CUDA graph of it replayed (as decode steps run)."""
    if graphed:
        fn()  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        fn = graph.replay
    return triton.testing.do_bench(fn, warmup=25, rep=200)


def bench_batch(num_tokens: int, args: argparse.Namespace, copy_bw: float, mm_flops: float):
    x, gate_up, down, weights, ids = inputs(
        num_tokens, args.experts, args.top_k, args.hidden, args.size
    )
    expected = reference.fused_moe(x, gate_up, down, weights, ids)
    torch.testing.assert_close(fused_moe(x, gate_up, down, weights, ids), expected,
                               atol=3e-2, rtol=3e-2)  # fmt: skip
    decode = num_tokens <= max(DECODE_BATCHES)
    fused = time_ms(lambda: fused_moe(x, gate_up, down, weights, ids), graphed=decode)
    loop = time_ms(lambda: reference.fused_moe(x, gate_up, down, weights, ids))
    num_used = ids.unique().numel()
    expert_bytes = num_used * 3 * args.hidden * args.size * x.element_size()
    flops = 2 * num_tokens * args.top_k * 3 * args.hidden * args.size
    tiles = tiles_for(num_tokens, args.top_k, args.experts)
    rate = (
        f"{expert_bytes / (fused * 1e-3) / copy_bw:5.1%} of copy ({num_used} experts read)"
        if decode
        else f"{flops / (fused * 1e-3) / mm_flops:5.1%} of bf16 matmul"
    )
    print(f"T={num_tokens:5d}  fused {fused * 1e3:8.1f} us{' (graph)' if decode else ''}  "
          f"loop {loop * 1e3:9.1f} us  x{loop / fused:5.1f}  {rate}  tiles {tiles}")  # fmt: skip
    if args.sweep:
        sweep(x, gate_up, down, weights, ids, decode)
    if args.fp8:
        bench_fp8(x, gate_up, down, weights, ids, args, copy_bw, fused)


def bench_fp8(x, gate_up, down, weights, ids, args, copy_bw: float, bf16_ms: float) -> None:
    """The FP8 experts' kernels against the bf16 ones (`bf16_ms`) and the loop on the
    dequantized weights, which they must match within FP8's error (the W8A8 path rounds x and
    the act(gate) * up rows to e4m3: a few percent of the output's RMS)."""
    (gate_up_q, gate_up_dq), (down_q, down_dq) = fp8_experts(gate_up), fp8_experts(down)
    expected = reference.fused_moe(x, gate_up_dq, down_dq, weights, ids)
    ours = fused_moe(x, gate_up_q, down_q, weights, ids)
    error = (ours.float() - expected.float()).square().mean().sqrt()
    relative = (error / expected.float().square().mean().sqrt()).item()
    assert relative < 0.1, f"FP8 experts off the dequantized loop by {relative:.1%} RMS"
    num_tokens = x.shape[0]
    decode = num_tokens <= max(DECODE_BATCHES)
    fused = time_ms(lambda: fused_moe(x, gate_up_q, down_q, weights, ids), graphed=decode)
    loop = time_ms(lambda: reference.fused_moe(x, gate_up_dq, down_dq, weights, ids))
    num_used = ids.unique().numel()
    fp8_bytes = num_used * 3 * args.hidden * args.size  # one byte a weight (scales: 0.1%)
    rate = f"{fp8_bytes / (fused * 1e-3) / copy_bw:5.1%} of copy" if decode else ""
    print(f"      fp8 {fused * 1e3:8.1f} us{' (graph)' if decode else ''}  "
          f"loop {loop * 1e3:9.1f} us  x{loop / fused:5.1f}  bf16/fp8 x{bf16_ms / fused:4.2f}  "
          f"{relative:.1%} RMS off the dequantized loop  {rate}")  # fmt: skip


def sweep(x, gate_up, down, weights, ids, decode: bool) -> None:
    candidates: list[MoeTiles | GemvTiles] = [
        MoeTiles(*tiles)
        for tiles in itertools.product((16, 32, 64, 128), (64, 128), (64, 128), (4, 8), (3,))
    ]
    if ids.numel() <= 4 * GEMV_MAX_PAIRS:  # the GEMV path, around where the table takes it
        candidates += [
            GemvTiles(*tiles)
            for tiles in itertools.product((8, 16, 32), (8, 16), (256, 512), (4, 8))
        ]
    results = []
    for tiles in candidates:
        try:
            ms = time_ms(lambda t=tiles: fused_moe(x, gate_up, down, weights, ids, tiles=t),
                         graphed=decode)  # fmt: skip
        except triton.runtime.errors.OutOfResources:
            continue
        results.append((ms, tiles))
    for ms, tiles in sorted(results, key=lambda r: r[0])[:3]:
        print(f"    {ms * 1e3:8.1f} us  {tiles}")


def bench_routing(router: Router, num_tokens: int) -> None:
    """The routing kernel against the reference's torch ops, both on the GPU, first checked:
    each token's weight per expert alike, on all but the rare rows where two groups' scores
    fall within rounding of each other (the kernel's exp is not torch's). Each row's logits
    are a shuffled grid 8 / E apart, exact in bfloat16: no ties (whose order torch.topk
    leaves open) and no near-ties between experts; the timings do not depend on the values."""
    num_experts = router.num_experts
    order = torch.argsort(torch.rand(num_tokens, num_experts, device="cuda"), dim=-1)
    logits = ((order - num_experts // 2) * (8 / num_experts)).to(DTYPE)
    # Whole numbers: the biased choices of two experts never nearly tie either.
    bias = torch.randint(0, 2, (num_experts,), device="cuda").float()
    ours = route_experts(logits, router, bias)
    theirs = reference.route_experts(logits, router, bias)
    difference = (per_expert(*ours, num_experts) - per_expert(*theirs, num_experts)).abs()
    agreeing = (difference.amax(dim=-1) <= 1e-5).float().mean().item()
    assert agreeing >= 0.999, f"the kernel's routing agrees with torch's on {agreeing:.2%} of rows"
    graphed = num_tokens <= 16
    kernel = time_ms(lambda: route_experts(logits, router, bias), graphed=graphed)
    torch_ms = time_ms(lambda: reference.route_experts(logits, router, bias), graphed=graphed)
    print(f"  T={num_tokens:5d}  kernel {kernel * 1e3:7.1f} us  torch {torch_ms * 1e3:7.1f} us"
          f"{' (graphs)' if graphed else ''}  x{torch_ms / kernel:5.1f}")  # fmt: skip


def per_expert(weights: torch.Tensor, ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[T, E]: each token's weight on every expert (0 where not chosen), in any order of ids."""
    dense = torch.zeros(ids.shape[0], num_experts, device=ids.device)
    return dense.scatter_(1, ids.long(), weights)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="time a grid of tiles per batch")
    parser.add_argument("--fp8", action="store_true", help="also time FP8 experts (see above)")
    parser.add_argument("--routing", action="store_true", help="time the routing (see above)")
    parser.add_argument("--batches", default=",".join(map(str, DECODE_BATCHES + PREFILL_BATCHES)))
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--size", type=int, default=768, help="each expert's intermediate size")
    args = parser.parse_args()
    if args.routing:
        print(f"{torch.cuda.get_device_name()}: routing, E={args.experts} k={args.top_k}, "
              f"{DTYPE} logits")  # fmt: skip
        for name, variant in ROUTERS.items():
            print(f"{name}:")
            for num_tokens in ROUTING_BATCHES:
                bench_routing(Router(args.experts, args.top_k, **variant), num_tokens)
        return
    copy_bw, mm_flops = ceilings()
    print(f"{torch.cuda.get_device_name()}: copy {copy_bw / 1e9:.0f} GB/s, "
          f"bf16 matmul {mm_flops / 1e12:.0f} TFLOP/s; E={args.experts} k={args.top_k} "
          f"H={args.hidden} I={args.size}")  # fmt: skip
    for num_tokens in map(int, args.batches.split(",")):
        bench_batch(num_tokens, args, copy_bw, mm_flops)


if __name__ == "__main__":
    main()

"""Tensor-parallel scaling on random-weight Llama shapes (bf16): W1 and W2 at each size; and
of the mixtures of experts Qwen3-30B-A3B and gpt-oss-20b (bf16 experts), expert-parallel under
TP (each GPU holds E/N whole experts, docs/ARCHITECTURE.md "Expert parallelism").

Correctness first: on a small random model (4 layers of the 8B's widths), the logits of TP=N
against TP=1 on the same weights, every prompt position of a 256-token prompt (max and mean
absolute difference over the largest logit, and how often the argmax agrees). Then, for each
size, the engine with random weights drawn on every GPU (no checkpoint needed) runs W1 (batch 1
decode, 128 prompt + 256 new, ms/token, and its weight bytes per second against the copy
bandwidth of all the GPUs together) and W2 (offline throughput, 512-token prompts and 256 new
tokens, at most --max-num-seqs running). AR times what a decode step spends in all-reduces: the
2 per layer of the model, of a batch-1 and a 256-row step's hidden rows, replayed from a CUDA
graph as the engine replays them, in `size` processes of their own; through NCCL and through
PyTorch's symmetric-memory one-shot all-reduce (the engine's default for small messages,
appliance.engine.parallel.all_reduce). `--all-reduce one-shot,nccl` runs W1/W2 with each.
Prints Markdown rows last.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
        python bench/tensor_parallel.py --shape 8b --sizes 1,2 [--workloads W1,W2]
    ... --shape 70b --sizes 2 --workloads AR,W1,W2 --all-reduce one-shot,nccl
    ... --shape qwen3-30b-a3b --sizes 1,2 --workloads AR,W1,W2 --w2-requests 512
    ... --shape qwen3.6-35b-a3b --sizes 2 --workloads AR,W1,W2 --w2-requests 512
    ... --shape gemma-4-31b --sizes 2 --workloads AR,W1,W2 --w2-requests 512

Qwen3.6-35B-A3B (69 GB in bf16) and Gemma-4-31B (62 GB) are the models that need two GPUs:
at TP=1 an 80 GB H100 has no room for their KV pools. Their correctness checks are
tests/appliance/engine/parallel/test_new_families_tp_gpu.py (C runs for the Llama shapes only);
the AR row counts the model's 2 all-reduces per layer (Gemma 4's MoE layers add one, its
per-layer inputs one per step; not in the AR row).

For a mixture of experts, W1's bytes per token are those one token reads (attention, the router,
its k experts of each layer and the LM head; gpu_engine.weight_bytes), and the correctness check
(C) is tests/appliance/engine/parallel/test_expert_parallel_gpu.py's instead (C skips it here).
The hybrid Qwen's W1 bytes are its weights' only (gpu_engine's W1 adds the recurrent state).

The sizes run one after another in this process (one tensor-parallel world at a time).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gpu_engine import (  # bench/, the script's own directory
    GEMMA_4_31B,
    GPT_OSS_20B,
    LLAMA_31_8B,
    QWEN3_30B_A3B,
    QWEN36_35B_A3B,
    random_prompts,
    release,
    run_timed,
    weight_bytes,
)

from appliance.engine.engine import Engine
from appliance.engine.engine_config import EngineConfig
from appliance.engine.models.config import ModelConfig
from appliance.engine.models.loader import build_model, load_model, random_model
from appliance.engine.parallel.all_reduce import AllReduce
from appliance.engine.sampling_params import SamplingParams
from kernels import triton_ops

# The 8B is gpu_engine's Llama-3.1-8B; the 70B changes only its widths and depth. The
# mixtures of experts are gpu_engine's.
SHAPES = {
    "8b": LLAMA_31_8B,
    "70b": {**LLAMA_31_8B, "hidden_size": 8192, "intermediate_size": 28672,
            "num_hidden_layers": 80, "num_attention_heads": 64},
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "gpt-oss-20b": GPT_OSS_20B,
    "qwen3.6-35b-a3b": QWEN36_35B_A3B,
    "gemma-4-31b": GEMMA_4_31B,
}  # fmt: skip
MAX_MODEL_LEN = 4096
rows: list[str] = []
COPY_BW = [0.0]  # one GPU's, measured at start


def report(name: str, value: str) -> None:
    rows.append(f"| {name} | {value} |")
    print(rows[-1], flush=True)


def write_config(directory: Path, shape: str, num_layers: int | None = None) -> Path:
    config = dict(SHAPES[shape])
    if num_layers is not None:
        config["num_hidden_layers"] = num_layers
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def engine_config(model_dir: Path, size: int, **overrides) -> EngineConfig:
    settings = {
        "device": "cuda",
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 8192,
        "tensor_parallel_size": size,
        **overrides,
    }
    return EngineConfig(model_dir=model_dir, **settings)


def build_random(model_dir: Path, size: int, **overrides) -> Engine:
    config = engine_config(model_dir, size, **overrides)
    group = config.start_workers(random_weights=True)
    try:
        model = random_model(
            model_dir,
            dtype=torch.bfloat16,
            device="cuda:0",
            ops=triton_ops,
            shard=None if group is None else group.plan,
        )
        return Engine.build(config, model, None, group=group)
    except BaseException:
        if group is not None:
            group.close()
        raise


def close(engine: Engine) -> None:
    """Close the engine and free its KV pool and graphs; the caller then drops the engine (the
    weights go with it) and calls `free_gpu_memory`."""
    engine.close()
    release(engine)


def free_gpu_memory() -> None:
    """Give the allocator's cached blocks back once the engine itself is gone, so that the
    next engine's profile counts them as free."""
    gc.collect()
    torch.cuda.empty_cache()


def correctness(size: int) -> None:
    """TP=size against TP=1 on the same (saved) small random model."""
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_config(Path(tmp), "8b", num_layers=4)
        reference = random_model(model_dir, dtype=torch.bfloat16, device="cuda:0", ops=triton_ops)
        save_file(_checkpoint_tensors(reference), str(model_dir / "model.safetensors"))
        del reference
        logits = []
        for n in (1, size):
            config = engine_config(model_dir, n, max_num_seqs=8)
            group = config.start_workers()
            try:
                model = load_model(
                    model_dir,
                    dtype=torch.bfloat16,
                    device="cuda:0",
                    ops=triton_ops,
                    shard=None if group is None else group.plan,
                )
                engine = Engine.build(config, model, None, group=group)
            except BaseException:
                if group is not None:
                    group.close()
                raise
            recorded: list[torch.Tensor] = []
            compute = engine.runner.model.compute_logits

            def recording(hidden: torch.Tensor, compute=compute, recorded=recorded, **options):
                out = compute(hidden, **options)
                recorded.append(out.clone())
                return out

            engine.runner.model.compute_logits = recording
            params = SamplingParams(
                temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=1
            )
            engine.generate(random_prompts(1, 256, seed=5), params)
            logits.append(torch.cat([t for t in recorded if t.shape[0] > 1]))
            close(engine)
            del model, engine
            free_gpu_memory()
        expected, got = logits
        scale = expected.abs().max().item()
        diff = (got - expected).abs()
        agree = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
        report(
            f"TP={size} vs TP=1 logits, 256 prompt positions (4-layer 8B-width model, bf16)",
            f"max |Δ| {diff.max().item():.4f} = {diff.max().item() / scale:.2%} of max |logit| "
            f"{scale:.2f}; mean |Δ| {diff.mean().item():.5f}; argmax agrees {agree:.1%}",
        )


def _checkpoint_tensors(model) -> dict[str, torch.Tensor]:
    """Our fused parameters back under the checkpoint's names (q/k/v, gate/up split)."""
    config = model.config
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    out: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": model.embed_tokens.weight,
        "model.norm.weight": model.norm.weight,
        "lm_head.weight": model.lm_head,
    }
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        wq, wk, wv = layer.self_attn.qkv_proj.weight.split([q, kv, kv])
        gate, up = layer.mlp.gate_up_proj.weight.chunk(2)
        out |= {
            p + "self_attn.q_proj.weight": wq,
            p + "self_attn.k_proj.weight": wk,
            p + "self_attn.v_proj.weight": wv,
            p + "self_attn.o_proj.weight": layer.self_attn.o_proj.weight,
            p + "mlp.gate_proj.weight": gate,
            p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": layer.mlp.down_proj.weight,
            p + "input_layernorm.weight": layer.input_layernorm.weight,
            p + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
        }
    return {name: t.detach().contiguous().cpu() for name, t in out.items()}


def _allreduce_rank(rank: int, size: int, rendezvous: str, hidden: int, layers: int, queue) -> None:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl", init_method=f"file://{rendezvous}", rank=rank, world_size=size, device_id=device
    )
    results = {}
    group = dist.group.WORLD
    one_shot = AllReduce.for_group(group, device, torch.bfloat16, one_shot=True)
    for rows in (1, 64, 256):
        x = torch.zeros(rows, hidden, dtype=torch.bfloat16, device=device)
        results[("NCCL", rows)] = _graph_seconds(lambda x=x: dist.all_reduce(x), 2 * layers)
        if one_shot.one_shot:  # the engine's (PyTorch's symmetric-memory kernel, no multicast)
            results[("one-shot", rows)] = _graph_seconds(lambda x=x: one_shot(x), 2 * layers)
        else:
            results[("one-shot", rows)] = "the peers' buffers could not be mapped (see the log)"
    one_shot.close()
    dist.barrier()
    if rank == 0:
        queue.put(results)
        queue.close()
        queue.join_thread()
    # NCCL's destroy_process_group may not return here (see docs/BENCHMARKS.md); the process
    # has nothing left to release.
    os._exit(0)


def _graph_seconds(op, repeats: int) -> float:
    """Median seconds of one replay of a CUDA graph of `repeats` calls of op()."""
    for _ in range(3):
        op()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):  # after o_proj and after down_proj, every layer
            op()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        start = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def allreduce(shape: str, size: int) -> None:
    hidden, layers = SHAPES[shape]["hidden_size"], SHAPES[shape]["num_hidden_layers"]
    context = mp.get_context("spawn")
    queue = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        rendezvous = str(Path(tmp) / "rendezvous")
        procs = [
            context.Process(
                target=_allreduce_rank, args=(rank, size, rendezvous, hidden, layers, queue)
            )
            for rank in range(size)
        ]
        for proc in procs:
            proc.start()
        results = queue.get(timeout=300)
        for proc in procs:
            proc.join(timeout=60)
    for (kind, rows), seconds in results.items():
        name = (
            f"AR TP={size}, {kind}: {2 * layers} all-reduces of [{rows}, {hidden}] bf16 (a "
            "decode step's), CUDA graph"
        )
        if isinstance(seconds, str):
            report(name, f"failed: {seconds}")
            continue
        each = seconds / (2 * layers) * 1e6
        report(name, f"{seconds * 1e3:.2f} ms per step, {each:.1f} µs each")


def bytes_per_token(model_dir: Path) -> int:
    """What batch-1 decode reads per token (gpu_engine.weight_bytes: every weight but the
    embedding table and, of a mixture of experts, the experts not chosen), of the whole model."""
    config = ModelConfig.from_model_dir(model_dir)
    model = build_model(config, dtype=torch.bfloat16, device="meta", ops=None, shard=None)
    return weight_bytes(model)[1]


def copy_bandwidth() -> float:
    """Bytes per second one GPU copies (read + write), as gpu_engine measures it."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    rate = 2 * src.numel() * 10 / (time.perf_counter() - start)
    del src, dst
    torch.cuda.empty_cache()
    return rate


def w1(engine: Engine, model_dir: Path, size: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    [prompt] = random_prompts(1, 128, seed=1)
    run_timed(engine, [prompt], SamplingParams(max_tokens=16, ignore_eos=True))  # warm-up
    per_token = []
    for _ in range(3):
        elapsed, [ttft], num_out = run_timed(engine, [prompt], params)
        per_token.append((elapsed - ttft) / (num_out - 1))
    ms = statistics.median(per_token) * 1e3
    rate = bytes_per_token(model_dir) / (ms * 1e-3)
    report(
        f"W1 TP={size}{_label(engine)} decode ms/token (batch 1, 128+256)",
        f"{ms:.2f} ms ({1e3 / ms:.0f} tok/s); weights {rate / 1e12:.2f} TB/s = "
        f"{rate / (size * COPY_BW[0]):.0%} of {size} GPUs' copy bandwidth",
    )


def w2(engine: Engine, size: int, num_requests: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    run_timed(engine, random_prompts(8, 512, seed=2), SamplingParams(max_tokens=8, ignore_eos=True))
    elapsed, _, num_out = run_timed(engine, random_prompts(num_requests, 512, seed=3), params)
    report(
        f"W2 TP={size}{_label(engine)} output tok/s ({num_requests} × 512/256, max "
        f"{engine.scheduler.config.max_num_seqs} running, {engine.block_manager.num_blocks} KV "
        "blocks)",
        f"{num_out / elapsed:,.0f} ({elapsed:.1f} s)",
    )


def workloads_on_one_engine(
    model_dir: Path, size: int, all_reduce: str, workloads: set[str], args: argparse.Namespace
) -> None:
    """W1 and W2 on one engine (its memory is free again on return, for the next)."""
    engine = build_random(
        model_dir,
        size,
        max_num_seqs=args.max_num_seqs,
        max_decode_burst=args.max_decode_burst,
        one_shot_all_reduce=all_reduce == "one-shot",
    )
    if "W1" in workloads:
        w1(engine, model_dir, size)
    if "W2" in workloads:
        w2(engine, size, args.w2_requests)
    close(engine)
    del engine
    free_gpu_memory()


def _label(engine: Engine) -> str:
    """Which all-reduce the engine took (a process's second one-shot engine takes NCCL:
    appliance.engine.parallel.all_reduce)."""
    if engine.group is None:
        return ""
    assert engine.group.all_reduce is not None
    return f", {'one-shot' if engine.group.all_reduce.one_shot else 'NCCL'} all-reduce"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--sizes", default="1,2")
    parser.add_argument("--workloads", default="C,W1,W2")
    parser.add_argument("--w2-requests", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-decode-burst", type=int, default=1)
    parser.add_argument(
        "--all-reduce",
        default="one-shot",
        help="the engine's all-reduces for W1/W2 under TP, comma-separated: one-shot (the "
        "default: engine.one_shot_all_reduce), nccl. A process maps one one-shot engine: list "
        "one-shot first",
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    workloads = set(args.workloads.split(","))
    print(f"{torch.cuda.get_device_name(0)} × {torch.cuda.device_count()}", flush=True)
    COPY_BW[0] = copy_bandwidth()
    print(f"copy bandwidth of one GPU: {COPY_BW[0] / 1e12:.2f} TB/s", flush=True)
    if "AR" in workloads:
        for size in sizes:
            if size > 1:
                allreduce(args.shape, size)
    if "C" in workloads and args.shape in ("8b", "70b"):  # the others: their GPU tests
        for size in sizes:
            if size > 1:
                correctness(size)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_config(Path(tmp), args.shape)
        for size in sizes:
            if not {"W1", "W2"} & workloads:
                break
            for all_reduce in args.all_reduce.split(",") if size > 1 else ["nccl"]:
                workloads_on_one_engine(model_dir, size, all_reduce, workloads, args)
    print(f"\n| {args.shape} random weights, bf16 | |\n|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()

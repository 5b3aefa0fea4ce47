"""GPU benchmarks of PERFORMANCE.md on a random-weight model of a real shape (bf16), in one run:
Llama-3.1-8B by default, or with --model Qwen3-8B, Gemma-3-12B, Phi-4-mini, Qwen3-30B-A3B,
gpt-oss-20b, Qwen3.6-35B-A3B or Gemma-4-31B (for a mixture of experts, W1's bytes are those a
token reads: its chosen experts only; for the hybrid Qwen3.6 they add the recurrent state a
token reads and writes in each linear layer, and W2 shows its memory per sequence against a
pure-attention model of the same shape).
With `--quantization fp8` its projections are FP8 (W8A8, models.projections), and a mixture's
experts FP8 too (models.sparse_moe: W1's expert bytes then one per weight), as
`engine.quantization = "fp8"` loads them.

Measures the ceilings first (device-to-device copy bandwidth, dense bf16 matmul rate), then
W1 (batch-1 decode), W2 (offline throughput), W4 (shared-prefix TTFT, prefix cache on vs off)
and W6 (GPU memory that is neither weights nor KV cache). Prints Markdown rows last.

The peer is transformers on the same weights in the same run (HFW1, HF, HFW4): the model's own
transformers class is built from the shape's config with random bf16 weights on the GPU and
runs W1 (`generate`, static cache + torch.compile, or eager where that fails: the row says
which), the W2 shape on continuous batching (`generate_batch`, paged attention; --hf-requests
bounds it; where that fails or returns nothing, as for gpt-oss and the hybrids on some
transformers releases, plain `generate` in batches of 64, and the rows say which) and W4; its
weights then go to host memory (the two models never fit on one GPU
together), and Inferno's model is filled from them through the loader's checkpoint-name mapping
(models.loader.load_state_dict) for Inferno's workloads. A mixture of experts routes by its
weights, so only the same weights make the two runs comparable. Each peer phase prints its time.
Without a peer workload Inferno's model is drawn directly on the GPU (models.loader.fill_randomly).

    python bench/gpu_engine.py [--model llama-3.1-8b|qwen3-8b|gemma-3-12b|phi-4-mini|
                                        qwen3-30b-a3b|gpt-oss-20b|qwen3.6-35b-a3b|gemma-4-31b]
                               [--workloads W1,W2,W2S,P,W4,HFW1,HF,HFW4] [--max-num-seqs 256]
                               [--max-decode-burst 1] [--kv-cache-dtype auto|fp8_e4m3]
                               [--async-scheduling]
                               [--w2-requests 1024] [--hf-requests 128] [--no-hf-compile]
                               [--tokenizer-json PATH] [--quantization fp8]
                               [--no-expandable-segments]

W2S is W2 with a JSON schema on every request (grammars compiled against --tokenizer-json).

W6 is measured right after W2, at W2's largest batch, with where it lies: the decode graphs'
pool, live tensors, blocks torch caches unused (fragmentation: the allocator runs in
expandable segments, as `inferno` runs it; `--no-expandable-segments` shows what fixed
segments leave) and memory outside torch, beside what the engine's profiled step measured.
Measure W6 without the peer: what transformers' compiled code and CUDA libraries leave in the
process would count as Inferno's.
P is prefill throughput at 8 × 2,048.
Every engine of the run stores its KV cache as --kv-cache-dtype says (the engine setting);
W2 reports its pool (blocks, tokens, bytes).

Qwen3.6-35B-A3B and Gemma-4-31B (issue 23) are declared from their published config.json;
until Inferno builds their architectures, --model refuses them by name before any GPU work.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import logging
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import triton
from torch import nn

from appliance.engine.cuda_graphs import DecodeGraphs
from appliance.engine.engine import Engine
from appliance.engine.engine_config import EngineConfig
from appliance.engine.errors import ModelLoadError
from appliance.engine.model_runner import ModelRunner
from appliance.engine.models.config import ModelConfig
from appliance.engine.models.decoder import CausalLM
from appliance.engine.models.loader import (
    Quantization,
    build_model,
    fill_randomly,
    load_state_dict,
)
from appliance.engine.models.projections import quantize_projections
from appliance.engine.models.recurrent_state import state_bytes_per_slot
from appliance.engine.models.sparse_moe import Experts
from appliance.engine.prompt_graphs import PromptGraphs
from appliance.engine.sampling_params import SamplingParams
from kernels import triton_ops
from kernels.ops import KernelOps

if TYPE_CHECKING:
    from transformers import PreTrainedModel

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": False,
}
# The text models' config.json values that set their shapes (from the releases' own files).
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
}
GEMMA_3_12B = {
    "architectures": ["Gemma3ForCausalLM"],
    "hidden_size": 3840,
    "intermediate_size": 15360,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 256,
    "vocab_size": 262208,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256,
    "sliding_window": 1024,
    "sliding_window_pattern": 6,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
}
PHI_4_MINI = {
    "architectures": ["Phi3ForCausalLM"],
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 32,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
    "vocab_size": 200064,
    "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "partial_rotary_factor": 0.75,
    # LongRoPE's 48 factors of each kind; their values change no cost, so these are made up.
    "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 48,
                     "long_factor": [4.0] * 48},
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}  # fmt: skip
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
}
# openai/gpt-oss-20b's config.json (its experts bf16 here: MXFP4 is dequantized on load).
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"],
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 201088,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "attention_bias": True,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "rope_theta": 150000.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "truncate": False, "original_max_position_embeddings": 4096},
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
}  # fmt: skip
# Qwen/Qwen3.6-35B-A3B's config.json: its text_config, for the text model's own class. The
# values are those of the published file as a public repository reproduces it in a test
# fixture (`real_qwen36_35b_a3b_config_json`; the huggingface.co file itself was not in the
# corpora searched). They agree with Qwen's model card (hidden 2048; 40 layers, 10 × (3 Gated
# DeltaNet + 1 gated attention); DeltaNet 16 QK and 32 V heads of 128; attention 16 Q and 2 KV
# heads of 256, 64 rotary dims; 256 experts of 512, 8 routed + 1 shared; vocabulary 248320),
# and transformers builds 34.66B parameters from them (the card: 35B).
QWEN36_35B_A3B = {
    "architectures": ["Qwen3_5MoeForCausalLM"],
    "attn_output_gate": True,
    "full_attention_interval": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 10,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "max_position_embeddings": 262144,
    "moe_intermediate_size": 512,
    "num_attention_heads": 16,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 40,
    "num_key_value_heads": 2,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {
        "mrope_interleaved": True,
        "mrope_section": [11, 11, 10],
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000000,
        "rope_type": "default",
    },
    "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False,
    "vocab_size": 248320,
}
# google/gemma-4-31B-it's config.json: its text_config, for the text model's own class. The
# values are those of the published file as two public repositories reproduce it in test
# fixtures (a Go `TestParseTextConfig31B` and a Rust writer of a gemma4 config.json; the
# huggingface.co file itself was not in the corpora searched), which agree field for field but
# for max_position_embeddings (262144 in one, as the model card's 256K context; 131072 in the
# other); the rope parameters are the second's. A model card (mlboydaisuke/Gemma-4-31B-CoreAI)
# agrees: 60 layers, hidden 5376, 32 heads, vocabulary 262144, softcap 30, tied, 5 sliding :
# 1 full, head 256 (global 512, 4 global KV heads, k = v). transformers builds 30.70B
# parameters from them (the card: 30.7B).
GEMMA_4_31B = {
    "architectures": ["Gemma4ForCausalLM"],
    "attention_bias": False,
    "attention_k_eq_v": True,
    "enable_moe_block": False,
    "final_logit_softcapping": 30.0,
    "global_head_dim": 512,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 5376,
    "hidden_size_per_layer_input": 0,
    "intermediate_size": 21504,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 10,
    "max_position_embeddings": 262144,
    "num_attention_heads": 32,
    "num_global_key_value_heads": 4,
    "num_hidden_layers": 60,
    "num_key_value_heads": 16,
    "num_kv_shared_layers": 0,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {
        "full_attention": {
            "partial_rotary_factor": 0.25,
            "rope_theta": 1000000.0,
            "rope_type": "proportional",
        },
        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
    },
    "sliding_window": 1024,
    "tie_word_embeddings": True,
    "use_double_wide_mlp": False,
    "vocab_size": 262144,
    "vocab_size_per_layer_input": 262144,
}
SHAPES = {
    "llama-3.1-8b": LLAMA_31_8B,
    "qwen3-8b": QWEN3_8B,
    "gemma-3-12b": GEMMA_3_12B,
    "phi-4-mini": PHI_4_MINI,
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "gpt-oss-20b": GPT_OSS_20B,
    "qwen3.6-35b-a3b": QWEN36_35B_A3B,
    "gemma-4-31b": GEMMA_4_31B,
}
MAX_MODEL_LEN = 4096
rows: list[str] = []
# Device memory in use outside torch's allocator once CUDA is up (main sets it): the context.
context_at_start = 0
# Engine settings every engine of this run shares (main fills it from the command line).
run_settings: dict[str, object] = {}


def report(name: str, value: str, goal: str = "") -> None:
    rows.append(f"| {name} | {value} | {goal} |")
    print(f"{name}: {value} {goal}", flush=True)


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (2 GiB buffers)."""
    src = torch.empty(2**30, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def matmul_rate() -> float:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300)
    return 2 * 8192**3 / (ms * 1e-3)


def random_model(
    shape: str = "llama-3.1-8b", seed: int = 0, quantization: str | None = None
) -> CausalLM:
    """The model of `SHAPES[shape]` with normal(0, 0.02) weights drawn on the GPU (norm
    weights 1), in bf16 on the Triton kernels; with quantization "fp8", its projections and a
    mixture's experts then quantized to FP8."""
    config = ModelConfig.from_dict(SHAPES[shape])
    model = build_model(config, dtype=torch.bfloat16, device="cuda", ops=triton_ops, shard=None)
    fill_randomly(model, seed)
    if quantization == "fp8":
        for module in model.modules():
            if isinstance(module, Experts):
                module.quantize()
        quantize_projections(model)
    model.init_rope_tables(MAX_MODEL_LEN)
    return model.eval()


def recurrent_state_bytes(model: CausalLM) -> int:
    """Bytes a hybrid model's decode step reads and writes per sequence: its state in every
    linear layer, once each way (0 for any other model)."""
    linear = model.config.linear_attention
    return (
        0 if linear is None else 2 * state_bytes_per_slot(linear, model.embed_tokens.weight.dtype)
    )


def memory_per_sequence(engine: Engine) -> None:
    """One sequence's cache at several context lengths, from the engine's own pool: its KV in
    the attention layers plus (a hybrid) its fixed recurrent state, against a pure-attention
    model of the same shape (every layer with KV)."""
    config = engine.runner.model.config
    linear = config.linear_attention
    if linear is None:
        return
    kv_caches = engine.runner.kv_caches
    per_token_layer = kv_caches[0][:, 0, 0].numel() * kv_caches[0].element_size()  # K and V
    state = state_bytes_per_slot(linear, engine.runner.model.embed_tokens.weight.dtype)
    for context in (4096, 32768, 262144):
        hybrid = len(kv_caches) * per_token_layer * context + state
        pure = config.num_layers * per_token_layer * context
        report(
            f"memory per sequence at {context:,} tokens",
            f"hybrid {hybrid / 2**20:,.0f} MiB (state {state / 2**20:.1f} MiB) vs "
            f"pure attention {pure / 2**20:,.0f} MiB = {hybrid / pure:.0%}",
        )


def build_engine(model: CausalLM, **overrides) -> Engine:
    settings = {
        "model_dir": Path("random-model"),
        "device": "cuda",
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 8192,
        **run_settings,
        **overrides,
    }
    with BuildClock() as clock:
        engine = Engine.build(EngineConfig(**settings), model, tokenizer=None)
    report("engine build (W5's warm-up phase)", clock.summary())
    # What is alive now is frozen, as `inferno serve` freezes its start's objects once ready
    # (appliance/boot/collector_pause.py; bench/server_load.py serves likewise): a full
    # collection during a workload then visits what the workload allocates, not the hundreds
    # of thousands of torch's, the model's and the engine's objects. Unfrozen, a W2 met six
    # such collections, each stopping the engine's loop 110-155 ms with the GPU idle.
    gc.collect()
    gc.freeze()
    return engine


class BuildClock:
    """Where an engine's build spends its time: sizing the KV pool (the profiled step and the
    graphs captured to measure their pool), allocating it, capturing the CUDA graphs (the
    prompt sizes', the decode batches', the greedy ones'). Wraps the methods while inside."""

    _PROFILE = (ModelRunner, "kv_pools_for_free_memory")
    _TIMED = (
        _PROFILE,
        (ModelRunner, "allocate_kv_caches"),
        (PromptGraphs, "_capture_size"),
        (DecodeGraphs, "_capture_plain"),
        (DecodeGraphs, "_capture_greedy"),
    )

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._kept: list[tuple[type, str, Any]] = []
        self._profiling = False

    def __enter__(self) -> BuildClock:
        self._start = time.perf_counter()
        for owner, name in self._TIMED:
            method = getattr(owner, name)
            self._kept.append((owner, name, method))
            setattr(owner, name, self._timed((owner, name), method))
        return self

    def __exit__(self, *exc: object) -> None:
        self.total = time.perf_counter() - self._start
        for owner, name, method in self._kept:
            setattr(owner, name, method)

    def _timed(self, timed_method: tuple[type, str], method):
        owner, name = timed_method
        key = f"{owner.__name__}.{name}"

        def timed(*args, **kwargs):
            profile = timed_method == self._PROFILE
            # Captures inside the profile (to measure the pool) count apart from the build's.
            where = "profile: " if self._profiling and not profile else ""
            self._profiling |= profile
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self.seconds[where + key] = self.seconds.get(where + key, 0.0) + elapsed
                if profile:
                    self._profiling = False

        return timed

    def summary(self) -> str:
        def s(key: str) -> float:
            return self.seconds.get(key, 0.0)

        captures = ("PromptGraphs._capture_size", "DecodeGraphs._capture_plain")
        greedy = "DecodeGraphs._capture_greedy"
        measuring = sum(s(f"profile: {key}") for key in captures)
        built = sum(s(key) for key in (*captures, greedy))
        return (
            f"{self.total:.2f} s: KV pool sized {s('ModelRunner.kv_pools_for_free_memory'):.2f} s"
            f" (of it the captures measuring the graphs' pool {measuring:.2f} s), allocated "
            f"{s('ModelRunner.allocate_kv_caches'):.2f} s, graphs captured {built:.2f} s "
            f"(prompt sizes {s(captures[0]):.2f} s, decode batches {s(captures[1]):.2f} s, "
            f"greedy {s(greedy):.2f} s)"
        )


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, LLAMA_31_8B["vocab_size"], (n, length), generator=g).tolist()


def weight_bytes(model: CausalLM) -> tuple[int, int]:
    """(all weights' bytes, the bytes one token's decode step reads of them). A token reads
    every weight but: of an embedding table (nn.Embedding: the tokens', a per-layer one) only
    its own row, and of a mixture-of-experts layer's stacked experts (weights and biases) only
    its top k of E; the LM head is read whole (a tied model's is the embedding matrix, so that
    is then read whole too). Attention with its biases and sinks, norms, routers and shared
    experts are read whole. Works on the meta device (no weights needed)."""
    moe = model.config.moe
    total = read = 0
    for module in model.modules():
        size = sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
        total += size
        if isinstance(module, nn.Embedding):
            read += size // module.num_embeddings
        elif isinstance(module, Experts):
            assert moe is not None, "experts without a mixture-of-experts config"
            read += size // moe.router.num_experts * moe.router.top_k
        else:
            read += size
    if model.lm_head is None:
        embed = model.embed_tokens.weight
        read += embed.numel() * embed.element_size()
    return total, read


def run_timed(engine: Engine, prompts: list[list[int]], params: SamplingParams):
    """Submit everything at once; returns (elapsed s, first-token times s, output tokens)."""
    start = time.perf_counter()
    ids = [f"b{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, p, params)
    first: dict[str, float] = {}
    num_out = 0
    while engine.has_unfinished():
        for out in engine.step():
            first.setdefault(out.request_id, time.perf_counter() - start)
            num_out += len(out.token_ids)
    return time.perf_counter() - start, [first[r] for r in ids], num_out


def release(engine: Engine) -> None:
    """Free an engine's KV pool and graphs before the next one is sized from free memory
    (unfrozen first: `build_engine` froze them, and a frozen cycle is never collected)."""
    engine.runner.release_kv_caches()
    gc.unfreeze()
    gc.collect()
    torch.cuda.empty_cache()


def w1(model: CausalLM, copy_bw: float, burst: int, async_scheduling: bool) -> None:
    engine = build_engine(
        model, max_num_seqs=8, max_decode_burst=burst, async_scheduling=async_scheduling
    )
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    [prompt] = random_prompts(1, 128, seed=1)
    run_timed(engine, [prompt], SamplingParams(max_tokens=16, ignore_eos=True))  # warm-up
    per_token = []
    for _ in range(3):
        elapsed, [ttft], num_out = run_timed(engine, [prompt], params)
        per_token.append((elapsed - ttft) / (num_out - 1))
    ms = statistics.median(per_token) * 1e3
    _, streamed = weight_bytes(model)
    streamed += recurrent_state_bytes(model)
    achieved = streamed / (ms * 1e-3)
    report("W1 decode ms/token (batch 1, 128+256)", f"{ms:.2f} ms ({1e3 / ms:.0f} tok/s)")
    report(
        "W1 weight bytes/s ÷ copy bandwidth",
        f"{achieved / 1e12:.2f} TB/s = {achieved / copy_bw:.0%}",
        "goal ≥ 85%",
    )
    # Where the time goes: the captured batch-1 forward alone (no output projection, sampling
    # or host work between steps).
    graphs = engine.runner.graphs
    assert graphs is not None
    replay_ms = triton.testing.do_bench(graphs.replay_only(1), warmup=10, rep=200)
    # A tied model (Gemma, Phi-4-mini) projects with the embedding matrix.
    lm_head = model.lm_head if model.lm_head is not None else model.embed_tokens.weight
    in_graph = streamed - lm_head.numel() * lm_head.element_size()
    report(
        "W1 decode graph replay alone (batch 1)",
        f"{replay_ms:.2f} ms: {in_graph / 1e9:.2f} GB at {in_graph / replay_ms / 1e9:.2f} TB/s "
        f"= {in_graph / (replay_ms * 1e-3) / copy_bw:.0%}; outside it {ms - replay_ms:.2f} ms",
    )
    if graphs.greedy_sizes:
        # What W1's steps replay: the same forward, then the LM head and argmax, in one graph.
        greedy_ms = triton.testing.do_bench(graphs.replay_only(1, greedy=True), warmup=10, rep=200)
        report(
            "W1 greedy graph replay alone (forward, LM head, argmax)",
            f"{greedy_ms:.2f} ms: {streamed / (greedy_ms * 1e-3) / copy_bw:.0%} of copy; "
            f"outside it {ms - greedy_ms:.2f} ms",
        )
    release(engine)


class StepProfile:
    """Where a run's wall time goes: model steps with prefill work, decode steps (single or in
    bursts; each including input preparation and the wait for its sampled tokens), and
    everything else (scheduling, output processing). With asynchronous scheduling the host
    prepares a step while the previous one runs, so a step's time here is its launch plus the
    part of its run the host still had to wait for."""

    def __init__(self, engine: Engine):
        self.time = {"prefill": 0.0, "decode": 0.0}
        self.steps = {"prefill": 0, "decode": 0}
        runner = engine.runner
        launch, collect = runner.launch, runner.collect

        def kind(chunks) -> str:
            return "decode" if all(c.num_new_tokens == 1 for c in chunks) else "prefill"

        def timed_launch(chunks, num_steps, generators, previous=None):
            start = time.perf_counter()
            step = launch(chunks, num_steps, generators, previous)
            self.time[kind(chunks)] += time.perf_counter() - start
            self.steps[kind(chunks)] += num_steps
            return step

        def timed_collect(step):
            start = time.perf_counter()
            results = collect(step)
            self.time[kind(step.chunks)] += time.perf_counter() - start
            return results

        runner.launch = timed_launch
        runner.collect = timed_collect

    @property
    def mean_decode_ms(self) -> float:
        return 1e3 * self.time["decode"] / max(self.steps["decode"], 1)

    def summary(self, wall: float) -> str:
        other = wall - sum(self.time.values())
        return (
            f"steps with prefill {self.steps['prefill']} / {self.time['prefill']:.1f} s, "
            f"decode steps {self.steps['decode']} / {self.time['decode']:.1f} s, "
            f"scheduling and outputs {other:.1f} s"
        )


def w2(
    model: CausalLM,
    num_requests: int,
    max_num_seqs: int,
    burst: int,
    async_scheduling: bool,
) -> None:
    from gpu_busy import BusySampler  # bench/, this script's directory

    engine = build_engine(
        model,
        max_num_seqs=max_num_seqs,
        max_decode_burst=burst,
        async_scheduling=async_scheduling,
    )
    cache = engine.runner.kv_caches
    blocks = engine.block_manager
    # With KV groups the windowed layers' pool is beside it (docs/ARCHITECTURE.md).
    window = blocks.window_group
    window_pool = "" if window is None else f" + {window.num_blocks:,} windowed-layer blocks"
    report(
        "W2 KV pool",
        f"{blocks.num_blocks:,} blocks ({blocks.num_blocks * blocks.block_size:,} tokens)"
        f"{window_pool}, {cache[0].dtype}, "
        f"{sum(t.numel() * t.element_size() for t in cache) / 2**30:.2f} GiB",
    )
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    run_timed(engine, random_prompts(8, 512, seed=2), SamplingParams(max_tokens=8, ignore_eos=True))
    profile = StepProfile(engine)
    with BusySampler(torch.cuda.current_device()) as busy:
        elapsed, _, num_out = run_timed(engine, random_prompts(num_requests, 512, seed=3), params)
    report(
        f"W2 output tok/s ({num_requests} × 512/256, max {max_num_seqs} running)",
        f"{num_out / elapsed:,.0f} ({elapsed:.1f} s)",
        "goal ≥ 15,000",
    )
    report("W2 time split", profile.summary(elapsed))
    report("W2 mean decode step (TPOT at this batch)", f"{profile.mean_decode_ms:.2f} ms")
    report("W2 GPU busy fraction (NVML utilization, 100 ms samples)", f"{busy.fraction:.0%}")
    memory_per_sequence(engine)
    w6(engine, model)
    release(engine)


# Two schemas an output cannot complete within 256 tokens, so that every request writes all
# 256 (as W2's ignore_eos does): a long array of small objects, and a long string.
W2S_SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer", "minimum": 0},
                        "name": {"type": "string", "maxLength": 16},
                        "ok": {"type": "boolean"},
                    },
                    "required": ["id", "name", "ok"],
                    "additionalProperties": False,
                },
                "minItems": 64,
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"summary": {"type": "string", "minLength": 4000}},
        "required": ["summary"],
        "additionalProperties": False,
    },
]


def w2_structured(
    model: CausalLM, num_requests: int, max_num_seqs: int, tokenizer_json: Path
) -> None:
    """W2 with a JSON schema on every request (structured outputs' cost per token), its
    grammars compiled against a real tokenizer's vocabulary (the rest of the model's
    vocabulary is never allowed)."""
    import json

    from appliance.engine.sampling_params import StructuredOutput
    from appliance.engine.structured_output import GrammarCompiler

    engine = build_engine(model, max_num_seqs=max_num_seqs)
    text = tokenizer_json.read_text()
    engine.grammars = GrammarCompiler(lambda: text, LLAMA_31_8B["vocab_size"], [0])
    specs = [StructuredOutput("json_schema", json.dumps(s)) for s in W2S_SCHEMAS]
    warm = [SamplingParams(max_tokens=8, structured=spec) for spec in specs]
    for i, p in enumerate(warm):
        run_timed(engine, random_prompts(4, 512, seed=10 + i), p)
    profile = StepProfile(engine)
    prompts = random_prompts(num_requests, 512, seed=3)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0.0, max_tokens=256, structured=specs[i % 2])
        engine.add_request(f"s{i}", prompt, params)
    num_out = 0
    while engine.has_unfinished():
        num_out += sum(len(out.token_ids) for out in engine.step())
    elapsed = time.perf_counter() - start
    report(
        f"W2 with a JSON schema on every request, output tok/s ({num_requests} × 512/256)",
        f"{num_out / elapsed:,.0f} ({elapsed:.1f} s)",
        "goal ≤ 10% below W2",
    )
    report("W2 with a JSON schema: time split", profile.summary(elapsed))
    report("W2 with a JSON schema: mean decode step", f"{profile.mean_decode_ms:.2f} ms")
    release(engine)


def w6(engine: Engine, model: CausalLM) -> None:
    """W6 and where it lies: the decode graphs' pool, the rest of torch's allocator (live
    tensors, and blocks it caches but no tensor uses: fragmentation), and what is outside it
    (CUDA context, cuBLAS, Triton's modules), beside what the profiled step measured."""
    total_weights, _ = weight_bytes(model)
    # The KV pool, and a hybrid model's recurrent state beside it (the same budget).
    kv = sum(t.numel() * t.element_size() for t in engine.runner.kv_caches)
    kv += sum(s.conv.nbytes + s.delta.nbytes for s in engine.runner.recurrent_states)
    free, total = torch.cuda.mem_get_info()
    other = (total - free) - total_weights - kv
    report(
        "W6 GPU bytes neither weights nor KV (after W2)",
        f"{other / 2**30:.2f} GiB (torch peak reserved "
        f"{(torch.cuda.max_memory_reserved() - total_weights - kv) / 2**30:.2f} GiB)",
        "goal ≤ 1.5 GiB",
    )
    graphs = engine.runner.graphs
    pool = tuple(graphs.pool) if graphs is not None else None
    segments = torch.cuda.memory_snapshot()
    in_pool = [s for s in segments if tuple(s.get("segment_pool_id", ())) == pool]
    eager = [s for s in segments if tuple(s.get("segment_pool_id", ())) != pool]
    reserved = torch.cuda.memory_reserved()
    live = torch.cuda.memory_allocated() - total_weights - kv
    mib = 2**20
    report(
        "W6 breakdown (MiB)",
        f"CUDA graphs' pool {sum(s['total_size'] for s in in_pool) / mib:.0f}; "
        f"live tensors beyond weights and KV {live / mib:.0f}; "
        f"cached, unused (fragmentation) "
        f"{sum(s['total_size'] - s['allocated_size'] for s in eager) / mib:.0f}; "
        f"outside torch {(total - free - reserved) / mib:.0f} "
        f"(of which at process start {context_at_start / mib:.0f})",
    )
    profile = engine.runner.memory_profile
    if profile is not None:
        report(
            "W6 profiled step (MiB)",
            f"forward peak {profile.forward_peak / mib:.0f}; logits and sampling peak "
            f"{profile.sampling_peak / mib:.0f}; step reserved {profile.step_reserved / mib:.0f}; "
            f"graph pool {profile.graph_pool / mib:.0f}",
        )


def prefill_throughput(model: CausalLM, matmul: float) -> None:
    """8 prompts of 2,048 tokens computed in one step (PERFORMANCE.md, "Prefill and kernels")."""
    engine = build_engine(model, max_num_batched_tokens=16384, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    run_timed(engine, random_prompts(8, 2048, seed=6), params)  # warm-up
    times = [run_timed(engine, random_prompts(8, 2048, seed=7 + i), params)[0] for i in range(3)]
    elapsed = statistics.median(times)
    _, streamed = weight_bytes(model)
    tokens = 8 * 2048
    # Projections: 2 FLOP per weight per token (the embedding is a lookup); attention: QK^T and
    # PV over the causal half, 2 FLOP each.
    config = model.config
    # Attending layers (a hybrid's linear layers have no QK^T), each at its own head dim.
    head_dims = [config.head_dim_of(i) for i in range(config.num_layers)
                 if not config.is_linear_layer(i)]  # fmt: skip
    attention = 8 * config.num_heads * 4 * sum(head_dims) * 2048 * 2048 / 2
    flops = 2 * (streamed // 2) * tokens + attention
    rate = flops / elapsed
    report(
        "prefill 8 × 2,048 tokens, one step",
        f"{tokens / elapsed:,.0f} tok/s, {rate / 1e12:.0f} TFLOP/s = {rate / matmul:.0%} of matmul",
        "goal ≥ 60%",
    )
    release(engine)


def w4(model: CausalLM) -> None:
    prompts = w4_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    p50 = {}
    for caching in (True, False):
        engine = build_engine(model, enable_prefix_caching=caching)
        run_timed(engine, prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))
        if caching:
            engine.block_manager.reset_prefix_cache()
        _, ttfts, _ = run_timed(engine, prompts, params)
        p50[caching] = statistics.median(ttfts)
        release(engine)
    report("W4 TTFT p50, prefix cache on", f"{p50[True] * 1e3:.0f} ms")
    report("W4 TTFT p50, prefix cache off", f"{p50[False] * 1e3:.0f} ms")
    report("W4 off ÷ on", f"{p50[False] / p50[True]:.1f}×", "goal ≥ 5×")


def w4_prompts() -> list[list[int]]:
    prefix = random_prompts(1, 2000, seed=4)[0]
    return [prefix + tail for tail in random_prompts(256, 100, seed=5)]


# The workloads transformers runs as the peer.
PEER_WORKLOADS = frozenset({"HFW1", "HF", "HFW4"})


def peer_model(
    shape: dict[str, Any],
    *,
    device: torch.device | str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> PreTrainedModel:
    """transformers' own class for `shape` (the one its `architectures` names, built from that
    class's config on the shape's config.json fields), on `device` in `dtype`, its weights
    drawn as Inferno's random models' are (fill_randomly: normal(0, 0.02), norm weights 1)."""
    import transformers

    architecture = shape["architectures"][0]
    model_class = getattr(transformers, architecture)
    config = model_class.config_class(**{k: v for k, v in shape.items() if k != "architectures"})
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    if type(model).__name__ != architecture:
        raise SystemExit(f"transformers built {type(model).__name__} for {architecture}")
    fill_randomly(model, seed)
    return model.eval()


def inferno_model_from(
    peer: PreTrainedModel,
    shape: dict[str, Any],
    *,
    device: torch.device | str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    ops: KernelOps | None = triton_ops,
    quantization: Quantization | None = None,
) -> CausalLM:
    """Inferno's model with the peer's weights: the peer moved to host memory first (its GPU
    memory freed: the two never fit on one GPU together), then its state dict loaded onto
    `device` through Inferno's loader (models.loader.load_state_dict: the checkpoint-name
    mapping and checks a model directory's files get); with quantization "fp8" its projections
    and experts then quantized, as --quantization does to a random model."""
    if peer.device.type == "cuda":
        peer.to("cpu")
        gc.collect()
        torch.cuda.empty_cache()
    config = ModelConfig.from_dict(shape)
    model = load_state_dict(
        config,
        peer.state_dict(),
        dtype=dtype,
        device=device,
        ops=ops,
        quantization=quantization,
    )
    model.init_rope_tables(MAX_MODEL_LEN)
    return model


def peer_w1(peer: PreTrainedModel, read_bytes: int, copy_bw: float, compile_: bool) -> None:
    """W1 on transformers' `generate`: static cache + torch.compile (transformers compiles the
    decode step itself when the cache is static), or eager with its dynamic cache when asked
    or when compiling fails. ms/token: (256 new tokens - 1 new token) / 255, medians of 3."""
    from transformers import GenerationConfig

    input_ids = torch.tensor(random_prompts(1, 128, seed=1), device=peer.device)

    def generate(num_new: int, compiled: bool) -> float:
        gen = GenerationConfig(
            max_new_tokens=num_new,
            min_new_tokens=num_new,
            do_sample=False,
            pad_token_id=0,
            cache_implementation="static" if compiled else None,
            disable_compile=not compiled,
        )
        torch.cuda.synchronize()
        start = time.perf_counter()
        peer.generate(input_ids, generation_config=gen)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    start = time.perf_counter()
    setting = "static cache + torch.compile" if compile_ else "eager, dynamic cache"
    try:
        generate(256, compile_)  # warm-up, and the compilation
    except Exception as exc:  # whatever fails to compile runs eager, and the row says so
        if not compile_:
            raise
        setting = f"eager, dynamic cache (torch.compile failed: {type(exc).__name__})"
        compile_ = False
        torch.compiler.reset()
        generate(16, compile_)
    if compile_ and not hasattr(peer, "_compiled_call"):  # transformers compiled nothing
        setting = "static cache, not compiled (transformers declined to compile)"
    warm_up = time.perf_counter() - start
    full = statistics.median(generate(256, compile_) for _ in range(3))
    first = statistics.median(generate(1, compile_) for _ in range(3))
    ms = (full - first) / 255 * 1e3
    achieved = read_bytes / (ms * 1e-3)
    report(
        f"transformers W1 decode ms/token (batch 1, 128+256; {setting})",
        f"{ms:.2f} ms ({1e3 / ms:.0f} tok/s)",
    )
    report(
        "transformers W1 weight bytes/s ÷ copy bandwidth",
        f"{achieved / 1e12:.2f} TB/s = {achieved / copy_bw:.0%}",
    )
    report(
        "transformers W1 phase",
        f"{time.perf_counter() - start:.0f} s (warm-up and compilation {warm_up:.0f} s)",
    )
    torch.compiler.reset()  # frees the compiled graphs' memory before continuous batching


def peer_w2_static(peer: PreTrainedModel, prompts: list[list[int]], batch: int = 64) -> None:
    """The W2 shape on transformers' plain `generate`, `batch` prompts at a time: the peer for
    models whose continuous batching fails (the prompts are all 512 tokens, so no padding)."""
    from transformers import GenerationConfig

    gen = GenerationConfig(
        max_new_tokens=256, min_new_tokens=256, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    torch.cuda.synchronize()
    start = time.perf_counter()
    num_out = 0
    for i in range(0, len(prompts), batch):
        ids = torch.tensor(prompts[i : i + batch], device=peer.device)
        num_out += peer.generate(ids, generation_config=gen).shape[1] * len(ids) - ids.numel()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    report(
        f"transformers generate W2-shape ({len(prompts)} × 512/256, batches of {batch}, "
        f"{peer.config._attn_implementation})",
        f"{num_out / elapsed:,.0f} tok/s ({elapsed:.1f} s)",
    )


def transformers_peer(
    peer: PreTrainedModel,
    workloads: set[str],
    num_requests: int,
    read_bytes: int,
    copy_bw: float,
    compile_: bool,
) -> None:
    """W1 (HFW1), the W2 shape (HF) and W4 (HFW4) on transformers, each phase timed."""
    from transformers import GenerationConfig

    if "HFW1" in workloads:
        peer_w1(peer, read_bytes, copy_bw, compile_)
    # Continuous batching needs paged attention: over SDPA where the model supports it, else
    # over its eager attention (gpt-oss: the sinks).
    attention = "paged|sdpa" if type(peer)._supports_sdpa else "paged|eager"
    peer.set_attn_implementation(attention)
    if "HF" in workloads:
        gen = GenerationConfig(max_new_tokens=256, do_sample=False, eos_token_id=-1, pad_token_id=0)
        prompts = random_prompts(num_requests, 512, seed=3)
        start = time.perf_counter()
        try:
            outputs = peer.generate_batch(inputs=prompts, generation_config=gen, progress_bar=False)
            num_out = sum(len(o.generated_tokens) for o in outputs.values())
            failure = "" if num_out else "no tokens"
        except Exception as exc:  # a model its continuous batching does not serve
            failure = f"{type(exc).__name__}: {str(exc)[:120]}"
        elapsed = time.perf_counter() - start
        if failure:
            report(f"transformers generate_batch W2-shape ({attention})", f"failed ({failure})")
            peer.set_attn_implementation("sdpa" if type(peer)._supports_sdpa else "eager")
            peer_w2_static(peer, prompts)
        else:
            report(
                f"transformers generate_batch W2-shape ({num_requests} × 512/256, {attention})",
                f"{num_out / elapsed:,.0f} tok/s ({elapsed:.1f} s)",
            )
    if "HFW4" in workloads:
        gen = GenerationConfig(max_new_tokens=64, do_sample=False, eos_token_id=-1, pad_token_id=0)
        start = time.perf_counter()
        outputs = peer.generate_batch(
            inputs=w4_prompts(), generation_config=gen, progress_bar=False, record_timestamps=True
        )
        elapsed = time.perf_counter() - start
        ttft = statistics.median(o.timestamps[0] - start for o in outputs.values())
        report(
            f"transformers generate_batch W4 TTFT p50 (its defaults, {attention})",
            f"{ttft * 1e3:.0f} ms (all 256 done in {elapsed:.1f} s)",
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(SHAPES), default="llama-3.1-8b")
    parser.add_argument("--workloads", default="W1,W2,P,W4,HFW1,HF,HFW4")
    parser.add_argument("--w2-requests", type=int, default=1024)
    parser.add_argument("--hf-requests", type=int, default=128)
    parser.add_argument(
        "--hf-compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="HFW1: transformers with a static cache and torch.compile (else eager)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=8192,
        help="tokens per step (W4 takes 16384 whatever this says)",
    )
    parser.add_argument("--max-decode-burst", type=int, default=1)
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8_e4m3"], default="auto")
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="W1/W2: engine.async_scheduling (on by default on cuda, as the engine's)",
    )
    parser.add_argument(
        "--tokenizer-json", type=Path, help="W2S: the tokenizer.json its grammars compile against"
    )
    parser.add_argument(
        "--quantization", choices=["fp8"], help="FP8 projections and experts instead of bf16"
    )
    parser.add_argument(
        "--expandable-segments",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="torch's allocator with expandable segments, as `inferno` runs it (W6's "
        "fragmentation against without)",
    )
    args = parser.parse_args()
    # Read by the allocator when CUDA first allocates, which has not happened yet.
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = f"expandable_segments:{args.expandable_segments}"
    run_settings["kv_cache_dtype"] = args.kv_cache_dtype
    run_settings["max_num_batched_tokens"] = args.max_num_batched_tokens
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    wanted = set(args.workloads.split(","))
    shape = SHAPES[args.model]
    try:  # before any GPU work: a shape Inferno cannot build is refused here, by name
        config = ModelConfig.from_dict(shape)
    except ModelLoadError as exc:
        parser.error(f"--model {args.model}: {exc}")
    on_meta = build_model(config, dtype=torch.bfloat16, device="meta", ops=None, shard=None)
    _, read_bytes = weight_bytes(on_meta)  # bf16: the peer's
    global context_at_start
    torch.empty(1, device="cuda")
    free, total = torch.cuda.mem_get_info()
    context_at_start = total - free - torch.cuda.memory_reserved()
    props = torch.cuda.get_device_properties(0)
    commit = (
        os.environ.get("INFERNO_COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
    )
    print(
        f"date {datetime.date.today()} device {props.name} ({props.total_memory / 2**30:.0f} GiB, "
        f"{props.multi_processor_count} SMs) torch {torch.__version__} triton {triton.__version__}"
        f" commit {commit or 'unknown'} max_decode_burst {args.max_decode_burst}"
        f" model {args.model}"
        f" quantization {args.quantization or 'none (bf16)'}"
        f" kv_cache_dtype {args.kv_cache_dtype}"
        f" async_scheduling {args.async_scheduling}"
        f" max_num_batched_tokens {args.max_num_batched_tokens}"
        f" expandable_segments {args.expandable_segments}"
    )
    copy_bw = copy_bandwidth()
    report("copy bandwidth (read + write)", f"{copy_bw / 1e12:.2f} TB/s")
    matmul = matmul_rate()
    report("dense bf16 matmul 8192³", f"{matmul / 1e12:.0f} TFLOP/s")
    start = time.perf_counter()
    if wanted & PEER_WORKLOADS:
        peer = peer_model(shape)
        report(
            f"transformers {args.model} built (random bf16)", f"{time.perf_counter() - start:.0f} s"
        )
        transformers_peer(peer, wanted, args.hf_requests, read_bytes, copy_bw, args.hf_compile)
        start = time.perf_counter()
        model = inferno_model_from(peer, shape, quantization=args.quantization)
        del peer
        gc.collect()
        torch.cuda.reset_peak_memory_stats()  # W6's peak is Inferno's, not the peer's
        report(
            f"Inferno {args.model} loaded with the peer's weights (via host memory)",
            f"{time.perf_counter() - start:.0f} s",
        )
    else:
        model = random_model(args.model, quantization=args.quantization)
        report(f"random {args.model} built", f"{time.perf_counter() - start:.1f} s")
    if "W1" in wanted:
        w1(model, copy_bw, args.max_decode_burst, args.async_scheduling)
    if "W2" in wanted:
        w2(model, args.w2_requests, args.max_num_seqs, args.max_decode_burst, args.async_scheduling)
    if "W2S" in wanted:
        w2_structured(model, args.w2_requests, args.max_num_seqs, args.tokenizer_json)
    if "P" in wanted:
        prefill_throughput(model, matmul)
    if "W4" in wanted:
        w4(model)
    print("\n| metric | value | goal |\n|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()

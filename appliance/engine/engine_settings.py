"""The engine's sizes and switches, defined once: the settings file's `[engine]` section
(`appliance.config`) is this model, and the engine is built from it plus the model directory
(`appliance.engine.engine_config.EngineConfig`). Sizes are in tokens unless the name says
otherwise.

No torch here, so that reading the settings does not load it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

PrefixCacheIsolation = Literal["principal", "role", "issuer", "shared"]
"""Who may reuse whose cached prompt prefixes (appliance.api.cache_domains)."""

KVCacheDtype = Literal["auto", "fp8_e4m3"]
"""What the KV cache stores: the model's dtype, or FP8 (appliance.engine.kv_cache)."""

GPU_DECODE_BURST = 8
"""`max_decode_burst` when unset, on a GPU."""


class EngineSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    device: str = Field(default="cpu", description="cpu, or cuda / cuda:N for a GPU")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        default=None, description="weights and KV cache; default float32 on cpu, bfloat16 on cuda"
    )
    # W8A8 FP8 projections (e4m3, a scale per output channel, activations per token) for a
    # checkpoint that is not quantized already; an FP8 checkpoint (its config.json's
    # quantization_config) is served in FP8 whatever this says. Embeddings, norms and the LM
    # head stay in dtype.
    quantization: Literal["fp8"] | None = Field(
        default=None, description="fp8: quantize an unquantized checkpoint's projections on load"
    )
    block_size: int = Field(default=16, ge=1, le=1024, description="tokens per KV-cache block")
    # KV pool: an explicit block count; otherwise, on the CPU, as many blocks as fit in
    # kv_cache_memory_bytes, and on a GPU, what gpu_memory_utilization leaves after the weights,
    # a profiled step and the decode graphs (docs/ARCHITECTURE.md, "GPU memory").
    num_kv_blocks: int | None = Field(
        default=None, ge=1, description="KV-cache blocks; default: sized from memory"
    )
    kv_cache_memory_bytes: int = Field(
        default=1 << 30, ge=1, description="KV-cache size on cpu when num_kv_blocks is unset"
    )
    # fp8_e4m3 stores keys and values in one byte (float8_e4m3fn) with a per-layer scale each,
    # so the same memory holds twice the tokens of a bf16 cache, at some accuracy: see
    # docs/ARCHITECTURE.md, "FP8 KV cache".
    kv_cache_dtype: KVCacheDtype = Field(
        default="auto", description="KV-cache storage: auto (the model's dtype) or fp8_e4m3"
    )
    gpu_memory_utilization: float = Field(
        default=0.9, gt=0.0, le=1.0, description="fraction of GPU memory the engine may use"
    )
    max_model_len: int | None = Field(
        default=None, ge=2, description="context length; default and upper bound: the model's"
    )
    max_num_seqs: int = Field(default=64, ge=1, description="sequences running at once")
    max_num_batched_tokens: int = Field(default=2048, ge=1, description="tokens per step")
    enable_prefix_caching: bool = Field(default=True, description="reuse KV of shared prefixes")
    # Applied by the API, which knows the caller and turns it into each request's cache salt:
    # the engine itself only ever sees salts.
    prefix_cache_isolation: PrefixCacheIsolation = Field(
        default="principal",
        description="who may reuse whose cached prefixes: principal, role, issuer or shared",
    )
    enable_chunked_prefill: bool = Field(default=True, description="split long prompts")
    enable_cuda_graphs: bool = Field(default=True, description="replay decode steps (cuda)")
    # Up to this many decode steps run back to back without the host when every running
    # request is decoding and none waits: less host time per token (one output, one write per
    # stream, per burst), at the price of up to that many steps before a newly arrived request
    # is admitted. 1 turns bursts off. Unset: 8 on cuda (W3 at 20 req/s on the H100: the
    # server's CPU 38% of a core against 51-54% without, TTFT p99 200 ms against 90-100;
    # docs/BENCHMARKS.md, issue 17 round 14), 1 on the cpu, whose steps are long.
    max_decode_burst: int | None = Field(
        default=None, ge=1, description="decode steps run back to back without the host"
    )
    # Schedule and prepare each step while the one before it runs on the device, its outputs
    # processed once the next is queued. A sequence that stops runs one step more than it
    # needs (that token is dropped); grammars and penalties wait for their tokens instead.
    # Unset: on for cuda (W1 and W2 faster, docs/BENCHMARKS.md), off on the cpu, where the
    # host and the "device" are the same cores and there is nothing to overlap.
    async_scheduling: bool | None = Field(
        default=None,
        description="prepare the next step while the device runs this one; default: on cuda",
    )

    @property
    def decode_burst(self) -> int:
        """`max_decode_burst`, or its default for the device."""
        if self.max_decode_burst is not None:
            return self.max_decode_burst
        return GPU_DECODE_BURST if self.device.startswith("cuda") else 1

    @property
    def schedules_asynchronously(self) -> bool:
        """`async_scheduling`, or its default for the device."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return self.device.startswith("cuda")

    # One process per device: this one (rank 0: the scheduler, sampling and its own shard) and
    # tensor_parallel_size - 1 workers, on cuda:i+1 .. for device cuda:i (gloo on the CPU). The
    # model's heads, KV heads, intermediate size and vocabulary must divide by it; the KV pool
    # is sized per GPU, from the smallest one's free memory.
    tensor_parallel_size: int = Field(
        default=1, ge=1, le=8, description="devices (processes) the model is split across"
    )
    # The small all-reduces of decode steps through PyTorch's symmetric-memory one-shot kernel
    # (GPU peer-to-peer reads) instead of NCCL, whose small messages are all latency: a third
    # of NCCL's time alone (docs/BENCHMARKS.md, where the in-engine effect is measured). Falls
    # back to NCCL by itself where peers cannot be mapped.
    one_shot_all_reduce: bool = Field(
        default=True,
        description="tensor parallelism on GPUs: small all-reduces through the one-shot kernel",
    )
    num_cpu_threads: int = Field(
        default=0, ge=0, description="torch threads when the engine runs on cpu; 0: automatic"
    )
    # Triton compiles each kernel at its first launch (seconds per kernel at start-up) and keeps
    # it here; a cache made beforehand on the same GPU model and Triton version (an offline
    # bundle carries one: docs/INSTALL.md) is read instead. Unset: Triton's ~/.triton/cache.
    triton_cache_dir: Path | None = Field(
        default=None, description="Triton's kernel cache on cuda; default ~/.triton/cache"
    )

"""Warm Triton's kernel cache for a model's architecture before the appliance first starts.

Triton compiles each kernel variant at its first launch, seconds each: on a fresh machine the
engine's start (the profiled step, the CUDA graph captures) and its first requests of each shape
pay for it. `inferno warmup` builds the engine exactly as the settings say, runs a workload that
reaches the kernel variants serving uses (prefill lengths on and off Triton's divisibility
specializations, chunked prefill, steps mixing prefills with decodes, batched decodes, sampled
and greedy tokens), and reports how many kernels it had to compile. Run once on a staging host
with the appliance's GPU model and Triton version, the cache it fills goes into the offline
bundle (docs/INSTALL.md), and the appliance's first start then compiles nothing; run again, it
shows that (`compiled 0`). The build also keeps the engine's measured memory profile in that
cache (appliance.engine.memory_profile_cache), which the served engine then reads; when it
has just kept one, the workload runs again in a new process that reads it, as the served
engine will, since such an engine launched kernel variants the measuring one had not.

The weights are random, drawn from the model directory's config.json: kernels are specialized
by shapes and dtypes, never by weight values, so a sealed model is warmed without its key and
without any plaintext weight.
"""

from __future__ import annotations

import gc
import multiprocessing
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from appliance.engine.engine import Engine
from appliance.engine.engine_config import EngineConfig
from appliance.engine.errors import EngineError
from appliance.engine.models import loader
from appliance.engine.models.decoder import CausalLM
from appliance.engine.parallel.sharding import ShardPlan
from appliance.engine.sampling_params import SamplingParams
from kernels.backend import triton_cache_dir

# Prompt lengths: 1 and multiples of 16 hit Triton's specializations of integer arguments
# (== 1, divisible by 16), the others the general variants.
_PROMPT_LENGTHS = (1, 7, 16, 33, 100, 257)


@dataclass(frozen=True, slots=True)
class WarmupReport:
    build_s: float
    # The workload's run; with a memory profile just kept, also the new process's (its start,
    # its engine's build and the workload again).
    workload_s: float
    kernels_before: int
    kernels_after: int
    # Whether the build read its memory profile from the cache (True) or measured and kept it
    # there (False: appliance.engine.memory_profile_cache); None where nothing was kept (the
    # CPU, tensor parallelism).
    memory_profile_read: bool | None = None

    @property
    def compiled(self) -> int:
        return self.kernels_after - self.kernels_before


def cached_kernels(cache_dir: Path) -> int:
    """Compiled kernels in a Triton cache directory: one subdirectory per cache key."""
    if not cache_dir.is_dir():
        return 0
    return sum(1 for entry in cache_dir.iterdir() if entry.is_dir())


def random_model(config: EngineConfig, seed: int = 0, shard: ShardPlan | None = None) -> CausalLM:
    """The model directory's architecture on the engine's device, with random weights (one
    tensor-parallel rank's part with `shard`)."""
    return loader.random_model(
        Path(config.model_dir),
        dtype=config.torch_dtype,
        device=config.torch_device,
        ops=config.kernel_ops(),
        shard=shard,
        seed=seed,
        quantization=config.quantization,
    )


def warm_up(config: EngineConfig) -> WarmupReport:
    """Build the engine of `config` with random weights and run the workload (module
    docstring); how long each took, and the kernels in Triton's cache before and after."""
    cache_dir = None
    if config.on_gpu:
        config.kernel_ops()  # points Triton at the settings' cache before it is read here
        cache_dir = triton_cache_dir()
    before = cached_kernels(cache_dir) if cache_dir else 0
    # Every CUDA graph captured at build, though the server captures its graphs once ready
    # (startup.engine_config): the kernels their captures launch (the greedy graphs' input
    # staging, say) are compiled here, not by a served engine after it is ready.
    config = config.model_copy(update={"capture_graphs_when_idle": False})
    build_s, workload_s, profile_read = _warm(config)
    if profile_read is False:
        # This build measured the memory profile and kept it. The served engine will read it,
        # in a process of its own, and then launched variants of two attention kernels that
        # neither this engine nor a second one in this process did (the H100: three kernels
        # compiled by the next warm-up). So the workload runs again as the served engine will.
        started = time.perf_counter()
        _warm_in_a_new_process(config)
        workload_s += time.perf_counter() - started
    after = cached_kernels(cache_dir) if cache_dir else 0
    return WarmupReport(build_s, workload_s, before, after, profile_read)


def _warm_in_a_new_process(config: EngineConfig) -> None:
    """`_warm(config)` in a spawned process (no CUDA state shared); EngineError if it fails."""
    child = multiprocessing.get_context("spawn").Process(target=_warm, args=(config,))
    child.start()
    child.join()
    if child.exitcode != 0:
        raise EngineError(
            "the warm-up's second engine, which reads the kept memory profile, failed "
            f"(exit status {child.exitcode})"
        )


def _warm(config: EngineConfig) -> tuple[float, float, bool | None]:
    """Build the engine, run the workload, close the engine and free its GPU memory for a next
    one: how long the build and the workload took, and `WarmupReport.memory_profile_read`."""
    start = time.perf_counter()
    # Under tensor parallelism every rank draws its own part, and compiles its own kernels.
    engine = Engine.load(
        config, None, lambda shard: random_model(config, shard=shard), random_weights=True
    )
    built = time.perf_counter()
    profile = engine.runner.memory_profile
    profile_read = None
    if profile is not None and config.tensor_parallel_size == 1:
        profile_read = profile.from_cache
    try:
        _run_workload(engine, config)
    finally:
        engine.close()
        engine.runner.release_kv_caches()
        del engine
        gc.collect()
        if config.on_gpu:
            torch.cuda.empty_cache()
    return built - start, time.perf_counter() - built, profile_read


def _run_workload(engine: Engine, config: EngineConfig) -> None:
    vocab = engine.vocab_size
    generator = torch.Generator().manual_seed(0)

    def prompts(lengths: list[int]) -> list[list[int]]:
        return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]

    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, ignore_eos=True)
    # Every prompt leaves room for its 4 new tokens in the context.
    lengths = [min(length, engine.max_model_len - 4) for length in _PROMPT_LENGTHS]
    for length in lengths:  # one prefill at a time, then its decodes alone
        engine.generate(prompts([length]), greedy)
    # All at once: steps mixing prefill chunks and decodes, batched decodes of every size up to
    # the batch, and a prompt longer than one step's token budget (chunked prefill).
    longest = min(config.max_num_batched_tokens + 100, engine.max_model_len - 4)
    engine.generate(prompts([*lengths, longest]), sampled)

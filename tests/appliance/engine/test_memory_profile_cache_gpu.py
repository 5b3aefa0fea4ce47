"""A second build of an engine reads the memory profile the first measured and kept
(appliance.engine.memory_profile_cache): the same peaks, no less in use, no larger a KV pool;
and the key follows what the profile depends on. Its own module: another engine alive in the
process (test_memory_profile_gpu.py's) would hold the share of the GPU these builds size."""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from appliance.engine.engine import Engine
from appliance.engine.engine_config import EngineConfig
from appliance.engine.memory_profile_cache import MemoryProfileCache
from appliance.engine.sampling_params import SamplingParams
from tests.appliance.engine.random_llama import llama_shape, random_llama

pytestmark = pytest.mark.gpu

_SHAPE = llama_shape(hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                     num_attention_heads=8)  # fmt: skip
_SLACK = 2 << 20  # the allocator's granularity


@pytest.fixture
def model_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory with the shape's config.json (what a kept profile is keyed by), whose kept
    profile, in Triton's cache where the engine keeps it, is removed before and after."""
    (tmp_path / "config.json").write_text(json.dumps(_SHAPE))
    kept = _kept_profile(_settings(tmp_path))
    kept.unlink(missing_ok=True)
    yield tmp_path
    kept.unlink(missing_ok=True)


def _settings(model_dir: Path) -> EngineConfig:
    return EngineConfig(
        model_dir=model_dir,
        device="cuda",
        max_model_len=1024,
        max_num_seqs=64,
        max_num_batched_tokens=1024,
        gpu_memory_utilization=0.3,
    )


def _kept_profile(config: EngineConfig) -> Path:
    cache = MemoryProfileCache.for_engine(config)
    assert cache is not None
    return cache.path


def test_a_second_build_reads_the_profile_the_first_kept(model_dir: Path) -> None:
    model = random_llama(_SHAPE, torch.bfloat16)
    first = Engine.build(_settings(model_dir), model, tokenizer=None)
    measured = first.runner.memory_profile
    assert measured is not None and not measured.from_cache
    assert _kept_profile(_settings(model_dir)).is_file()
    first.runner.release_kv_caches()
    del first
    gc.collect()
    torch.cuda.empty_cache()

    second = Engine.build(_settings(model_dir), model, tokenizer=None)
    read = second.runner.memory_profile
    assert read is not None and read.from_cache
    peaks = ("forward_peak", "sampling_peak", "step_reserved", "graph_pool")
    assert [getattr(read, p) for p in peaks] == [getattr(measured, p) for p in peaks]
    # What the measuring steps loaded is counted in use (twice here: this process has it).
    assert read.in_use >= measured.in_use - _SLACK, (read, measured)
    assert read.kv_budget <= measured.kv_budget + _SLACK, (read, measured)
    # Steps as large as the profiled one run on the pool sized from the kept figures.
    prompts = torch.randint(0, _SHAPE["vocab_size"], (64, 16)).tolist()
    outputs = second.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    assert [len(out.token_ids) for out in outputs] == [4] * 64


def test_the_key_follows_the_settings_and_the_model_not_the_pools_share(model_dir: Path) -> None:
    settings = _settings(model_dir)
    kept = _kept_profile(settings)
    assert _kept_profile(settings.model_copy(update={"max_num_seqs": 32})) != kept
    assert _kept_profile(settings.model_copy(update={"kv_cache_dtype": "fp8_e4m3"})) != kept
    assert _kept_profile(settings.model_copy(update={"gpu_memory_utilization": 0.5})) == kept
    (model_dir / "config.json").write_text(json.dumps(_SHAPE | {"num_hidden_layers": 5}))
    assert _kept_profile(settings) != kept

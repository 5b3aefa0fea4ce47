"""The profiled step that sizes the KV pool accounts for what steps and graphs really take.

A random Llama-shaped model (bf16, Triton kernels, CUDA graphs) sized so that the logits and the
sampler matter (a 32k vocabulary): after the engine is built, a step as large as the profiled
one (max_num_batched_tokens tokens, every running request sampled with top-k, top-p and min-p
and asking for log-probabilities) and decode steps of the largest captured batch must stay
within what `ModelRunner.memory_profile` measured, and the decode graphs of every batch size
within the pool measured for the largest alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from appliance.engine.engine import Engine
from appliance.engine.engine_config import EngineConfig
from appliance.engine.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from tests.appliance.engine.random_llama import llama_shape, random_llama

pytestmark = pytest.mark.gpu

_SHAPE = llama_shape(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=8,
)
_MAX_TOKENS = 1024  # per step: 64 prompts of 16 tokens fill one
_MAX_SEQS = 64
# The allocator's granularity: a step's blocks may land in a fresh 2 MiB segment.
_SLACK = 2 << 20


@pytest.fixture(scope="module")
def engine() -> Engine:
    model = random_llama(_SHAPE, torch.bfloat16)
    settings = EngineConfig(
        model_dir=Path("random-model"),
        device="cuda",
        max_model_len=1024,
        max_num_seqs=_MAX_SEQS,
        max_num_batched_tokens=_MAX_TOKENS,
        # A share small enough to leave room for other tests' models in the same process.
        gpu_memory_utilization=0.3,
    )
    return Engine.build(settings, model.eval(), tokenizer=None)


def test_a_full_step_and_decodes_stay_within_the_profiled_peak(engine: Engine) -> None:
    profile = engine.runner.memory_profile
    assert profile is not None and profile.kv_budget > 0
    params = SamplingParams(
        temperature=1.0,
        top_k=50,
        top_p=0.9,
        min_p=0.05,
        logprobs=MAX_TOP_LOGPROBS,
        prompt_logprobs=MAX_TOP_LOGPROBS,
        max_tokens=8,
        ignore_eos=True,
    )
    prompts = torch.randint(0, _SHAPE["vocab_size"], (_MAX_SEQS, 16)).tolist()
    torch.cuda.synchronize()
    at_rest = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    # One full prefill step (64 × 16 tokens, 64 rows sampled), then decodes of all 64 at once.
    num_tokens = 0
    while engine.has_unfinished():
        num_tokens += sum(len(out.token_ids) for out in engine.step())
    torch.cuda.synchronize()
    assert num_tokens == _MAX_SEQS * 8
    peak = torch.cuda.max_memory_allocated() - at_rest
    assert peak <= max(profile.forward_peak, profile.sampling_peak) + _SLACK, (peak, profile)


def test_the_graphs_of_every_batch_size_fit_the_pool_profiled_for_the_largest(
    engine: Engine,
) -> None:
    profile = engine.runner.memory_profile
    graphs = engine.runner.graphs
    assert profile is not None and graphs is not None and graphs.max_batch == _MAX_SEQS
    assert 0 < graphs.pool_bytes() <= profile.graph_pool, (graphs.pool_bytes(), profile)

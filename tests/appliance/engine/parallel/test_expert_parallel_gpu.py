"""Expert parallelism on 2 GPUs (the Triton fused MoE kernel over each rank's experts, the
all-reduces, CUDA graphs with them captured inside) against one GPU on the same random
Qwen3-MoE and gpt-oss checkpoints, in float32.

Not bf16, as the dense test is: the router picks its top-k from logits that two GPUs round
differently in bf16 (each rank rounds its part of a sum that one GPU rounds whole), and a
random router's logits nearly tie, so a token takes another expert on one side and its hidden
state, and every logit after, moves by the logits' own scale (the first H200 run: 47% of the
scale at one prompt position, argmax 89.5%). In float32 the sums differ in their last bits
only and no choice flips: every compared logit within 0.1% of the largest logit's magnitude,
the argmax equal everywhere. A wrong expert map (another rank's expert run, or one run twice)
or a bias added on both ranks misses that by the logits' own scale.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
        python -m pytest -m gpu -o log_cli=true --log-cli-level=INFO \\
        tests/appliance/engine/parallel/test_expert_parallel_gpu.py
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from appliance.engine.engine import Engine
from appliance.engine.engine_config import EngineConfig
from appliance.engine.sampling_params import SamplingParams

from .gpu_models import MOE_ARCHITECTURES, save_gpu_moe_model
from .test_tensor_parallel import prompt_ids
from .test_tensor_parallel_gpu import SETTINGS, _check, _load, _run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for expert parallelism"),
]


FLOAT32_BOUND = 1e-3


@pytest.fixture(scope="module", params=MOE_ARCHITECTURES)
def engines(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Engine, Engine]]:
    model_dir = save_gpu_moe_model(tmp_path_factory.mktemp("ep-gpu"), request.param)
    # Fixed pools: sized from free memory they would depend on what the other model's left.
    settings = {**SETTINGS, "dtype": "float32", "num_kv_blocks": 256}
    single = Engine.build(
        EngineConfig(model_dir=model_dir, **settings), _load(model_dir, None, torch.float32), None
    )
    config = EngineConfig(model_dir=model_dir, tensor_parallel_size=2, **settings)
    parallel = Engine.load(config, None, lambda shard: _load(model_dir, shard, torch.float32))
    yield single, parallel
    parallel.close()


def _expert_bytes(engine: Engine) -> int:
    params = engine.runner.model.named_parameters()
    return sum(p.numel() * p.element_size() for name, p in params if ".experts." in name)


def test_each_gpu_holds_half_the_experts(engines) -> None:
    single, parallel = engines
    assert 2 * _expert_bytes(parallel) == _expert_bytes(single)


def test_prefill_and_chunked_prefill_logits_match_one_gpu(engines) -> None:
    # 200 prompt tokens in steps of 64: four chunks; logits at every prompt position.
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    (_, single), (_, parallel) = (_run(e, [prompt_ids(200)], params) for e in engines)
    assert [t.shape for t in single] == [t.shape for t in parallel]
    agree = _check("prefill", torch.cat(single), torch.cat(parallel), FLOAT32_BOUND)
    assert agree == 1.0


def test_decode_steps_from_cuda_graphs_match_one_gpu(engines) -> None:
    """Greedy decode of three sequences (CUDA graphs on both): the same tokens, and the same
    logits within the bound at every step."""
    _, parallel_engine = engines
    assert parallel_engine.runner.graphs is not None and parallel_engine.runner.graphs.max_batch
    prompts = [prompt_ids(n, offset=k) for k, n in ((3, 5), (40, 17), (90, 33))]
    # Log-probabilities asked: the one-GPU engine's greedy graphs, which keep the LM head
    # inside, would leave its decode logits unseen by the recorder.
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    (tokens_1, single), (tokens_2, parallel) = (_run(e, prompts, params) for e in engines)
    assert tokens_1 == tokens_2
    assert [s.shape for s in single] == [p.shape for p in parallel]
    _check("decode", torch.cat(single), torch.cat(parallel), FLOAT32_BOUND)

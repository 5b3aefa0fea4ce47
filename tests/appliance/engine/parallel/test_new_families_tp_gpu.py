"""Tensor parallelism of Gemma 4 and the hybrid Qwen on 2 GPUs (NCCL, Triton kernels, CUDA
graphs with the all-reduces and, for the hybrid, the state slots captured inside) against one
GPU on the same random checkpoints (gpu_models.py). The dense models in bf16 with the dense
test's bound (test_tensor_parallel_gpu.py: 5% of the largest logit, argmax at 95% of prompt
positions, decode compared until a near tie parts the runs); the mixtures in float32 with the
expert-parallel test's (test_expert_parallel_gpu.py: 0.1%, every argmax), as it explains.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
        python -m pytest -m gpu -o log_cli=true --log-cli-level=INFO \\
        tests/appliance/engine/parallel/test_new_families_tp_gpu.py
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from appliance.engine.engine import Engine
from appliance.engine.engine_config import EngineConfig
from appliance.engine.sampling_params import SamplingParams

from .gpu_models import NEW_FAMILY_ARCHITECTURES, save_gpu_new_family_model
from .test_expert_parallel_gpu import FLOAT32_BOUND
from .test_tensor_parallel import prompt_ids
from .test_tensor_parallel_gpu import (
    ARGMAX_AGREEMENT,
    SETTINGS,
    _check,
    _load,
    _run,
    check_decode_until_parted,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for tensor parallelism"),
]


def _is_moe(architecture: str) -> bool:
    return architecture.endswith("-moe")


@pytest.fixture(scope="module", params=NEW_FAMILY_ARCHITECTURES)
def engines(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Engine, Engine]]:
    architecture = request.param
    model_dir = save_gpu_new_family_model(tmp_path_factory.mktemp("tp-new"), architecture)
    dtype = torch.float32 if _is_moe(architecture) else torch.bfloat16
    # Fixed pools: sized from free memory they would depend on what the other model's left.
    settings = {**SETTINGS, "dtype": str(dtype).removeprefix("torch."), "num_kv_blocks": 256}
    single = Engine.build(
        EngineConfig(model_dir=model_dir, **settings), _load(model_dir, None, dtype), None
    )
    config = EngineConfig(model_dir=model_dir, tensor_parallel_size=2, **settings)
    parallel = Engine.load(config, None, lambda shard: _load(model_dir, shard, dtype))
    yield single, parallel
    parallel.close()


def _bound(engines) -> float | None:
    """The float32 bound for a mixture, None for bf16 (the dense test's)."""
    single, _ = engines
    return FLOAT32_BOUND if single.runner.model.config.moe is not None else None


def test_prefill_and_chunked_prefill_logits_match_one_gpu(engines) -> None:
    # 200 prompt tokens in steps of 64: four chunks; logits at every prompt position.
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    (_, single), (_, parallel) = (_run(e, [prompt_ids(200)], params) for e in engines)
    assert [t.shape for t in single] == [t.shape for t in parallel]
    bound = _bound(engines)
    if bound is None:
        agree = _check("prefill", torch.cat(single), torch.cat(parallel))
        assert agree >= ARGMAX_AGREEMENT
    else:
        assert _check("prefill", torch.cat(single), torch.cat(parallel), bound) == 1.0


def test_decode_steps_from_cuda_graphs_match_one_gpu(engines) -> None:
    """Greedy decode of three sequences of different lengths (CUDA graphs on both; a hybrid's
    graphs read each row's state slot on every rank)."""
    _, parallel_engine = engines
    assert parallel_engine.runner.graphs is not None and parallel_engine.runner.graphs.max_batch
    prompts = [prompt_ids(n, offset=k) for k, n in ((3, 5), (40, 17), (90, 33))]
    # Log-probabilities asked: the one-GPU engine's greedy graphs, which keep the LM head
    # inside, would leave its decode logits unseen by the recorder.
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    (tokens_1, single), (tokens_2, parallel) = (_run(e, prompts, params) for e in engines)
    bound = _bound(engines)
    if bound is None:
        check_decode_until_parted(single, parallel, len(prompts))
    else:
        assert tokens_1 == tokens_2
        _check("decode", torch.cat(single), torch.cat(parallel), bound)


def test_each_gpu_holds_half_the_kv_heads_and_half_the_recurrent_state(engines) -> None:
    single, parallel = engines
    for one, two in zip(single.runner.kv_caches, parallel.runner.kv_caches, strict=True):
        assert two.shape[3] * 2 == one.shape[3]  # [2, blocks, block_size, kv_heads, D]
    states = single.runner.recurrent_states, parallel.runner.recurrent_states
    for one, two in zip(*states, strict=True):
        assert two.delta.shape[1] * 2 == one.delta.shape[1]  # [slots, Hv, Dk, Dv]
        assert two.conv.shape[1] * 2 == one.conv.shape[1]  # [slots, conv_dim, K - 1]

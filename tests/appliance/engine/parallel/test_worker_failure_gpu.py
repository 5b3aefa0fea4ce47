"""On 2 GPUs: a killed worker ends the step blocked in NCCL (the watch aborts the communicators)
and stops the engine with an error naming the worker, in bounded time.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
        python -m pytest -m gpu -o log_cli=true --log-cli-level=INFO \\
        tests/appliance/engine/parallel/
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from appliance.engine.engine import Engine, EngineConfig
from appliance.engine.errors import TensorParallelError
from appliance.engine.sampling_params import SamplingParams

from .gpu_models import save_gpu_test_model
from .test_tensor_parallel import prompt_ids

logger = logging.getLogger(__name__)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for tensor parallelism"),
]


def _step_for(engine: Engine, seconds: float) -> None:
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        engine.step()


def test_a_killed_worker_stops_the_gpu_engine_with_an_error_naming_it(tmp_path: Path) -> None:
    from appliance.engine.models.loader import load_model
    from kernels import triton_ops

    model_dir = save_gpu_test_model(tmp_path / "model")
    config = EngineConfig(
        model_dir=model_dir, device="cuda", tensor_parallel_size=2, max_num_seqs=8
    )
    engine = Engine.load(
        config,
        None,
        lambda shard: load_model(
            model_dir, dtype=torch.bfloat16, device="cuda:0", ops=triton_ops, shard=shard
        ),
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)
        engine.add_request("r", prompt_ids(5), params)
        for _ in range(3):
            engine.step()
        assert engine.group is not None
        [pid] = engine.group.worker_pids
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"rank 1 .* killed by signal 9"):
            _step_for(engine, seconds=60)
        logger.info(f"the engine failed {time.monotonic() - started:.2f} s after the kill")
        assert time.monotonic() - started < 30
    finally:
        engine.close()

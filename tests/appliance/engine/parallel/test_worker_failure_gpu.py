"""On 2 GPUs: a killed worker stops the engine with an error naming the worker, in bounded time,
whether the step it interrupts waits in NCCL (the watch aborts the communicators) or in the
one-shot all-reduce's barrier (the watch fails the engine around the held thread).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
        python -m pytest -m gpu -o log_cli=true --log-cli-level=INFO \\
        tests/appliance/engine/parallel/test_worker_failure_gpu.py

In a process of its own (test_tensor_parallel_gpu.py says why).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from pathlib import Path

import pytest
import torch

from appliance.engine.async_engine import AsyncEngine, EngineDeadError
from appliance.engine.engine import Engine
from appliance.engine.engine_config import EngineConfig
from appliance.engine.errors import TensorParallelError
from appliance.engine.sampling_params import SamplingParams

from .gpu_models import save_gpu_test_model
from .test_tensor_parallel import prompt_ids
from .test_worker_failure import kill_worker_while_streaming

logger = logging.getLogger(__name__)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for tensor parallelism"),
]


def _step_for(engine: Engine, seconds: float) -> None:
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        engine.step()


@pytest.mark.parametrize("one_shot", [True, False], ids=["one-shot", "nccl"])
def test_a_killed_worker_stops_the_gpu_engine_with_an_error_naming_it(
    tmp_path: Path, one_shot: bool
) -> None:
    """As the server runs it (AsyncEngine). With NCCL all-reduces the watch's abort ends the
    step; with the one-shot kernel nothing ends it (the barrier spins on the GPU for the dead
    peer), and the watch fails the engine by itself."""
    from appliance.engine.models.loader import load_model
    from kernels import triton_ops

    model_dir = save_gpu_test_model(tmp_path / "model")
    config = EngineConfig(
        model_dir=model_dir,
        device="cuda",
        tensor_parallel_size=2,
        max_num_seqs=8,
        num_kv_blocks=256,  # the other parametrization's engine may still hold GPU 0
        one_shot_all_reduce=one_shot,
    )
    engine = Engine.load(
        config,
        None,
        lambda shard: load_model(
            model_dir, dtype=torch.bfloat16, device="cuda:0", ops=triton_ops, shard=shard
        ),
    )
    assert engine.group is not None and engine.group.all_reduce is not None
    assert engine.group.all_reduce.one_shot is one_shot

    async def main() -> float:
        ae = AsyncEngine(engine)
        ae.start()
        params = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
        stream = ae.generate("r", prompt_ids(5), params)
        killed_at: list[float] = []
        with pytest.raises(EngineDeadError) as caught:
            await kill_worker_while_streaming(engine, stream, killed_at, within_s=60)
        took = time.monotonic() - killed_at[0]
        assert isinstance(caught.value.__cause__, TensorParallelError)
        assert re.search(r"rank 1 .* killed by signal 9", str(caught.value.__cause__))
        assert not ae.is_running  # /health: 503 "stopped"
        async with asyncio.timeout(30):
            await ae.shutdown()
        return took

    try:
        took = asyncio.run(main())
        logger.info(f"the engine failed {took:.2f} s after the kill")
        assert took < 30
    finally:
        engine.close()

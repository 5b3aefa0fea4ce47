"""What the engine is built from: `EngineConfig`, the model directory and the engine's settings
(appliance.engine.engine_settings).

The start-up checks a config before torch is imported (appliance.boot.startup.engine_config,
step 1 of docs/ARCHITECTURE.md's "Start-up"), so that the server builds its app, listens and
attests while the engine's preload imports torch: no torch at this module's import. A config
refuses a device name other than cpu, cuda and cuda:N as it is made. What needs torch (the
device as torch sees it, and whether this machine has that GPU; the dtype; the kernels; the
tensor-parallel workers) is imported by the member that returns it, which only the engine's
load and build call.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import field_validator

from appliance.engine.engine_settings import EngineSettings
from appliance.engine.errors import EngineConfigError
from appliance.engine.models.config import ModelConfig

if TYPE_CHECKING:
    import torch

    from appliance.engine.parallel.group import TensorParallelGroup
    from appliance.engine.parallel.worker import SealedWeights
    from kernels.ops import KernelOps

# The CPU, or a CUDA GPU: the current one, or the one of that index.
_DEVICE_NAME = re.compile(r"cpu|cuda(:[0-9]+)?")


def is_device_name(value: str) -> bool:
    """Whether `value` names a device Inferno runs on: cpu, cuda or cuda:N (the settings' and
    the command line's one rule)."""
    return _DEVICE_NAME.fullmatch(value) is not None


def first_gpu_ordinal(device: str) -> int:
    """CUDA's ordinal of rank 0's GPU for a cuda or cuda:N device name: N, or 0 for cuda (a
    process that set no other device)."""
    _, _, index = device.partition(":")
    return int(index) if index else 0


def gpu_ordinals(device: str, size: int, available: int) -> list[int]:
    """CUDA's ordinal of each of `size` tensor-parallel ranks' GPUs for a cuda or cuda:N device
    name (cuda:N+r for rank r), on a machine with `available` GPUs. Raises EngineConfigError
    when they are too few. No torch: step 4b counts the GPUs through CUDA's driver."""
    first = first_gpu_ordinal(device)
    if first + size > available:
        raise EngineConfigError(
            f"tensor_parallel_size {size} from {device} needs GPUs cuda:{first}..cuda:"
            f"{first + size - 1}; this machine has {available}"
        )
    return list(range(first, first + size))


def automatic_cpu_threads(num_cpus: int) -> int:
    """Torch threads for an engine on `num_cpus` CPUs when the setting leaves it to us: all but
    one. Each torch op waits for its slowest thread, so a thread that shares its CPU (with the
    engine loop, the event loop or another process) stalls them all: on a busy 2-CPU machine, the
    CPU benchmark took more than 4x as long with two threads as with one (docs/BENCHMARKS.md,
    "Torch threads on CPU")."""
    return max(num_cpus - 1, 1)


class EngineConfig(EngineSettings):
    """Everything the engine is built from: the model directory and the engine settings.
    Raises EngineConfigError as it is made if `device` is none of cpu, cuda and cuda:N."""

    model_dir: Path
    # The CUDA graphs captured after the build, one at a time by the engine thread (AsyncEngine:
    # whenever the engine has nothing to run, and under load now and then), rather than during
    # it: the server answers meanwhile, eagerly where no graph is captured yet. The server's
    # start sets it (W5: ready a second or more sooner); whoever steps an engine itself (tests,
    # benchmarks) gets every graph at build.
    capture_graphs_when_idle: bool = False

    @field_validator("device")
    @classmethod
    def _refuse_unknown_device(cls, device: str) -> str:
        # EngineConfigError, not pydantic's ValueError: the start-up reports engine errors
        # (and pydantic lets any other exception through as it is).
        if not is_device_name(device):
            raise EngineConfigError(f"device {device!r}: Inferno runs on cpu, cuda or cuda:N")
        return device

    @property
    def on_gpu(self) -> bool:
        return self.device != "cpu"

    @property
    def dtype_name(self) -> Literal["float32", "bfloat16", "float16"]:
        """`dtype`, or its default for the device: bfloat16 on a GPU, float32 on the CPU."""
        return self.dtype or ("bfloat16" if self.on_gpu else "float32")

    @property
    def torch_device(self) -> torch.device:
        """`device`, on a machine that has it: raises EngineConfigError where no CUDA GPU is
        available, or none of that index. The engine's load asks, after the start-up's step 4
        (a confidential GPU may refuse CUDA before its verdict set it ready)."""
        import torch

        device = torch.device(self.device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise EngineConfigError(f"device {self.device!r}: no CUDA GPU is available here")
            num_gpus = torch.cuda.device_count()
            if (device.index or 0) >= num_gpus:
                raise EngineConfigError(
                    f"device {self.device!r}: this machine has {num_gpus} CUDA GPU(s), "
                    f"cuda:0 to cuda:{num_gpus - 1}"
                )
        return device

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype_name)

    def kernel_ops(self) -> KernelOps:
        """The kernels for this device, Triton's cache where the settings put it."""
        from kernels.backend import kernel_ops_for

        return kernel_ops_for(self.torch_device, triton_cache_dir=self.triton_cache_dir)

    @property
    def torch_num_threads(self) -> int:
        """Torch's threads on the CPU: the setting, or automatic_cpu_threads for this machine."""
        return self.num_cpu_threads or automatic_cpu_threads(len(os.sched_getaffinity(0)))

    @property
    def rank_num_threads(self) -> int:
        """Torch's threads in each tensor-parallel process on the CPU: they share the CPUs."""
        return max(1, self.torch_num_threads // self.tensor_parallel_size)

    def context_length(self, model_config: ModelConfig) -> int:
        """max_model_len: the setting, at most the model's own."""
        return min(self.max_model_len or model_config.max_model_len, model_config.max_model_len)

    def start_workers(
        self, *, random_weights: bool = False, sealed: SealedWeights | None = None
    ) -> TensorParallelGroup | None:
        """Spawn this config's tensor-parallel workers (None for one device). Load rank 0's
        shard of the weights with `shard=group.plan`, then `Engine.build(..., group=group)`;
        close the group if that fails. `random_weights`: benchmarks (loader.random_model);
        `sealed`: the workers decrypt their parts of this sealed model."""
        if self.tensor_parallel_size == 1:
            return None
        from appliance.engine.parallel.group import TensorParallelGroup

        return TensorParallelGroup.start(
            self,
            self.model_dir,
            max_model_len=self.context_length(ModelConfig.from_model_dir(self.model_dir)),
            dtype=self.torch_dtype,
            num_cpu_threads=self.rank_num_threads,
            random_weights=random_weights,
            sealed=sealed,
        )

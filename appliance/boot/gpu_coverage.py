"""Start-up step 4b: the passing verdict covers exactly the GPUs the engine will use.

A verdict is about the GPUs whose evidence it verified; the engine runs on the devices its
settings name (one per tensor-parallel rank). The gate opens only when the two are the same
set: as many GPUs attested as the engine's ranks use, and the same GPUs by NVML UUID (each
evidence entry carries the UUID of the GPU that gave it, covered by the digest the CPU report
binds). A GPU the engine would use but the verdict does not cover could be outside the TEE's
protection; an attested GPU the engine does not use means the machine is not the one the
settings describe. Both are refused, before any key is released or weight decrypted.
"""

from __future__ import annotations

from collections.abc import Sequence

from appliance.boot import cuda_driver
from appliance.engine.engine_config import gpu_ordinals
from appliance.errors import BootError


class GpuCoverageError(BootError):
    """The verdict's GPUs and the engine's GPUs differ (count or identity)."""


def verify_gpus_covered(attested: Sequence[str | None], used: Sequence[str]) -> None:
    """`attested`: the UUID of each GPU in the verdict's evidence (None: the collector named
    none); `used`: the UUID of each rank's device. Returns, or raises GpuCoverageError saying
    what differs. Fail closed: an unnamed attested GPU, or a device named twice, is refused."""
    if any(uuid is None for uuid in attested):
        raise GpuCoverageError(
            "the verdict's GPU evidence does not name its GPUs (no uuid): it cannot be matched "
            "to the engine's devices; update the evidence collector"
        )
    covered = [_normalized(uuid) for uuid in attested if uuid is not None]
    engine = [_normalized(uuid) for uuid in used]
    if len(set(engine)) != len(engine) or len(set(covered)) != len(covered):
        raise GpuCoverageError("a GPU is named twice among the attested or the engine's GPUs")
    if len(covered) != len(engine):
        raise GpuCoverageError(
            f"the verdict covers {len(covered)} GPUs but the engine uses {len(engine)} "
            "(engine.tensor_parallel_size): the attested GPUs must be exactly the engine's"
        )
    missing = sorted(set(engine) - set(covered))
    if missing:
        raise GpuCoverageError(
            f"the engine would use GPUs the verdict does not cover: {', '.join(missing)}"
        )


def engine_gpu_uuids(device: str, tensor_parallel_size: int) -> list[str]:
    """The UUID of each tensor-parallel rank's GPU (cuda:i+r for `device` cuda:i, or cuda:0 for
    cuda), as CUDA reports it, from its driver: torch is not needed (appliance.boot.cuda_driver).
    Only after the GPUs were set ready: CUDA may refuse a confidential GPU before. Raises
    EngineConfigError when the machine has too few GPUs, CudaDriverError when CUDA fails."""
    ordinals = gpu_ordinals(device, tensor_parallel_size, cuda_driver.device_count())
    return [cuda_driver.device_uuid(ordinal) for ordinal in ordinals]


def _normalized(uuid: str) -> str:
    """NVML writes `GPU-<uuid>`, CUDA the bare UUID; compare the UUID, lower case."""
    uuid = uuid.strip().lower()
    return uuid.removeprefix("gpu-")

"""Step 4b: the verdict's GPUs are exactly the engine's, by count and UUID, or the gate stays
shut. NVML names a GPU `GPU-<uuid>`, CUDA by the bare UUID: both name the same GPU."""

from __future__ import annotations

import pytest

from appliance.boot.gpu_coverage import GpuCoverageError, verify_gpus_covered

A = "GPU-0a1b2c3d-0000-1111-2222-333344445555"
B = "GPU-9f8e7d6c-0000-1111-2222-333344445555"
C = "GPU-11111111-0000-1111-2222-333344445555"


def test_the_same_gpus_in_another_order_and_spelling_pass() -> None:
    verify_gpus_covered([A, B], [B.removeprefix("GPU-"), A.lower()])


@pytest.mark.parametrize(
    ("attested", "used", "message"),
    [
        ([A], [A, B], "covers 1 GPUs but the engine uses 2"),
        ([A, B], [A], "covers 2 GPUs but the engine uses 1"),
        ([A, C], [A, B], "does not cover: 9f8e7d6c"),
        ([A, None], [A, B], "does not name its GPUs"),
        ([], [A], "covers 0 GPUs but the engine uses 1"),
        ([A, A], [A, B], "named twice"),
        ([A, B], [A, A], "named twice"),
    ],
    ids=["fewer", "more", "another-gpu", "unnamed", "none", "attested-twice", "used-twice"],
)
def test_a_verdict_not_covering_exactly_the_engines_gpus_is_refused(
    attested: list[str | None], used: list[str], message: str
) -> None:
    with pytest.raises(GpuCoverageError, match=message):
        verify_gpus_covered(attested, used)


@pytest.mark.gpu
def test_cuda_and_nvml_name_this_machines_gpus_alike() -> None:
    """What the collector reports (NVML) and what the engine uses (CUDA) match on a real host
    (run without CUDA_VISIBLE_DEVICES, which renumbers CUDA's devices but not NVML's)."""
    import pynvml
    import torch

    from appliance.boot.gpu_coverage import engine_gpu_uuids

    pynvml.nvmlInit()
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        nvml = [pynvml.nvmlDeviceGetUUID(h) for h in handles]
    finally:
        pynvml.nvmlShutdown()
    nvml = [u.decode() if isinstance(u, bytes) else u for u in nvml]
    verify_gpus_covered(nvml, engine_gpu_uuids("cuda", torch.cuda.device_count()))

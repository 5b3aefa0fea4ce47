"""CUDA's driver through ctypes (appliance.boot.cuda_driver): step 4b's UUIDs without torch, as
torch writes them; every failure a CudaDriverError naming the call. A stand-in driver plays the
library here; on the GPU machine the real one must agree with torch."""

from __future__ import annotations

import ctypes
import uuid
from typing import Any

import pytest

from appliance.boot import cuda_driver
from appliance.boot.cuda_driver import CudaDriverError
from appliance.boot.gpu_coverage import engine_gpu_uuids
from appliance.engine.engine_config import first_gpu_ordinal
from appliance.engine.errors import EngineConfigError

UUIDS = [uuid.UUID(int=0x0A1B2C3D_0000_1111_2222_333344445555 + i) for i in range(4)]
NOT_READY = 600  # CUDA_ERROR_NOT_READY


class StandInDriver:
    """The few entry points cuda_driver calls, with ctypes' by-reference arguments."""

    def __init__(self, count: int, failing: str | None = None) -> None:
        self.count = count
        self.failing = failing
        self.retained: list[int] = []

    def _result(self, call: str) -> int:
        return NOT_READY if call == self.failing else 0

    def cuDeviceGetCount(self, count: Any) -> int:
        count._obj.value = self.count
        return self._result("cuDeviceGetCount")

    def cuDeviceGet(self, device: Any, ordinal: int) -> int:
        if ordinal >= self.count:
            return 101  # CUDA_ERROR_INVALID_DEVICE
        device._obj.value = ordinal
        return self._result("cuDeviceGet")

    def cuDeviceGetUuid_v2(self, raw: Any, device: ctypes.c_int) -> int:
        ctypes.memmove(raw, UUIDS[device.value].bytes, 16)
        return self._result("cuDeviceGetUuid_v2")

    def cuDevicePrimaryCtxRetain(self, context: Any, device: ctypes.c_int) -> int:
        self.retained.append(device.value)
        return self._result("cuDevicePrimaryCtxRetain")

    def cuGetErrorName(self, result: int, name: Any) -> int:
        known = {NOT_READY: b"CUDA_ERROR_NOT_READY", 101: b"CUDA_ERROR_INVALID_DEVICE"}
        if result not in known:
            return 1
        name._obj.value = known[result]
        return 0


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> StandInDriver:
    """A stand-in with CUDA's entry-point names (two GPUs)."""
    stand_in = StandInDriver(count=2)
    monkeypatch.setattr(cuda_driver, "_initialized", lambda: stand_in)
    return stand_in


def test_the_engine_s_gpus_are_named_by_uuid_as_torch_writes_them(driver: StandInDriver) -> None:
    assert engine_gpu_uuids("cuda", 2) == [str(UUIDS[0]), str(UUIDS[1])]
    assert engine_gpu_uuids("cuda:1", 1) == ["0a1b2c3d-0000-1111-2222-333344445556"]


def test_too_few_gpus_for_the_ranks_is_refused(driver: StandInDriver) -> None:
    with pytest.raises(EngineConfigError, match=r"needs GPUs cuda:1\.\.cuda:2; this machine has 2"):
        engine_gpu_uuids("cuda:1", 2)


def test_a_failing_call_names_itself_and_cuda_s_error(driver: StandInDriver) -> None:
    driver.failing = "cuDeviceGetUuid_v2"
    with pytest.raises(CudaDriverError, match="in cuDeviceGetUuid: CUDA_ERROR_NOT_READY"):
        engine_gpu_uuids("cuda", 1)
    driver.failing = "cuDevicePrimaryCtxRetain"
    with pytest.raises(CudaDriverError, match="in cuDevicePrimaryCtxRetain: CUDA_ERROR_NOT"):
        cuda_driver.retain_primary_context(1)
    with pytest.raises(CudaDriverError, match=r"in cuDeviceGet\(7\): CUDA_ERROR_INVALID_DEVICE"):
        cuda_driver.device_uuid(7)


def test_an_unnamed_error_is_reported_by_its_number(driver: StandInDriver) -> None:
    driver.failing = "cuDeviceGetCount"
    driver.cuGetErrorName = lambda result, name: 1  # type: ignore[method-assign]
    with pytest.raises(CudaDriverError, match="in cuDeviceGetCount: error 600"):
        cuda_driver.device_count()


def test_a_machine_without_cuda_s_driver_gets_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cuda_driver._initialized.cache_clear()
    monkeypatch.setattr(cuda_driver, "_LIBRARY", "libcuda-absent.so.1")
    try:
        with pytest.raises(CudaDriverError, match=r"\(libcuda-absent.so.1\) cannot be loaded"):
            cuda_driver.device_count()
    finally:
        cuda_driver._initialized.cache_clear()


def test_the_primary_context_is_retained_on_rank_0_s_gpu(driver: StandInDriver) -> None:
    cuda_driver.retain_primary_context(first_gpu_ordinal("cuda:1"))
    cuda_driver.retain_primary_context(first_gpu_ordinal("cuda"))
    assert driver.retained == [1, 0]


@pytest.mark.gpu
def test_the_driver_names_the_gpus_as_torch_does() -> None:
    import torch

    count = torch.cuda.device_count()
    assert cuda_driver.device_count() == count
    assert [cuda_driver.device_uuid(i) for i in range(count)] == [
        str(torch.cuda.get_device_properties(i).uuid) for i in range(count)
    ]

"""CUDA's driver API through ctypes: what the start needs of the GPUs before torch is imported.

Step 4b (appliance.boot.gpu_coverage) needs the UUIDs of the engine's GPUs. Asked through torch,
it waited for the preload's import of torch (seconds on the GPU machine) and then for CUDA's
start (0.2 s on the H100). The driver answers without torch: libcuda.so.1 is loaded with ctypes,
whose calls release the GIL, so steps 4b and 5 go on while torch imports. The answer is torch's:
`cudaGetDeviceProperties(i).uuid` is the driver's `cuDeviceGetUuid_v2` of ordinal i, and both
number the devices CUDA_VISIBLE_DEVICES leaves alike.

`retain_primary_context` makes a device's primary context (0.14-0.17 s on the H100), the one
torch's runtime then uses, so that the sealed load does not make it when it first touches the
GPU. Both are called only once the GPUs are set ready (a confidential GPU takes no work before).
"""

from __future__ import annotations

import ctypes
import functools
import uuid

from appliance.engine.errors import EngineError

_LIBRARY = "libcuda.so.1"
_SUCCESS = 0


class CudaDriverError(EngineError):
    """CUDA's driver cannot be loaded, or one of its calls failed (the message says which)."""


def device_count() -> int:
    """How many GPUs CUDA sees (CUDA_VISIBLE_DEVICES applied)."""
    driver = _initialized()
    count = ctypes.c_int()
    _check(driver, driver.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
    return count.value


def device_uuid(ordinal: int) -> str:
    """The UUID of CUDA's device `ordinal`, written as torch writes it (8-4-4-4-12 hex)."""
    driver = _initialized()
    raw = (ctypes.c_ubyte * 16)()
    _check(driver, driver.cuDeviceGetUuid_v2(raw, _device(driver, ordinal)), "cuDeviceGetUuid")
    return str(uuid.UUID(bytes=bytes(raw)))


def retain_primary_context(ordinal: int) -> None:
    """Make (or take) device `ordinal`'s primary context, and keep it for the process's life:
    released, it would be destroyed before torch took it."""
    driver = _initialized()
    context = ctypes.c_void_p()
    device = _device(driver, ordinal)
    _check(
        driver,
        driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), device),
        "cuDevicePrimaryCtxRetain",
    )


@functools.cache
def _initialized() -> ctypes.CDLL:
    """The driver, loaded and initialized once (cuInit: 0.1 s on the H100)."""
    try:
        driver = ctypes.CDLL(_LIBRARY)
    except OSError as exc:
        raise CudaDriverError(f"CUDA's driver ({_LIBRARY}) cannot be loaded: {exc}") from exc
    _check(driver, driver.cuInit(0), "cuInit")
    return driver


def _device(driver: ctypes.CDLL, ordinal: int) -> ctypes.c_int:
    device = ctypes.c_int()
    _check(driver, driver.cuDeviceGet(ctypes.byref(device), ordinal), f"cuDeviceGet({ordinal})")
    return device


def _check(driver: ctypes.CDLL, result: int, call: str) -> None:
    if result == _SUCCESS:
        return
    name = ctypes.c_char_p()
    named = driver.cuGetErrorName(result, ctypes.byref(name)) == _SUCCESS and name.value
    what = name.value.decode() if named and name.value else f"error {result}"
    raise CudaDriverError(f"CUDA's driver failed in {call}: {what}")

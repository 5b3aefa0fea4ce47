"""The GPUs the Overview shows: per GPU its utilization, memory, temperature and
confidential-computing mode, read through NVML (the `nvidia-ml-py` package, module `pynvml`).

This is a device edge, like appliance.attestation.devices: pynvml is imported only when the
first reading is taken, and every reading runs in a daemon thread with a deadline, so a wedged
driver shows as "NVML did not answer" instead of a hung page or sampler (NVML offers no way to
cancel a call: a stuck thread is abandoned, and no second one is started while it hangs). On a
machine without NVML or without a GPU, the first reading says so and NVML is not asked again.

The CC mode is NVML's system-wide confidential-computing state (on, off, or devtools on
Hopper); where NVML cannot tell (an older driver, a GPU without CC), the mode the standing
attestation verdict's claims name for that GPU is shown instead, marked as such.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

READ_TIMEOUT_S = 2.0
NOT_REPORTED = "—"
_GIB = float(1 << 30)


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One GPU at one moment, as NVML reported it; None where NVML could not tell."""

    index: int
    name: str
    utilization_pct: int | None
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    temperature_c: int | None
    cc_mode: str | None  # "on", "off" or "devtools": the system's CC state (all GPUs alike)

    @property
    def memory_used_fraction(self) -> float | None:
        if self.memory_used_bytes is None or not self.memory_total_bytes:
            return None
        return self.memory_used_bytes / self.memory_total_bytes


@dataclass(frozen=True, slots=True)
class GpuReport:
    """The GPUs' readings, or why there are none: `no_gpu` when NVML is missing or sees no
    GPU (the machine has none to show), `problem` for a reading that failed or hung."""

    gpus: tuple[GpuReading, ...]
    problem: str | None = None
    no_gpu: bool = False


NOT_READ = GpuReport((), "the GPUs have not been read yet")


class _NoGpu(Exception):
    """NVML is missing or sees no GPU: asking again would not change that."""


class GpuMonitor:
    """Reads this machine's GPUs through NVML; `load_nvml` gives the pynvml module (tests pass a
    fake one). NVML is initialised at the first reading and shut down by `close`."""

    def __init__(
        self,
        timeout_s: float = READ_TIMEOUT_S,
        load_nvml: Callable[[], Any] = lambda: importlib.import_module("pynvml"),
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout_s = timeout_s
        self._load_nvml = load_nvml
        self._monotonic = monotonic
        self._nvml: Any = None  # the initialised module, touched by one worker at a time
        self._no_gpu: str | None = None
        # When the reading in progress began (None: none is): set here, cleared by its thread.
        self._busy_since_s: float | None = None

    async def read(self) -> GpuReport:
        """The GPUs now, within `timeout_s`; never raises."""
        if self._no_gpu is not None:
            return GpuReport((), self._no_gpu, no_gpu=True)
        busy_since_s = self._busy_since_s
        if busy_since_s is not None:
            waited_s = self._monotonic() - busy_since_s
            return GpuReport((), f"NVML has not answered for {waited_s:.0f} s (driver wedged?)")
        loop = asyncio.get_running_loop()
        # The outcome, an exception included, is the future's result: a reading that ends
        # after its deadline leaves no exception unretrieved.
        answer: asyncio.Future[GpuReport | BaseException] = loop.create_future()

        def run() -> None:
            try:
                outcome: GpuReport | BaseException = self._read()
            except BaseException as exc:  # handed to the event loop below
                outcome = exc
            self._busy_since_s = None
            with contextlib.suppress(RuntimeError):  # the loop closed while NVML hung
                loop.call_soon_threadsafe(_settle, answer, outcome)

        self._busy_since_s = self._monotonic()
        threading.Thread(target=run, name="inferno-nvml-read", daemon=True).start()
        try:
            outcome = await asyncio.wait_for(asyncio.shield(answer), self.timeout_s)
        except TimeoutError:
            return GpuReport((), f"NVML did not answer within {self.timeout_s:g} s")
        if isinstance(outcome, _NoGpu):
            self._no_gpu = str(outcome)
            return GpuReport((), self._no_gpu, no_gpu=True)
        if isinstance(outcome, BaseException):
            return GpuReport((), f"NVML failed: {type(outcome).__name__}: {outcome}")
        return outcome

    def _read(self) -> GpuReport:
        """The GPUs now, in the calling thread (may block as long as the driver does). Raises
        _NoGpu, or NVML's own errors."""
        nvml = self._initialised()
        try:
            num_gpus = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as exc:
            return GpuReport((), f"NVML cannot count the GPUs: {exc}")
        if num_gpus == 0:
            raise _NoGpu("NVML sees no GPU")
        cc_mode = _cc_mode(nvml)
        return GpuReport(tuple(_read_gpu(nvml, index, cc_mode) for index in range(num_gpus)))

    def close(self) -> None:
        """Shut NVML down if a reading started it (not while a reading hangs in it)."""
        if self._busy_since_s is not None:
            return
        nvml, self._nvml = self._nvml, None
        if nvml is None:
            return
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()

    def _initialised(self) -> Any:
        if self._nvml is not None:
            return self._nvml
        try:
            nvml = self._load_nvml()
        except ImportError:
            raise _NoGpu("NVML bindings are not installed (nvidia-ml-py)") from None
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise _NoGpu(f"NVML cannot start (no NVIDIA driver?): {exc}") from None
        self._nvml = nvml
        return nvml


def _settle(
    answer: asyncio.Future[GpuReport | BaseException], outcome: GpuReport | BaseException
) -> None:
    if not answer.done():
        answer.set_result(outcome)


def _cc_mode(nvml: Any) -> str | None:
    """The system's CC mode, or None where NVML cannot tell (no such call in this driver or
    these bindings, or not supported by the GPU)."""
    try:
        state = nvml.nvmlSystemGetConfComputeState()
    except (AttributeError, nvml.NVMLError):
        return None
    if state.ccFeature != nvml.NVML_CC_SYSTEM_FEATURE_ENABLED:
        return "off"
    return "devtools" if state.devToolsMode == nvml.NVML_CC_SYSTEM_DEVTOOLS_MODE_ON else "on"


def _read_gpu(nvml: Any, index: int, cc_mode: str | None) -> GpuReading:
    """One GPU's reading; a value NVML refuses (not supported on this GPU) is None."""
    handle = nvml.nvmlDeviceGetHandleByIndex(index)

    def ask(call: Callable[[], Any]) -> Any:
        try:
            return call()
        except nvml.NVMLError:
            return None

    name = ask(lambda: nvml.nvmlDeviceGetName(handle))
    if isinstance(name, bytes):  # older bindings answer bytes
        name = name.decode("utf-8", "replace")
    utilization = ask(lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
    memory = ask(lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
    temperature = ask(lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
    return GpuReading(
        index=index,
        name=name or f"GPU {index}",
        utilization_pct=None if utilization is None else int(utilization.gpu),
        memory_used_bytes=None if memory is None else int(memory.used),
        memory_total_bytes=None if memory is None else int(memory.total),
        temperature_c=None if temperature is None else int(temperature),
        cc_mode=cc_mode,
    )


# -- as the Overview shows them ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GpuRow:
    """One GPU as text, for the Overview's table and its live updates."""

    index: int
    name: str
    utilization: str
    memory: str
    temperature: str
    cc_mode: str

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "name": self.name,
            "utilization": self.utilization,
            "memory": self.memory,
            "temperature": self.temperature,
            "cc_mode": self.cc_mode,
        }


def gpu_rows(report: GpuReport, claims: Mapping[str, Any] | None) -> list[GpuRow]:
    """The report's GPUs as text; `claims` are the standing verdict's (for the CC mode where
    NVML cannot tell it)."""
    return [
        GpuRow(
            index=gpu.index,
            name=gpu.name,
            utilization=format_percent(gpu.utilization_pct),
            memory=format_memory(gpu.memory_used_bytes, gpu.memory_total_bytes),
            temperature=NOT_REPORTED if gpu.temperature_c is None else f"{gpu.temperature_c} °C",
            cc_mode=cc_mode_text(gpu, claims),
        )
        for gpu in report.gpus
    ]


def gpu_note(report: GpuReport, engine_device: str) -> str | None:
    """What the GPU panel says instead of (or beside) its table; None when all is read."""
    if report.no_gpu and engine_device == "cpu":
        return "No GPU: the engine runs on the CPU."
    if report.no_gpu:
        return f"No GPU reading ({report.problem}), though the engine runs on {engine_device}."
    if report.problem is not None:
        return f"GPU readings unavailable: {report.problem}."
    return None


def format_percent(value: int | None) -> str:
    return NOT_REPORTED if value is None else f"{value} %"


def format_memory(used_bytes: int | None, total_bytes: int | None) -> str:
    """`12.3 / 79.6 GiB (15 %)`."""
    if used_bytes is None or not total_bytes:
        return NOT_REPORTED
    share = round(100 * used_bytes / total_bytes)
    return f"{used_bytes / _GIB:.1f} / {total_bytes / _GIB:.1f} GiB ({share} %)"


def cc_mode_text(gpu: GpuReading, claims: Mapping[str, Any] | None) -> str:
    """NVML's CC mode, else the one the attestation claims for this GPU, else "unknown"."""
    if gpu.cc_mode is not None:
        return gpu.cc_mode
    attested = _attested_cc_mode(claims, gpu.index)
    if attested is not None:
        return f"{attested} (as attested; NVML cannot tell)"
    return "unknown (NVML cannot tell, and no verdict names it)"


def _attested_cc_mode(claims: Mapping[str, Any] | None, index: int) -> str | None:
    """`claims["gpu"]["gpus"][index]["cc_mode"]` of a combined verdict
    (attestation.gpu.verify), if there."""
    gpu_claims = (claims or {}).get("gpu")
    gpus = gpu_claims.get("gpus") if isinstance(gpu_claims, Mapping) else None
    if not isinstance(gpus, list) or not 0 <= index < len(gpus):
        return None
    mode = gpus[index].get("cc_mode") if isinstance(gpus[index], Mapping) else None
    return mode if isinstance(mode, str) else None

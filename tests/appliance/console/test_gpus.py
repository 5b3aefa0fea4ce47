"""The Overview's GPU readings (appliance.console.gpus) over a fake NVML module: parsing what
NVML answers, the text shown, the CC mode from NVML or else the attestation claims, a machine
without GPU, and a wedged driver that must not hold up the page; on the GPU machine, the real
driver against what torch sees."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from appliance.console.gpus import (
    GpuMonitor,
    GpuReading,
    GpuReport,
    cc_mode_text,
    format_memory,
    gpu_note,
    gpu_rows,
)

GIB = 1 << 30


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


@dataclass
class FakeGpu:
    name: str | bytes = "NVIDIA H100 80GB HBM3"
    utilization: int | None = 87
    used: int = 12 * GIB
    total: int = 80 * GIB
    temperature: int | None = 41


@dataclass
class FakeNvml:
    """The part of pynvml the monitor uses; None for a call this "driver" does not support."""

    gpus: list[FakeGpu] = field(default_factory=lambda: [FakeGpu()])
    cc_feature: int | None = 1
    dev_tools: int = 0
    init_error: int | None = None
    hang: threading.Event | None = None
    num_inits: int = 0
    num_shutdowns: int = 0
    num_counts: int = 0

    NVMLError = NVMLError
    NVML_TEMPERATURE_GPU = 0
    NVML_CC_SYSTEM_FEATURE_ENABLED = 1
    NVML_CC_SYSTEM_DEVTOOLS_MODE_ON = 1
    NOT_SUPPORTED = 3

    def nvmlInit(self) -> None:
        self.num_inits += 1
        if self.init_error is not None:
            raise NVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.num_shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        self.num_counts += 1
        if self.hang is not None:
            self.hang.wait()
        return len(self.gpus)

    def nvmlSystemGetConfComputeState(self) -> Any:
        if self.cc_feature is None:
            raise NVMLError(self.NOT_SUPPORTED)
        return SimpleNamespace(ccFeature=self.cc_feature, devToolsMode=self.dev_tools)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        return self.gpus[index]

    def nvmlDeviceGetName(self, gpu: FakeGpu) -> str | bytes:
        return gpu.name

    def nvmlDeviceGetUtilizationRates(self, gpu: FakeGpu) -> Any:
        if gpu.utilization is None:
            raise NVMLError(self.NOT_SUPPORTED)
        return SimpleNamespace(gpu=gpu.utilization, memory=3)

    def nvmlDeviceGetMemoryInfo(self, gpu: FakeGpu) -> Any:
        return SimpleNamespace(used=gpu.used, total=gpu.total, free=gpu.total - gpu.used)

    def nvmlDeviceGetTemperature(self, gpu: FakeGpu, sensor: int) -> int:
        assert sensor == self.NVML_TEMPERATURE_GPU
        if gpu.temperature is None:
            raise NVMLError(self.NOT_SUPPORTED)
        return gpu.temperature


def read(monitor: GpuMonitor) -> GpuReport:
    return asyncio.run(monitor.read())


def test_readings_are_parsed_per_gpu() -> None:
    nvml = FakeNvml(gpus=[FakeGpu(), FakeGpu(name=b"NVIDIA H200", utilization=5, temperature=33)])
    report = read(GpuMonitor(load_nvml=lambda: nvml))
    assert report.problem is None and not report.no_gpu
    assert report.gpus == (
        GpuReading(0, "NVIDIA H100 80GB HBM3", 87, 12 * GIB, 80 * GIB, 41, "on"),
        GpuReading(1, "NVIDIA H200", 5, 12 * GIB, 80 * GIB, 33, "on"),  # bytes decoded
    )
    assert report.gpus[0].memory_used_fraction == 12 / 80


def test_nvml_is_started_once_and_shut_down_at_close() -> None:
    nvml = FakeNvml()
    monitor = GpuMonitor(load_nvml=lambda: nvml)
    read(monitor)
    read(monitor)
    monitor.close()
    assert (nvml.num_inits, nvml.num_counts, nvml.num_shutdowns) == (1, 2, 1)


def test_what_a_gpu_does_not_support_is_shown_as_not_reported() -> None:
    nvml = FakeNvml(gpus=[FakeGpu(utilization=None, temperature=None)])
    [row] = gpu_rows(read(GpuMonitor(load_nvml=lambda: nvml)), None)
    assert (row.utilization, row.temperature) == ("—", "—")
    assert row.memory == "12.0 / 80.0 GiB (15 %)"


def test_rows_are_the_text_the_overview_shows() -> None:
    report = read(GpuMonitor(load_nvml=lambda: FakeNvml()))
    [row] = gpu_rows(report, None)
    assert row.to_json() == {
        "index": 0,
        "name": "NVIDIA H100 80GB HBM3",
        "utilization": "87 %",
        "memory": "12.0 / 80.0 GiB (15 %)",
        "temperature": "41 °C",
        "cc_mode": "on",
    }
    assert format_memory(None, None) == "—" and format_memory(1, 0) == "—"


def test_cc_mode_comes_from_nvml_off_on_or_devtools() -> None:
    for feature, dev_tools, shown in ((0, 0, "off"), (1, 0, "on"), (1, 1, "devtools")):
        nvml = FakeNvml(cc_feature=feature, dev_tools=dev_tools)
        [row] = gpu_rows(read(GpuMonitor(load_nvml=lambda nvml=nvml: nvml)), None)
        assert row.cc_mode == shown


def test_cc_mode_falls_back_to_the_attestation_claims_when_nvml_cannot_tell() -> None:
    report = read(GpuMonitor(load_nvml=lambda: FakeNvml(cc_feature=None)))
    assert report.gpus[0].cc_mode is None
    claims = {"gpu": {"num_gpus": 1, "gpus": [{"arch": "HOPPER", "cc_mode": "on"}]}, "cpu": {}}
    [row] = gpu_rows(report, claims)
    assert row.cc_mode == "on (as attested; NVML cannot tell)"
    assert cc_mode_text(report.gpus[0], None).startswith("unknown")
    assert cc_mode_text(report.gpus[0], {"gpu": {"driver_version": "550"}}).startswith("unknown")
    assert cc_mode_text(report.gpus[0], {"gpu": {"gpus": ["junk"]}}).startswith("unknown")


def test_a_machine_without_nvml_or_gpu_says_so_and_is_not_asked_again() -> None:
    def missing() -> Any:
        raise ImportError("No module named 'pynvml'")

    report = read(GpuMonitor(load_nvml=missing))
    assert report.no_gpu and report.gpus == ()
    assert gpu_note(report, "cpu") == "No GPU: the engine runs on the CPU."
    no_driver = FakeNvml(init_error=9)  # NVML_ERROR_DRIVER_NOT_LOADED
    monitor = GpuMonitor(load_nvml=lambda: no_driver)
    assert read(monitor).no_gpu and read(monitor).no_gpu
    assert no_driver.num_inits == 1
    none = read(GpuMonitor(load_nvml=lambda: FakeNvml(gpus=[])))
    assert none.no_gpu and none.problem == "NVML sees no GPU"
    note = gpu_note(none, "cuda:0")
    assert note is not None and "NVML sees no GPU" in note and "cuda:0" in note


def test_a_wedged_driver_answers_within_the_deadline_and_starts_no_second_reading() -> None:
    hang = threading.Event()
    nvml = FakeNvml(hang=hang)
    monitor = GpuMonitor(timeout_s=0.05, load_nvml=lambda: nvml)

    async def two_reads() -> tuple[GpuReport, GpuReport]:
        return await monitor.read(), await monitor.read()

    first, second = asyncio.run(two_reads())
    assert first.problem == "NVML did not answer within 0.05 s" and first.gpus == ()
    assert second.problem is not None and "has not answered for" in second.problem
    assert nvml.num_counts == 1  # the stuck call only
    note = gpu_note(first, "cuda")
    assert note == "GPU readings unavailable: NVML did not answer within 0.05 s."
    monitor.close()
    assert nvml.num_shutdowns == 0  # not while a call hangs in it
    hang.set()  # the driver comes back: once the stuck reading has ended, read again
    for thread in threading.enumerate():
        if thread.name == "inferno-nvml-read":
            thread.join(timeout=10)
    assert read(monitor).gpus


def test_an_nvml_error_mid_reading_is_a_problem_not_a_crash() -> None:
    class Failing(FakeNvml):
        def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
            raise NVMLError(15)  # NVML_ERROR_GPU_IS_LOST

    report = read(GpuMonitor(load_nvml=lambda: Failing()))
    assert report.gpus == () and not report.no_gpu
    assert report.problem == "NVML failed: NVMLError: NVML error 15"


@pytest.mark.gpu
def test_the_real_driver_reports_every_gpu_torch_sees() -> None:
    import torch

    monitor = GpuMonitor()
    try:
        report = asyncio.run(monitor.read())
    finally:
        monitor.close()
    assert report.problem is None and not report.no_gpu, report.problem
    assert len(report.gpus) == torch.cuda.device_count()
    for gpu in report.gpus:
        assert gpu.name == torch.cuda.get_device_name(gpu.index)
        assert gpu.utilization_pct is not None and 0 <= gpu.utilization_pct <= 100
        _, total = torch.cuda.mem_get_info(gpu.index)  # CUDA's view of the same memory
        assert gpu.memory_total_bytes is not None
        assert abs(gpu.memory_total_bytes - total) <= 0.02 * total
        assert gpu.memory_used_bytes is not None and 0 < gpu.memory_used_bytes <= total
        assert gpu.temperature_c is not None and 10 <= gpu.temperature_c <= 100
        assert gpu.cc_mode in ("on", "off", "devtools", None)

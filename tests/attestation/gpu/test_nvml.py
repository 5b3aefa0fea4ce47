"""NVML collection against a fake `pynvml` (hermetic), and against the real driver on the GPU
machine (`-m gpu`), where CC is off: collection must say so, promptly, instead of hanging."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from attestation.errors import CollectionError
from attestation.gpu import collect_gpu_evidence, set_gpus_ready
from attestation.gpu.evidence import GpuEvidence
from attestation.gpu.report import GpuReport
from tests.attestation.gpu.synthetic import SyntheticGpuCa, build_report, default_measurements

NVML_ERROR_UNKNOWN = 999


class FakeNVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


class FakeNvml:
    """Just enough of pynvml: the calls collect_gpu_evidence makes, with a real synthetic chain
    and reports signed over the nonce it is given."""

    NVMLError = FakeNVMLError
    NVML_ERROR_UNKNOWN = NVML_ERROR_UNKNOWN
    NVML_CC_SYSTEM_FEATURE_ENABLED = 1
    NVML_CC_SYSTEM_DEVTOOLS_MODE_ON = 1
    NVML_DEVICE_ARCH_HOPPER = 9
    NVML_CC_ACCEPTING_CLIENT_REQUESTS_TRUE = 1

    def __init__(
        self, *, num_gpus: int = 2, cc_on: bool = True, dev_tools: bool = False, hang_s: float = 0.0
    ) -> None:
        self.gpus = [SyntheticGpuCa.create().device() for _ in range(num_gpus)]
        self.cc_on, self.dev_tools, self.hang_s = cc_on, dev_tools, hang_s
        self.shut_down = False
        self.ready_state: int | None = None

    def nvmlInit(self) -> None:
        time.sleep(self.hang_s)

    def nvmlShutdown(self) -> None:
        self.shut_down = True

    def nvmlSystemSetConfComputeGpusReadyState(self, state: int) -> None:
        if not self.cc_on:
            raise FakeNVMLError(NVML_ERROR_UNKNOWN)
        self.ready_state = state

    def nvmlSystemGetConfComputeState(self) -> SimpleNamespace:
        return SimpleNamespace(
            environment=2, ccFeature=int(self.cc_on), devToolsMode=int(self.dev_tools)
        )

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetArchitecture(self, handle: int) -> int:
        return self.NVML_DEVICE_ARCH_HOPPER

    def nvmlDeviceGetUUID(self, handle: int) -> bytes:
        return f"GPU-{handle:08x}-0000-0000-0000-000000000000".encode()  # old pynvml: bytes

    def nvmlDeviceGetConfComputeGpuCertificate(self, handle: int) -> SimpleNamespace:
        if not self.cc_on:
            raise FakeNVMLError(NVML_ERROR_UNKNOWN)  # as the real driver does with CC off
        chain = self.gpus[handle].chain_pem
        return SimpleNamespace(
            attestationCertChain=list(chain) + [0] * 16, attestationCertChainSize=len(chain)
        )

    def nvmlDeviceGetConfComputeGpuAttestationReport(
        self, handle: int, nonce: bytes
    ) -> SimpleNamespace:
        if not self.cc_on:
            raise FakeNVMLError(NVML_ERROR_UNKNOWN)
        report = build_report(
            self.gpus[handle].chain[0].key,
            nonce,
            driver_version="550.90.07",
            vbios_version="96.00.9F.00.01",
            measurements=default_measurements(),
        )
        return SimpleNamespace(
            attestationReport=list(report) + [0] * 32, attestationReportSize=len(report)
        )


InstallNvml = Callable[..., FakeNvml]


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch) -> InstallNvml:
    def install(**kwargs: object) -> FakeNvml:
        fake = FakeNvml(**kwargs)
        monkeypatch.setitem(sys.modules, "pynvml", fake)
        return fake

    return install


def test_collects_one_signed_report_per_gpu_over_its_nonce(fake_nvml: InstallNvml) -> None:
    fake = fake_nvml(num_gpus=2)
    nonces = [os.urandom(32), os.urandom(32)]
    evidence = collect_gpu_evidence(nonces)
    assert [GpuReport.parse(e.report).nonce for e in evidence] == nonces
    assert [e.cc_mode for e in evidence] == ["on", "on"]
    assert [e.dev_tools_mode for e in evidence] == [False, False]
    assert evidence[0].certificate_chain == fake.gpus[0].chain_pem
    # Which GPU gave each report, as NVML names it (the boot gate matches the engine's GPUs).
    assert [e.uuid for e in evidence] == [
        "GPU-00000000-0000-0000-0000-000000000000",
        "GPU-00000001-0000-0000-0000-000000000000",
    ]
    assert GpuEvidence.from_json(evidence[1].to_json()) == evidence[1]
    assert fake.shut_down


def test_dev_tools_mode_is_reported(fake_nvml: InstallNvml) -> None:
    fake_nvml(num_gpus=1, dev_tools=True)
    (evidence,) = collect_gpu_evidence([os.urandom(32)])
    assert (evidence.cc_mode, evidence.dev_tools_mode) == ("devtools", True)


def test_cc_off_says_so(fake_nvml: InstallNvml) -> None:
    fake = fake_nvml(num_gpus=1, cc_on=False)
    with pytest.raises(CollectionError, match="confidential computing is off"):
        collect_gpu_evidence([os.urandom(32)])
    assert fake.shut_down


def test_wedged_driver_times_out_instead_of_hanging(fake_nvml: InstallNvml) -> None:
    fake_nvml(num_gpus=1, hang_s=5.0)
    started = time.monotonic()
    with pytest.raises(CollectionError, match="did not answer within"):
        collect_gpu_evidence([os.urandom(32)], timeout_s=0.2)
    assert time.monotonic() - started < 2.0


def test_gpu_not_ready_while_the_system_says_cc_on_is_named(
    fake_nvml: InstallNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = fake_nvml(num_gpus=1)

    def fail(handle: int, nonce: bytes) -> None:
        raise FakeNVMLError(NVML_ERROR_UNKNOWN)

    monkeypatch.setattr(fake, "nvmlDeviceGetConfComputeGpuAttestationReport", fail)
    with pytest.raises(CollectionError, match="GPU 0: no attestation evidence"):
        collect_gpu_evidence([os.urandom(32)])


def test_nonce_count_must_match_gpu_count(fake_nvml: InstallNvml) -> None:
    fake_nvml(num_gpus=2)
    with pytest.raises(CollectionError, match="2 GPUs present but 1 nonces"):
        collect_gpu_evidence([os.urandom(32)])


def test_gpus_ready_state_is_set(fake_nvml: InstallNvml) -> None:
    fake = fake_nvml(num_gpus=1)
    set_gpus_ready()
    assert fake.ready_state == 1
    assert fake.shut_down


def test_gpus_ready_state_refused_is_a_collection_error(fake_nvml: InstallNvml) -> None:
    fake_nvml(num_gpus=1, cc_on=False)
    with pytest.raises(CollectionError, match="ready state"):
        set_gpus_ready()


def test_nonce_must_be_32_bytes() -> None:
    with pytest.raises(CollectionError, match="32 bytes"):
        collect_gpu_evidence([b"short"])


def test_missing_bindings_say_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(CollectionError, match="nvidia-ml-py"):
        collect_gpu_evidence([os.urandom(32)])


@pytest.mark.gpu
def test_real_driver_collects_or_says_why_not() -> None:
    """On the GPU machine: with CC on, a report over our nonce; with CC off (the development
    H100), a CollectionError that says so — within the timeout, never a hang."""
    import pynvml

    pynvml.nvmlInit()
    try:
        num_gpus = pynvml.nvmlDeviceGetCount()
    finally:
        pynvml.nvmlShutdown()
    nonces = [os.urandom(32) for _ in range(num_gpus)]
    started = time.monotonic()
    refusal = ""
    try:
        evidence = collect_gpu_evidence(nonces, timeout_s=60)
    except CollectionError as exc:
        refusal = str(exc)
    sys.stderr.write(f"NVML collection: {refusal or 'collected'}\n")
    if refusal:
        assert "confidential computing" in refusal
    else:
        assert [GpuReport.parse(e.report).nonce for e in evidence] == nonces
    assert time.monotonic() - started < 60
    assert threading.active_count() < 50

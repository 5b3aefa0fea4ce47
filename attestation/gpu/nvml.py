"""Collecting GPU evidence through NVML (the `nvidia-ml-py` package, module `pynvml`): per GPU
the system CC state, dev-tools mode, the attestation certificate chain and an SPDM attestation
report over a caller-supplied 32-byte nonce.

This is the device edge: nothing here verifies anything. Every NVML call runs in a worker thread
with a deadline, so a wedged driver turns into a CollectionError instead of a hung boot (the
stuck thread is abandoned as a daemon; NVML offers no way to cancel a call). With CC off, the
certificate and report calls fail with NVML_ERROR_UNKNOWN (seen on an H200 with CC off); the
system CC state is read first, so this is reported as "confidential computing is off", not as
an obscure driver error.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from attestation.errors import CollectionError
from attestation.gpu.evidence import GpuEvidence

NONCE_LEN = 32
DEFAULT_TIMEOUT_S = 30.0
T = TypeVar("T")


def collect_gpu_evidence(
    nonces: Sequence[bytes], *, timeout_s: float = DEFAULT_TIMEOUT_S
) -> list[GpuEvidence]:
    """Evidence of every GPU NVML sees, GPU i signing `nonces[i]` (one 32-byte nonce per GPU,
    as many as there are GPUs). Raises CollectionError when NVML is missing, CC is off, the
    number of nonces differs from the number of GPUs, or any call takes over `timeout_s`."""
    if any(len(nonce) != NONCE_LEN for nonce in nonces):
        raise CollectionError(f"every GPU nonce must be {NONCE_LEN} bytes")
    return _call_with_deadline(lambda: _collect(_load_pynvml(), list(nonces)), timeout_s)


def set_gpus_ready(*, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Tell the driver that attestation passed, so the GPUs accept work (NVML's CC "GPUs ready
    state", ARCHITECTURE.md start-up step 4). Call it only with a trusted verdict in hand; in CC
    mode the GPUs refuse work until it is set. Raises CollectionError if NVML refuses or hangs."""

    def run() -> None:
        nvml = _load_pynvml()
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise CollectionError(f"NVML cannot start (no NVIDIA driver?): {exc}") from exc
        try:
            nvml.nvmlSystemSetConfComputeGpusReadyState(nvml.NVML_CC_ACCEPTING_CLIENT_REQUESTS_TRUE)
        except nvml.NVMLError as exc:
            raise CollectionError(f"NVML refused to set the GPUs ready state: {exc}") from exc
        finally:
            with contextlib.suppress(nvml.NVMLError):
                nvml.nvmlShutdown()

    _call_with_deadline(run, timeout_s)


def _load_pynvml() -> Any:
    try:
        return importlib.import_module("pynvml")
    except ImportError as exc:
        raise CollectionError("NVML bindings missing: install nvidia-ml-py") from exc


def _collect(nvml: Any, nonces: list[bytes]) -> list[GpuEvidence]:
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        raise CollectionError(f"NVML cannot start (no NVIDIA driver?): {exc}") from exc
    try:
        state = nvml.nvmlSystemGetConfComputeState()
        cc_on = state.ccFeature == nvml.NVML_CC_SYSTEM_FEATURE_ENABLED
        dev_tools = state.devToolsMode == nvml.NVML_CC_SYSTEM_DEVTOOLS_MODE_ON
        if not cc_on:
            # Seen on an H200 with CC off: the certificate call fails with NVML_ERROR_UNKNOWN
            # before the report call is reached, so the system state is checked first.
            raise CollectionError(
                "confidential computing is off on this system (NVML CC feature disabled): "
                "no attestation evidence exists; enable CC mode (nvidia-smi conf-compute) in "
                "a confidential VM"
            )
        num_gpus = nvml.nvmlDeviceGetCount()
        if num_gpus != len(nonces):
            raise CollectionError(f"{num_gpus} GPUs present but {len(nonces)} nonces given")
        return [_collect_one(nvml, i, nonce, dev_tools) for i, nonce in enumerate(nonces)]
    except nvml.NVMLError as exc:
        raise CollectionError(f"NVML call failed: {exc}") from exc
    finally:
        with contextlib.suppress(nvml.NVMLError):
            nvml.nvmlShutdown()


def _collect_one(nvml: Any, index: int, nonce: bytes, dev_tools: bool) -> GpuEvidence:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    architecture = nvml.nvmlDeviceGetArchitecture(handle)
    arch = "HOPPER" if architecture == nvml.NVML_DEVICE_ARCH_HOPPER else f"NVML_ARCH_{architecture}"
    try:
        certificate = nvml.nvmlDeviceGetConfComputeGpuCertificate(handle)
        chain = bytes(certificate.attestationCertChain[: certificate.attestationCertChainSize])
        report = nvml.nvmlDeviceGetConfComputeGpuAttestationReport(handle, nonce)
    except nvml.NVMLError as exc:
        if exc.value == nvml.NVML_ERROR_UNKNOWN:
            raise CollectionError(
                f"GPU {index}: no attestation evidence ({exc}): confidential computing is not "
                "ready on this GPU although the system reports it on"
            ) from exc
        raise
    return GpuEvidence(
        arch=arch,
        nonce=nonce,
        report=bytes(report.attestationReport[: report.attestationReportSize]),
        certificate_chain=chain,
        cc_mode="devtools" if dev_tools else "on",
        dev_tools_mode=dev_tools,
        uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
    )


def _text(value: str | bytes) -> str:
    """pynvml returns str, older versions bytes."""
    return value.decode("ascii") if isinstance(value, bytes) else value


def _call_with_deadline(body: Callable[[], T], timeout_s: float) -> T:
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(body())
        except BaseException as exc:  # handed to the caller's thread below
            error.append(exc)

    worker = threading.Thread(target=run, name="nvml-collect", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise CollectionError(f"NVML did not answer within {timeout_s:g} s (driver wedged?)")
    if error:
        raise error[0]
    return result[0]

"""The TEE service of a real machine: its GPUs through NVML, its CPU report through
configfs-tsm, and the `attestation` package's offline verifiers with the policy and pinned
roots that `[tee]` names. Imported only with `tee.mode = required` (appliance.app).

Collection order (docs/ATTESTATION.md): the GPU nonces are derived from the challenge
(appliance.attestation.challenge.gpu_nonces); the GPU evidence is collected; its digest, the
challenge, the attestation public key and the channel (TLS key, audit vkey) make the CPU
report_data (attestation.binding.report_data_v2); the CPU report is collected last, so that it
covers the GPU evidence. The verifier recomputes every derived value from the challenge and the
evidence and trusts none of the collector's.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from appliance.attestation.challenge import gpu_nonces
from appliance.attestation.evidence import CpuEvidenceSource, GpuEvidenceSource, TeeEvidence
from appliance.attestation.service import TeeService
from appliance.config import TeeSettings
from appliance.trust_store import TrustStore
from attestation.binding import Channel, report_data_v2
from attestation.collateral import CollateralPolicy, verify_collateral
from attestation.cpu import CpuPolicy, CpuTrust, collect_cpu_evidence, verify_cpu_evidence
from attestation.cpu.evidence import CpuEvidence
from attestation.errors import CollectionError, TrustBundleError
from attestation.gpu import (
    GpuEvidence,
    GpuPolicy,
    GpuTrust,
    collect_gpu_evidence,
    gpu_evidence_digest,
    verify_gpu_evidence,
)
from attestation.policy import policy_table, read_policy_file
from attestation.trust_bundle import TrustBundleId
from attestation.verdict import Verdict


class EvidenceCollection:
    """The EvidenceCollector of appliance.attestation.evidence over any GPU and CPU source."""

    def __init__(self, gpus: GpuEvidenceSource, cpu: CpuEvidenceSource) -> None:
        self.gpus = gpus
        self.cpu = cpu

    def collect(self, challenge: bytes, public_key: bytes, channel: Channel) -> TeeEvidence:
        """Raises CollectionError from either source."""
        nonces = gpu_nonces(challenge, self.gpus.num_gpus())
        gpu = tuple(self.gpus.collect(nonces))
        digest = gpu_evidence_digest(gpu)
        bound = report_data_v2(challenge, digest, public_key, channel)
        cpu = self.cpu.collect(bound)
        return TeeEvidence(challenge, public_key, gpu, cpu, digest, bound, channel)

    def set_gpus_ready(self) -> None:
        self.gpus.set_ready()


@dataclass(frozen=True, slots=True)
class _Trust:
    """The trust inputs of one source: `source` names it (the trust bundle's directory, or None
    for the directories of `[tee]`), `bundle` is the trust bundle's id where there is one."""

    source: Path | None
    gpu: GpuTrust
    cpu: CpuTrust
    bundle: TrustBundleId | None


class OfflineVerifier:
    """The EvidenceVerifier of appliance.attestation.evidence: the GPU and CPU verifiers of the
    `attestation` package, and the age of their collateral (attestation.collateral), against
    the policy file and the trust inputs of `[tee]`.

    The policy is read at the first verification and kept for the process's life (a changed
    policy takes effect at restart, recorded by its boot.start config digest and verdicts).
    The trust inputs are read then too; from a trust store (`tee.trust_dir`), they are read
    again, and the bundle verified again, whenever its `current` bundle changed since: an
    `inferno trust update` is in force from the next attestation on."""

    def __init__(self, settings: TeeSettings) -> None:
        if settings.policy_file is None:
            raise ValueError("tee.policy_file is required")  # checked by TeeSettings
        self.settings = settings
        self.store = TrustStore.from_settings(settings)
        self._policies: tuple[GpuPolicy, CpuPolicy, CollateralPolicy] | None = None
        self._trust: _Trust | None = None
        self._lock = threading.Lock()

    def _load(self) -> tuple[GpuPolicy, CpuPolicy, CollateralPolicy, _Trust]:
        """Raises PolicyError naming the file at fault, or TrustBundleError."""
        with self._lock:
            if self._policies is None:
                assert self.settings.policy_file is not None, "checked in __init__"
                tables = read_policy_file(self.settings.policy_file)
                source = str(self.settings.policy_file)
                gpu_policy = GpuPolicy.from_table(policy_table(tables, "gpu", source), source)
                self._policies = (
                    gpu_policy,
                    CpuPolicy.from_tables(tables),
                    CollateralPolicy.from_tables(tables),
                )
            source = None if self.store is None else self.store.current_path()
            if self._trust is None or self._trust.source != source:
                self._trust = self._load_trust()
            return (*self._policies, self._trust)

    def _load_trust(self) -> _Trust:
        settings = self.settings
        if self.store is None:
            assert settings.gpu_rims_dir is not None, "checked by TeeSettings"
            gpu, cpu = _trust_inputs(
                settings, settings.gpu_rims_dir, settings.gpu_revocation_dir,
                settings.cpu_trust_dir,
            )  # fmt: skip
            return _Trust(None, gpu, cpu, None)
        bundle = self.store.load_current()
        if not bundle.gpu_rims_dir.is_dir():
            raise TrustBundleError(f"trust bundle {bundle.id.digest} carries no gpu/rims/")
        revocation = bundle.gpu_revocation_dir
        gpu, cpu = _trust_inputs(
            settings, bundle.gpu_rims_dir, revocation if revocation.is_dir() else None,
            bundle.cpu_trust_dir,
        )  # fmt: skip
        return _Trust(bundle.root, gpu, cpu, bundle.id)

    def verify(self, evidence: TeeEvidence, *, at: datetime) -> Verdict:
        """Raises PolicyError (policy or trust unreadable), TrustBundleError (the installed
        trust bundle does not verify) or EvidenceError (unparsable evidence); every other
        problem is a failed check."""
        gpu_policy, cpu_policy, collateral_policy, trust = self._load()
        gpu = verify_gpu_evidence(
            evidence.gpu,
            expected_nonces=gpu_nonces(evidence.challenge, len(evidence.gpu)),
            policy=gpu_policy,
            trust=trust.gpu,
            at=at,
        )
        expected = report_data_v2(
            evidence.challenge,
            gpu_evidence_digest(evidence.gpu),
            evidence.public_key,
            evidence.channel,
        )
        cpu = verify_cpu_evidence(
            evidence.cpu, expected_report_data=expected, policy=cpu_policy, trust=trust.cpu, at=at
        )
        collateral = verify_collateral(trust.bundle, collateral_policy, at=at)
        return Verdict.combine([("gpu", gpu), ("cpu", cpu), ("collateral", collateral)], at)


def _trust_inputs(
    settings: TeeSettings, rim_dir: Path, revocation_dir: Path | None, cpu_dir: Path | None
) -> tuple[GpuTrust, CpuTrust]:
    gpu = GpuTrust.from_paths(
        rim_dir=rim_dir, roots_dir=settings.gpu_roots_dir, revocation_dir=revocation_dir
    )
    return gpu, CpuTrust.builtin() if cpu_dir is None else CpuTrust.load(cpu_dir)


class NvmlGpus:
    """The GpuEvidenceSource of this machine's GPUs (attestation.gpu.nvml)."""

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s

    def num_gpus(self) -> int:
        """NVML's device count, within `timeout_s` (a wedged driver must not hang the boot:
        the call runs in a daemon thread that is abandoned if it does not return)."""
        result: list[int | BaseException] = []

        def count() -> None:
            try:
                result.append(_nvml_device_count())
            except BaseException as exc:  # handed to the waiting thread
                result.append(exc)

        thread = threading.Thread(target=count, name="inferno-nvml-count", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if not result:
            raise CollectionError(f"NVML did not tell the number of GPUs in {self.timeout_s} s")
        if isinstance(result[0], BaseException):
            raise result[0]
        return result[0]

    def collect(self, nonces: Sequence[bytes]) -> Sequence[GpuEvidence]:
        return collect_gpu_evidence(nonces, timeout_s=self.timeout_s)

    def set_ready(self) -> None:
        from attestation.gpu.nvml import set_gpus_ready

        set_gpus_ready(timeout_s=self.timeout_s)


def _nvml_device_count() -> int:
    try:
        nvml: Any = importlib.import_module("pynvml")
    except ImportError as exc:
        raise CollectionError("NVML bindings missing: install nvidia-ml-py") from exc
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        raise CollectionError(f"NVML cannot start (no NVIDIA driver?): {exc}") from exc
    try:
        return int(nvml.nvmlDeviceGetCount())
    except nvml.NVMLError as exc:
        raise CollectionError(f"NVML cannot count the GPUs: {exc}") from exc
    finally:
        with contextlib.suppress(nvml.NVMLError):
            nvml.nvmlShutdown()


class ConfigfsTsmCpu:
    """The CpuEvidenceSource of this confidential VM (attestation.cpu.collect)."""

    def __init__(self, tsm_root: Path) -> None:
        self.tsm_root = tsm_root

    def collect(self, report_data: bytes) -> CpuEvidence:
        return collect_cpu_evidence(report_data, tsm_root=self.tsm_root)


def device_tee_service(settings: TeeSettings) -> TeeService:
    """The TEE service attesting this machine as `settings` configures it."""
    collection = EvidenceCollection(NvmlGpus(), ConfigfsTsmCpu(settings.tsm_report_dir))
    return TeeService(settings.mode, collection, OfflineVerifier(settings))

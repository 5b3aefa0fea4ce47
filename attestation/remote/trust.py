"""The client's trust directory (`--trust DIR`): the layout of a trust bundle
(attestation.trust_bundle), so that the bundle an operator installs on the appliance can be
handed to application teams as it is, plus pinned GPU roots for tests and private CAs:

    gpu/rims/           NVIDIA's signed RIMs (*.swidtag, *.xml)            required
    gpu/revocation/     OCSP responses and CRLs (*.ocsp, *.crl)            optional
    gpu/roots/          nvidia_device_identity_ca.pem,
                        nvidia_corim_signing_root_ca.pem                   optional (else NVIDIA's)
    cpu/                snp/..., tdx/... as attestation.cpu.trust reads     optional (else AMD's
                                                                            and Intel's roots)

Nothing in it is fetched or updated by the client; it is as fresh as the team keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from attestation.cpu.trust import CpuTrust
from attestation.errors import PolicyError
from attestation.gpu.trust import GpuTrust


@dataclass(frozen=True, slots=True)
class ApplianceTrust:
    gpu: GpuTrust
    cpu: CpuTrust

    @classmethod
    def load(cls, directory: Path) -> ApplianceTrust:
        """Raises PolicyError for a missing directory or an unreadable file."""
        directory = Path(directory)
        if not (directory / "gpu" / "rims").is_dir():
            raise PolicyError(f"trust directory {directory} has no gpu/rims/")
        roots, revocation, cpu = (
            directory / "gpu" / "roots",
            directory / "gpu" / "revocation",
            directory / "cpu",
        )
        gpu = GpuTrust.from_paths(
            rim_dir=directory / "gpu" / "rims",
            roots_dir=roots if roots.is_dir() else None,
            revocation_dir=revocation if revocation.is_dir() else None,
        )
        return cls(gpu, CpuTrust.load(cpu) if cpu.is_dir() else CpuTrust.builtin())

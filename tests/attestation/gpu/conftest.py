"""Real NVIDIA H100 evidence (tests/attestation/vectors/nvidia, public files with their licenses,
described in tests/attestation/vectors/README.md) and the policies the tests verify it under."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest

from attestation.gpu import GpuEvidence, GpuPolicy, GpuTrust

VECTORS = Path(__file__).resolve().parents[1] / "vectors" / "nvidia"
# NVIDIA's RIM signer certificates for the 545 RIMs expired in June 2025: before, they verify.
BEFORE_RIM_EXPIRY = datetime(2025, 5, 1, tzinfo=UTC)
TODAY = datetime(2026, 11, 22, tzinfo=UTC)
NONCE_545 = bytes.fromhex("4cff7f5380ead8fad8ec2c531c110aca4302a88f603792801a8ca29ee151af2e")
NONCE_550 = bytes.fromhex("931d8dd0add203ac3d8b4fbde75e115278eefcdceac5b87671a748f32364dfcb")


@dataclass(frozen=True)
class RealGpu:
    evidence: GpuEvidence
    nonce: bytes
    policy: GpuPolicy


def report_hex(path: Path) -> bytes:
    return bytes.fromhex(path.read_text().strip())


def real_evidence(directory: str, nonce: bytes, report: Path | None = None) -> GpuEvidence:
    """A real report and chain as the exchange format carries them (no NVML state)."""
    return GpuEvidence(
        arch="HOPPER",
        nonce=nonce,
        report=report_hex(report or VECTORS / directory / "attestation_report.hex"),
        certificate_chain=(VECTORS / directory / "cert_chain.pem").read_bytes(),
    )


def real_policy(driver: str, vbios: str, **overrides: object) -> GpuPolicy:
    """A policy for evidence collected elsewhere: the exchange format carries no NVML state,
    so the CC and dev-tools checks are switched off explicitly, and no revocation bundle is
    published for these devices, so "unchecked" is accepted explicitly."""
    table: dict[str, object] = {
        "driver_versions": [driver],
        "vbios_versions": [vbios],
        "num_gpus": 1,
        "require_cc_on": False,
        "require_dev_tools_off": False,
        "revocation_accept": ["good", "unchecked"],
    }
    table.update(overrides)
    return GpuPolicy.from_table(table)


@pytest.fixture(scope="session")
def gpu_545() -> RealGpu:
    return RealGpu(
        real_evidence("h100-545", NONCE_545),
        NONCE_545,
        real_policy("545.00", "96.00.5E.00.01"),
    )


@pytest.fixture(scope="session")
def gpu_550() -> RealGpu:
    return RealGpu(
        real_evidence("h100-550", NONCE_550),
        NONCE_550,
        real_policy("550.90.07", "96.00.9F.00.01"),
    )


@pytest.fixture(scope="session")
def trust_545() -> GpuTrust:
    return GpuTrust.from_paths(rim_dir=VECTORS / "h100-545")


@pytest.fixture(scope="session")
def trust_no_rims(tmp_path_factory: pytest.TempPathFactory) -> GpuTrust:
    """NVIDIA's pinned roots and an empty RIM directory (the 550 RIMs are not public)."""
    return GpuTrust.from_paths(rim_dir=tmp_path_factory.mktemp("no-rims"))

"""The real CPU vectors (tests/attestation/vectors/cpu, public files with their licenses):
go-sev-guest's Milan SEV-SNP report with its VCEK and AMD's ASK/ARK, go-tdx-guest's TDX quotes
with Intel's SGX root, and dcap-qvl's TDX quote with a complete DCAP collateral set."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from attestation.cpu.evidence import CpuEvidence
from attestation.cpu.policy import CpuPolicy
from attestation.cpu.snp import ASK_GUID, VCEK_GUID, SnpReport, build_certificate_table
from attestation.cpu.trust import CpuTrust

VECTORS = Path(__file__).parent.parent / "vectors" / "cpu"
SEV = VECTORS / "go-sev-guest"
TDX = VECTORS / "go-tdx-guest"
DCAP = VECTORS / "dcap-qvl"

# Inside every certificate's validity (VCEK 2022-09-24 .. 2029-09-24).
SNP_AT = datetime(2025, 1, 1, tzinfo=UTC)
# Inside the dcap-qvl collateral window (TCB info issued 2025-06-19, next update 2025-07-19).
TDX_AT = datetime(2025, 7, 1, tzinfo=UTC)
# The MRTD and report_data of dcap-qvl's TDX quote (`dcap_qvl.parse_quote(quote).report`).
DCAP_MR_TD = (
    "91eb2b44d141d4ece09f0c75c2c53d247a3c68edd7fafe8a"
    "3520c942a604a407de03ae6dc5f87f27428b2538873118b7"
)
DCAP_REPORT_DATA = bytes.fromhex(
    "9a9d48e7f6799642d3d1b34e1e5e1742d4bb02dd6ddd551862c1211d35c304f9"
    "eca3efdbb481601c163cf52493d6e44aed55d51ec39b7e518fadb92c2b523f20"
)


@dataclass(frozen=True)
class RealSnp:
    report: bytes
    vcek_der: bytes
    ask: x509.Certificate
    ark: x509.Certificate
    genoa_ark: x509.Certificate

    @property
    def parsed(self) -> SnpReport:
        return SnpReport.parse(self.report)

    def auxblob(self) -> bytes:
        return build_certificate_table(
            {VCEK_GUID: self.vcek_der, ASK_GUID: self.ask.public_bytes(Encoding.DER)}
        )

    def evidence(self, report: bytes | None = None) -> CpuEvidence:
        return CpuEvidence("snp", report or self.report, self.auxblob(), "sev_guest")

    def trust(self) -> CpuTrust:
        return CpuTrust(snp_arks={"Milan": self.ark})

    def policy_table(self) -> dict[str, object]:
        """A policy that accepts this report's measurement and TCB: only debug can fail. No AMD
        CRL is among the vectors, so revocation is accepted as "unchecked"."""
        return {
            "revocation_accept": ["good", "unchecked"],
            "measurements": [self.parsed.measurement.hex()],
            "min_tcb": {"bootloader": 2, "tee": 0, "snp": 5, "microcode": 68},
        }

    def policy(self) -> CpuPolicy:
        return CpuPolicy.from_tables({"snp": self.policy_table()})


@pytest.fixture(scope="session")
def real_snp() -> RealSnp:
    ask, ark = x509.load_pem_x509_certificates(
        (SEV / "verify_trust_ask_ark_milan.pem").read_bytes()
    )
    _, genoa_ark = x509.load_pem_x509_certificates(
        (SEV / "verify_trust_ask_ark_genoa.pem").read_bytes()
    )
    return RealSnp(
        report=(SEV / "verify_testdata_attestation.bin").read_bytes(),
        vcek_der=(SEV / "verify_testdata_vcek.testcer").read_bytes(),
        ask=ask,
        ark=ark,
        genoa_ark=genoa_ark,
    )


@pytest.fixture(scope="session")
def intel_root_der() -> bytes:
    pem = (TDX / "verify_trusted_root.pem").read_bytes()
    return x509.load_pem_x509_certificate(pem).public_bytes(Encoding.DER)


@pytest.fixture(scope="session")
def dcap_trust(intel_root_der: bytes) -> CpuTrust:
    return CpuTrust(
        tdx_root_ca_der=intel_root_der,
        tdx_collateral={"B0C06F000000": (DCAP / "tdx_quote_collateral.json").read_text()},
    )

"""The real SEV-SNP report (go-sev-guest, Milan): its signatures verify through VCEK <- ASK <-
pinned ARK, and a policy that accepts its measurement and TCB still refuses it because its guest
policy allows debugging ("debug must be off"), as tests/attestation/vectors/README.md says."""

from __future__ import annotations

import shutil
from datetime import UTC, datetime
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.serialization import Encoding

from attestation.cpu import CpuTrust, verify_cpu_evidence
from attestation.cpu.errors import SnpCertificateChainError
from attestation.cpu.evidence import CpuEvidence
from attestation.cpu.snp import (
    VCEK_GUID,
    SnpReport,
    TcbVersion,
    load_amd_certificate,
    parse_certificate_table,
    verify_snp_report,
)
from tests.attestation.cpu.conftest import SEV, SNP_AT, RealSnp

MECHANISM = ["snp.certificates", "snp.certificate_chain", "snp.vcek", "snp.signature"]


def test_real_report_parses_to_the_fields_go_sev_guest_reports(real_snp: RealSnp) -> None:
    report = real_snp.parsed
    assert report.version == 2
    assert report.policy == 0xB0000
    assert report.debug_allowed
    assert report.vmpl == 0
    assert report.report_data[:5] == bytes([1, 2, 3, 4, 5])
    assert TcbVersion.from_bytes(report.reported_tcb, "Milan") == TcbVersion(2, 0, 5, 0x44)


def test_real_report_signatures_verify_and_policy_refuses_debug(real_snp: RealSnp) -> None:
    verdict = verify_cpu_evidence(
        real_snp.evidence(),
        expected_report_data=real_snp.parsed.report_data,
        policy=real_snp.policy(),
        trust=real_snp.trust(),
        at=SNP_AT,
    )
    passed = [check.name for check in verdict.checks if check.passed]
    assert passed[:5] == [*MECHANISM, "snp.report_data"]
    assert not verdict.trusted
    assert [check.name for check in verdict.failures] == ["snp.policy.debug"]
    assert "debug must be off" in verdict.failures[0].detail
    assert verdict.claims["product"] == "Milan"
    assert verdict.claims["debug"] is True


def test_real_report_verifies_at_todays_date_too(real_snp: RealSnp) -> None:
    # Today (2026) is still inside the VCEK's validity (to 2029-09-24).
    product = verify_snp_report(
        real_snp.parsed,
        vcek=load_amd_certificate(real_snp.vcek_der),
        ask=real_snp.ask,
        arks={"Milan": real_snp.ark},
        at=datetime.now(UTC),
    )
    assert product == "Milan"


def test_real_report_verifies_with_vcek_from_the_offline_cache(real_snp: RealSnp) -> None:
    trust = CpuTrust(
        snp_arks={"Milan": real_snp.ark},
        snp_certificates=(load_amd_certificate(real_snp.vcek_der), real_snp.ask),
    )
    verdict = verify_cpu_evidence(
        CpuEvidence("snp", real_snp.report),
        expected_report_data=real_snp.parsed.report_data,
        policy=real_snp.policy(),
        trust=trust,
        at=SNP_AT,
    )
    assert [check.name for check in verdict.failures] == ["snp.policy.debug"]


def test_report_without_certificates_anywhere_fails_the_certificates_step(
    real_snp: RealSnp,
) -> None:
    verdict = verify_cpu_evidence(
        CpuEvidence("snp", real_snp.report),
        expected_report_data=real_snp.parsed.report_data,
        policy=real_snp.policy(),
        trust=real_snp.trust(),
        at=SNP_AT,
    )
    assert [check.name for check in verdict.checks] == ["snp.certificates"]
    assert "no VCEK" in verdict.failures[0].detail
    assert verdict.claims == {}


def test_trust_directory_with_the_milan_ark_loads_and_pins_it(
    real_snp: RealSnp, tmp_path: Path
) -> None:
    (tmp_path / "snp").mkdir()
    (tmp_path / "snp" / "ark-milan.pem").write_bytes(real_snp.ark.public_bytes(Encoding.PEM))
    (tmp_path / "snp" / "certificates").mkdir()
    shutil.copy(SEV / "verify_testdata_vcek.testcer", tmp_path / "snp" / "certificates")
    trust = CpuTrust.load(tmp_path, builtin_roots=False)
    assert trust.snp_arks == {"Milan": real_snp.ark}
    assert len(trust.snp_certificates) == 1


def test_certificate_table_round_trips(real_snp: RealSnp) -> None:
    table = parse_certificate_table(real_snp.auxblob())
    assert table[VCEK_GUID] == real_snp.vcek_der


@pytest.mark.parametrize(
    ("at", "expired"),
    [(datetime(2022, 9, 1, tzinfo=UTC), "VCEK"), (datetime(2030, 1, 1, tzinfo=UTC), "VCEK")],
)
def test_real_report_outside_vcek_validity_fails_the_chain(
    real_snp: RealSnp, at: datetime, expired: str
) -> None:
    with pytest.raises(SnpCertificateChainError, match=f"the {expired} is valid from"):
        verify_snp_report(
            SnpReport.parse(real_snp.report),
            vcek=load_amd_certificate(real_snp.vcek_der),
            ask=real_snp.ask,
            arks={"Milan": real_snp.ark},
            at=at,
        )

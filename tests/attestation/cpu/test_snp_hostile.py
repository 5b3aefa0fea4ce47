"""Hostile SEV-SNP inputs built from the real Milan report: every single-bit flip of the signed
report and of the signature, bit flips across the VCEK certificate, substituted chains, a wrong
pinned ARK, a forged ARK of the right name, and a report_data from another challenge. Each is
refused, at the step its defect belongs to."""

from __future__ import annotations

import contextlib
import functools
import hashlib

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from hypothesis import given, settings
from hypothesis import strategies as st

from attestation.cpu import CpuTrust, verify_cpu_evidence
from attestation.cpu.errors import (
    SnpCertificateChainError,
    SnpReportFormatError,
    SnpSignatureError,
    SnpVcekMismatchError,
)
from attestation.cpu.evidence import CpuEvidence
from attestation.cpu.snp import (
    ASK_GUID,
    REPORT_SIZE,
    SIGNED_SIZE,
    VCEK_GUID,
    SnpReport,
    build_certificate_table,
    load_amd_certificate,
    parse_certificate_table,
    verify_report_signature,
    verify_snp_report,
    verify_vcek_binding,
)
from attestation.errors import EvidenceError
from tests.attestation.cpu.conftest import SNP_AT, RealSnp
from tests.attestation.cpu.synthetic import SyntheticSnp

MECHANISM_STEPS = {"snp.certificates", "snp.certificate_chain", "snp.vcek", "snp.signature"}
# Fields whose flip the parser may refuse (version, VMPL, algorithm, policy bit 17, key info,
# reserved ranges) or that the VCEK binding checks (key info, REPORTED_TCB, CHIP_ID).
_STRUCTURAL = [(0x00, 0x04), (0x08, 0x10), (0x30, 0x38), (0x48, 0x50), (0x180, 0x1A0),
               (0x1A0, 0x1E0), (0x1EB, 0x1EC), (0x1EF, 0x1F0), (0x1F8, SIGNED_SIZE)]  # fmt: skip


def _flip(data: bytes, bit: int) -> bytes:
    flipped = bytearray(data)
    flipped[bit // 8] ^= 1 << (bit % 8)
    return bytes(flipped)


def _outcome(report: bytes, vcek: x509.Certificate) -> str:
    """The step at which a report fails, given the genuine chain (checked once elsewhere)."""
    try:
        parsed = SnpReport.parse(report)
        verify_vcek_binding(parsed, vcek, "Milan")
        verify_report_signature(parsed, vcek)
    except SnpReportFormatError:
        return "format"
    except SnpVcekMismatchError:
        return "vcek"
    except SnpSignatureError:
        return "signature"
    return "accepted"


def test_every_single_bit_flip_of_the_signed_report_is_refused(real_snp: RealSnp) -> None:
    vcek = load_amd_certificate(real_snp.vcek_der)
    assert _outcome(real_snp.report, vcek) == "accepted"
    for bit in range(SIGNED_SIZE * 8):
        outcome = _outcome(_flip(real_snp.report, bit), vcek)
        offset = bit // 8
        structural = any(start <= offset < end for start, end in _STRUCTURAL)
        allowed = {"format", "vcek", "signature"} if structural else {"signature"}
        assert outcome in allowed, f"bit {bit} (offset 0x{offset:03X}): {outcome}"


@pytest.mark.parametrize("offset", [0x50, 0x90, 0xBF, 0x140, 0x1E0])
def test_flipped_bit_in_report_data_measurement_or_ids_fails_the_signature(
    real_snp: RealSnp, offset: int
) -> None:
    vcek = load_amd_certificate(real_snp.vcek_der)
    assert _outcome(_flip(real_snp.report, offset * 8), vcek) == "signature"


def test_flipped_bit_in_reported_tcb_or_chip_id_fails_the_vcek_binding(real_snp: RealSnp) -> None:
    vcek = load_amd_certificate(real_snp.vcek_der)
    assert _outcome(_flip(real_snp.report, 0x180 * 8), vcek) == "vcek"
    assert _outcome(_flip(real_snp.report, 0x1A0 * 8 + 3), vcek) == "vcek"


def test_every_single_bit_flip_of_the_signature_is_refused(real_snp: RealSnp) -> None:
    vcek = load_amd_certificate(real_snp.vcek_der)
    for bit in range(SIGNED_SIZE * 8, REPORT_SIZE * 8):
        offset = bit // 8 - SIGNED_SIZE
        significant = offset < 144 and offset % 72 < 48
        expected = "signature" if significant else "format"
        assert _outcome(_flip(real_snp.report, bit), vcek) == expected, f"signature bit {bit}"


@pytest.mark.parametrize("length", [REPORT_SIZE - 1, REPORT_SIZE + 1, 0x2A0])
def test_truncated_or_extended_report_is_refused_as_malformed(
    real_snp: RealSnp, length: int
) -> None:
    report = (real_snp.report + b"\0")[:length]
    with pytest.raises(SnpReportFormatError, match="1184 bytes"):
        verify_cpu_evidence(
            CpuEvidence("snp", report, real_snp.auxblob()),
            expected_report_data=real_snp.parsed.report_data,
            policy=real_snp.policy(),
            trust=real_snp.trust(),
            at=SNP_AT,
        )


def test_every_flipped_byte_of_the_vcek_certificate_is_refused(real_snp: RealSnp) -> None:
    ask = real_snp.ask.public_bytes(Encoding.DER)
    for offset in range(len(real_snp.vcek_der)):
        vcek = _flip(real_snp.vcek_der, offset * 8)
        evidence = CpuEvidence(
            "snp", real_snp.report, build_certificate_table({VCEK_GUID: vcek, ASK_GUID: ask})
        )
        try:
            verdict = verify_cpu_evidence(
                evidence,
                expected_report_data=real_snp.parsed.report_data,
                policy=real_snp.policy(),
                trust=real_snp.trust(),
                at=SNP_AT,
            )
        except EvidenceError:
            continue  # the flipped certificate no longer parses
        failed = {check.name for check in verdict.failures}
        assert failed & MECHANISM_STEPS, f"VCEK byte {offset} flipped: {verdict.failures}"


def test_flipped_bit_in_the_ask_signature_fails_the_chain(real_snp: RealSnp) -> None:
    ask = real_snp.ask.public_bytes(Encoding.DER)
    tampered = load_amd_certificate(_flip(ask, (len(ask) - 10) * 8))
    with pytest.raises(SnpCertificateChainError, match="ASK"):
        verify_snp_report(
            real_snp.parsed,
            vcek=load_amd_certificate(real_snp.vcek_der),
            ask=tampered,
            arks={"Milan": real_snp.ark},
            at=SNP_AT,
        )


def test_wrong_pinned_ark_fails_the_chain(real_snp: RealSnp) -> None:
    verdict = verify_cpu_evidence(
        real_snp.evidence(),
        expected_report_data=real_snp.parsed.report_data,
        policy=real_snp.policy(),
        trust=CpuTrust(snp_arks={"Genoa": real_snp.genoa_ark}),
        at=SNP_AT,
    )
    assert [check.name for check in verdict.failures] == ["snp.certificate_chain"]
    assert "not signed by any pinned ARK" in verdict.failures[0].detail


def test_forged_ark_with_amds_name_fails_the_chain(real_snp: RealSnp) -> None:
    forged = SyntheticSnp.create("Milan")  # its ARK is also called ARK-Milan
    verdict = verify_cpu_evidence(
        real_snp.evidence(),
        expected_report_data=real_snp.parsed.report_data,
        policy=real_snp.policy(),
        trust=forged.trust(),
        at=SNP_AT,
    )
    assert [check.name for check in verdict.failures] == ["snp.certificate_chain"]


def test_no_pinned_ark_never_verifies(real_snp: RealSnp) -> None:
    with pytest.raises(SnpCertificateChainError, match="no ARK is pinned"):
        verify_snp_report(
            real_snp.parsed,
            vcek=load_amd_certificate(real_snp.vcek_der),
            ask=real_snp.ask,
            arks={},
            at=SNP_AT,
        )


def test_substituted_vcek_from_a_test_chain_fails_the_chain(real_snp: RealSnp) -> None:
    other = SyntheticSnp.create()
    auxblob = build_certificate_table(
        {
            VCEK_GUID: other.vcek.public_bytes(Encoding.DER),
            ASK_GUID: real_snp.ask.public_bytes(Encoding.DER),
        }
    )
    verdict = verify_cpu_evidence(
        CpuEvidence("snp", real_snp.report, auxblob),
        expected_report_data=real_snp.parsed.report_data,
        policy=real_snp.policy(),
        trust=real_snp.trust(),
        at=SNP_AT,
    )
    assert [check.name for check in verdict.failures] == ["snp.certificate_chain"]


def test_entire_test_chain_presented_with_a_real_report_fails_the_chain(real_snp: RealSnp) -> None:
    other = SyntheticSnp.create()
    verdict = verify_cpu_evidence(
        CpuEvidence("snp", real_snp.report, other.certificate_table()),
        expected_report_data=real_snp.parsed.report_data,
        policy=real_snp.policy(),
        trust=real_snp.trust(),
        at=SNP_AT,
    )
    assert [check.name for check in verdict.failures] == ["snp.certificate_chain"]


def test_vcek_and_ask_swapped_fail_the_chain(real_snp: RealSnp) -> None:
    auxblob = build_certificate_table(
        {VCEK_GUID: real_snp.ask.public_bytes(Encoding.DER), ASK_GUID: real_snp.vcek_der}
    )
    verdict = verify_cpu_evidence(
        CpuEvidence("snp", real_snp.report, auxblob),
        expected_report_data=real_snp.parsed.report_data,
        policy=real_snp.policy(),
        trust=real_snp.trust(),
        at=SNP_AT,
    )
    assert [check.name for check in verdict.failures] == ["snp.certificate_chain"]


def test_report_for_another_challenge_fails_the_report_data_step(real_snp: RealSnp) -> None:
    verdict = verify_cpu_evidence(
        real_snp.evidence(),
        expected_report_data=hashlib.sha512(b"another challenge").digest(),
        policy=real_snp.policy(),
        trust=real_snp.trust(),
        at=SNP_AT,
    )
    assert [check.name for check in verdict.failures] == ["snp.report_data"]
    assert verdict.claims == {}


def test_synthetic_report_claiming_a_tcb_its_vcek_does_not_certify_is_refused() -> None:
    platform = SyntheticSnp.create()
    higher = platform.tcb.__class__(bootloader=9, tee=9, snp=99, microcode=255)
    evidence = platform.evidence(bytes(64), reported_tcb=higher)
    verdict = verify_cpu_evidence(
        evidence,
        expected_report_data=bytes(64),
        policy=platform.policy(),
        trust=platform.trust(),
        at=SNP_AT,
    )
    assert [check.name for check in verdict.failures] == ["snp.vcek"]
    assert "the VCEK certifies TCB" in verdict.failures[0].detail


def test_synthetic_report_from_another_chip_is_refused() -> None:
    platform = SyntheticSnp.create()
    body = bytearray(platform.report(bytes(64)))
    body[0x1A0:0x1E0] = hashlib.sha512(b"another chip").digest()
    evidence = CpuEvidence("snp", platform.sign(bytes(body)), platform.certificate_table())
    verdict = verify_cpu_evidence(
        evidence,
        expected_report_data=bytes(64),
        policy=platform.policy(),
        trust=platform.trust(),
        at=SNP_AT,
    )
    assert [check.name for check in verdict.failures] == ["snp.vcek"]
    assert "another chip" in verdict.failures[0].detail


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=2 * REPORT_SIZE))
def test_arbitrary_bytes_are_refused_only_as_malformed_reports(data: bytes) -> None:
    with contextlib.suppress(SnpReportFormatError):
        SnpReport.parse(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_arbitrary_certificate_tables_are_refused_only_as_malformed(data: bytes) -> None:
    with contextlib.suppress(SnpReportFormatError):
        parse_certificate_table(data)


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=0, max_value=REPORT_SIZE - 1), st.integers(0, 255))
def test_arbitrary_byte_changes_to_a_synthetic_report_are_never_trusted(
    offset: int, value: int
) -> None:
    platform, genuine = _synthetic()
    report = bytearray(genuine)
    if report[offset] == value:
        return
    report[offset] = value
    evidence = CpuEvidence("snp", bytes(report), platform.certificate_table())
    try:
        verdict = verify_cpu_evidence(
            evidence,
            expected_report_data=bytes(64),
            policy=platform.policy(),
            trust=platform.trust(SNP_AT),
            at=SNP_AT,
        )
    except SnpReportFormatError:
        return
    assert not verdict.trusted


@functools.cache
def _synthetic() -> tuple[SyntheticSnp, bytes]:
    platform = SyntheticSnp.create()
    return platform, platform.report(bytes(64))

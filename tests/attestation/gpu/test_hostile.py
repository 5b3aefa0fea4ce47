"""A hostile corpus built from real evidence (the H100 550 report, FWID and all), each defect
named, each rejected at the step that owns it. Steps are the numbered ones of
attestation.gpu.verify; a check's detail starts with the error type of its step."""

from __future__ import annotations

import base64
import random
from collections.abc import Iterator
from dataclasses import replace

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from attestation.gpu import GpuEvidence, GpuTrust, verify_gpu_evidence
from attestation.gpu.chain import load_certificates
from attestation.gpu.report import REQUEST_LEN, SIGNATURE_LEN
from attestation.verdict import Verdict
from tests.attestation.gpu.conftest import TODAY, VECTORS, RealGpu
from tests.attestation.gpu.synthetic import SyntheticGpuCa

BLOCK_LEN = 55  # index, spec, size u16, value type, value size u16, SHA-384
RECORD_OFFSET = REQUEST_LEN + 8


def flip(data: bytes, bit: int) -> bytes:
    out = bytearray(data)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def verify(gpu: RealGpu, evidence: GpuEvidence, trust: GpuTrust) -> Verdict:
    return verify_gpu_evidence(
        [evidence], expected_nonces=[gpu.nonce], policy=gpu.policy, trust=trust, at=TODAY
    )


def first_failure(verdict: Verdict) -> tuple[str, str]:
    assert not verdict.trusted
    check = verdict.failures[0]
    return check.name, check.detail.split(":")[0]


def with_report(evidence: GpuEvidence, report: bytes) -> GpuEvidence:
    return replace(evidence, report=report)


def with_chain(evidence: GpuEvidence, certs: list[x509.Certificate]) -> GpuEvidence:
    return replace(
        evidence, certificate_chain=b"".join(c.public_bytes(Encoding.PEM) for c in certs)
    )


def bits(start: int, length: int) -> Iterator[int]:
    return iter(range(start * 8, (start + length) * 8))


def test_the_unmodified_evidence_passes_every_mechanism_step(
    gpu_550: RealGpu, trust_no_rims: GpuTrust
) -> None:
    verdict = verify(gpu_550, gpu_550.evidence, trust_no_rims)
    assert [c.name for c in verdict.failures] == ["gpu0.rim.driver", "gpu0.rim.vbios"]


def test_every_single_bit_flip_in_the_signature_fails_the_signature_step(
    gpu_550: RealGpu, trust_no_rims: GpuTrust
) -> None:
    report = gpu_550.evidence.report
    for bit in bits(len(report) - SIGNATURE_LEN, SIGNATURE_LEN):
        verdict = verify(gpu_550, with_report(gpu_550.evidence, flip(report, bit)), trust_no_rims)
        assert first_failure(verdict) == ("gpu0.signature", "ReportSignatureError"), bit


@pytest.mark.parametrize("block", [1, 7, 33, 64])
def test_every_single_bit_flip_in_a_measurement_fails_the_signature_step(
    gpu_550: RealGpu, trust_no_rims: GpuTrust, block: int
) -> None:
    report = gpu_550.evidence.report
    start = RECORD_OFFSET + (block - 1) * BLOCK_LEN + 7
    for bit in bits(start, 48):
        verdict = verify(gpu_550, with_report(gpu_550.evidence, flip(report, bit)), trust_no_rims)
        assert first_failure(verdict) == ("gpu0.signature", "ReportSignatureError"), bit


def test_every_single_bit_flip_in_the_nonce_fails_the_nonce_and_signature_steps(
    gpu_550: RealGpu, trust_no_rims: GpuTrust
) -> None:
    report = gpu_550.evidence.report
    for bit in bits(4, 32):
        verdict = verify(gpu_550, with_report(gpu_550.evidence, flip(report, bit)), trust_no_rims)
        failed = [(c.name, c.detail.split(":")[0]) for c in verdict.failures]
        assert failed[:2] == [
            ("gpu0.nonce", "NonceMismatchError"),
            ("gpu0.signature", "ReportSignatureError"),
        ], bit


def test_report_for_another_nonce_fails_the_nonce_step_only(
    gpu_550: RealGpu, trust_no_rims: GpuTrust
) -> None:
    verdict = verify_gpu_evidence(
        [gpu_550.evidence],
        expected_nonces=[bytes(32)],
        policy=gpu_550.policy,
        trust=trust_no_rims,
        at=TODAY,
    )
    assert first_failure(verdict) == ("gpu0.nonce", "NonceMismatchError")
    assert [c.passed for c in verdict.checks if c.name == "gpu0.signature"] == [True]


@pytest.mark.parametrize("position", [0, 1, 2, 3])
def test_bit_flips_in_a_certificate_fail_the_chain_unless_the_signed_content_is_unchanged(
    gpu_550: RealGpu, trust_no_rims: GpuTrust, position: int
) -> None:
    """Every 5th byte of each certificate, low bit flipped. Either the DER no longer parses, or
    a link breaks (step 3), or a later step fails. The one kind of flip that passes changes
    only the encoding, not what is signed: e.g. the unused-bits count of the signature BIT
    STRING (the TBS and the signature value are byte-identical to the original)."""
    certs = list(gpu_550.evidence.certificates())
    original = certs[position]
    der = original.public_bytes(Encoding.DER)
    outcomes = set()
    for offset in range(0, len(der), 5):
        try:
            flipped = load_certificates(flip(der, offset * 8), pem=False, error=ValueError)[0]
        except ValueError:
            continue
        certs[position] = flipped
        verdict = verify(gpu_550, with_chain(gpu_550.evidence, certs), trust_no_rims)
        name = first_failure(verdict)[0]
        outcomes.add(name)
        if name.startswith("gpu0.rim."):  # every mechanism step passed
            assert flipped.tbs_certificate_bytes == original.tbs_certificate_bytes, offset
            assert flipped.signature == original.signature, offset
        else:
            assert name in {"gpu0.certificate_chain", "gpu0.signature", "gpu0.fwid"}, offset
    assert "gpu0.certificate_chain" in outcomes


def test_substituted_chain_of_another_gpu_fails_fwid_and_signature(
    gpu_550: RealGpu, trust_no_rims: GpuTrust
) -> None:
    other = x509.load_pem_x509_certificates((VECTORS / "h100-545" / "cert_chain.pem").read_bytes())
    verdict = verify(gpu_550, with_chain(gpu_550.evidence, other), trust_no_rims)
    failed = [c.name for c in verdict.failures]
    assert failed[:2] == ["gpu0.fwid", "gpu0.signature"]


def test_substituted_intermediate_fails_the_chain(
    gpu_550: RealGpu, trust_no_rims: GpuTrust
) -> None:
    certs = list(gpu_550.evidence.certificates())
    other = x509.load_pem_x509_certificates((VECTORS / "h100-545" / "cert_chain.pem").read_bytes())
    certs[1] = other[1]  # another GPU's BROM certificate
    verdict = verify(gpu_550, with_chain(gpu_550.evidence, certs), trust_no_rims)
    assert first_failure(verdict) == ("gpu0.certificate_chain", "CertificateChainError")


@pytest.mark.parametrize("swap", [(0, 1), (1, 2), (2, 3), (3, 4)])
def test_reordered_chain_fails_the_chain(
    gpu_550: RealGpu, trust_no_rims: GpuTrust, swap: tuple[int, int]
) -> None:
    certs = list(gpu_550.evidence.certificates())
    certs[swap[0]], certs[swap[1]] = certs[swap[1]], certs[swap[0]]
    verdict = verify(gpu_550, with_chain(gpu_550.evidence, certs), trust_no_rims)
    assert first_failure(verdict) == ("gpu0.certificate_chain", "CertificateChainError")


@pytest.mark.parametrize("drop", [4, 3, 0])
def test_four_certificate_chain_fails_the_chain(
    gpu_550: RealGpu, trust_no_rims: GpuTrust, drop: int
) -> None:
    certs = list(gpu_550.evidence.certificates())
    del certs[drop]
    verdict = verify(gpu_550, with_chain(gpu_550.evidence, certs), trust_no_rims)
    assert first_failure(verdict) == ("gpu0.certificate_chain", "CertificateChainError")
    assert "4 certificates, not 5" in verdict.failures[0].detail


def test_six_certificate_chain_fails_the_chain(gpu_550: RealGpu, trust_no_rims: GpuTrust) -> None:
    certs = list(gpu_550.evidence.certificates())
    verdict = verify(gpu_550, with_chain(gpu_550.evidence, [*certs, certs[-1]]), trust_no_rims)
    assert first_failure(verdict) == ("gpu0.certificate_chain", "CertificateChainError")


def test_presented_root_is_replaced_by_the_pinned_one(
    gpu_550: RealGpu, trust_no_rims: GpuTrust
) -> None:
    """A fake 5th certificate changes nothing: the pinned Device Identity CA is used instead."""
    certs = list(gpu_550.evidence.certificates())
    certs[4] = SyntheticGpuCa.create().device_root.cert
    verdict = verify(gpu_550, with_chain(gpu_550.evidence, certs), trust_no_rims)
    chain = next(c for c in verdict.checks if c.name == "gpu0.certificate_chain")
    assert chain.passed
    assert "replaced" in chain.detail


def test_genuine_chain_under_another_pinned_root_fails_the_chain(
    gpu_550: RealGpu, trust_no_rims: GpuTrust
) -> None:
    trust = replace(trust_no_rims, device_identity_ca=SyntheticGpuCa.create().device_root.cert)
    verdict = verify(gpu_550, gpu_550.evidence, trust)
    assert first_failure(verdict) == ("gpu0.certificate_chain", "CertificateChainError")


@pytest.mark.parametrize(
    ("defect", "cut"),
    [("truncated signature", -1), ("truncated record", 200), ("request only", REQUEST_LEN)],
)
def test_truncated_report_fails_the_report_step(
    gpu_550: RealGpu, trust_no_rims: GpuTrust, defect: str, cut: int
) -> None:
    report = gpu_550.evidence.report
    truncated = report[:cut]
    verdict = verify(gpu_550, with_report(gpu_550.evidence, truncated), trust_no_rims)
    assert first_failure(verdict) == ("gpu0.report", "ReportFormatError"), defect


def test_trailing_byte_fails_the_report_step(gpu_550: RealGpu, trust_no_rims: GpuTrust) -> None:
    report = gpu_550.evidence.report + b"\0"
    verdict = verify(gpu_550, with_report(gpu_550.evidence, report), trust_no_rims)
    assert first_failure(verdict) == ("gpu0.report", "ReportFormatError")
    assert "trail" in verdict.failures[0].detail


def test_fwid_flipped_in_the_opaque_data_fails_fwid_and_signature(
    gpu_550: RealGpu, trust_no_rims: GpuTrust
) -> None:
    report = gpu_550.evidence.report
    fwid = bytes.fromhex(
        "f5c384aebb579217a2c66b17ed0f28e6a9b8d639041acd7b4721cec004f7275494ba94bb5cdfdb3055ee051762b1f75d"
    )
    tampered = report.replace(fwid, flip(fwid, 0))
    verdict = verify(gpu_550, with_report(gpu_550.evidence, tampered), trust_no_rims)
    assert [c.name for c in verdict.failures][:2] == ["gpu0.fwid", "gpu0.signature"]


def test_evidence_json_with_a_bad_chain_is_unusable_input(gpu_550: RealGpu) -> None:
    from attestation.gpu.errors import GpuEvidenceFormatError

    item = gpu_550.evidence.to_json()
    item["certificate"] = base64.b64encode(b"not a certificate").decode()
    with pytest.raises(GpuEvidenceFormatError):
        GpuEvidence.from_json(item)


def test_one_gpus_evidence_twice_does_not_count_as_two_gpus(
    gpu_550: RealGpu, trust_no_rims: GpuTrust
) -> None:
    policy = replace(gpu_550.policy, num_gpus=frozenset({2}))
    verdict = verify_gpu_evidence(
        [gpu_550.evidence, gpu_550.evidence],
        expected_nonces=[gpu_550.nonce, gpu_550.nonce],
        policy=policy,
        trust=trust_no_rims,
        at=TODAY,
    )
    distinct = next(c for c in verdict.checks if c.name == "gpu.distinct")
    assert not distinct.passed
    assert "more than once" in distinct.detail


def test_naive_validation_time_is_a_programming_error(
    gpu_550: RealGpu, trust_no_rims: GpuTrust
) -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        verify_gpu_evidence(
            [gpu_550.evidence],
            expected_nonces=[gpu_550.nonce],
            policy=gpu_550.policy,
            trust=trust_no_rims,
            at=TODAY.replace(tzinfo=None),
        )


def test_random_byte_changes_anywhere_in_the_report_never_verify(
    gpu_550: RealGpu, trust_no_rims: GpuTrust
) -> None:
    """Every byte of a report is either signed or the signature itself, so no change can pass
    step 5; a change that breaks the framing fails step 1. Nothing raises."""
    rng = random.Random(550)
    report = gpu_550.evidence.report
    for _ in range(400):
        offset = rng.randrange(len(report))
        changed = put_byte(report, offset, rng.randrange(1, 256))
        verdict = verify(gpu_550, with_report(gpu_550.evidence, changed), trust_no_rims)
        passed = {c.name for c in verdict.checks if c.passed}
        assert "gpu0.signature" not in passed, offset


def put_byte(data: bytes, offset: int, xor: int) -> bytes:
    out = bytearray(data)
    out[offset] ^= xor
    return bytes(out)

"""Revocation from an operator's bundle of OCSP responses and CRLs, with synthetic issuers:
each outcome (good, revoked, stale, unchecked) reported, and policy deciding which it accepts."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509 import ocsp

from attestation.errors import PolicyError
from attestation.gpu import verify_gpu_evidence
from attestation.gpu.revocation import RevocationBundle
from attestation.verdict import Check, Verdict
from tests.attestation.gpu.synthetic import Issued, SyntheticGpuSetup, issue, synthetic_gpu_setup

NOW = datetime(2026, 11, 22, tzinfo=UTC)
FRESH = NOW - timedelta(hours=1)


def pairs(setup: SyntheticGpuSetup) -> list[tuple[Issued, Issued]]:
    """(certificate, issuer) of every certificate the verifier looks up: the device chain below
    the root, and each RIM signing chain below the CoRIM root."""
    chain = setup.gpus[0].chain
    ca = setup.ca
    rim_chain = [
        (ca.rim_signer, ca.corim_l3),
        (ca.corim_l3, ca.corim_ca),
        (ca.corim_ca, ca.corim_root),
    ]
    return [(chain[i], chain[i + 1]) for i in range(4)] + rim_chain


def write_ocsp(
    setup: SyntheticGpuSetup,
    directory: Path,
    *,
    this_update: datetime = FRESH,
    revoked: set[str] = frozenset(),
    skip: set[str] = frozenset(),
) -> None:
    directory.mkdir(exist_ok=True)
    for n, (cert, issuer) in enumerate(pairs(setup)):
        name = cert.cert.subject.rfc4514_string()
        if any(s in name for s in skip):
            continue
        response = setup.ca.ocsp_response(
            cert.cert,
            issuer,
            revoked=any(r in name for r in revoked),
            this_update=this_update,
            next_update=this_update + timedelta(days=30),
        )
        (directory / f"{n}.ocsp").write_bytes(response)
    setup.revocation_dir = directory


def verify(setup: SyntheticGpuSetup, **policy: object) -> Verdict:
    nonce = os.urandom(32)
    return verify_gpu_evidence(
        setup.collect([nonce]),
        expected_nonces=[nonce],
        policy=setup.policy(**policy),
        trust=setup.trust(),
        at=NOW,
    )


def revocation_check(verdict: Verdict) -> Check:
    return next(c for c in verdict.checks if c.name == "gpu0.revocation")


@pytest.fixture
def setup(tmp_path: Path) -> SyntheticGpuSetup:
    return synthetic_gpu_setup(tmp_path)


def test_fresh_good_ocsp_for_every_certificate_is_good(
    setup: SyntheticGpuSetup, tmp_path: Path
) -> None:
    write_ocsp(setup, tmp_path / "bundle")
    verdict = verify(setup, revocation_accept=["good"])
    assert verdict.trusted, verdict.failures
    assert verdict.claims["gpus"][0]["revocation"] == "good"


def test_revoked_leaf_fails_whatever_the_policy_accepts(
    setup: SyntheticGpuSetup, tmp_path: Path
) -> None:
    write_ocsp(setup, tmp_path / "bundle", revoked={"FMC LF"})
    verdict = verify(setup, revocation_accept=["good", "stale", "unchecked"])
    check = revocation_check(verdict)
    assert not check.passed
    assert "revocation state revoked" in check.detail


def test_revoked_rim_signer_fails(setup: SyntheticGpuSetup, tmp_path: Path) -> None:
    write_ocsp(setup, tmp_path / "bundle", revoked={"RIM L4 Signer"})
    assert "revoked" in revocation_check(verify(setup)).detail


def test_old_ocsp_is_stale_and_accepted_only_if_policy_says_so(
    setup: SyntheticGpuSetup, tmp_path: Path
) -> None:
    write_ocsp(setup, tmp_path / "bundle", this_update=NOW - timedelta(days=10))
    strict = verify(setup, revocation_accept=["good"], revocation_max_age_s=7 * 24 * 3600)
    assert "revocation state stale" in revocation_check(strict).detail
    lenient = verify(setup, revocation_accept=["good", "stale"], revocation_max_age_s=7 * 24 * 3600)
    assert lenient.trusted


def test_ocsp_from_after_the_validation_time_is_not_fresh(
    setup: SyntheticGpuSetup, tmp_path: Path
) -> None:
    write_ocsp(setup, tmp_path / "bundle", this_update=NOW + timedelta(days=1))
    assert "stale" in revocation_check(verify(setup, revocation_accept=["good"])).detail


def test_partial_bundle_is_unchecked(setup: SyntheticGpuSetup, tmp_path: Path) -> None:
    write_ocsp(setup, tmp_path / "bundle", skip={"BROM"})
    assert (
        "revocation state unchecked"
        in revocation_check(verify(setup, revocation_accept=["good"])).detail
    )
    assert verify(setup, revocation_accept=["good", "unchecked"]).trusted


def test_no_bundle_is_unchecked_and_fails_a_policy_that_wants_good(
    setup: SyntheticGpuSetup,
) -> None:
    verdict = verify(setup, revocation_accept=["good"])
    assert verdict.claims["gpus"][0]["revocation"] == "unchecked"
    assert not revocation_check(verdict).passed


def test_crl_listing_an_intermediate_revokes_it(setup: SyntheticGpuSetup, tmp_path: Path) -> None:
    write_ocsp(setup, tmp_path / "bundle", skip={"BROM"})
    brom, provisioner = setup.gpus[0].chain[1], setup.gpus[0].chain[2]
    crl = setup.ca.crl(
        provisioner,
        revoked_serials=[brom.cert.serial_number],
        last_update=FRESH,
        next_update=NOW + timedelta(days=7),
    )
    (tmp_path / "bundle" / "provisioner.crl").write_bytes(crl)
    assert "revoked" in revocation_check(verify(setup)).detail


def test_fresh_crl_not_listing_the_certificate_is_good(
    setup: SyntheticGpuSetup, tmp_path: Path
) -> None:
    write_ocsp(setup, tmp_path / "bundle", skip={"BROM"})
    provisioner = setup.gpus[0].chain[2]
    crl = setup.ca.crl(provisioner, last_update=FRESH, next_update=NOW + timedelta(days=7))
    (tmp_path / "bundle" / "provisioner.crl").write_bytes(crl)
    assert verify(setup, revocation_accept=["good"]).trusted


def test_crl_past_its_next_update_is_stale(setup: SyntheticGpuSetup, tmp_path: Path) -> None:
    write_ocsp(setup, tmp_path / "bundle", skip={"BROM"})
    provisioner = setup.gpus[0].chain[2]
    crl = setup.ca.crl(
        provisioner, last_update=NOW - timedelta(days=2), next_update=NOW - timedelta(days=1)
    )
    (tmp_path / "bundle" / "provisioner.crl").write_bytes(crl)
    assert "stale" in revocation_check(verify(setup, revocation_accept=["good"])).detail


def test_ocsp_signed_by_a_responder_the_issuer_never_named_is_a_revocation_error(
    setup: SyntheticGpuSetup, tmp_path: Path
) -> None:
    write_ocsp(setup, tmp_path / "bundle", skip={"FMC LF"})
    leaf, brom = setup.gpus[0].chain[0], setup.gpus[0].chain[1]
    impostor = issue("impostor responder", None, ca=False)
    builder = ocsp.OCSPResponseBuilder().add_response(
        cert=leaf.cert,
        issuer=brom.cert,
        algorithm=hashes.SHA1(),
        cert_status=ocsp.OCSPCertStatus.GOOD,
        this_update=FRESH,
        next_update=None,
        revocation_time=None,
        revocation_reason=None,
    )
    builder = builder.responder_id(ocsp.OCSPResponderEncoding.HASH, impostor.cert)
    response = builder.sign(impostor.key, hashes.SHA384()).public_bytes(Encoding.DER)
    (tmp_path / "bundle" / "leaf.ocsp").write_bytes(response)
    check = revocation_check(verify(setup, revocation_accept=["good", "unchecked"]))
    assert check.detail.startswith("RevocationError") and "neither the issuer" in check.detail


def test_ocsp_with_a_flipped_signature_bit_is_a_revocation_error(
    setup: SyntheticGpuSetup, tmp_path: Path
) -> None:
    write_ocsp(setup, tmp_path / "bundle", skip={"FMC LF"})
    leaf, brom = setup.gpus[0].chain[0], setup.gpus[0].chain[1]
    response = bytearray(setup.ca.ocsp_response(leaf.cert, brom, this_update=FRESH))
    response[-1] ^= 1  # the last byte of the signature (the response carries no certificates)
    (tmp_path / "bundle" / "leaf.ocsp").write_bytes(bytes(response))
    check = revocation_check(verify(setup, revocation_accept=["good", "unchecked"]))
    assert check.detail.startswith("RevocationError") and "does not verify" in check.detail


def test_crl_with_a_bad_signature_is_a_revocation_error(
    setup: SyntheticGpuSetup, tmp_path: Path
) -> None:
    write_ocsp(setup, tmp_path / "bundle")
    provisioner = setup.gpus[0].chain[2]
    impostor = Issued(provisioner.cert, issue("impostor", None, ca=True).key)
    crl = setup.ca.crl(impostor, last_update=FRESH, next_update=NOW + timedelta(days=7))
    (tmp_path / "bundle" / "forged.crl").write_bytes(crl)
    check = revocation_check(verify(setup))
    assert check.detail.startswith("RevocationError") and "bad signature" in check.detail


def test_bundle_with_a_foreign_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(PolicyError, match=r"neither \.ocsp nor \.crl"):
        RevocationBundle.from_directory(tmp_path)


def test_bundle_with_a_corrupt_response_is_refused(tmp_path: Path) -> None:
    (tmp_path / "broken.ocsp").write_bytes(b"\x30\x03\x0a\x01")
    with pytest.raises(PolicyError, match="does not parse"):
        RevocationBundle.from_directory(tmp_path)

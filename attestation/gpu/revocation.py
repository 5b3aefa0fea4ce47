"""Revocation from an operator-supplied bundle (the site is air-gapped: nothing is fetched).

A bundle is a directory of `*.ocsp` files (DER OCSP responses) and `*.crl` files (DER or PEM
CRLs), refreshed by the operator from NVIDIA's OCSP service and CRL distribution points. For one
certificate and its issuer the outcome is one of:

    good       a fresh OCSP response says good, or a fresh CRL by the issuer does not list it
    revoked    an OCSP response or CRL (fresh or not) says revoked
    stale      the only answers found are older than the maximum age or past their nextUpdate
    unchecked  the bundle has nothing about this certificate

Every answer used must be signed by the issuer (an OCSP response may also be signed by a
delegated responder certificate that the issuer issued for OCSP signing); a bad signature is a
`RevocationError`, never silently "unchecked". Policy decides which outcomes it accepts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.x509 import ocsp
from cryptography.x509.oid import ExtendedKeyUsageOID

from attestation.errors import PolicyError
from attestation.gpu.errors import RevocationError

GOOD, REVOKED, STALE, UNCHECKED = "good", "revoked", "stale", "unchecked"


@dataclass(frozen=True, slots=True)
class RevocationBundle:
    """Parsed OCSP responses and CRLs. An empty bundle makes every certificate "unchecked"."""

    ocsp_responses: tuple[ocsp.OCSPResponse, ...] = ()
    crls: tuple[x509.CertificateRevocationList, ...] = ()

    @classmethod
    def from_directory(cls, directory: Path) -> RevocationBundle:
        """Read every `*.ocsp` and `*.crl` file of `directory`. Any other file, or one that does
        not parse, is a PolicyError: a bundle the operator cannot trust entirely is refused."""
        directory = Path(directory)
        if not directory.is_dir():
            raise PolicyError(f"revocation bundle {directory} is not a directory")
        responses, crls = [], []
        for path in sorted(directory.iterdir()):
            data = path.read_bytes()
            try:
                if path.suffix == ".ocsp":
                    responses.append(ocsp.load_der_ocsp_response(data))
                elif path.suffix == ".crl":
                    pem = data.lstrip().startswith(b"-----BEGIN")
                    crls.append(
                        x509.load_pem_x509_crl(data) if pem else x509.load_der_x509_crl(data)
                    )
                else:
                    raise PolicyError(
                        f"revocation bundle file {path.name} is neither .ocsp nor .crl"
                    )
            except ValueError as exc:
                raise PolicyError(
                    f"revocation bundle file {path.name} does not parse: {exc}"
                ) from exc
        return cls(tuple(responses), tuple(crls))


@dataclass(frozen=True, slots=True)
class RevocationStatus:
    state: str
    detail: str


def check_revocation(
    cert: x509.Certificate,
    issuer: x509.Certificate,
    bundle: RevocationBundle,
    *,
    at: datetime,
    max_age: timedelta,
) -> RevocationStatus:
    """The revocation state of `cert` (issued by `issuer`) at `at`. Raises RevocationError when
    an answer about it is signed by anyone but its issuer or a delegated responder."""
    answers = [
        *_ocsp_answers(cert, issuer, bundle, at, max_age),
        *_crl_answers(cert, issuer, bundle, at, max_age),
    ]
    for state in (REVOKED, GOOD, STALE):
        for answer in answers:
            if answer.state == state:
                return answer
    return RevocationStatus(
        UNCHECKED, f"no OCSP response or CRL covers serial {cert.serial_number:x}"
    )


def combine_states(states: Sequence[str]) -> str:
    """One state for a chain: revoked if any is, good only if all are, else stale if any is."""
    if REVOKED in states:
        return REVOKED
    if states and all(state == GOOD for state in states):
        return GOOD
    return STALE if STALE in states else UNCHECKED


def _fresh(
    this_update: datetime, next_update: datetime | None, at: datetime, max_age: timedelta
) -> bool:
    return (
        this_update <= at
        and at - this_update <= max_age
        and (next_update is None or at <= next_update)
    )


def _ocsp_answers(cert, issuer, bundle, at, max_age) -> list[RevocationStatus]:
    answers = []
    for response in bundle.ocsp_responses:
        if response.response_status != ocsp.OCSPResponseStatus.SUCCESSFUL:
            continue
        for single in response.responses:
            if single.serial_number != cert.serial_number or not _same_issuer(single, issuer):
                continue
            _verify_ocsp_signature(response, issuer)
            if single.certificate_status == ocsp.OCSPCertStatus.REVOKED:
                answers.append(
                    RevocationStatus(REVOKED, f"OCSP: revoked at {single.revocation_time_utc}")
                )
            elif single.certificate_status == ocsp.OCSPCertStatus.GOOD:
                fresh = _fresh(single.this_update_utc, single.next_update_utc, at, max_age)
                answers.append(
                    RevocationStatus(
                        GOOD if fresh else STALE,
                        f"OCSP good as of {single.this_update_utc:%Y-%m-%dT%H:%M:%SZ}"
                        + ("" if fresh else " (too old)"),
                    )
                )
    return answers


def _crl_answers(cert, issuer, bundle, at, max_age) -> list[RevocationStatus]:
    answers = []
    for crl in bundle.crls:
        if crl.issuer != issuer.subject:
            continue
        if not crl.is_signature_valid(issuer.public_key()):  # type: ignore[arg-type]
            raise RevocationError(f"CRL of {issuer.subject.rfc4514_string()} has a bad signature")
        if crl.get_revoked_certificate_by_serial_number(cert.serial_number) is not None:
            answers.append(RevocationStatus(REVOKED, "CRL lists the certificate as revoked"))
            continue
        fresh = _fresh(crl.last_update_utc, crl.next_update_utc, at, max_age)
        answers.append(
            RevocationStatus(
                GOOD if fresh else STALE,
                f"CRL of {crl.last_update_utc:%Y-%m-%dT%H:%M:%SZ} does not list it"
                + ("" if fresh else " (too old)"),
            )
        )
    return answers


def _same_issuer(single: ocsp.OCSPSingleResponse, issuer: x509.Certificate) -> bool:
    algorithm = single.hash_algorithm
    name_hash = hashes.Hash(algorithm)
    name_hash.update(issuer.subject.public_bytes())
    key_hash = hashes.Hash(algorithm)
    key_hash.update(_subject_public_key(issuer))
    return (
        single.issuer_name_hash == name_hash.finalize()
        and single.issuer_key_hash == key_hash.finalize()
    )


def _subject_public_key(cert: x509.Certificate) -> bytes:
    """The BIT STRING contents of subjectPublicKey (what OCSP's issuerKeyHash hashes)."""
    key = cert.public_key()
    if isinstance(key, ec.EllipticCurvePublicKey):
        return key.public_bytes(
            serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint
        )
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.PKCS1)


def _verify_ocsp_signature(response: ocsp.OCSPResponse, issuer: x509.Certificate) -> None:
    signer = issuer
    if not _responder_is(response, issuer):
        delegated = [c for c in response.certificates if _responder_is(response, c)]
        if len(delegated) != 1:
            raise RevocationError(
                "OCSP response is signed by neither the issuer nor a responder it names"
            )
        signer = delegated[0]
        try:
            signer.verify_directly_issued_by(issuer)
            usage = signer.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        except (ValueError, InvalidSignature, x509.ExtensionNotFound, TypeError) as exc:
            raise RevocationError(
                "OCSP responder certificate is not issued by the issuer for OCSP signing"
            ) from exc
        if ExtendedKeyUsageOID.OCSP_SIGNING not in usage:
            raise RevocationError("OCSP responder certificate lacks the OCSP-signing usage")
    key = signer.public_key()
    try:
        if isinstance(key, ec.EllipticCurvePublicKey):
            key.verify(
                response.signature,
                response.tbs_response_bytes,
                ec.ECDSA(response.signature_hash_algorithm),
            )
        elif isinstance(key, rsa.RSAPublicKey):
            key.verify(
                response.signature,
                response.tbs_response_bytes,
                padding.PKCS1v15(),
                response.signature_hash_algorithm,
            )
        else:
            raise RevocationError("OCSP signer key type is not supported")
    except (InvalidSignature, UnsupportedAlgorithm, TypeError) as exc:
        raise RevocationError("OCSP response signature does not verify") from exc


def _responder_is(response: ocsp.OCSPResponse, cert: x509.Certificate) -> bool:
    if response.responder_name is not None:
        return response.responder_name == cert.subject
    digest = hashes.Hash(hashes.SHA1())
    digest.update(_subject_public_key(cert))
    return response.responder_key_hash == digest.finalize()

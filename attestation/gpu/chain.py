"""X.509 chain checks shared by the device identity chain and the RIM signing chains: each link's
signature, key usage, basic constraints and path length, unknown critical extensions, and
validity at a given time. Pure: certificates and a time in, a typed error out.

Revocation is not checked here (see `attestation.gpu.revocation`), and validity is a separate
function because policy may treat an expired RIM signer differently from a broken link.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.x509.oid import ExtensionOID

from attestation.errors import VerificationError

FWID_OID = x509.ObjectIdentifier("2.23.133.5.4.1")  # TCG DICE TcbInfo, carries the FWID
FWID_LEN = 48

# Critical extensions this verifier understands; any other critical one fails the chain
# (RFC 5280 §4.2: a certificate with an unrecognized critical extension must be rejected).
_UNDERSTOOD_CRITICAL = {
    ExtensionOID.BASIC_CONSTRAINTS,
    ExtensionOID.KEY_USAGE,
    ExtensionOID.SUBJECT_KEY_IDENTIFIER,
    ExtensionOID.AUTHORITY_KEY_IDENTIFIER,
    ExtensionOID.SUBJECT_ALTERNATIVE_NAME,
    FWID_OID,
}


def load_certificates(data: bytes, *, pem: bool, error: type[Exception]) -> list[x509.Certificate]:
    """Parse certificates (a PEM bundle, or one DER certificate) and touch every field a check
    reads: `cryptography` parses some fields lazily, and a corrupted name or extension would
    otherwise surface later as a KeyError or ValueError in the middle of a check. Raises
    `error` for anything that does not parse."""
    try:
        certs = (
            x509.load_pem_x509_certificates(data) if pem else [x509.load_der_x509_certificate(data)]
        )
        for cert in certs:
            cert.subject.rfc4514_string()
            cert.issuer.rfc4514_string()
            list(cert.extensions)
            cert.public_key()
            cert.not_valid_before_utc, cert.not_valid_after_utc  # noqa: B018
            cert.signature_hash_algorithm  # noqa: B018
    # Broad on purpose: the bytes are hostile and cryptography raises ValueError, KeyError,
    # DuplicateExtension (an Exception) or UnsupportedAlgorithm for different corruptions.
    except Exception as exc:
        raise error(f"certificate does not parse: {exc!r}") from exc
    return certs


def verify_links(
    chain: Sequence[x509.Certificate],
    root: x509.Certificate,
    *,
    error: type[VerificationError],
    what: str,
) -> None:
    """Check that `chain` (leaf first, without a root) is issued link by link up to `root`: each
    issuer's name and signature, CA basic constraints and path length on every issuer, keyCertSign
    on every issuer and digitalSignature on the leaf, no unknown critical extension anywhere.
    Validity is not checked here. Raises `error` with a message naming the link and `what`."""
    certs = [*chain, root]
    for position, cert in enumerate(certs):
        for extension in cert.extensions:
            if extension.critical and extension.oid not in _UNDERSTOOD_CRITICAL:
                raise error(
                    f"{what} certificate {position} has an unknown critical extension "
                    f"{extension.oid.dotted_string}"
                )
    _require_key_usage(certs[0], "digital_signature", error, f"{what} leaf certificate")
    for position in range(1, len(certs)):
        subject, issuer = certs[position - 1], certs[position]
        label = f"{what} certificate {position - 1} ({_cn(subject)})"
        try:
            subject.verify_directly_issued_by(issuer)
        except ValueError as exc:
            raise error(f"{label} is not issued by {_cn(issuer)}: {exc}") from exc
        except (InvalidSignature, UnsupportedAlgorithm, TypeError) as exc:
            raise error(f"{label}: signature by {_cn(issuer)} does not verify") from exc
        constraints = _extension(issuer, x509.BasicConstraints)
        if constraints is None or not constraints.ca:
            raise error(f"{what} issuer {_cn(issuer)} is not a CA (basic constraints)")
        num_intermediates_below = position - 1
        if (
            constraints.path_length is not None
            and constraints.path_length < num_intermediates_below
        ):
            raise error(
                f"{what} issuer {_cn(issuer)} path length {constraints.path_length} exceeded"
            )
        _require_key_usage(issuer, "key_cert_sign", error, f"{what} issuer {_cn(issuer)}")


def validity_problems(certs: Sequence[x509.Certificate], at: datetime) -> list[str]:
    """For each certificate not valid at `at`, a sentence saying which and when."""
    problems = []
    for cert in certs:
        if at < cert.not_valid_before_utc:
            problems.append(f"{_cn(cert)} is not valid before {cert.not_valid_before_utc:%Y-%m-%d}")
        elif at > cert.not_valid_after_utc:
            problems.append(f"{_cn(cert)} expired {cert.not_valid_after_utc:%Y-%m-%d}")
    return problems


def leaf_fwid(cert: x509.Certificate) -> bytes | None:
    """The FWID of a device leaf certificate: the last 48 bytes of its 2.23.133.5.4.1 extension
    (a DICE TcbInfo whose only FWID is the SHA-384 digest), or None if it has no such extension."""
    try:
        extension = cert.extensions.get_extension_for_oid(FWID_OID)
    except x509.ExtensionNotFound:
        return None
    value = extension.value
    raw = value.value if isinstance(value, x509.UnrecognizedExtension) else b""
    return raw[-FWID_LEN:] if len(raw) >= FWID_LEN else None


def _require_key_usage(
    cert: x509.Certificate, usage: str, error: type[VerificationError], label: str
) -> None:
    key_usage = _extension(cert, x509.KeyUsage)
    if key_usage is None or not getattr(key_usage, usage):
        raise error(f"{label} lacks the {usage} key usage")


def _extension(cert: x509.Certificate, kind: type) -> object | None:
    try:
        return cert.extensions.get_extension_for_class(kind).value
    except x509.ExtensionNotFound:
        return None
    except ValueError:  # a duplicate or malformed extension
        return None


def _cn(cert: x509.Certificate) -> str:
    names = cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
    return str(names[0].value) if names else cert.subject.rfc4514_string()

"""Revocation of AMD SEV-SNP certificates from an operator-supplied CRL (offline).

AMD's Key Distribution Service publishes one CRL per processor line
(`https://kdsintf.amd.com/vcek/v1/<product>/crl`), signed by that line's ARK with RSA-PSS
SHA-384; it lists revoked ASKs (and VLEK/ASVK certificates). An air-gapped appliance cannot
fetch it, so the operator brings it into the trust directory (`snp/crl-<product>.der`), and
verification reports what it can say, rather than hiding that it could not check:

  good       a CRL signed by the pinned ARK, fresh at the validation time, does not list the ASK
  revoked    the CRL lists the ASK
  stale      the CRL is older than the policy's maximum age, or past its nextUpdate
  unchecked  no CRL for this product, or one that is not validly signed by the pinned ARK or
             not yet issued at the validation time

The policy (`[snp] revocation_accept`, default ["good"]) decides which states are acceptable;
"revoked" never is.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import SignatureAlgorithmOID

from attestation.cpu.snp import AMD_PSS

RevocationState = Literal["good", "revoked", "stale", "unchecked"]
REVOCATION_STATES: tuple[RevocationState, ...] = ("good", "revoked", "stale", "unchecked")


@dataclass(frozen=True, slots=True)
class RevocationStatus:
    state: RevocationState
    detail: str


def check_snp_revocation(
    *,
    ask: x509.Certificate,
    ark: x509.Certificate,
    crl: x509.CertificateRevocationList | None,
    at: datetime,
    max_age: timedelta,
) -> RevocationStatus:
    """The revocation state of `ask` under the pinned `ark`, from `crl` (the operator's copy
    of AMD's CRL for this product, or None)."""
    if crl is None:
        return RevocationStatus("unchecked", "no CRL for this product in the trust directory")
    problem = _crl_problem(crl, ark)
    if problem:
        return RevocationStatus("unchecked", problem)
    issued = crl.last_update_utc
    if issued > at:
        detail = f"the CRL was issued {issued.isoformat()}, after the validation time"
        return RevocationStatus("unchecked", detail)
    # The ARK's CRL covers what the ARK issued: the ASK. (VCEKs are issued by the ASK, all
    # with serial number 0, so a serial in this CRL never names a VCEK.)
    revoked = crl.get_revoked_certificate_by_serial_number(ask.serial_number)
    if revoked is not None:
        return RevocationStatus(
            "revoked",
            f"the ASK (serial {ask.serial_number:x}) was revoked on "
            f"{revoked.revocation_date_utc.isoformat()}",
        )
    next_update = crl.next_update_utc
    if next_update is not None and next_update < at:
        return RevocationStatus("stale", f"the CRL's nextUpdate {next_update.isoformat()} passed")
    if at - issued > max_age:
        detail = f"the CRL was issued {issued.isoformat()}, more than {max_age} earlier"
        return RevocationStatus("stale", detail)
    return RevocationStatus("good", "")


def _crl_problem(crl: x509.CertificateRevocationList, ark: x509.Certificate) -> str:
    if crl.issuer != ark.subject:
        return f"the CRL is issued by {crl.issuer.rfc4514_string()}, not the pinned ARK"
    if crl.signature_algorithm_oid != SignatureAlgorithmOID.RSASSA_PSS or not isinstance(
        crl.signature_hash_algorithm, hashes.SHA384
    ):
        return "the CRL is not signed with RSASSA-PSS SHA-384"
    key = ark.public_key()
    assert isinstance(key, rsa.RSAPublicKey)  # a pinned ARK is RSA (checked by the chain step)
    try:
        key.verify(crl.signature, crl.tbs_certlist_bytes, AMD_PSS, hashes.SHA384())
    except InvalidSignature:
        return "the CRL's signature does not verify under the pinned ARK"
    return ""

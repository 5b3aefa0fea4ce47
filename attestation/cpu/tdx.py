"""Intel TDX quotes: parsing and DCAP verification through the `dcap-qvl` package (mechanism
only; acceptable values are `attestation.cpu.policy`'s business).

dcap-qvl (Phala, MIT; Rust with Python bindings) implements Intel's DCAP quote verification:
the PCK certificate chain to the Intel SGX Root CA, the Root CA and PCK CRLs, the signed TCB
info and QE identity with their issuer chains, the QE report and its binding of the attestation
key, the quote signature, and the TCB status of the platform and the QE. It takes the
validation time as a value (`now_secs`) and never reaches the network when handed collateral,
which is what an air-gapped appliance needs: the collateral is bundled (`CpuTrust`).

Verification plan (`verify_tdx_quote`), one error type per step:
  1. parse the quote; it must be a TDX quote        -> TdxQuoteFormatError (EvidenceError)
  2. bundled collateral for the quote's FMSPC        -> TdxCollateralError
  3. dcap-qvl verifies the quote against it and the
     pinned Intel root at the validation time         -> TdxQuoteVerificationError
  4. report_data equals the expected value            -> ReportDataMismatchError (in `verify`)
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

import dcap_qvl
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from attestation.cpu.errors import (
    TdxCollateralError,
    TdxQuoteFormatError,
    TdxQuoteVerificationError,
)


@dataclass(frozen=True, slots=True)
class TdxClaims:
    """What a verified quote says: its TD report fields, and dcap-qvl's TCB status."""

    tcb_status: str
    advisory_ids: tuple[str, ...]
    fmspc: str
    td_attributes: bytes
    xfam: bytes
    mr_td: bytes
    mr_config_id: bytes
    mr_owner: bytes
    mr_owner_config: bytes
    rtmrs: tuple[bytes, bytes, bytes, bytes]
    mr_seam: bytes
    tee_tcb_svn: bytes
    report_data: bytes

    def to_json(self) -> dict[str, object]:
        return {
            "tcb_status": self.tcb_status,
            "advisory_ids": list(self.advisory_ids),
            "fmspc": self.fmspc,
            "td_attributes": self.td_attributes.hex(),
            "xfam": self.xfam.hex(),
            "mr_td": self.mr_td.hex(),
            "mr_config_id": self.mr_config_id.hex(),
            "mr_owner": self.mr_owner.hex(),
            "mr_owner_config": self.mr_owner_config.hex(),
            "rtmrs": [rtmr.hex() for rtmr in self.rtmrs],
            "mr_seam": self.mr_seam.hex(),
            "tee_tcb_svn": self.tee_tcb_svn.hex(),
            "report_data": self.report_data.hex(),
        }


@dataclass(frozen=True, slots=True)
class TdxQuote:
    """A parsed TDX quote (step 1): the raw bytes and the platform it names."""

    raw: bytes
    fmspc: str
    version: int

    @classmethod
    def parse(cls, raw: bytes) -> TdxQuote:
        """Raises TdxQuoteFormatError if dcap-qvl cannot parse it or it is not a TDX quote."""
        raw = bytes(raw)
        try:
            quote = dcap_qvl.parse_quote(raw)
            is_tdx = quote.is_tdx()
            fmspc = quote.fmspc().upper()
            version = quote.header.version
        except ValueError as exc:
            raise TdxQuoteFormatError(f"not a parsable DCAP quote: {exc}") from exc
        if not is_tdx:
            raise TdxQuoteFormatError("the quote is an SGX quote, not a TDX quote")
        return cls(raw=raw, fmspc=fmspc, version=version)

    def pck_chain(self) -> list[x509.Certificate]:
        """The PCK certificate chain embedded in the quote (leaf first)."""
        pem = dcap_qvl.parse_quote(self.raw).cert_chain_pem_bytes()
        if not pem:
            raise TdxQuoteFormatError("the quote embeds no PCK certificate chain")
        try:
            return x509.load_pem_x509_certificates(pem)
        except ValueError as exc:
            raise TdxQuoteFormatError(f"the quote's PCK chain is not PEM: {exc}") from exc


def verify_pck_chain(quote: TdxQuote, root_ca_der: bytes, at: datetime) -> list[x509.Certificate]:
    """The quote's embedded PCK chain, checked link by link (ECDSA P-256 SHA-256) up to the
    pinned Intel SGX Root CA, each certificate valid at `at`. This is the part of DCAP that
    needs no collateral; `verify_tdx_quote` does it all (through dcap-qvl) when collateral is
    bundled. Raises TdxQuoteVerificationError."""
    root = x509.load_der_x509_certificate(root_ca_der)
    chain = quote.pck_chain()
    if chain[-1] != root:
        raise TdxQuoteVerificationError("the PCK chain does not end at the pinned Intel root")
    for cert, issuer in itertools.pairwise(chain):
        key = issuer.public_key()
        if cert.issuer != issuer.subject or not isinstance(key, ec.EllipticCurvePublicKey):
            raise TdxQuoteVerificationError(f"{cert.subject.rfc4514_string()} is not issued by "
                                            f"{issuer.subject.rfc4514_string()}")  # fmt: skip
        try:
            key.verify(cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(hashes.SHA256()))
        except InvalidSignature:
            raise TdxQuoteVerificationError(
                f"the signature of {cert.subject.rfc4514_string()} does not verify"
            ) from None
    for cert in chain:
        if not cert.not_valid_before_utc <= at <= cert.not_valid_after_utc:
            raise TdxQuoteVerificationError(
                f"{cert.subject.rfc4514_string()} is not valid at {at.isoformat()}"
            )
    return chain


def verify_tdx_quote(
    quote: TdxQuote,
    *,
    collateral: Mapping[str, str],
    root_ca_der: bytes | None,
    at: datetime,
) -> TdxClaims:
    """Steps 2-3 of the plan above. `collateral` maps an FMSPC to its QuoteCollateralV3 JSON.
    Raises TdxCollateralError or TdxQuoteVerificationError; a TCB status other than UpToDate is
    not an error here but a claim the policy judges."""
    if root_ca_der is None:
        raise TdxCollateralError("no Intel SGX Root CA is pinned: TDX evidence can never verify")
    text = collateral.get(quote.fmspc)
    if text is None:
        raise TdxCollateralError(
            f"no bundled DCAP collateral for platform FMSPC {quote.fmspc} "
            f"(bundled: {sorted(collateral) or 'none'})"
        )
    try:
        bundle = dcap_qvl.QuoteCollateralV3.from_json(text)
    except ValueError as exc:
        raise TdxCollateralError(f"collateral for FMSPC {quote.fmspc} is malformed: {exc}") from exc
    try:
        verified = dcap_qvl.verify_with_root_ca(quote.raw, bundle, root_ca_der, int(at.timestamp()))
    except ValueError as exc:
        message = str(exc)
        if "xpired" in message or "in the future" in message:
            raise TdxQuoteVerificationError(
                f"the bundled collateral is not valid at {at.isoformat()} "
                f"(expired or not yet issued): {message}"
            ) from exc
        raise TdxQuoteVerificationError(f"dcap-qvl rejected the quote: {message}") from exc
    # The TD report fields of the very bytes dcap-qvl just verified (TDX 1.0 and 1.5 reports
    # expose the same properties; quote v5 TD15 bodies included).
    try:
        td = dcap_qvl.parse_quote(quote.raw).report
        return TdxClaims(
            tcb_status=str(verified.status),
            advisory_ids=tuple(verified.advisory_ids),
            fmspc=quote.fmspc,
            td_attributes=bytes(td.td_attributes),
            xfam=bytes(td.xfam),
            mr_td=bytes(td.mr_td),
            mr_config_id=bytes(td.mr_config_id),
            mr_owner=bytes(td.mr_owner),
            mr_owner_config=bytes(td.mr_owner_config),
            rtmrs=(bytes(td.rt_mr0), bytes(td.rt_mr1), bytes(td.rt_mr2), bytes(td.rt_mr3)),
            mr_seam=bytes(td.mr_seam),
            tee_tcb_svn=bytes(td.tee_tcb_svn),
            report_data=bytes(td.report_data),
        )
    except (ValueError, AttributeError) as exc:
        raise TdxQuoteFormatError(
            f"dcap-qvl verified a report this code cannot read: {exc}"
        ) from exc

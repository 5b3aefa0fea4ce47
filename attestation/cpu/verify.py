"""Verify CPU evidence into a Verdict: the mechanism steps of `attestation.cpu.snp` or
`attestation.cpu.tdx`, the report_data binding, then the policy.

A mechanism step that fails ends verification with that step's failed check: the values of a
report whose signature did not verify mean nothing, so no policy check runs on them and no
claims are reported. Evidence that cannot even be parsed raises EvidenceError, and evidence of
a kind the policy has no table for raises PolicyError (`python -m attestation` exit status 2);
everything else is a check in the returned Verdict.
"""

from __future__ import annotations

import hmac
import uuid
from datetime import datetime, timedelta
from typing import Any

from cryptography import x509
from cryptography.x509.oid import NameOID

from attestation.cpu.errors import ReportDataMismatchError, SnpCertificatesMissingError
from attestation.cpu.evidence import CpuEvidence
from attestation.cpu.policy import CpuPolicy
from attestation.cpu.revocation import check_snp_revocation
from attestation.cpu.snp import (
    ASK_GUID,
    OID_HWID,
    VCEK_GUID,
    SnpReport,
    TcbVersion,
    load_amd_certificate,
    parse_certificate_table,
    verify_report_signature,
    verify_snp_chain,
    verify_vcek_binding,
)
from attestation.cpu.tdx import TdxQuote, verify_tdx_quote
from attestation.cpu.trust import CpuTrust
from attestation.errors import PolicyError, VerificationError
from attestation.verdict import Check, Verdict

REPORT_DATA_SIZE = 64


def verify_cpu_evidence(
    evidence: CpuEvidence,
    *,
    expected_report_data: bytes,
    policy: CpuPolicy,
    trust: CpuTrust,
    at: datetime,
) -> Verdict:
    """Verify `evidence` at the validation time `at` (timezone-aware). Returns a Verdict whose
    checks are named `snp.*` or `tdx.*`; trusted only if the signatures chain to the pinned
    roots, the signed report_data equals `expected_report_data` (64 bytes, see
    `attestation.binding.report_data`) and every policy check passes. Raises EvidenceError on
    unparsable evidence, PolicyError if the policy has no table for the evidence's kind."""
    if len(expected_report_data) != REPORT_DATA_SIZE:
        raise ValueError(f"expected_report_data must be {REPORT_DATA_SIZE} bytes")
    if at.tzinfo is None:
        raise ValueError("the validation time must be timezone-aware")
    if evidence.kind == "snp":
        return _verify_snp(evidence, expected_report_data, policy, trust, at)
    return _verify_tdx(evidence, expected_report_data, policy, trust, at)


def _verify_snp(
    evidence: CpuEvidence, expected: bytes, policy: CpuPolicy, trust: CpuTrust, at: datetime
) -> Verdict:
    if policy.snp is None:
        raise PolicyError("the policy has no [snp] table: SEV-SNP evidence is never accepted")
    report = SnpReport.parse(evidence.report)
    checks: list[Check] = []
    step = "snp.certificates"
    try:
        vcek, ask = _snp_certificates(report, evidence, trust)
        checks.append(Check(step, True))
        step = "snp.certificate_chain"
        product = verify_snp_chain(vcek, ask, trust.snp_arks, at)
        checks.append(Check(step, True))
        step = "snp.vcek"
        verify_vcek_binding(report, vcek, product)
        checks.append(Check(step, True))
        step = "snp.signature"
        verify_report_signature(report, vcek)
        checks.append(Check(step, True))
        step = "snp.report_data"
        _verify_report_data(report.report_data, expected)
        checks.append(Check(step, True))
    except VerificationError as exc:
        return _failed_at(step, exc, checks, at)
    revocation = check_snp_revocation(
        ask=ask,
        ark=trust.snp_arks[product],
        crl=trust.snp_crls.get(product),
        at=at,
        max_age=timedelta(seconds=policy.snp.revocation_max_age_s),
    )
    checks.extend(policy.snp.evaluate(report, product, revocation))
    claims: dict[str, Any] = {
        "kind": "snp",
        "product": product,
        "version": report.version,
        "measurement": report.measurement.hex(),
        "report_data": report.report_data.hex(),
        "host_data": report.host_data.hex(),
        "vmpl": report.vmpl,
        "guest_policy": f"0x{report.policy:x}",
        "debug": report.debug_allowed,
        "guest_svn": report.guest_svn,
        "reported_tcb": TcbVersion.from_bytes(report.reported_tcb, product).to_json(),
        "chip_id": report.chip_id.hex(),
        "revocation": revocation.state,
    }
    return Verdict(tuple(checks), at, claims)


def _snp_certificates(
    report: SnpReport, evidence: CpuEvidence, trust: CpuTrust
) -> tuple[x509.Certificate, x509.Certificate]:
    """VCEK and ASK: from the evidence's certificate table if it has them, else from the trust
    store's offline cache (the VCEK whose hwID is this chip's, and the ASK that issued it).
    The table's ARK, if any, is ignored: only pinned ARKs anchor a chain."""
    table = parse_certificate_table(evidence.auxblob) if evidence.auxblob else {}
    vcek = _certificate(table, VCEK_GUID) or _cached_vcek(report, trust)
    if vcek is None:
        raise SnpCertificatesMissingError(
            f"no VCEK for chip {report.chip_id[:8].hex()}...: the evidence carries no "
            "certificate table and the trust store caches none for this chip"
        )
    ask = _certificate(table, ASK_GUID) or next(
        (cert for cert in trust.snp_certificates if cert.subject == vcek.issuer), None
    )
    if ask is None:
        raise SnpCertificatesMissingError(f"no ASK named {vcek.issuer.rfc4514_string()}")
    return vcek, ask


def _certificate(table: dict[uuid.UUID, bytes], guid: uuid.UUID) -> x509.Certificate | None:
    return load_amd_certificate(table[guid]) if guid in table else None


def _cached_vcek(report: SnpReport, trust: CpuTrust) -> x509.Certificate | None:
    for cert in trust.snp_certificates:
        names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        if not names or names[0].value != "SEV-VCEK":
            continue
        try:
            hwid = cert.extensions.get_extension_for_oid(OID_HWID).value
        except x509.ExtensionNotFound:
            continue
        if isinstance(hwid, x509.UnrecognizedExtension) and hwid.value.endswith(
            report.chip_id if len(hwid.value) >= 64 else report.chip_id[:8]
        ):
            return cert
    return None


def _verify_report_data(signed: bytes, expected: bytes) -> None:
    if not hmac.compare_digest(signed, expected):
        raise ReportDataMismatchError(
            "the signed report_data is not the expected binding of this challenge's nonce, GPU "
            "evidence and key-release key (a replayed or foreign report)"
        )


def _verify_tdx(
    evidence: CpuEvidence, expected: bytes, policy: CpuPolicy, trust: CpuTrust, at: datetime
) -> Verdict:
    if policy.tdx is None:
        raise PolicyError("the policy has no [tdx] table: TDX evidence is never accepted")
    quote = TdxQuote.parse(evidence.report)
    checks: list[Check] = []
    step = "tdx.quote"
    try:
        claims = verify_tdx_quote(
            quote, collateral=trust.tdx_collateral, root_ca_der=trust.tdx_root_ca_der, at=at
        )
        checks.append(Check(step, True))
        step = "tdx.report_data"
        _verify_report_data(claims.report_data, expected)
        checks.append(Check(step, True))
    except VerificationError as exc:
        return _failed_at(step, exc, checks, at)
    checks.extend(policy.tdx.evaluate(claims))
    return Verdict(tuple(checks), at, {"kind": "tdx", **claims.to_json()})


def _failed_at(step: str, exc: VerificationError, passed: list[Check], at: datetime) -> Verdict:
    """The verdict of evidence whose mechanism `step` failed: the steps that passed, then the
    failed one. No policy check runs and no claims are reported (see the module docstring)."""
    return Verdict((*passed, Check(step, False, str(exc))), at)

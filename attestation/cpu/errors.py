"""Errors of CPU evidence verification, one type per numbered step of `attestation.cpu.snp` and
`attestation.cpu.tdx`, so that a hostile-input test can name the step its input must fail at."""

from __future__ import annotations

from attestation.errors import EvidenceError, VerificationError


class SnpReportFormatError(EvidenceError):
    """Step 1 (SEV-SNP): the report is not a well-formed 1184-byte ATTESTATION_REPORT."""


class SnpCertificatesMissingError(VerificationError):
    """Step 2 (SEV-SNP): no VCEK or ASK for this chip, neither in the evidence's certificate
    table nor in the trust store's offline cache."""


class SnpCertificateChainError(VerificationError):
    """Step 2 (SEV-SNP): the VCEK does not chain to a pinned ARK through the ASK (RSA-PSS
    SHA-384), or a certificate is outside its validity at the validation time."""


class SnpVcekMismatchError(VerificationError):
    """Step 3 (SEV-SNP): the VCEK certifies another chip or another TCB than the report names."""


class SnpSignatureError(VerificationError):
    """Step 4 (SEV-SNP): the ECDSA P-384 report signature does not verify under the VCEK."""


class TdxQuoteFormatError(EvidenceError):
    """Step 1 (TDX): the quote cannot be parsed as a TDX DCAP quote."""


class TdxCollateralError(VerificationError):
    """Step 2 (TDX): no bundled collateral for the quote's platform (FMSPC)."""


class TdxQuoteVerificationError(VerificationError):
    """Step 3 (TDX): dcap-qvl rejected the quote: PCK chain, CRLs, TCB info, QE identity,
    signatures, or collateral outside its validity at the validation time."""


class ReportDataMismatchError(VerificationError):
    """Final mechanism step: the signed report_data is not the value the verifier expects."""

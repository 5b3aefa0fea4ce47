"""The GPU verifier's errors: one type per numbered step of `attestation.gpu.verify`, so that a
caller (and a hostile-input test) can name the step at which evidence failed.

Parse errors are `EvidenceError`s (the input is unusable: exit status 2 of the CLI); a check that
ran and failed is a `VerificationError` (exit status 1). Foreign exceptions (`cryptography`,
`lxml`, `binascii`) are translated with `raise ... from exc`.
"""

from __future__ import annotations

from attestation.errors import EvidenceError, VerificationError


class GpuEvidenceFormatError(EvidenceError):
    """The evidence JSON, its base64 report or its PEM certificate chain cannot be decoded."""


class ReportFormatError(EvidenceError):
    """The SPDM 1.1 GET_MEASUREMENTS request/response pair is malformed (step 1)."""


class NonceMismatchError(VerificationError):
    """The request nonce in the report is not the nonce the verifier asked for (step 2)."""


class CertificateChainError(VerificationError):
    """The device certificate chain does not lead to the pinned Device Identity CA (step 3)."""


class FwidMismatchError(VerificationError):
    """The FWID in the report's opaque data differs from the leaf certificate's (step 4)."""


class ReportSignatureError(VerificationError):
    """The ECDSA-P384 signature over request ‖ response does not verify (step 5)."""


class DeclaredVersionMismatchError(VerificationError):
    """A version the evidence declares beside the report (PPCIe's informative `driver_version`,
    `vbios_version`) differs from the one the GPU signed (step 6)."""


class RimFormatError(EvidenceError):
    """A reference manifest (RIM) is not a well-formed, signed SWID tag of the expected shape."""


class RimNotFoundError(VerificationError):
    """No RIM in the RIM directory matches the driver or VBIOS version of the report (step 7)."""


class RimSignatureError(VerificationError):
    """A RIM's XML signature (digest or ECDSA-P384 signature value) does not verify (step 7)."""


class RimChainError(VerificationError):
    """A RIM's signing chain does not lead to the pinned CoRIM root at the validation time."""


class RimCertificateExpiredError(RimChainError):
    """A RIM signer certificate is outside its validity at the validation time (NVIDIA's expire
    after two years); policy decides whether that alone is fatal."""


class MeasurementMismatchError(VerificationError):
    """A measurement block differs from every golden alternative of its RIM entry (step 8)."""


class RevocationError(VerificationError):
    """A revocation bundle entry is malformed or its signature does not verify (step 9)."""

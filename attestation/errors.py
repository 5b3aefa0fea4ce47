"""The attestation package's errors: one root, and one type per boundary a caller handles.

`python -m attestation` maps `EvidenceError` and `PolicyError` to exit status 2 (the input is
unusable) and reports checks that fail (exit status 1) through a `Verdict`, not an exception.
Each verifier's module adds its own subclasses, one per numbered step, so that a test can name
the step a hostile input must fail at.
"""

from __future__ import annotations


class AttestationError(Exception):
    """Root of every error the attestation package raises."""


class EvidenceError(AttestationError, ValueError):
    """Evidence that cannot even be parsed: wrong length, bad encoding, a field out of range."""


class PolicyError(AttestationError, ValueError):
    """A policy file that is missing, empty, malformed, or names a value it cannot hold."""


class VerificationError(AttestationError):
    """Evidence parsed but failed a check. Subclasses name the step; the message says why."""


class CollectionError(AttestationError):
    """Evidence could not be collected from the device (CC off, no driver, no configfs-tsm)."""


class KeyReleaseError(AttestationError):
    """A key provider refused or failed to release a data key."""


class SealedModelError(AttestationError):
    """A sealed model directory is malformed, tampered with, or sealed under another key."""


class TrustBundleError(AttestationError):
    """A trust bundle (attestation.trust_bundle) is malformed, tampered with, signed by another
    key, or holds a file its layout does not name."""

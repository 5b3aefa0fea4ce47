"""The audit package's errors: one root, and one type per boundary a caller handles.

The offline verifier (`python -m audit verify`) maps `BundleFormatError` to exit status 2 (the
input is unusable) and `VerificationError` to exit status 1 (the log failed a check).
"""

from __future__ import annotations


class AuditError(Exception):
    """Root of every error the audit package raises."""


class CanonicalJsonError(AuditError, ValueError):
    """A value has no RFC 8785 canonical form (NaN, a huge integer, a non-string key ...)."""


class MerkleError(AuditError):
    """A Merkle proof is malformed or does not verify (RFC 9162, section 2.1)."""


class RootMismatchError(MerkleError):
    """A proof computed a root other than the expected one."""

    def __init__(self, expected: bytes, calculated: bytes) -> None:
        super().__init__(
            f"calculated root {calculated.hex()} does not match expected root {expected.hex()}"
        )
        self.expected = expected
        self.calculated = calculated


class NoteFormatError(AuditError, ValueError):
    """A signed note, checkpoint, tlog-proof or verifier key is malformed."""


class SignatureError(AuditError):
    """A signed note carries no valid signature from the pinned key."""


class KeyFileError(AuditError):
    """A secret key file is missing, malformed, or readable by others than its owner."""


class SignerRefusedError(AuditError):
    """The checkpoint signer refuses a checkpoint inconsistent with the last one it signed."""


class AuditStoreError(AuditError):
    """The audit database cannot be opened, read or written, or its contents are inconsistent."""


class AuditWriteError(AuditStoreError):
    """An entry could not be appended: the caller must not proceed (fail closed)."""


class AuditClosedError(AuditWriteError):
    """The audit log is closed or its writer has stopped: nothing can be appended."""


class BundleFormatError(AuditError):
    """An export bundle, its manifest, a checkpoint file or a state file is unusable input."""


class VerificationError(AuditError):
    """An export bundle failed a verification check: the log cannot be trusted as exported."""


class UnknownEntryError(AuditError):
    """No entry exists at the requested log position."""


class ExportRangeError(AuditError, ValueError):
    """An export's requested range holds no entries or is contradictory."""


class WitnessRefusedError(AuditError):
    """A witness refuses to cosign a checkpoint; `status` is the tlog-witness HTTP status."""

    status = 400


class UnknownLogError(WitnessRefusedError):
    """The checkpoint's origin is no log this witness was configured with (404)."""

    status = 404


class UntrustedCheckpointError(WitnessRefusedError):
    """No signature on the checkpoint verifies against the log's pinned key (403)."""

    status = 403


class OldSizeConflictError(WitnessRefusedError):
    """The request's old size is not the size the witness last cosigned (409): the client
    retries from `latest_size`."""

    status = 409

    def __init__(self, latest_size: int) -> None:
        super().__init__(f"the latest checkpoint this witness cosigned has size {latest_size}")
        self.latest_size = latest_size


class SplitViewError(WitnessRefusedError):
    """A checkpoint of the size the witness last cosigned, with another root (409): the log
    shows two different trees of one size."""

    status = 409


class InconsistentCheckpointError(WitnessRefusedError):
    """The consistency proof does not show the checkpoint extends the cosigned one (422)."""

    status = 422


class WitnessUnavailableError(AuditError):
    """A witness could not be reached, refused a checkpoint, or answered something unusable."""


class WitnessDisagreesError(WitnessUnavailableError):
    """A witness refuses the checkpoint as inconsistent with what it cosigned (409 for another
    root or a larger tree, 422): the log's tree may have forked, or its database been restored."""


class WitnessStateError(AuditError):
    """The witness's state file is unreadable, or holds a checkpoint its log did not sign: the
    witness must not start, as one that forgot what it cosigned could cosign a fork."""

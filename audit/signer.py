"""The checkpoint signer: signs a tree head only if it extends the last one it signed.

c2sp.org/tlog-checkpoint: "A log MUST not sign any checkpoint which is inconsistent with any
checkpoint it previously signed." The signer keeps its own record of the last signed checkpoint
(the signed note itself, in a file beside its key), so a database restored from an old backup or
rewritten by hand cannot make it sign a fork: the next checkpoint must come with a consistency
proof from that record, and the record is written durably before the signature is released.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from audit.checkpoint import Checkpoint, open_checkpoint
from audit.errors import AuditError, KeyFileError, MerkleError, SignerRefusedError
from audit.keyfile import load_or_create_secret, read_secret_file, write_file_atomically
from audit.merkle import verify_consistency
from audit.note import NoteSigner, VerifierKey


def load_or_create_note_signer(path: Path, name: str) -> NoteSigner:
    """The log's Ed25519 key, created at first start as an owner-only skey file."""
    skey = load_or_create_secret(path, lambda: NoteSigner.generate(name).to_skey().encode())
    return _parse_note_signer(path, name, skey)


def load_note_signer(path: Path, name: str) -> NoteSigner:
    """The log's existing key (to show its vkey); raises KeyFileError if there is none yet."""
    try:
        skey = read_secret_file(path)
    except FileNotFoundError:
        raise KeyFileError(
            f"there is no signing key at {path} yet: the log makes it when it is first opened"
        ) from None
    return _parse_note_signer(path, name, skey)


def _parse_note_signer(path: Path, name: str, skey: bytes) -> NoteSigner:
    try:
        signer = NoteSigner.from_skey(skey.decode("ascii"))
    except (AuditError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"signing key file {path} is not a note signer key") from exc
    if signer.name != name:
        raise KeyFileError(
            f"signing key file {path} is the key of log {signer.name!r}, not of {name!r}"
        )
    return signer


class CheckpointSigner:
    """Signs checkpoints of one log, refusing any that do not extend the last one it signed."""

    def __init__(self, note_signer: NoteSigner, state_path: Path) -> None:
        self._note_signer = note_signer
        self._state_path = state_path
        self._last = self._read_state()

    @property
    def origin(self) -> str:
        return self._note_signer.name

    @property
    def verifier(self) -> VerifierKey:
        return self._note_signer.verifier

    @property
    def last_signed(self) -> Checkpoint | None:
        return self._last

    def _read_state(self) -> Checkpoint | None:
        try:
            note = read_secret_file(self._state_path)
        except FileNotFoundError:
            return None
        try:
            return open_checkpoint(note, self._note_signer.verifier)
        except AuditError as exc:
            raise KeyFileError(
                f"signer state {self._state_path} is not a checkpoint signed by this log's key: "
                f"{exc}"
            ) from exc

    def sign(self, checkpoint: Checkpoint, consistency_proof: Sequence[bytes]) -> str:
        """Sign `checkpoint` given a consistency proof from `last_signed`; return the note.

        The proof is ignored when nothing was signed yet. Raises SignerRefusedError when the
        checkpoint is for another log, smaller than the last one, or not proven to extend it.
        """
        if checkpoint.origin != self.origin:
            raise SignerRefusedError(
                f"checkpoint origin {checkpoint.origin!r} is not {self.origin!r}"
            )
        if checkpoint.size == 0:
            raise SignerRefusedError("an empty log has nothing to checkpoint")
        last = self._last
        if last is not None:
            if checkpoint.size < last.size:
                raise SignerRefusedError(
                    f"tree size {checkpoint.size} is smaller than the last signed size {last.size}:"
                    " the log was truncated or rolled back"
                )
            try:
                verify_consistency(
                    last.size, checkpoint.size, consistency_proof, last.root, checkpoint.root
                )
            except MerkleError as exc:
                raise SignerRefusedError(
                    f"tree of size {checkpoint.size} does not extend the last signed checkpoint "
                    f"(size {last.size}): {exc}"
                ) from exc
        note = checkpoint.sign(self._note_signer)
        write_file_atomically(self._state_path, note.encode())
        self._last = checkpoint
        return note

"""C2SP tlog-checkpoint (c2sp.org/tlog-checkpoint): a signed log origin, tree size and root."""

from __future__ import annotations

from dataclasses import dataclass

from audit.encoding import decode_base64, encode_base64, parse_decimal
from audit.errors import NoteFormatError, SignatureError
from audit.merkle import HASH_SIZE
from audit.note import NoteSigner, SignedNote, VerifierKey


@dataclass(frozen=True)
class Checkpoint:
    """A tree head: origin line, decimal tree size, base64 RFC 6962 root.

    Inferno's checkpoints carry no extension lines (the spec does not recommend them, as log
    monitors cannot audit them), so parsing refuses any rather than accept unauditable text.
    """

    origin: str
    size: int
    root: bytes

    def __post_init__(self) -> None:
        if not self.origin or "\n" in self.origin:
            raise NoteFormatError("checkpoint origin must be one non-empty line")
        if self.size < 0:
            raise NoteFormatError(f"checkpoint size {self.size} is negative")
        if len(self.root) != HASH_SIZE:
            raise NoteFormatError(f"checkpoint root is {len(self.root)} bytes, not {HASH_SIZE}")

    def to_text(self) -> str:
        return f"{self.origin}\n{self.size}\n{encode_base64(self.root)}\n"

    @classmethod
    def from_text(cls, text: str) -> Checkpoint:
        lines = text.split("\n")
        if len(lines) != 4 or lines[3] != "":
            raise NoteFormatError(
                "checkpoint text must be exactly three lines: origin, tree size, root hash"
            )
        origin, size, root = lines[:3]
        return cls(
            origin,
            parse_decimal(size, "checkpoint tree size"),
            decode_base64(root, "checkpoint root hash"),
        )

    def sign(self, signer: NoteSigner) -> str:
        """Return this checkpoint as a signed note."""
        return signer.sign(self.to_text())


def open_checkpoint(note: str | bytes, verifier: VerifierKey) -> Checkpoint:
    """Verify a signed checkpoint against the pinned `verifier` and return it.

    The checkpoint's origin must be the key's name: Inferno names its log key after its origin,
    as the spec recommends, so a checkpoint of another log signed by this key is refused too.
    Raises NoteFormatError for malformed notes, SignatureError for missing or bad signatures.
    """
    checkpoint = Checkpoint.from_text(SignedNote.parse(note).open(verifier))
    if checkpoint.origin != verifier.name:
        raise SignatureError(
            f"checkpoint of log {checkpoint.origin!r} is signed by the key of {verifier.name!r}"
        )
    return checkpoint

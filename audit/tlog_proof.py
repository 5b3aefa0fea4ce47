"""C2SP tlog-proof (c2sp.org/tlog-proof@v1): an offline receipt that one entry is in the log.

The text is `c2sp.org/tlog-proof@v1`, an optional `extra` line, `index N`, the base64 inclusion
proof (one hash a line, leaf's sibling first), a blank line, and the signed checkpoint verbatim.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from audit.checkpoint import Checkpoint, open_checkpoint
from audit.encoding import decode_base64, encode_base64, parse_decimal
from audit.errors import NoteFormatError
from audit.merkle import verify_inclusion
from audit.note import VerifierKey

HEADER = "c2sp.org/tlog-proof@v1"


@dataclass(frozen=True)
class TlogProof:
    index: int
    proof: Sequence[bytes]
    checkpoint_note: str
    extra: bytes | None = None

    def to_text(self) -> str:
        lines = [HEADER]
        if self.extra is not None:
            lines.append(f"extra {encode_base64(self.extra)}")
        lines.append(f"index {self.index}")
        lines += [encode_base64(h) for h in self.proof]
        return "\n".join(lines) + "\n\n" + self.checkpoint_note

    @classmethod
    def from_text(cls, text: str) -> TlogProof:
        head, sep, checkpoint_note = text.partition("\n\n")
        if not sep:
            raise NoteFormatError("tlog-proof has no blank line before its checkpoint")
        lines = head.split("\n")
        if lines[0] != HEADER:
            raise NoteFormatError(f"tlog-proof must start with {HEADER!r}")
        lines = lines[1:]
        extra = None
        if lines and lines[0].startswith("extra "):
            extra = decode_base64(lines.pop(0)[len("extra ") :], "tlog-proof extra data")
        if not lines or not lines[0].startswith("index "):
            raise NoteFormatError("tlog-proof has no 'index N' line")
        index = parse_decimal(lines.pop(0)[len("index ") :], "tlog-proof index")
        proof = [decode_base64(line, f"tlog-proof hash {i}") for i, line in enumerate(lines)]
        return cls(index, proof, checkpoint_note, extra)

    def verify(self, leaf_hash: bytes, verifier: VerifierKey) -> Checkpoint:
        """Check the checkpoint's signature and the entry's inclusion; return the checkpoint.

        Raises NoteFormatError, SignatureError or MerkleError (all AuditError).
        """
        checkpoint = open_checkpoint(self.checkpoint_note, verifier)
        verify_inclusion(self.index, checkpoint.size, leaf_hash, self.proof, checkpoint.root)
        return checkpoint

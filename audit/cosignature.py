"""C2SP tlog-cosignature (c2sp.org/tlog-cosignature), the Ed25519 `cosignature/v1` type.

A cosignature is a note signature line on a checkpoint,

    — <cosigner name> base64(key ID (4) || timestamp (8, big-endian) || Ed25519 signature (64))

over the message `cosignature/v1\\ntime <timestamp>\\n` followed by the checkpoint's note text
(section "Ed25519 signed message"). The key ID is SHA-256(name || 0x0A || 0x04 || public key)[:4]
and the cosigner's verifier key a vkey of signature type 0x04 (section "Format"). The spec
defines no encoding of the secret key; a witness keeps its own as
`PRIVATE+KEY+<name>+<hex key id>+<base64(0x04 || 32-byte seed)>`, a note skey whose type byte
says the key signs cosignatures only.

Standard library and `cryptography` only: the offline verifier checks cosignatures with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from audit.encoding import encode_base64
from audit.errors import NoteFormatError, SignatureError
from audit.note import (
    SIGNATURE_PREFIX,
    SKEY_PREFIX,
    SignedNote,
    check_key_name,
    check_note_text,
    key_id,
    parse_key,
)

ALG_COSIGNATURE_V1 = 0x04
HEADER = "cosignature/v1"
# "It MUST NOT exceed 2^63 - 1" (section "Format").
MAX_TIMESTAMP = 2**63 - 1
_TIMESTAMP_SIZE = 8
_ED25519_SIGNATURE_SIZE = 64


def signed_message(checkpoint_text: str, timestamp: int) -> bytes:
    """What an Ed25519 cosigner signs: the header line, the time line, the checkpoint's text."""
    if not 0 <= timestamp <= MAX_TIMESTAMP:
        raise NoteFormatError(f"cosignature timestamp {timestamp} is outside 0..2^63-1")
    return f"{HEADER}\ntime {timestamp}\n{checkpoint_text}".encode()


@dataclass(frozen=True)
class CosignerKey:
    """A witness's verifier key (vkey type 0x04), pinned out of band like the log's."""

    name: str
    key_id: int
    public_key: bytes

    @classmethod
    def parse(cls, vkey: str) -> CosignerKey:
        name, kid, public_key = parse_key(vkey.strip(), "witness key", ALG_COSIGNATURE_V1)
        if kid != key_id(name, public_key, ALG_COSIGNATURE_V1):
            raise NoteFormatError(f"witness key id {kid:08x} does not match its name and key")
        return cls(name, kid, public_key)

    def __str__(self) -> str:
        encoded = encode_base64(bytes([ALG_COSIGNATURE_V1]) + self.public_key)
        return f"{self.name}+{self.key_id:08x}+{encoded}"

    def verify(self, checkpoint_text: str, blob: bytes) -> int:
        """Check `blob` (a signature line's bytes after the key ID) over the checkpoint's text;
        return its timestamp. Raises SignatureError if it is malformed or does not verify."""
        if len(blob) != _TIMESTAMP_SIZE + _ED25519_SIGNATURE_SIZE:
            raise SignatureError(
                f"the cosignature by {self.name}+{self.key_id:08x} is {len(blob)} bytes, not "
                f"{_TIMESTAMP_SIZE + _ED25519_SIGNATURE_SIZE} (timestamp and Ed25519 signature)"
            )
        timestamp = int.from_bytes(blob[:_TIMESTAMP_SIZE], "big")
        if timestamp > MAX_TIMESTAMP:
            raise SignatureError(f"the cosignature by {self.name} has a timestamp above 2^63-1")
        message = signed_message(checkpoint_text, timestamp)
        try:
            Ed25519PublicKey.from_public_bytes(self.public_key).verify(
                blob[_TIMESTAMP_SIZE:], message
            )
        except InvalidSignature:
            raise SignatureError(
                f"the cosignature by {self.name}+{self.key_id:08x} does not verify"
            ) from None
        return timestamp


class Cosigner:
    """A witness's Ed25519 cosigning key. Holds a secret; never log it."""

    def __init__(self, name: str, private_key: Ed25519PrivateKey) -> None:
        check_key_name(name)
        self.name = name
        self._private_key = private_key
        public_key = private_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.verifier = CosignerKey(name, key_id(name, public_key, ALG_COSIGNATURE_V1), public_key)

    @classmethod
    def generate(cls, name: str) -> Cosigner:
        return cls(name, Ed25519PrivateKey.generate())

    @classmethod
    def from_skey(cls, skey: str) -> Cosigner:
        if not skey.startswith(SKEY_PREFIX):
            raise NoteFormatError(f"witness signer key must start with {SKEY_PREFIX!r}")
        name, kid, seed = parse_key(
            skey.strip()[len(SKEY_PREFIX) :], "witness signer key", ALG_COSIGNATURE_V1
        )
        cosigner = cls(name, Ed25519PrivateKey.from_private_bytes(seed))
        if kid != cosigner.verifier.key_id:
            raise NoteFormatError(f"witness signer key id {kid:08x} does not match its key")
        return cosigner

    def to_skey(self) -> str:
        seed = self._private_key.private_bytes_raw()
        encoded = encode_base64(bytes([ALG_COSIGNATURE_V1]) + seed)
        return f"{SKEY_PREFIX}{self.name}+{self.verifier.key_id:08x}+{encoded}"

    def __repr__(self) -> str:
        return f"Cosigner({self.verifier})"

    def cosign(self, checkpoint_text: str, timestamp: int) -> str:
        """The signature line (ending in a newline) cosigning `checkpoint_text` at `timestamp`."""
        check_note_text(checkpoint_text)
        signature = self._private_key.sign(signed_message(checkpoint_text, timestamp))
        blob = (
            self.verifier.key_id.to_bytes(4, "big")
            + timestamp.to_bytes(_TIMESTAMP_SIZE, "big")
            + signature
        )
        return f"{SIGNATURE_PREFIX}{self.name} {encode_base64(blob)}\n"


@dataclass(frozen=True)
class Cosignature:
    witness: CosignerKey
    timestamp: int


def verify_cosignatures(note: SignedNote, witnesses: Sequence[CosignerKey]) -> list[Cosignature]:
    """The cosignatures on `note` by the pinned `witnesses`, each verified over the note's text.

    Lines of other keys (the log's own, unknown witnesses) are ignored, as signed-note asks. A
    line that names a pinned witness and its key ID but does not verify raises SignatureError:
    someone altered the note or forged the line, and the note is not to be trusted.
    """
    found: dict[CosignerKey, Cosignature] = {}
    for witness in witnesses:
        for line in note.signatures:
            if line.name == witness.name and line.key_id == witness.key_id:
                timestamp = witness.verify(note.text, line.signature)
                found.setdefault(witness, Cosignature(witness, timestamp))
    return list(found.values())

"""C2SP signed notes (c2sp.org/signed-note) with Ed25519 keys (signature type 0x01).

A verifier key ("vkey") is `<name>+<hex key id>+<base64(0x01 || 32-byte public key)>` and a signer
key ("skey") is `PRIVATE+KEY+<name>+<hex key id>+<base64(0x01 || 32-byte seed)>`, the encodings of
golang.org/x/mod/sumdb/note, so Go tooling and witnesses read both.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from audit.encoding import decode_base64, encode_base64
from audit.errors import NoteFormatError, SignatureError

ALG_ED25519 = 0x01
ED25519_KEY_SIZE = 32
# The spec asks verifiers to bound signatures per note and to accept at least 16.
MAX_SIGNATURES = 100
SKEY_PREFIX = "PRIVATE+KEY+"
SIGNATURE_PREFIX = "\u2014 "  # em dash, space
_KEY_ID = re.compile(r"[0-9a-f]{8}")


def check_key_name(name: str) -> None:
    """Key names are non-empty and hold neither Unicode spaces nor '+' (signed-note, Format)."""
    if not name or "+" in name or any(c.isspace() for c in name):
        raise NoteFormatError(f"key name {name!r} must be non-empty, without spaces or '+'")


def key_id(name: str, public_key: bytes, alg: int = ALG_ED25519) -> int:
    """SHA-256(name || 0x0A || alg || public key)[:4], big-endian (signed-note, Ed25519: alg
    0x01; tlog-cosignature's Ed25519 cosignatures: alg 0x04)."""
    digest = hashlib.sha256(name.encode() + b"\n" + bytes([alg]) + public_key).digest()
    return int.from_bytes(digest[:4], "big")


def parse_key(text: str, what: str, alg: int = ALG_ED25519) -> tuple[str, int, bytes]:
    """Split `<name>+<hex id>+<base64(alg || key)>` into name, key id and 32-byte Ed25519 key.

    Only checks the form; callers compare the key id with `key_id(name, key, alg)`."""
    parts = text.split("+", 2)  # the base64 key may itself hold "+"
    if len(parts) != 3:
        raise NoteFormatError(f"{what} must be <name>+<hex key id>+<base64 key>")
    name, hex_id, encoded = parts
    check_key_name(name)
    if not _KEY_ID.fullmatch(hex_id):
        raise NoteFormatError(f"{what} key id {hex_id!r} is not 8 lowercase hex digits")
    raw = decode_base64(encoded, f"{what} key")
    if len(raw) != 1 + ED25519_KEY_SIZE or raw[0] != alg:
        raise NoteFormatError(f"{what} is not an Ed25519 key (type {alg:#04x} and 32 bytes)")
    return name, int(hex_id, 16), raw[1:]


@dataclass(frozen=True)
class VerifierKey:
    """A parsed vkey: the only thing a verifier trusts, pinned out of band."""

    name: str
    key_id: int
    public_key: bytes

    @classmethod
    def parse(cls, vkey: str) -> VerifierKey:
        name, kid, public_key = parse_key(vkey.strip(), "verifier key")
        if kid != key_id(name, public_key):
            raise NoteFormatError(f"verifier key id {kid:08x} does not match its name and key")
        return cls(name, kid, public_key)

    def __str__(self) -> str:
        encoded = encode_base64(bytes([ALG_ED25519]) + self.public_key)
        return f"{self.name}+{self.key_id:08x}+{encoded}"

    def verify(self, text: bytes, signature: bytes) -> bool:
        try:
            Ed25519PublicKey.from_public_bytes(self.public_key).verify(signature, text)
        except InvalidSignature:
            return False
        return True


class NoteSigner:
    """An Ed25519 note signer: a key name and a private key. Holds a secret; never log it."""

    def __init__(self, name: str, private_key: Ed25519PrivateKey) -> None:
        check_key_name(name)
        self.name = name
        self._private_key = private_key
        public_key = private_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.verifier = VerifierKey(name, key_id(name, public_key), public_key)

    @classmethod
    def generate(cls, name: str) -> NoteSigner:
        return cls(name, Ed25519PrivateKey.generate())

    @classmethod
    def from_skey(cls, skey: str) -> NoteSigner:
        if not skey.startswith(SKEY_PREFIX):
            raise NoteFormatError(f"signer key must start with {SKEY_PREFIX!r}")
        name, kid, seed = parse_key(skey.strip()[len(SKEY_PREFIX) :], "signer key")
        signer = cls(name, Ed25519PrivateKey.from_private_bytes(seed))
        if kid != signer.verifier.key_id:
            raise NoteFormatError(f"signer key id {kid:08x} does not match its name and key")
        return signer

    def to_skey(self) -> str:
        seed = self._private_key.private_bytes_raw()
        encoded = encode_base64(bytes([ALG_ED25519]) + seed)
        return f"{SKEY_PREFIX}{self.name}+{self.verifier.key_id:08x}+{encoded}"

    def __repr__(self) -> str:
        return f"NoteSigner({self.verifier})"

    def sign(self, text: str) -> str:
        """Return the signed note: `text`, a blank line, and this key's signature line."""
        check_note_text(text)
        signature = self._private_key.sign(text.encode())
        blob = self.verifier.key_id.to_bytes(4, "big") + signature
        return f"{text}\n{SIGNATURE_PREFIX}{self.name} {encode_base64(blob)}\n"


def check_note_text(text: str) -> None:
    """Note text ends in a newline and holds no control character other than newline."""
    if not text.endswith("\n"):
        raise NoteFormatError("note text must end with a newline")
    bad = next((c for c in text if c < " " and c != "\n"), None)
    if bad is not None:
        raise NoteFormatError(f"note text holds the control character {ord(bad):#04x}")


@dataclass(frozen=True)
class NoteSignature:
    name: str
    key_id: int
    signature: bytes


@dataclass(frozen=True)
class SignedNote:
    """A parsed, not yet verified, signed note."""

    text: str
    signatures: Sequence[NoteSignature]

    @classmethod
    def parse(cls, note: str | bytes) -> SignedNote:
        if isinstance(note, bytes):
            try:
                note = note.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise NoteFormatError("signed note is not valid UTF-8") from exc
        check_note_text(note)
        text, sep, block = note.rpartition("\n\n")
        if not sep:
            raise NoteFormatError("signed note has no blank line before its signatures")
        text += "\n"
        lines = block.removesuffix("\n").split("\n")
        if len(lines) > MAX_SIGNATURES:
            raise NoteFormatError(f"signed note has more than {MAX_SIGNATURES} signatures")
        return cls(text, tuple(parse_signature_line(line) for line in lines))

    def open(self, verifier: VerifierKey) -> str:
        """Return the text if a signature by `verifier` verifies; raise SignatureError if not.

        Signatures by other keys are ignored (signed-note, Signatures); a matching signature that
        fails to verify rejects the whole note.
        """
        matching = [
            s for s in self.signatures if s.name == verifier.name and s.key_id == verifier.key_id
        ]
        if not matching:
            raise SignatureError(
                f"not signed by the pinned key {verifier.name}+{verifier.key_id:08x}"
            )
        for sig in matching:
            if not verifier.verify(self.text.encode(), sig.signature):
                raise SignatureError(
                    f"the signature by {verifier.name}+{verifier.key_id:08x} does not verify"
                )
        return self.text


def parse_signature_line(line: str) -> NoteSignature:
    """One signature line, with or without its newline: `— <name> base64(key id || sig)`."""
    line = line.removesuffix("\n")
    if not line.startswith(SIGNATURE_PREFIX):
        raise NoteFormatError(f"signature line {line[:40]!r} does not start with an em dash")
    name, sep, encoded = line[len(SIGNATURE_PREFIX) :].partition(" ")
    if not sep:
        raise NoteFormatError("signature line has no space between key name and signature")
    check_key_name(name)
    blob = decode_base64(encoded, f"signature by {name}")
    if len(blob) < 5:
        raise NoteFormatError(f"signature by {name} is too short to hold a key id")
    return NoteSignature(name, int.from_bytes(blob[:4], "big"), blob[4:])


def open_note(note: str | bytes, verifier: VerifierKey) -> str:
    """Parse `note` and return its text if `verifier` signed it (see SignedNote.open)."""
    return SignedNote.parse(note).open(verifier)

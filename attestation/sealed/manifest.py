"""The signed manifest of a sealed model directory.

A sealed model directory holds:

    manifest.json            this manifest (UTF-8 JSON, the exact bytes that are signed)
    manifest.sig             base64 of the Ed25519 signature over
                             b"inferno-sealed-model/1 manifest\\n" ‖ manifest.json
    <name>.sealed            each weight file (*.safetensors), sealed in AES-256-GCM chunks
                             (attestation.sealed.chunks)
    <name>                   every other file (config.json, tokenizer.json, ...), in the clear

Only weight files are encrypted: the architecture and the tokenizer are not secret, and the
engine reads them from the directory as it reads any model. They are still listed with their
size and SHA-256 and checked when the model is opened, so nothing the engine reads from the
directory is unsigned.

    {"format": "inferno-sealed-model/1", "model_id": str, "seal_id": hex (16 bytes),
     "key_id": str, "wrapped_key": base64, "key_check": hex (32 bytes), "chunk_size": int,
     "files": [{"name": str, "size": int, "sha256": hex, "sealed": bool,
                "num_chunks": int (sealed files only)}, ...]}

`size` and `sha256` are always those of the plaintext, so the weights digest of a sealed model
(`appliance.boot.weights`) equals that of the model it was sealed from without decrypting anything.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from attestation.errors import SealedModelError
from attestation.input_limits import parse_json
from attestation.sealed.chunks import FORMAT, SEAL_ID_SIZE, num_chunks_of
from attestation.sealed.errors import ManifestFormatError, ManifestSignatureError

MANIFEST_NAME = "manifest.json"
SIGNATURE_NAME = "manifest.sig"
SEALED_SUFFIX = ".sealed"
_SIGNING_CONTEXT = FORMAT.encode() + b" manifest\n"
# Each decryption worker reads one whole sealed chunk into its own scratch buffer: the upper
# bound keeps 16 workers' scratch within 4 GiB whatever a manifest says.
MIN_CHUNK_SIZE = 4096
MAX_CHUNK_SIZE = 256 << 20
# A manifest lists each file in about 200 bytes: 16 MiB holds any model's.
MAX_MANIFEST_BYTES = 16 << 20
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._+-]{0,254}$")
_MANIFEST_KEYS = {
    "format", "model_id", "seal_id", "key_id", "wrapped_key", "key_check", "chunk_size", "files"
}  # fmt: skip
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True, slots=True)
class ManifestFile:
    """One file of the model: plaintext `size` and `sha256` (hex); weight files are `sealed`."""

    name: str
    size: int
    sha256: str
    sealed: bool
    num_chunks: int = 0

    @property
    def stored_name(self) -> str:
        """The name of the file in the sealed directory."""
        return self.name + SEALED_SUFFIX if self.sealed else self.name

    def to_json(self) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "name": self.name,
            "size": self.size,
            "sha256": self.sha256,
            "sealed": self.sealed,
        }
        if self.sealed:
            entry["num_chunks"] = self.num_chunks
        return entry


@dataclass(frozen=True, slots=True)
class SealedManifest:
    """A parsed manifest. Only `verify_and_parse` makes one from bytes, after the signature."""

    model_id: str
    seal_id: bytes
    key_id: str
    wrapped_key: bytes
    key_check: bytes
    chunk_size: int
    files: tuple[ManifestFile, ...]

    @property
    def sealed_files(self) -> tuple[ManifestFile, ...]:
        return tuple(entry for entry in self.files if entry.sealed)

    def file(self, name: str) -> ManifestFile:
        for entry in self.files:
            if entry.name == name:
                return entry
        raise SealedModelError(f"the sealed model {self.model_id!r} has no file {name!r}")

    def to_bytes(self) -> bytes:
        """The canonical bytes that are signed (sorted keys, no spaces, ASCII, one line)."""
        document = {
            "format": FORMAT,
            "model_id": self.model_id,
            "seal_id": self.seal_id.hex(),
            "key_id": self.key_id,
            "wrapped_key": base64.b64encode(self.wrapped_key).decode(),
            "key_check": self.key_check.hex(),
            "chunk_size": self.chunk_size,
            "files": [entry.to_json() for entry in self.files],
        }
        return json.dumps(document, sort_keys=True, separators=(",", ":")).encode() + b"\n"

    def sign(self, signing_key: Ed25519PrivateKey) -> tuple[bytes, bytes]:
        """(manifest.json bytes, manifest.sig bytes)."""
        body = self.to_bytes()
        signature = signing_key.sign(_SIGNING_CONTEXT + body)
        return body, base64.b64encode(signature) + b"\n"

    @classmethod
    def verify_and_parse(
        cls, body: bytes, signature_text: bytes, public_key: Ed25519PublicKey
    ) -> SealedManifest:
        """Verify the signature over `body`, then parse it strictly.

        1. The signature (base64, 64 bytes) verifies over the signing context ‖ body, under
           `public_key`; otherwise ManifestSignatureError. Nothing in `body` is read before.
        2. `body` is a manifest of this format: JSON within MAX_MANIFEST_BYTES and
           attestation.input_limits.MAX_NESTING_DEPTH, exact keys, types and ranges, safe
           unique file names, chunk counts that match the sizes; otherwise ManifestFormatError.
        """
        try:
            signature = base64.b64decode(signature_text.strip(), validate=True)
            public_key.verify(signature, _SIGNING_CONTEXT + body)
        except (binascii.Error, ValueError, InvalidSignature):
            raise ManifestSignatureError(
                "the manifest's signature does not verify under the pinned manifest key: the "
                "manifest was altered or signed by another key"
            ) from None
        document = parse_json(
            body,
            what="the signed manifest",
            error=ManifestFormatError,
            max_bytes=MAX_MANIFEST_BYTES,
        )
        return _parse(document)


def _parse(document: Any) -> SealedManifest:
    fields = _exact_keys(document, _MANIFEST_KEYS, "the manifest")
    if fields["format"] != FORMAT:
        raise ManifestFormatError(
            f"the manifest is of format {fields['format']!r}; this appliance reads {FORMAT!r}"
        )
    model_id = _text(fields["model_id"], "model_id")
    key_id = _text(fields["key_id"], "key_id")
    chunk_size = _int(fields["chunk_size"], "chunk_size")
    if not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE:
        raise ManifestFormatError(
            f"chunk_size {chunk_size} is outside [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}]"
        )
    seal_id = _hex(fields["seal_id"], "seal_id", SEAL_ID_SIZE)
    key_check = _hex(fields["key_check"], "key_check", 32)
    try:
        wrapped_key = base64.b64decode(_text(fields["wrapped_key"], "wrapped_key"), validate=True)
    except binascii.Error:
        raise ManifestFormatError("wrapped_key is not base64") from None
    if not isinstance(fields["files"], list) or not fields["files"]:
        raise ManifestFormatError("the manifest lists no files")
    files = tuple(_parse_file(entry, chunk_size) for entry in fields["files"])
    # Names are unique, and stored names cannot collide: a plain file never ends in
    # .safetensors or .sealed, a sealed one is always <name>.safetensors.sealed.
    names = [entry.name for entry in files]
    if len(set(names)) != len(names):
        raise ManifestFormatError("the manifest lists a file name twice")
    if set(names) & {MANIFEST_NAME, SIGNATURE_NAME}:
        raise ManifestFormatError("a listed file collides with the manifest's own files")
    if not any(entry.sealed for entry in files):
        raise ManifestFormatError("the manifest lists no sealed weight file")
    return SealedManifest(model_id, seal_id, key_id, wrapped_key, key_check, chunk_size, files)


def _parse_file(entry: Any, chunk_size: int) -> ManifestFile:
    sealed = isinstance(entry, Mapping) and entry.get("sealed") is True
    keys = {"name", "size", "sha256", "sealed"} | ({"num_chunks"} if sealed else set())
    fields = _exact_keys(entry, keys, "a file entry")
    name = _text(fields["name"], "a file name")
    if not _NAME.match(name):
        raise ManifestFormatError(
            f"file name {name!r} is not a plain file name (letters, digits, . _ + -)"
        )
    if not isinstance(fields["sealed"], bool):
        raise ManifestFormatError(f"{name}: sealed must be true or false")
    if sealed and not name.endswith(".safetensors"):
        raise ManifestFormatError(f"{name}: only *.safetensors weight files are sealed")
    if not sealed and name.endswith((".safetensors", SEALED_SUFFIX)):
        raise ManifestFormatError(f"{name}: a weight file must be sealed, never plain")
    size = _int(fields["size"], f"{name}: size")
    sha256 = fields["sha256"]
    if not isinstance(sha256, str) or not _HEX64.match(sha256):
        raise ManifestFormatError(f"{name}: sha256 must be 64 lowercase hex digits")
    num_chunks = 0
    if sealed:
        num_chunks = _int(fields["num_chunks"], f"{name}: num_chunks")
        if num_chunks != num_chunks_of(size, chunk_size):
            raise ManifestFormatError(
                f"{name}: num_chunks {num_chunks} does not match size {size} in chunks of "
                f"{chunk_size}"
            )
    return ManifestFile(name, size, sha256, sealed, num_chunks)


def _exact_keys(value: Any, keys: set[str], what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ManifestFormatError(f"{what} is not a JSON object")
    if set(value) != keys:
        extra, missing = sorted(set(value) - keys), sorted(keys - set(value))
        raise ManifestFormatError(f"{what} has unknown keys {extra} or lacks {missing}")
    return value


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > 1024:
        raise ManifestFormatError(f"{what} must be a non-empty string of at most 1024 characters")
    return value


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 53:
        raise ManifestFormatError(f"{what} must be a non-negative integer")
    return value


def _hex(value: Any, what: str, size: int) -> bytes:
    if not isinstance(value, str) or not re.fullmatch(f"[0-9a-f]{{{2 * size}}}", value):
        raise ManifestFormatError(f"{what} must be {2 * size} lowercase hex digits")
    return bytes.fromhex(value)


def load_manifest_public_key(path: Path) -> Ed25519PublicKey:
    """The Ed25519 manifest-verification key in PEM (SubjectPublicKeyInfo) at `path`. Raises
    SealedModelError if it cannot be read or is not an Ed25519 public key."""
    try:
        key = serialization.load_pem_public_key(Path(path).read_bytes())
    except (OSError, ValueError) as exc:
        raise SealedModelError(f"cannot load the manifest public key {path}: {exc}") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise SealedModelError(f"the manifest public key {path} is not an Ed25519 key")
    return key


def load_manifest_signing_key(path: Path) -> Ed25519PrivateKey:
    """The Ed25519 manifest-signing key in unencrypted PEM (PKCS#8) at `path` (the sealer's)."""
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise SealedModelError(f"cannot load the manifest signing key {path}: {exc}") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise SealedModelError(f"the manifest signing key {path} is not an Ed25519 key")
    return key

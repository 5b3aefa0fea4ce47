"""The chunk cipher of a sealed model: AES-256-GCM over fixed-size chunks of one file.

A weight file of `size` bytes is cut into `num_chunks = max(1, ceil(size / chunk_size))` chunks
(an empty file still has one, empty, authenticated chunk). On disk chunk `i` is its ciphertext
followed by its 16-byte tag; chunks are stored in order, so chunk `i` starts at
`i * (chunk_size + 16)`.

Each chunk's nonce and associated data bind everything that says where it belongs:

    context = b"inferno-sealed-model/1" ‖ seal_id (16 bytes) ‖ lp(model_id) ‖ lp(file_name)
              ‖ u64be(index) ‖ u64be(num_chunks)          (lp: u32be length, then UTF-8)
    nonce   = SHA-256(b"nonce" ‖ context)[:12]
    aad     = context

so a chunk moved to another position, another file, another model or another seal, and a file
cut short by whole chunks (its last chunk then claims a smaller count), all fail their tag.
The data key is drawn fresh for every seal, so no (key, nonce) pair is ever reused; the random
`seal_id` also keeps two seals apart should a key ever be reused by mistake.

AES-GCM is not key-committing, so the manifest also holds `key_check = HMAC-SHA256(data_key,
b"inferno-sealed-model/1 key check" ‖ seal_id)`: a wrong key is refused by name before any
chunk is tried, and no second key can be made to open the same ciphertext.

These functions are pure (bytes and buffers in, bytes or a typed error out); the file IO is in
`attestation.sealed.model` and `attestation.sealed.writer`.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from attestation.sealed.errors import ChunkAuthenticationError, DataKeyMismatchError

FORMAT = "inferno-sealed-model/1"
TAG_SIZE = 16
DATA_KEY_SIZE = 32
SEAL_ID_SIZE = 16


def num_chunks_of(size: int, chunk_size: int) -> int:
    """How many chunks a plaintext of `size` bytes is sealed in (at least one)."""
    return max(1, -(-size // chunk_size))


def sealed_size_of(size: int, chunk_size: int) -> int:
    """The size on disk of a sealed file whose plaintext has `size` bytes."""
    return size + num_chunks_of(size, chunk_size) * TAG_SIZE


def chunk_context(
    seal_id: bytes, model_id: str, file_name: str, index: int, num_chunks: int
) -> bytes:
    """The associated data of chunk `index` of `num_chunks` (see the module docstring)."""
    parts = [FORMAT.encode(), seal_id]
    for text in (model_id, file_name):
        raw = text.encode()
        parts += [struct.pack(">I", len(raw)), raw]
    parts.append(struct.pack(">QQ", index, num_chunks))
    return b"".join(parts)


def chunk_nonce(context: bytes) -> bytes:
    """The 96-bit GCM nonce of the chunk whose associated data is `context`."""
    return hashlib.sha256(b"nonce" + context).digest()[:12]


def key_check(data_key: bytes, seal_id: bytes) -> bytes:
    """The manifest's commitment to the data key (see the module docstring)."""
    return hmac.digest(data_key, FORMAT.encode() + b" key check" + seal_id, "sha256")


def verify_data_key(data_key: bytes, seal_id: bytes, expected_check: bytes) -> None:
    """Raise DataKeyMismatchError unless `data_key` is the key the manifest commits to."""
    if len(data_key) != DATA_KEY_SIZE:
        raise DataKeyMismatchError(
            f"a data key must be {DATA_KEY_SIZE} bytes, this one is {len(data_key)}: "
            "the key provider returned something that is not an AES-256 key"
        )
    if not hmac.compare_digest(key_check(data_key, seal_id), expected_check):
        raise DataKeyMismatchError(
            "the released data key is not the key this model was sealed with "
            "(check the manifest's key_id against the key provider's key)"
        )


def encrypt_chunk_into(
    data_key: bytes, context: bytes, plaintext: memoryview, out: memoryview
) -> None:
    """Encrypt `plaintext` into `out` (len(plaintext) + 16 bytes: ciphertext, then tag)."""
    if len(out) != len(plaintext) + TAG_SIZE:
        raise ValueError("the output of a chunk holds its ciphertext and a 16-byte tag")
    encryptor = Cipher(algorithms.AES(data_key), modes.GCM(chunk_nonce(context))).encryptor()
    encryptor.authenticate_additional_data(context)
    written = encryptor.update_into(plaintext, out[: len(plaintext)])
    encryptor.finalize()
    assert written == len(plaintext)  # GCM is a stream mode: update writes everything
    out[len(plaintext) :] = encryptor.tag


def decrypt_chunk_into(
    data_key: bytes, context: bytes, sealed: memoryview, out: memoryview, where: str
) -> None:
    """Decrypt a sealed chunk (ciphertext ‖ tag) into `out`, which must be exactly as long as the
    ciphertext. Raises ChunkAuthenticationError naming `where` if the tag does not verify;
    `out` then holds unauthenticated bytes, which the caller must discard (zero).

    `update_into` writes straight into `out` and releases the GIL while it runs, so several
    threads decrypt several chunks at once without copies.
    """
    if len(sealed) != len(out) + TAG_SIZE:
        raise ChunkAuthenticationError(f"{where} has {len(sealed)} bytes, expected {len(out) + 16}")
    tag = bytes(sealed[len(out) :])
    decryptor = Cipher(algorithms.AES(data_key), modes.GCM(chunk_nonce(context), tag)).decryptor()
    decryptor.authenticate_additional_data(context)
    decryptor.update_into(sealed[: len(out)], out)
    try:
        decryptor.finalize()
    except InvalidTag:
        raise ChunkAuthenticationError(
            f"{where} failed authentication: it was altered, moved from another position, "
            "file or seal, or cut short; re-copy the sealed model from its source"
        ) from None

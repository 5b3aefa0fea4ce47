"""The chunk cipher against a naive reference written from the format's text (the module
docstring of attestation.sealed.chunks), and the bindings that make a moved chunk fail."""

from __future__ import annotations

import hashlib
import os
import struct

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from attestation.sealed.chunks import (
    TAG_SIZE,
    chunk_context,
    decrypt_chunk_into,
    encrypt_chunk_into,
    num_chunks_of,
    sealed_size_of,
)
from attestation.sealed.errors import ChunkAuthenticationError

KEY = bytes(range(32))
SEAL_ID = bytes(range(100, 116))


def _reference_context(model_id: str, file_name: str, index: int, count: int) -> bytes:
    def lp(text: str) -> bytes:
        return struct.pack(">I", len(text.encode())) + text.encode()

    return (
        b"inferno-sealed-model/1" + SEAL_ID + lp(model_id) + lp(file_name)
        + struct.pack(">Q", index) + struct.pack(">Q", count)
    )  # fmt: skip


def _buffer(size: int) -> memoryview:
    return memoryview(bytearray(size))


def _seal(plaintext: bytes, context: bytes) -> bytes:
    out = memoryview(bytearray(len(plaintext) + TAG_SIZE))
    encrypt_chunk_into(KEY, context, memoryview(plaintext), out)
    return bytes(out)


def test_a_chunk_is_aes_gcm_with_the_documented_nonce_and_aad() -> None:
    plaintext = os.urandom(1000)
    context = _reference_context("acme/m", "model.safetensors", 3, 9)
    assert chunk_context(SEAL_ID, "acme/m", "model.safetensors", 3, 9) == context
    nonce = hashlib.sha256(b"nonce" + context).digest()[:12]
    assert _seal(plaintext, context) == AESGCM(KEY).encrypt(nonce, plaintext, context)


@pytest.mark.parametrize(
    "moved",
    [
        ("acme/m", "model.safetensors", 4, 9),  # another position
        ("acme/m", "model.safetensors", 3, 8),  # a file cut short: the count differs
        ("acme/m", "other.safetensors", 3, 9),  # another file
        ("acme/n", "model.safetensors", 3, 9),  # another model
        ("acme/", "mmodel.safetensors", 3, 9),  # the same bytes split otherwise
    ],
)
def test_a_chunk_does_not_open_anywhere_else(moved: tuple[str, str, int, int]) -> None:
    sealed = _seal(b"weights" * 100, chunk_context(SEAL_ID, "acme/m", "model.safetensors", 3, 9))
    elsewhere = chunk_context(SEAL_ID, *moved)
    with pytest.raises(ChunkAuthenticationError, match="chunk X failed authentication"):
        decrypt_chunk_into(KEY, elsewhere, memoryview(sealed), _buffer(700), "chunk X")


def test_a_chunk_of_another_seal_does_not_open() -> None:
    context = chunk_context(SEAL_ID, "acme/m", "model.safetensors", 0, 1)
    sealed = _seal(b"w" * 64, context)
    other_seal = chunk_context(bytes(16), "acme/m", "model.safetensors", 0, 1)
    with pytest.raises(ChunkAuthenticationError):
        decrypt_chunk_into(KEY, other_seal, memoryview(sealed), memoryview(bytearray(64)), "c")


def test_a_chunk_with_a_cut_tag_is_refused() -> None:
    context = chunk_context(SEAL_ID, "m", "f.safetensors", 0, 1)
    sealed = _seal(b"w" * 64, context)[:-1]
    with pytest.raises(ChunkAuthenticationError, match="has 79 bytes, expected 80"):
        decrypt_chunk_into(KEY, context, memoryview(sealed), memoryview(bytearray(64)), "c")


@pytest.mark.parametrize(
    ("size", "chunk_size", "num_chunks"),
    [(0, 4096, 1), (1, 4096, 1), (4096, 4096, 1), (4097, 4096, 2), (10 * 4096, 4096, 10)],
)
def test_chunk_counts_and_sealed_sizes(size: int, chunk_size: int, num_chunks: int) -> None:
    assert num_chunks_of(size, chunk_size) == num_chunks
    assert sealed_size_of(size, chunk_size) == size + TAG_SIZE * num_chunks

"""Opening and decrypting a sealed model: the round trip, and a hostile corpus named by defect,
each refused at its step with a clear error (attestation.sealed.model, steps 1-5)."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from safetensors.torch import load, load_file

from attestation.errors import SealedModelError
from attestation.sealed import SealedModel
from attestation.sealed.chunks import TAG_SIZE
from attestation.sealed.errors import (
    ChunkAuthenticationError,
    DataKeyMismatchError,
    ManifestSignatureError,
    SealedFileError,
)
from tests.attestation.sealed.conftest import CHUNK_SIZE, SealedFixture, flip_bit, seal

SHARD_1 = "model-00001-of-00002.safetensors"
SHARD_2 = "model-00002-of-00002.safetensors"
STRIDE = CHUNK_SIZE + TAG_SIZE


def _open(fixture: SealedFixture) -> SealedModel:
    return SealedModel.open(fixture.sealed, manifest_key=fixture.public_key)


def _swap_chunks(path_a: Path, index_a: int, path_b: Path, index_b: int) -> None:
    with path_a.open("r+b") as a, path_b.open("r+b") as b:
        a.seek(index_a * STRIDE)
        chunk_a = a.read(STRIDE)
        b.seek(index_b * STRIDE)
        chunk_b = b.read(STRIDE)
        a.seek(index_a * STRIDE)
        a.write(chunk_b)
        b.seek(index_b * STRIDE)
        b.write(chunk_a)


# --- the round trip ---------------------------------------------------------------------------


def test_unsealing_round_trips_every_tensor_bit_for_bit(sealed: SealedFixture) -> None:
    weights = _open(sealed).decrypt_all(sealed.data_key, workers=3)
    assert set(weights) == {SHARD_1, SHARD_2}
    for name, plaintext in weights.items():
        original = load_file(sealed.source / name)
        unsealed = load(bytes(plaintext))
        assert unsealed.keys() == original.keys()
        for tensor_name, tensor in original.items():
            assert tensor.dtype == unsealed[tensor_name].dtype
            assert torch.equal(tensor, unsealed[tensor_name])
        assert plaintext == (sealed.source / name).read_bytes()


def test_the_sealed_directory_holds_no_plaintext_weight_bytes(sealed: SealedFixture) -> None:
    plaintext = (sealed.source / SHARD_1).read_bytes()
    stored = {path.name: path.read_bytes() for path in sealed.sealed.iterdir()}
    assert SHARD_1 not in stored
    assert SHARD_1 + ".sealed" in stored
    # No 64-byte window of the tensor data survives anywhere in the sealed directory.
    probe = plaintext[-64:]
    assert not any(probe in data for data in stored.values())


def test_non_weight_files_stay_plain_listed_and_digested(sealed: SealedFixture) -> None:
    config = (sealed.source / "config.json").read_bytes()
    assert (sealed.sealed / "config.json").read_bytes() == config
    entry = sealed.manifest.file("config.json")
    assert not entry.sealed
    assert entry.sha256 == hashlib.sha256(config).hexdigest()
    assert not (sealed.sealed / ".cache").exists()


def test_the_manifest_lists_plaintext_digests_of_the_weights(sealed: SealedFixture) -> None:
    for name in (SHARD_1, SHARD_2):
        entry = sealed.manifest.file(name)
        plaintext = (sealed.source / name).read_bytes()
        assert (entry.size, entry.sha256) == (len(plaintext), hashlib.sha256(plaintext).hexdigest())
        assert entry.num_chunks == -(-len(plaintext) // CHUNK_SIZE) > 1


@pytest.mark.parametrize("workers", [1, 2, 8])
def test_decrypt_into_fills_a_caller_buffer_of_any_element_type(
    sealed: SealedFixture, workers: int
) -> None:
    plaintext = (sealed.source / SHARD_2).read_bytes()
    # A numpy array stands in for pinned host memory: any writable contiguous buffer will do.
    buffer = np.full(len(plaintext), 0xAA, dtype=np.uint8)
    _open(sealed).decrypt_into(sealed.data_key, SHARD_2, memoryview(buffer), workers=workers)
    assert buffer.tobytes() == plaintext


def test_progress_reports_every_plaintext_byte_once(sealed: SealedFixture) -> None:
    done: list[int] = []
    _open(sealed).decrypt_all(sealed.data_key, workers=2, progress=done.append)
    assert sum(done) == sum(entry.size for entry in sealed.manifest.sealed_files)


def test_an_empty_weight_file_round_trips_as_one_empty_chunk(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    (source / "empty.safetensors").write_bytes(b"")
    fixture = seal(source, tmp_path / "sealed")
    assert fixture.manifest.file("empty.safetensors").num_chunks == 1
    assert (tmp_path / "sealed" / "empty.safetensors.sealed").stat().st_size == TAG_SIZE
    assert _open(fixture).decrypt_all(fixture.data_key) == {"empty.safetensors": bytearray()}


# --- step 1: the manifest's signature ---------------------------------------------------------


def test_open_rejects_a_manifest_signed_by_another_key(sealed: SealedFixture) -> None:
    other = Ed25519PrivateKey.generate().public_key()
    with pytest.raises(ManifestSignatureError, match="does not verify under the pinned"):
        SealedModel.open(sealed.sealed, manifest_key=other)


def test_open_rejects_a_manifest_with_one_flipped_bit(sealed: SealedFixture) -> None:
    body = (sealed.sealed / "manifest.json").read_bytes()
    flip_bit(sealed.sealed / "manifest.json", body.index(b'"size":') + 8)
    with pytest.raises(ManifestSignatureError):
        _open(sealed)


def test_open_rejects_a_directory_without_manifest(sealed: SealedFixture) -> None:
    (sealed.sealed / "manifest.json").unlink()
    with pytest.raises(ManifestSignatureError, match="not a sealed model directory"):
        _open(sealed)


def test_open_rejects_a_signature_that_is_not_base64(sealed: SealedFixture) -> None:
    (sealed.sealed / "manifest.sig").write_text("not base64!\n")
    with pytest.raises(ManifestSignatureError):
        _open(sealed)


# --- step 3: files present, sealed sizes exact, plain digests ---------------------------------


def test_open_rejects_a_sealed_file_truncated_by_whole_chunks(sealed: SealedFixture) -> None:
    path = sealed.sealed / (SHARD_1 + ".sealed")
    os.truncate(path, path.stat().st_size - STRIDE)
    with pytest.raises(SealedFileError, match="it was truncated"):
        _open(sealed)


def test_open_rejects_a_sealed_file_cut_inside_a_tag(sealed: SealedFixture) -> None:
    path = sealed.sealed / (SHARD_1 + ".sealed")
    os.truncate(path, path.stat().st_size - 1)
    with pytest.raises(SealedFileError, match="it was truncated"):
        _open(sealed)


def test_open_rejects_a_sealed_file_with_an_appended_chunk(sealed: SealedFixture) -> None:
    path = sealed.sealed / (SHARD_1 + ".sealed")
    with path.open("ab") as f:
        f.write(path.read_bytes()[:STRIDE])
    with pytest.raises(SealedFileError, match="it was extended"):
        _open(sealed)


def test_open_rejects_a_missing_weight_file(sealed: SealedFixture) -> None:
    (sealed.sealed / (SHARD_2 + ".sealed")).unlink()
    with pytest.raises(SealedFileError, match="listed in the manifest but missing"):
        _open(sealed)


def test_open_rejects_an_altered_plain_file(sealed: SealedFixture) -> None:
    (sealed.sealed / "config.json").write_text('{"architectures": ["Evil"]}\n')
    with pytest.raises(SealedFileError, match=r"config\.json"):
        _open(sealed)


def test_open_rejects_a_plain_file_of_the_same_size_but_other_content(
    sealed: SealedFixture,
) -> None:
    flip_bit(sealed.sealed / "tokenizer.json", 3)
    with pytest.raises(SealedFileError, match="does not match its digest"):
        _open(sealed)


def test_a_file_truncated_after_open_is_refused_at_decryption(sealed: SealedFixture) -> None:
    model = _open(sealed)
    path = sealed.sealed / (SHARD_1 + ".sealed")
    os.truncate(path, path.stat().st_size - STRIDE)
    with pytest.raises(SealedFileError, match="it was truncated"):
        model.decrypt_all(sealed.data_key)


# --- step 4: the data key ---------------------------------------------------------------------


def test_decrypt_rejects_a_wrong_data_key_before_any_chunk(sealed: SealedFixture) -> None:
    with pytest.raises(DataKeyMismatchError, match="not the key this model was sealed with"):
        _open(sealed).decrypt_all(os.urandom(32))


def test_decrypt_rejects_a_data_key_of_the_wrong_length(sealed: SealedFixture) -> None:
    with pytest.raises(DataKeyMismatchError, match="must be 32 bytes"):
        _open(sealed).decrypt_all(sealed.data_key[:16])


def test_decrypt_rejects_the_key_of_another_seal_of_the_same_model(
    sealed: SealedFixture, tmp_path: Path
) -> None:
    other = seal(sealed.source, tmp_path / "resealed")
    with pytest.raises(DataKeyMismatchError):
        _open(sealed).decrypt_all(other.data_key)


# --- step 5: every chunk authenticated --------------------------------------------------------


@pytest.mark.parametrize(
    ("where", "offset"),
    [
        ("ciphertext of chunk 0", 17),
        ("tag of chunk 0", CHUNK_SIZE + 3),
        ("ciphertext of chunk 1", STRIDE + 100),
        ("tag of the last chunk", -1),
    ],
)
def test_decrypt_rejects_a_flipped_bit(sealed: SealedFixture, where: str, offset: int) -> None:
    path = sealed.sealed / (SHARD_1 + ".sealed")
    flip_bit(path, offset % path.stat().st_size, bit=5)
    with pytest.raises(ChunkAuthenticationError, match=f"of {SHARD_1} failed authentication"):
        _open(sealed).decrypt_all(sealed.data_key)


def test_decrypt_rejects_two_chunks_swapped_within_a_file(sealed: SealedFixture) -> None:
    path = sealed.sealed / (SHARD_1 + ".sealed")
    _swap_chunks(path, 0, path, 1)
    with pytest.raises(ChunkAuthenticationError, match=r"chunk [01] of \d+ of model-00001"):
        _open(sealed).decrypt_all(sealed.data_key)


def test_decrypt_rejects_a_chunk_swapped_between_files(sealed: SealedFixture) -> None:
    _swap_chunks(sealed.sealed / (SHARD_1 + ".sealed"), 1, sealed.sealed / (SHARD_2 + ".sealed"), 1)
    with pytest.raises(ChunkAuthenticationError, match="chunk 1 of"):
        _open(sealed).decrypt_all(sealed.data_key)


def test_decrypt_rejects_two_whole_files_swapped(sealed: SealedFixture) -> None:
    a, b = sealed.sealed / (SHARD_1 + ".sealed"), sealed.sealed / (SHARD_2 + ".sealed")
    a.rename(sealed.sealed / "tmp")
    b.rename(a)
    (sealed.sealed / "tmp").rename(b)
    with pytest.raises(ChunkAuthenticationError):
        _open(sealed).decrypt_all(sealed.data_key)


def test_decrypt_rejects_the_same_chunk_from_another_model_id(
    sealed: SealedFixture, tmp_path: Path
) -> None:
    """Another model sealed under the same manifest key (and, by mistake, the same data key
    would not help either: the model id and seal id are in every nonce and AAD)."""
    other = seal(sealed.source, tmp_path / "other", model_id="acme/other")
    target = sealed.sealed / (SHARD_1 + ".sealed")
    with (other.sealed / (SHARD_1 + ".sealed")).open("rb") as f:
        foreign = f.read(STRIDE)
    with target.open("r+b") as f:
        f.write(foreign)
    with pytest.raises(ChunkAuthenticationError, match="chunk 0 of"):
        _open(sealed).decrypt_all(sealed.data_key)


def test_a_failed_decryption_leaves_the_buffer_zeroed(sealed: SealedFixture) -> None:
    path = sealed.sealed / (SHARD_1 + ".sealed")
    flip_bit(path, path.stat().st_size - 1)  # only the last chunk is bad
    size = sealed.manifest.file(SHARD_1).size
    buffer = bytearray(b"\xff" * size)
    with pytest.raises(ChunkAuthenticationError):
        _open(sealed).decrypt_into(sealed.data_key, SHARD_1, memoryview(buffer), workers=2)
    assert buffer == bytes(size)


def test_decrypt_into_rejects_a_buffer_of_the_wrong_size(sealed: SealedFixture) -> None:
    with pytest.raises(SealedModelError, match="its plaintext has"):
        _open(sealed).decrypt_into(sealed.data_key, SHARD_1, memoryview(bytearray(10)))


def test_decrypt_into_rejects_a_read_only_buffer(sealed: SealedFixture) -> None:
    size = sealed.manifest.file(SHARD_1).size
    with pytest.raises(SealedModelError, match="writable and contiguous"):
        _open(sealed).decrypt_into(sealed.data_key, SHARD_1, memoryview(bytes(size)))


def test_decrypt_into_refuses_a_plain_file(sealed: SealedFixture) -> None:
    with pytest.raises(SealedModelError, match="plain file"):
        _open(sealed).decrypt_into(sealed.data_key, "config.json", memoryview(bytearray(1)))


def test_sealing_refuses_a_non_empty_destination(sealed: SealedFixture) -> None:
    with pytest.raises(SealedModelError, match="not empty"):
        seal(sealed.source, sealed.sealed)


def test_sealing_refuses_a_directory_without_weights(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text("{}")
    with pytest.raises(SealedModelError, match=r"no \*\.safetensors"):
        seal(tmp_path / "src", tmp_path / "out")


def test_sealing_refuses_a_nested_directory(sealed: SealedFixture, tmp_path: Path) -> None:
    source = tmp_path / "nested"
    shutil.copytree(sealed.source, source)
    (source / "sub").mkdir()
    with pytest.raises(SealedModelError, match="flat directory"):
        seal(source, tmp_path / "out")


def test_the_chunk_reader_decrypts_single_chunks(sealed: SealedFixture) -> None:
    plaintext = (sealed.source / SHARD_2).read_bytes()
    with _open(sealed).chunk_reader(sealed.data_key) as reader:
        start, length = reader.chunk_span(SHARD_2, 1)
        out = bytearray(length)
        reader.decrypt_chunk_into(SHARD_2, 1, memoryview(out))
        assert (start, bytes(out)) == (CHUNK_SIZE, plaintext[CHUNK_SIZE : CHUNK_SIZE + length])
        with pytest.raises(SealedModelError, match="has no sealed chunk 99"):
            reader.chunk_span(SHARD_2, 99)


def test_the_chunk_reader_checks_the_key_first(sealed: SealedFixture) -> None:
    with pytest.raises(DataKeyMismatchError), _open(sealed).chunk_reader(os.urandom(32)):
        pass


@pytest.mark.parametrize(
    "name", ["generation_config.json", "model.safetensors", ".hidden", "extra.safetensors.sealed"]
)
def test_open_rejects_an_unlisted_file(sealed: SealedFixture, name: str) -> None:
    (sealed.sealed / name).write_text("{}")
    with pytest.raises(SealedFileError, match="does not list"):
        _open(sealed)

"""A small model directory (two weight shards, a config, a tokenizer), sealed in chunks of 4 KiB
so that every file spans several chunks and the tamper tests have chunks to move around."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from safetensors.torch import save_file

from attestation.sealed import SealedManifest, seal_model

CHUNK_SIZE = 4096


@dataclass
class SealedFixture:
    source: Path
    sealed: Path
    manifest: SealedManifest
    data_key: bytes
    signing_key: Ed25519PrivateKey

    @property
    def public_key(self) -> Ed25519PublicKey:
        return self.signing_key.public_key()


class RecordingWrapper:
    """A stand-in for a key provider's wrap_data_key that keeps the data key for the test."""

    def __init__(self) -> None:
        self.data_key = b""

    def __call__(self, key_id: str, data_key: bytes) -> bytes:
        self.data_key = data_key
        return b"wrapped:" + key_id.encode()


def write_model(directory: Path) -> Path:
    directory.mkdir(parents=True)
    generator = torch.Generator().manual_seed(7)
    # Two shards of equal size, so that a chunk swapped between them has the right length.
    save_file(
        {"a.weight": torch.randn(128, 64, generator=generator).to(torch.bfloat16),
         "a.bias": torch.randn(64, generator=generator)},
        directory / "model-00001-of-00002.safetensors",
    )  # fmt: skip
    save_file(
        {"b.weight": torch.randn(128, 64, generator=generator).to(torch.bfloat16),
         "b.bias": torch.randn(64, generator=generator)},
        directory / "model-00002-of-00002.safetensors",
    )  # fmt: skip
    (directory / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}\n')
    (directory / "tokenizer.json").write_text('{"model": {}}\n')
    (directory / ".cache").mkdir()  # hidden: skipped by the sealer
    return directory


def seal(source: Path, out: Path, *, model_id: str = "acme/llama-test") -> SealedFixture:
    signing_key = Ed25519PrivateKey.generate()
    wrapper = RecordingWrapper()
    manifest = seal_model(
        source,
        out,
        model_id=model_id,
        key_id="kek-1",
        wrap_data_key=wrapper,
        signing_key=signing_key,
        chunk_size=CHUNK_SIZE,
        workers=2,
    )
    return SealedFixture(source, out, manifest, wrapper.data_key, signing_key)


@pytest.fixture
def sealed(tmp_path: Path) -> SealedFixture:
    return seal(write_model(tmp_path / "src"), tmp_path / "sealed")


def flip_bit(path: Path, offset: int, bit: int = 0) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))

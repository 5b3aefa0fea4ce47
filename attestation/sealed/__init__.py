"""Sealed models: a signed manifest and AES-256-GCM chunked weight files (see `manifest` for the
directory layout, `chunks` for the cipher, `model` to open and decrypt, `writer` to seal)."""

from attestation.sealed.manifest import (
    ManifestFile,
    SealedManifest,
    load_manifest_public_key,
    load_manifest_signing_key,
)
from attestation.sealed.model import ChunkReader, SealedModel, default_workers
from attestation.sealed.writer import DEFAULT_CHUNK_SIZE, seal_model, source_files

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "ChunkReader",
    "ManifestFile",
    "SealedManifest",
    "SealedModel",
    "default_workers",
    "load_manifest_public_key",
    "load_manifest_signing_key",
    "seal_model",
    "source_files",
]

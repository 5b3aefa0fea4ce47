"""Seal a model directory: the sealer's side of the format (attestation.sealed.manifest).

Run where the plaintext model already is (the vendor's or the security team's machine), never on
the appliance. A fresh random data key and seal id are drawn for every seal; the data key is
wrapped by the key provider (`wrap_data_key(key_id, data_key)`) and only its wrapped form is
written. The manifest is written last, so an interrupted seal leaves a directory that no
appliance opens.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from attestation.errors import SealedModelError
from attestation.sealed.chunks import (
    DATA_KEY_SIZE,
    SEAL_ID_SIZE,
    TAG_SIZE,
    chunk_context,
    encrypt_chunk_into,
    key_check,
    num_chunks_of,
)
from attestation.sealed.manifest import (
    MANIFEST_NAME,
    MAX_CHUNK_SIZE,
    MIN_CHUNK_SIZE,
    SIGNATURE_NAME,
    ManifestFile,
    SealedManifest,
)

DEFAULT_CHUNK_SIZE = 16 << 20
WrapDataKey = Callable[[str, bytes], bytes]


def source_files(source_dir: Path) -> list[Path]:
    """The files of `source_dir` that a seal covers: every regular top-level file (symbolic links
    followed, as in a Hugging Face cache), hidden names skipped. Raises SealedModelError for a
    subdirectory (the format is flat) or a directory without *.safetensors."""
    source_dir = Path(source_dir)
    if not source_dir.is_dir():
        raise SealedModelError(f"{source_dir} is not a model directory")
    files = []
    for path in sorted(source_dir.iterdir(), key=lambda p: p.name):
        if path.name.startswith("."):
            continue
        if not path.is_file():
            raise SealedModelError(
                f"{path} is not a regular file: a sealed model is a flat directory"
            )
        files.append(path)
    if not any(path.name.endswith(".safetensors") for path in files):
        raise SealedModelError(f"{source_dir} holds no *.safetensors weight file to seal")
    return files


def seal_model(
    source_dir: Path,
    out_dir: Path,
    *,
    model_id: str,
    key_id: str,
    wrap_data_key: WrapDataKey,
    signing_key: Ed25519PrivateKey,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    workers: int = 4,
    progress: Callable[[int], None] | None = None,
) -> SealedManifest:
    """Seal `source_dir` into the new or empty directory `out_dir` and return the manifest.

    *.safetensors files are encrypted in chunks; every other file is copied in the clear and
    listed with its digest. `progress` is called with the number of plaintext bytes of each
    piece done. Raises SealedModelError for an unusable source or destination, and whatever the
    key provider raises (KeyReleaseError) if it cannot wrap the key.
    """
    if not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE:
        raise SealedModelError(f"chunk size must be in [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}]")
    files = source_files(source_dir)
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise SealedModelError(f"{out_dir} is not empty: seal into a new directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    data_key = os.urandom(DATA_KEY_SIZE)
    seal_id = os.urandom(SEAL_ID_SIZE)
    workers = max(1, workers)
    # SHA-256 of a file is one sequential pass (about 1-2 GB/s), so files are read and hashed
    # concurrently, one thread each, while their chunks are encrypted on the shared pool.
    with (
        ThreadPoolExecutor(max_workers=workers, thread_name_prefix="seal") as pool,
        ThreadPoolExecutor(max_workers=workers, thread_name_prefix="seal-file") as readers,
    ):
        slots = threading.BoundedSemaphore(2 * workers)
        sealer = _FileSealer(pool, slots, data_key, seal_id, model_id, chunk_size)
        futures = [
            readers.submit(sealer.seal, path, out_dir, progress)
            if path.name.endswith(".safetensors")
            else readers.submit(_copy_plain, path, out_dir, progress)
            for path in files
        ]
        entries = [future.result() for future in futures]
    manifest = SealedManifest(
        model_id=model_id,
        seal_id=seal_id,
        key_id=key_id,
        wrapped_key=wrap_data_key(key_id, data_key),
        key_check=key_check(data_key, seal_id),
        chunk_size=chunk_size,
        files=tuple(entries),
    )
    body, signature = manifest.sign(signing_key)
    (out_dir / SIGNATURE_NAME).write_bytes(signature)
    (out_dir / MANIFEST_NAME).write_bytes(body)
    return manifest


def _copy_plain(path: Path, out_dir: Path, progress: Callable[[int], None] | None) -> ManifestFile:
    with path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    shutil.copyfile(path, out_dir / path.name)
    size = (out_dir / path.name).stat().st_size
    if progress is not None:
        progress(size)
    return ManifestFile(path.name, size, digest, sealed=False)


@dataclass(frozen=True, slots=True)
class _FileSealer:
    """Seals weight files of one model under one data key, chunks encrypted on `pool`."""

    pool: ThreadPoolExecutor
    # Chunks read but not yet written, across all files: at most 2 × workers in memory.
    slots: threading.BoundedSemaphore
    data_key: bytes
    seal_id: bytes
    model_id: str
    chunk_size: int

    def seal(
        self, path: Path, out_dir: Path, progress: Callable[[int], None] | None
    ) -> ManifestFile:
        """Read `path` once, in order, hashing the plaintext; encrypt its chunks on the pool,
        each written at its own offset."""
        size = path.stat().st_size
        chunk_size = self.chunk_size
        num_chunks = num_chunks_of(size, chunk_size)
        digest = hashlib.sha256()
        pending: list[Future[None]] = []
        with path.open("rb") as source, (out_dir / (path.name + ".sealed")).open("wb") as sink:
            out_fd = sink.fileno()

            def encrypt(index: int, plaintext: memoryview) -> None:
                try:
                    sealed = memoryview(bytearray(len(plaintext) + TAG_SIZE))
                    context = chunk_context(
                        self.seal_id, self.model_id, path.name, index, num_chunks
                    )
                    encrypt_chunk_into(self.data_key, context, plaintext, sealed)
                    os.pwrite(out_fd, sealed, index * (chunk_size + TAG_SIZE))
                    if progress is not None:
                        progress(len(plaintext))
                finally:
                    self.slots.release()

            try:
                for index in range(num_chunks):
                    length = min(chunk_size, size - index * chunk_size)
                    plaintext = memoryview(bytearray(length))
                    if source.readinto(plaintext) != length:
                        raise SealedModelError(f"{path} changed size while it was being sealed")
                    digest.update(plaintext)
                    self.slots.acquire()
                    pending.append(self.pool.submit(encrypt, index, plaintext))
                    pending = [future for future in pending if not _finished(future)]
            finally:
                # No chunk may still be writing once `sink` closes and its descriptor is reused.
                wait(pending)
            for future in pending:
                future.result()
            if source.read(1):
                raise SealedModelError(f"{path} changed size while it was being sealed")
        return ManifestFile(path.name, size, digest.hexdigest(), sealed=True, num_chunks=num_chunks)


def _finished(future: Future[None]) -> bool:
    """True once `future` is done; re-raises its error so a failed chunk stops the seal."""
    if future.done():
        future.result()
        return True
    return False

"""Open a sealed model directory and decrypt its weights into memory (the IO edge of the format).

    model = SealedModel.open(directory, manifest_key=public_key)     # steps 1-3
    weights = model.decrypt_all(data_key, workers=8)                  # steps 4-5

Opening, in order (each step has its own error, attestation.sealed.errors):
  1. manifest.json and manifest.sig exist and the signature verifies under the pinned key;
  2. the manifest parses strictly (attestation.sealed.manifest);
  3. every listed file is there: each sealed file has exactly the size its chunks need (so a
     truncated or extended file is named before any decryption), each plain file the listed
     size and SHA-256; and nothing else is there (an unlisted generation_config.json, say,
     would otherwise be read by the engine unsigned).
Decrypting, in order:
  4. the data key is the one the manifest commits to (`key_check`);
  5. every chunk decrypts, in parallel threads, straight into the caller's buffer, and its tag
     verifies. On any failure every buffer of the call is zeroed before the error is raised,
     so no unauthenticated plaintext survives. Nothing is written to disk.

The plaintext SHA-256 of sealed files is not recomputed on decryption (that would be one
sequential pass per file, seconds for an 8B model): the GCM tags under the data key, which
only the sealer and an attested appliance hold, authenticate every byte instead.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from attestation.errors import SealedModelError
from attestation.sealed.chunks import (
    TAG_SIZE,
    chunk_context,
    decrypt_chunk_into,
    sealed_size_of,
    verify_data_key,
)
from attestation.sealed.errors import ManifestSignatureError, SealedFileError
from attestation.sealed.manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    SIGNATURE_NAME,
    ManifestFile,
    SealedManifest,
)


def default_workers() -> int:
    """Decryption threads when the caller does not say: one per CPU, at most 16."""
    return max(1, min(16, os.cpu_count() or 1))


@dataclass(frozen=True, slots=True)
class SealedModel:
    """A sealed model directory whose manifest verified and whose files are all present."""

    directory: Path
    manifest: SealedManifest

    @classmethod
    def open(cls, directory: Path, *, manifest_key: Ed25519PublicKey) -> SealedModel:
        """Steps 1-3 of the module docstring. Raises a SealedModelError subclass naming the
        step that failed."""
        directory = Path(directory)
        body = _read_small(directory / MANIFEST_NAME)
        signature = _read_small(directory / SIGNATURE_NAME)
        manifest = SealedManifest.verify_and_parse(body, signature, manifest_key)
        for entry in manifest.files:
            _check_present(directory, entry, manifest.chunk_size)
        _check_nothing_unlisted(directory, manifest)
        return cls(directory, manifest)

    def decrypt_into(
        self,
        data_key: bytes,
        file_name: str,
        buffer: memoryview,
        *,
        workers: int | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        """Decrypt sealed file `file_name` into `buffer` (writable, contiguous, exactly the
        plaintext size). Steps 4-5 of the module docstring."""
        self.decrypt_files(data_key, {file_name: buffer}, workers=workers, progress=progress)

    def decrypt_all(
        self,
        data_key: bytes,
        *,
        workers: int | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> dict[str, bytearray]:
        """Every sealed file, decrypted into a new bytearray each, by plaintext name."""
        buffers = {entry.name: bytearray(entry.size) for entry in self.manifest.sealed_files}
        self.decrypt_files(
            data_key,
            {name: memoryview(buffer) for name, buffer in buffers.items()},
            workers=workers,
            progress=progress,
        )
        return buffers

    def decrypt_files(
        self,
        data_key: bytes,
        buffers: Mapping[str, memoryview],
        *,
        workers: int | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        """Decrypt several sealed files at once, each into its buffer, all chunks of all files
        sharing one pool of `workers` threads. `progress`, if given, is called with the number
        of plaintext bytes of each chunk once it is authenticated (from worker threads)."""
        targets = {name: (self.manifest.file(name), _byte_view(name, buffer)) for name, buffer
                   in buffers.items()}  # fmt: skip
        for name, (entry, view) in targets.items():
            if not entry.sealed:
                raise SealedModelError(f"{name} is a plain file of the model, not a sealed one")
            if len(view) != entry.size:
                raise SealedModelError(
                    f"the buffer for {name} has {len(view)} bytes, its plaintext has {entry.size}"
                )
        with self.chunk_reader(data_key) as reader:
            jobs = []
            for name, (entry, view) in targets.items():
                for index in range(entry.num_chunks):
                    start, length = reader.chunk_span(name, index)
                    jobs.append((name, index, view[start : start + length]))
            try:
                _run_all(reader, jobs, workers or default_workers(), progress)
            except BaseException:
                for _, view in targets.values():
                    _zero(view, self.manifest.chunk_size)
                raise

    @contextmanager
    def chunk_reader(self, data_key: bytes) -> Iterator[ChunkReader]:
        """Step 4, then a reader that decrypts single chunks (for callers that stream chunks
        elsewhere, such as through pinned staging buffers to a GPU). The files' sizes are
        checked again and they stay mapped for as long as the context lasts."""
        verify_data_key(data_key, self.manifest.seal_id, self.manifest.key_check)
        maps: dict[str, mmap.mmap] = {}
        try:
            for entry in self.manifest.sealed_files:
                path = self.directory / entry.stored_name
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError as exc:
                    raise SealedFileError(f"cannot open {path}: {exc.strerror}") from exc
                try:
                    size = os.fstat(fd).st_size
                    _check_sealed_size(path, size, entry, self.manifest.chunk_size)
                    maps[entry.name] = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
                except OSError as exc:
                    raise SealedFileError(f"cannot map {path}: {exc.strerror}") from exc
                finally:
                    os.close(fd)
            yield ChunkReader(self.manifest, data_key, maps)
        finally:
            for mapped in maps.values():
                mapped.close()


class ChunkReader:
    """Decrypts one chunk at a time (step 5); safe to call from several threads at once. Made
    by `SealedModel.chunk_reader`, valid inside its context only.

    Each chunk is decrypted straight from the file's pages in the page cache (the files are
    memory-mapped): with the chunk read into a buffer first, each byte crossed memory three
    times before its plaintext was written, and the ring's decryption to a GPU was bound by
    that (docs/BENCHMARKS.md, round 11). As with any mapped file (safetensors' own loading
    included), a file cut short by another process while it is being decrypted ends this one
    with SIGBUS rather than an error; its size is checked when the context opens."""

    def __init__(self, manifest: SealedManifest, data_key: bytes, maps: Mapping[str, mmap.mmap]):
        self.manifest = manifest
        self._data_key = data_key
        self._maps = maps

    def chunk_span(self, file_name: str, index: int) -> tuple[int, int]:
        """(offset, length) of chunk `index` of `file_name` in the plaintext."""
        entry = self.manifest.file(file_name)
        if not entry.sealed or not 0 <= index < entry.num_chunks:
            raise SealedModelError(f"{file_name} has no sealed chunk {index}")
        start = index * self.manifest.chunk_size
        return start, min(self.manifest.chunk_size, entry.size - start)

    def decrypt_chunk_into(self, file_name: str, index: int, out: memoryview) -> None:
        """Decrypt chunk `index` of `file_name` into `out` (exactly its length). On
        ChunkAuthenticationError `out` holds unauthenticated bytes: the caller must zero it."""
        chunk_size = self.manifest.chunk_size
        entry = self.manifest.file(file_name)
        _, length = self.chunk_span(file_name, index)
        where = f"chunk {index} of {entry.num_chunks} of {entry.name}"
        start = index * (chunk_size + TAG_SIZE)
        context = chunk_context(
            self.manifest.seal_id, self.manifest.model_id, entry.name, index, entry.num_chunks
        )
        out = _byte_view(file_name, out)
        end = start + length + TAG_SIZE
        with memoryview(self._maps[file_name]) as whole, whole[start:end] as sealed:
            decrypt_chunk_into(self._data_key, context, sealed, out, where)


def _run_all(
    reader: ChunkReader,
    jobs: list[tuple[str, int, memoryview]],
    workers: int,
    progress: Callable[[int], None] | None,
) -> None:
    """Decrypt every (file, chunk, destination) job on a pool; the first error stops the rest."""
    failed = threading.Event()

    def decrypt(name: str, index: int, out: memoryview) -> None:
        if failed.is_set():
            return
        try:
            reader.decrypt_chunk_into(name, index, out)
        except BaseException:
            failed.set()
            raise
        if progress is not None:
            progress(len(out))

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="unseal") as pool:
        futures = [pool.submit(decrypt, *job) for job in jobs]
        wait(futures, return_when=FIRST_EXCEPTION)
        for future in futures:
            future.cancel()
        # After a failure, the remaining chunks are cancelled or return at once; the pool's
        # exit waits for those in flight before the caller zeroes the buffers.
        errors = (future.exception() for future in futures if not future.cancelled())
        first = next((error for error in errors if error is not None), None)
        if first is not None:
            raise first


def _read_small(path: Path) -> bytes:
    try:
        with path.open("rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise ManifestSignatureError(
            f"{path} does not exist: this is not a sealed model directory"
        ) from None
    except OSError as exc:
        raise ManifestSignatureError(f"cannot read {path}: {exc.strerror}") from exc
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestSignatureError(f"{path} is larger than any manifest")
    return data


def _check_nothing_unlisted(directory: Path, manifest: SealedManifest) -> None:
    listed = {entry.stored_name for entry in manifest.files} | {MANIFEST_NAME, SIGNATURE_NAME}
    try:
        present = {path.name for path in directory.iterdir()}
    except OSError as exc:
        raise SealedFileError(f"cannot list {directory}: {exc.strerror}") from exc
    unlisted = sorted(present - listed)
    if unlisted:
        raise SealedFileError(
            f"{directory} holds files its manifest does not list ({', '.join(unlisted[:5])}): "
            "remove them, or re-copy the sealed model from its source"
        )


def _check_present(directory: Path, entry: ManifestFile, chunk_size: int) -> None:
    path = directory / entry.stored_name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise SealedFileError(f"{path} is listed in the manifest but missing") from None
    except OSError as exc:
        raise SealedFileError(f"cannot stat {path}: {exc.strerror}") from exc
    if entry.sealed:
        _check_sealed_size(path, size, entry, chunk_size)
        return
    if size != entry.size:
        raise SealedFileError(f"{path} has {size} bytes, the manifest lists {entry.size}")
    try:
        with path.open("rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
    except OSError as exc:
        raise SealedFileError(f"cannot read {path}: {exc.strerror}") from exc
    if digest != entry.sha256:
        raise SealedFileError(f"{path} does not match its digest in the manifest (altered)")


def _check_sealed_size(path: Path, size: int, entry: ManifestFile, chunk_size: int) -> None:
    expected = sealed_size_of(entry.size, chunk_size)
    if size != expected:
        change = "truncated" if size < expected else "extended"
        raise SealedFileError(
            f"{path} has {size} bytes where its {entry.num_chunks} chunks need {expected}: "
            f"it was {change}; re-copy the sealed model from its source"
        )


def _byte_view(name: str, buffer: memoryview) -> memoryview:
    view = memoryview(buffer)
    if view.readonly or not view.c_contiguous:
        raise SealedModelError(f"the buffer for {name} must be writable and contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _zero(view: memoryview, chunk_size: int) -> None:
    zeros = bytes(min(chunk_size, len(view)))
    for start in range(0, len(view), chunk_size):
        end = min(start + chunk_size, len(view))
        view[start:end] = zeros[: end - start]

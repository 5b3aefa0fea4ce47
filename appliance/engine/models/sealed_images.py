"""A sealed model's weight files, decrypted one at a time into memory on the target device.

`SealedImages` is the `weights` mapping `load_model` takes: file name -> the plaintext
safetensors image as a uint8 tensor, decrypted when the loader asks for it (the loader takes one
file at a time, so only one image is alive at a time, next to the model).

On a GPU the plaintext goes through a ring of pinned host chunks instead of one pinned buffer
per file: pinning host memory runs at about 1 GB/s (measured on an H200 host: 14 s for 16 GB),
so the ring is kept small (2 × workers chunks) and allocated once. It needs no key, so it can be
allocated ahead of time, while attestation runs (a `StagingRing` passed in, or `prepare()`).
Worker threads decrypt chunk i into slot i mod S while the copy engine moves earlier slots to
the device image; a slot is reused only after its copy's event has completed. On any failure
the ring and the partial device image are zeroed before the error propagates; `close()` zeroes
the ring. On the CPU each file is decrypted straight into its image (no ring), unless
`staging=True` (tests).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType

import torch

from attestation.sealed import ChunkReader, SealedModel, default_workers


class SealedImages(Mapping[str, torch.Tensor]):
    """Plaintext images of `sealed`'s weight files on `device` (see the module docstring).
    Each access decrypts again; SealedModelError propagates from a wrong key or bad chunk.
    Use as a context manager (or call `close()`) so that the staging ring is wiped."""

    def __init__(
        self,
        sealed: SealedModel,
        data_key: bytes,
        device: torch.device,
        *,
        workers: int | None = None,
        staging: bool | None = None,
        ring: StagingRing | None = None,
    ) -> None:
        """`ring`, if given, is a staging ring allocated beforehand (for `workers` threads and
        at least this model's chunk size); it is wiped, not freed, at close."""
        self._sealed = sealed
        self._data_key = data_key
        self._device = torch.device(device)
        self._workers = workers or default_workers()
        # Anything but the CPU is reached through the staging ring; on the CPU it is optional.
        self._staging = self._device.type != "cpu" or bool(staging)
        self._names = sorted(entry.name for entry in sealed.manifest.sealed_files)
        if ring is not None and ring.chunk_size < sealed.manifest.chunk_size:
            raise ValueError("the staging ring's chunks are smaller than the model's")
        self._ring = ring

    def prepare(self) -> None:
        """Allocate the staging ring now rather than at the first file."""
        if self._staging and self._ring is None:
            self._ring = StagingRing(
                self._sealed.manifest.chunk_size,
                self._workers,
                pinned=self._device.type == "cuda",
            )

    def close(self) -> None:
        """Zero and release the staging ring (it held plaintext chunks)."""
        if self._ring is not None:
            self._ring.clear()
            self._ring = None

    def __enter__(self) -> SealedImages:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        size = self._sealed.manifest.file(name).size
        image = torch.empty(size, dtype=torch.uint8, device=self._device)
        if not self._staging:
            view = memoryview(image.numpy())
            self._sealed.decrypt_into(self._data_key, name, view, workers=self._workers)
            return image
        self.prepare()
        assert self._ring is not None
        with self._sealed.chunk_reader(self._data_key) as reader:
            self._ring.copy(reader, name, image)
        return image


class StagingRing:
    """2 × `workers` host chunks (pinned for a GPU) through which chunks reach device images."""

    def __init__(self, chunk_size: int, workers: int, *, pinned: bool) -> None:
        self.chunk_size = chunk_size
        self.workers = workers
        self.pinned = pinned
        self.slots = [
            torch.empty(chunk_size, dtype=torch.uint8, pin_memory=pinned)
            for _ in range(2 * workers)
        ]
        self.copied: list[torch.cuda.Event | None] = [None] * len(self.slots)

    def copy(self, reader: ChunkReader, name: str, image: torch.Tensor) -> None:
        """Decrypt every chunk of `name` through the ring into `image` (its plaintext size).
        On failure, zero the ring and `image`, then raise."""
        num_chunks = reader.manifest.file(name).num_chunks
        # In flight, oldest first: (chunk index, slot, decryption future).
        pending: deque[tuple[int, int, Future[None]]] = deque()
        with ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="unseal") as pool:
            try:
                for index in range(num_chunks):
                    slot = index % len(self.slots)
                    if len(pending) == len(self.slots):
                        self._copy_out(reader, name, image, *pending.popleft())
                    event = self.copied[slot]
                    if event is not None:
                        event.synchronize()  # the slot's last copy has landed
                    _, length = reader.chunk_span(name, index)
                    out = memoryview(self.slots[slot].numpy())[:length]
                    pending.append(
                        (index, slot, pool.submit(reader.decrypt_chunk_into, name, index, out))
                    )
                while pending:
                    self._copy_out(reader, name, image, *pending.popleft())
                self._synchronize()
            except BaseException:
                for _, _, future in pending:
                    future.cancel()
                pool.shutdown(wait=True)
                self._synchronize()
                image.zero_()
                self.clear()
                raise

    def clear(self) -> None:
        """Zero every slot, once no copy from them is in flight."""
        self._synchronize()
        for slot in self.slots:
            slot.zero_()

    def _copy_out(
        self,
        reader: ChunkReader,
        name: str,
        image: torch.Tensor,
        index: int,
        slot: int,
        done: Future[None],
    ) -> None:
        done.result()
        start, length = reader.chunk_span(name, index)
        image[start : start + length].copy_(self.slots[slot][:length], non_blocking=self.pinned)
        if self.pinned:
            event = torch.cuda.Event()
            event.record()
            self.copied[slot] = event

    def _synchronize(self) -> None:
        if self.pinned:
            torch.cuda.synchronize()

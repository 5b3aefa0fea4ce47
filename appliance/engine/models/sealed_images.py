"""A sealed model's weight files, decrypted one at a time into memory on the target device.

`SealedImages` is the `weights` mapping `load_model` takes: file name -> the plaintext
safetensors image as a uint8 tensor, decrypted when the loader asks for it (the loader takes one
file at a time, so only one image is alive at a time, next to the model).

On a GPU the plaintext goes through a ring of pinned host chunks instead of one pinned buffer
per file: pinning many gigabytes costs seconds (cudaHostAlloc touches every page), whereas a ring
of 2 × workers chunks is allocated in milliseconds. Worker threads decrypt chunk i into slot
i mod S while the copy engine moves earlier slots to the device image; a slot is reused only
after its copy's event has completed. The ring is zeroed once a file is done, and on any failure
both the ring and the partial device image are zeroed before the error propagates. On the CPU
each file is decrypted straight into its image (no ring), unless `staging=True` (tests).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from attestation.sealed import ChunkReader, SealedModel, default_workers


class SealedImages(Mapping[str, torch.Tensor]):
    """Plaintext images of `sealed`'s weight files on `device` (see the module docstring).
    Each access decrypts again; SealedModelError propagates from a wrong key or bad chunk."""

    def __init__(
        self,
        sealed: SealedModel,
        data_key: bytes,
        device: torch.device,
        *,
        workers: int | None = None,
        staging: bool | None = None,
    ) -> None:
        self._sealed = sealed
        self._data_key = data_key
        self._device = torch.device(device)
        self._workers = workers or default_workers()
        # Anything but the CPU is reached through the staging ring; on the CPU it is optional.
        self._staging = self._device.type != "cpu" or bool(staging)
        self._names = sorted(entry.name for entry in sealed.manifest.sealed_files)

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
        with self._sealed.chunk_reader(self._data_key) as reader:
            _StagingRing(reader, self._workers, pinned=self._device.type == "cuda").copy(
                name, image
            )
        return image


class _StagingRing:
    """2 × workers host chunks through which one file's chunks reach its device image."""

    def __init__(self, reader: ChunkReader, workers: int, *, pinned: bool) -> None:
        self.reader = reader
        self.workers = workers
        self.pinned = pinned
        chunk_size = reader.manifest.chunk_size
        self.slots = [
            torch.empty(chunk_size, dtype=torch.uint8, pin_memory=pinned)
            for _ in range(2 * workers)
        ]
        self.copied: list[torch.cuda.Event | None] = [None] * len(self.slots)

    def copy(self, name: str, image: torch.Tensor) -> None:
        num_chunks = self.reader.manifest.file(name).num_chunks
        # In flight, oldest first: (chunk index, slot, decryption future).
        pending: deque[tuple[int, int, Future[None]]] = deque()
        with ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="unseal") as pool:
            try:
                for index in range(num_chunks):
                    slot = index % len(self.slots)
                    if len(pending) == len(self.slots):
                        self._copy_out(name, image, *pending.popleft())
                    event = self.copied[slot]
                    if event is not None:
                        event.synchronize()  # the slot's last copy has landed
                    _, length = self.reader.chunk_span(name, index)
                    out = memoryview(self.slots[slot].numpy())[:length]
                    pending.append(
                        (index, slot, pool.submit(self.reader.decrypt_chunk_into, name, index, out))
                    )
                while pending:
                    self._copy_out(name, image, *pending.popleft())
                self._synchronize()
            except BaseException:
                for _, _, future in pending:
                    future.cancel()
                pool.shutdown(wait=True)
                self._synchronize()
                image.zero_()
                raise
            finally:
                self._synchronize()
                for slot in self.slots:
                    slot.zero_()

    def _copy_out(
        self, name: str, image: torch.Tensor, index: int, slot: int, done: Future[None]
    ) -> None:
        done.result()
        start, length = self.reader.chunk_span(name, index)
        image[start : start + length].copy_(self.slots[slot][:length], non_blocking=self.pinned)
        if self.pinned:
            event = torch.cuda.Event()
            event.record()
            self.copied[slot] = event

    def _synchronize(self) -> None:
        if self.pinned:
            torch.cuda.synchronize()

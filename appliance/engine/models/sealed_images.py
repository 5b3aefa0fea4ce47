"""A sealed model's weight files, decrypted one at a time into memory on the target device.

`SealedImages` is the `weights` mapping `load_model` takes: file name -> the plaintext
safetensors image as a uint8 tensor, decrypted when the loader asks for it (the loader takes one
file at a time, so only one image is alive at a time, next to the model).

On a GPU the plaintext goes through a ring of pinned host chunks instead of one pinned buffer
per file: pinning host memory runs at 1-2 GB/s (an H200 host: 14 s for 16 GB; an H100 host:
0.27 s for 512 MiB), so the ring is kept small (workers + 2 chunks) and allocated once. It
needs no key, so it can be allocated ahead of time (a `StagingRing` passed in, or `prepare()`)
or beside other work (`prepare_in_background()`: the sealed load pins it while it allocates the
model).
Worker threads decrypt chunk i into slot i mod S while the copy engine moves earlier slots to
the device image; a slot is reused only after its copy's event has completed. On any failure
the ring and the partial device image are zeroed before the error propagates; `close()` zeroes
the ring. On the CPU each file is decrypted straight into its image (no ring), unless
`staging=True` (tests).
"""

from __future__ import annotations

import contextlib
import json
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType

import torch

from appliance.engine.errors import ModelLoadError
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
        self._pinning: Future[StagingRing] | None = None

    def prepare(self) -> None:
        """Allocate the staging ring now rather than at the first file (or wait for
        `prepare_in_background`'s, raising what it raised)."""
        if self._pinning is not None:
            pinning, self._pinning = self._pinning, None
            self._ring = pinning.result()
        if self._staging and self._ring is None:
            self._ring = self._new_ring()

    def prepare_in_background(self) -> None:
        """Start allocating the staging ring in a thread of its own, while the caller does
        something else (builds the model): pinning host memory releases the GIL and took
        0.1-0.2 s for the ring on the H100's host. The first file waits for it."""
        if self._staging and self._ring is None and self._pinning is None:
            pool = ThreadPoolExecutor(1, thread_name_prefix="staging-ring")
            self._pinning = pool.submit(self._new_ring)
            pool.shutdown(wait=False)  # its thread ends with the allocation

    def close(self) -> None:
        """Zero and release the staging ring (it held plaintext chunks)."""
        if self._pinning is not None:
            pinning, self._pinning = self._pinning, None
            if pinning.exception() is None:  # never used: it holds no plaintext
                self._ring = pinning.result()
        if self._ring is not None:
            self._ring.clear()
            self._ring = None

    def _new_ring(self) -> StagingRing:
        pinned = self._device.type == "cuda"
        with torch.cuda.device(self._device) if pinned else contextlib.nullcontext():
            return StagingRing(self._sealed.manifest.chunk_size, self._workers, pinned=pinned)

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
    """`workers` + 2 host chunks (pinned for a GPU) through which chunks reach device images:
    one for each worker to decrypt into, and two more whose copies to the device are in flight
    meanwhile (a chunk's copy takes 0.3 ms of its worker's 10-20 ms). Twice the workers' chunks
    were no faster and took 0.12 s longer to pin on the H100 (docs/BENCHMARKS.md, round 11)."""

    def __init__(self, chunk_size: int, workers: int, *, pinned: bool) -> None:
        self.chunk_size = chunk_size
        self.workers = workers
        self.pinned = pinned
        self.slots = [
            torch.empty(chunk_size, dtype=torch.uint8, pin_memory=pinned)
            for _ in range(workers + 2)
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


class SealedShardImages(Mapping[str, torch.Tensor]):
    """Host images of a sealed model's weight files in which only the chunks holding a part of
    some tensor that `part_of` asks for (one tensor-parallel rank's: loader.parts_of) are
    decrypted: the loader then copies just those parts to the rank's GPU, so no GPU ever holds
    another rank's plaintext, and chunks that hold only other ranks' rows are never decrypted.

    What the format allows (chunks of `manifest.chunk_size` bytes, each encrypted on its own):
    a rank's rows of a row-split tensor (q/k/v, gate/up, embedding, lm_head) are one byte range,
    so only the chunks it spans are decrypted, and at most the two chunks at its ends also hold
    a neighbour's rows; a column-split tensor (o_proj, down_proj: [out, in], split along `in`)
    has a piece of every rank's columns in every row, so all its chunks are decrypted on the
    host, and only this rank's columns go to its GPU. A projection the checkpoint stores fused
    (Phi-3's qkv_proj and gate_up_proj) is decrypted whole on the host likewise. Host memory of
    this process holds those bytes until the next file is asked for (then they are zeroed),
    never the GPU. Avoiding even
    that needs the sealer to store column-split tensors rank by rank (a tensor-parallel seal).

    Bytes of an image that were never decrypted are zero and are never read by the loader.
    `num_chunks_decrypted` / `num_chunks` count what this mapping decrypted of what exists.
    """

    def __init__(
        self,
        sealed: SealedModel,
        data_key: bytes,
        part_of: Callable[[str, tuple[int, ...]], tuple[int, int, int] | None],
        *,
        workers: int | None = None,
    ) -> None:
        self._sealed = sealed
        self._data_key = data_key
        self._part_of = part_of
        self._workers = workers or default_workers()
        self._names = sorted(entry.name for entry in sealed.manifest.sealed_files)
        self._last: tuple[torch.Tensor, list[tuple[int, int]]] | None = None
        self.num_chunks_decrypted = 0
        self.num_chunks = sum(entry.num_chunks for entry in sealed.manifest.sealed_files)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __enter__(self) -> SealedShardImages:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Zero the plaintext of the last image handed out."""
        if self._last is not None:
            image, spans = self._last
            for start, length in spans:
                image[start : start + length].zero_()
            self._last = None

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        self.close()
        entry = self._sealed.manifest.file(name)
        chunk_size = self._sealed.manifest.chunk_size
        image = torch.zeros(entry.size, dtype=torch.uint8)  # [bytes]; only some get plaintext
        view = memoryview(image.numpy())
        spans: list[tuple[int, int]] = []
        self._last = (image, spans)
        with self._sealed.chunk_reader(self._data_key) as reader:

            def decrypt(indices: Iterable[int]) -> None:
                todo = [i for i in sorted(set(indices)) if reader.chunk_span(name, i) not in spans]
                with ThreadPoolExecutor(self._workers, thread_name_prefix="unseal") as pool:
                    done = []
                    try:
                        for index in todo:
                            start, length = reader.chunk_span(name, index)
                            out = view[start : start + length]
                            done.append(pool.submit(reader.decrypt_chunk_into, name, index, out))
                        for future in done:
                            future.result()
                    finally:
                        spans.extend(reader.chunk_span(name, i) for i in todo)
                self.num_chunks_decrypted += len(todo)

            try:
                decrypt(_chunks_of(0, min(8, entry.size), chunk_size))
                header_end = 8 + int.from_bytes(bytes(view[:8]), "little")
                if header_end > entry.size:
                    raise ModelLoadError(f"{name}: the safetensors header exceeds the file")
                decrypt(_chunks_of(0, header_end, chunk_size))
                ranges = _needed_ranges(bytes(view[8:header_end]), header_end, self._part_of)
                decrypt(i for lo, hi in ranges for i in _chunks_of(lo, hi, chunk_size))
            except BaseException:
                self.close()  # no unauthenticated or partial plaintext survives a failure
                raise
        return image


def _chunks_of(start: int, stop: int, chunk_size: int) -> range:
    """Indices of the chunks that bytes start .. stop - 1 fall in."""
    if stop <= start:
        return range(0)
    return range(start // chunk_size, (stop - 1) // chunk_size + 1)


def _needed_ranges(
    header_bytes: bytes,
    data_start: int,
    part_of: Callable[[str, tuple[int, ...]], tuple[int, int, int] | None],
) -> list[tuple[int, int]]:
    """Byte ranges (in the file) of the parts `part_of` asks for, from a safetensors header.
    The loader validates the header strictly afterwards; here only what is needed is read."""
    try:
        header = json.loads(header_bytes)
        header.pop("__metadata__", None)
        tensors = [
            (name, [int(n) for n in info["shape"]], *map(int, info["data_offsets"]))
            for name, info in header.items()
        ]
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ModelLoadError(f"a sealed safetensors header is unusable: {exc}") from None
    ranges = []
    for name, shape, begin, end in tensors:
        begin, end = data_start + begin, data_start + end
        part = part_of(name, tuple(shape)) if shape else None
        if part is None or part[0] != 0:
            ranges.append((begin, end))  # all of it, or a column split: every row has a piece
            continue
        row_bytes = (end - begin) // max(shape[0], 1)
        ranges.append((begin + part[1] * row_bytes, begin + part[2] * row_bytes))
    return ranges

"""Sealed-model throughput (W5 of PERFORMANCE.md: decryption must keep up with the disk).

Builds an 8B-sized model directory (default 16 GB, the size of Llama-3.1-8B in bf16) of
*.safetensors shards, seals it (attestation.sealed: AES-256-GCM chunks, signed manifest), then
decrypts it with the appliance's code path, reporting GB/s (10^9 bytes per second) for:

  seal                 read, SHA-256, encrypt and write every shard (the sealer's machine)
  read                 plain read of the sealed files (the page-cache ceiling decryption meets)
  decrypt/workers=N    decrypt the first shard into pinned host memory with N threads (scaling:
                       cryptography releases the GIL in update_into, so N threads should scale)
  allocate host buffers  the pinned host buffers (cudaHostAlloc), allocated once per load
  decrypt→pinned       every shard decrypted into pinned host memory, all workers
  →GPU                 the pinned buffers copied to the GPU
  decrypt→GPU overlap  each shard's host-to-device copy overlapping the next shard's decryption
  allocate ring        the appliance's staging ring: 2 × workers pinned chunks, allocated once
  ring→device          the appliance's own path (appliance.engine.models.sealed_images): each
                       shard decrypted through the ring into its GPU image, with no whole-file
                       pinned buffer (on the CPU: a CPU image)

The shard contents are one random 64 MiB block repeated (AES-GCM's speed does not depend on the
data; every chunk's ciphertext still differs, since every nonce does). Files are written under
--dir and read back from the page cache, as W5 assumes ("weights in page cache").

Needs only torch, cryptography, numpy and tqdm (no `pip install -e .`: the repository root is put
on sys.path). Without CUDA the GPU rows are skipped and host memory is not pinned.

    python bench/seal_throughput.py [--size-gb 16] [--shard-gb 5] [--chunk-mib 16]
        [--workers N] [--dir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from appliance.engine.models.sealed_images import SealedImages  # after the path fix
from attestation.sealed import SealedModel, seal_model

T = TypeVar("T")
GB = 1e9
BLOCK = 64 << 20


def make_source(directory: Path, size: int, shard_size: int) -> list[Path]:
    """Shards of random-looking bytes totalling `size` bytes, plus a config.json."""
    directory.mkdir(parents=True)
    block = np.random.default_rng(0).bytes(BLOCK)
    num_shards = max(1, -(-size // shard_size))
    paths = []
    with tqdm(total=size, unit="B", unit_scale=True, desc="writing source") as bar:
        for index in range(num_shards):
            path = directory / f"model-{index + 1:05d}-of-{num_shards:05d}.safetensors"
            remaining = min(shard_size, size - index * shard_size)
            with path.open("wb") as f:
                while remaining:
                    n = min(BLOCK, remaining)
                    f.write(block[:n])
                    remaining -= n
                    bar.update(n)
            paths.append(path)
    (directory / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}\n')
    return paths


def rate(num_bytes: int, seconds: float) -> float:
    return num_bytes / GB / seconds


def timed(label: str, num_bytes: int, results: dict[str, float], fn: Callable[[], T]) -> T:
    start = time.perf_counter()
    value = fn()
    seconds = time.perf_counter() - start
    results[f"{label} GB/s"] = round(rate(num_bytes, seconds), 2)
    results[f"{label} s"] = round(seconds, 3)
    print(f"{label:<24} {rate(num_bytes, seconds):7.2f} GB/s  ({seconds:.2f} s)", flush=True)
    return value


def read_all(paths: list[Path]) -> None:
    buffer = bytearray(BLOCK)
    view = memoryview(buffer)
    for path in paths:
        with path.open("rb", buffering=0) as f:
            while f.readinto(view):
                pass


def through_ring(images: SealedImages, cuda: bool) -> None:
    """Every image through the staging ring, one alive at a time (as the loader takes them)."""
    for name in images:
        image = images[name]
        del image
    if cuda:
        torch.cuda.synchronize()


def measure_whole_file_buffers(
    model: SealedModel, data_key: bytes, workers: int, cuda: bool, results: dict[str, float]
) -> None:
    """The alternative to the ring: one pinned host buffer per file, then the copies."""
    entries = model.manifest.sealed_files
    size = sum(e.size for e in entries)
    # Pinned memory is populated when allocated; pageable memory at first touch, so it is
    # touched here to keep page faults out of the decryption rows.
    buffers = timed("allocate host buffers", size, results, lambda: {
        e.name: torch.empty(e.size, dtype=torch.uint8, pin_memory=cuda).fill_(0)
        for e in entries
    })  # fmt: skip
    views = {name: memoryview(t.numpy()) for name, t in buffers.items()}
    first = entries[0]
    for num_workers in sorted({1, 2, 4, 8, workers}):
        if num_workers > workers:
            continue
        timed(f"decrypt/workers={num_workers}", first.size, results, lambda w=num_workers: (
            model.decrypt_into(data_key, first.name, views[first.name], workers=w)
        ))  # fmt: skip
    timed("decrypt→pinned", size, results, lambda: model.decrypt_files(
        data_key, views, workers=workers
    ))  # fmt: skip
    sample = bytes(views[first.name][: 1 << 20])
    assert sample == np.random.default_rng(0).bytes(BLOCK)[: 1 << 20], "wrong plaintext"
    if not cuda:
        return
    device = {n: torch.empty(t.numel(), dtype=torch.uint8, device="cuda")
              for n, t in buffers.items()}  # fmt: skip

    def to_gpu() -> None:
        for name, host in buffers.items():
            device[name].copy_(host, non_blocking=True)
        torch.cuda.synchronize()

    to_gpu()
    timed("→GPU", size, results, to_gpu)

    def overlapped() -> None:
        stream = torch.cuda.Stream()
        for entry in entries:
            model.decrypt_into(data_key, entry.name, views[entry.name], workers=workers)
            with torch.cuda.stream(stream):
                device[entry.name].copy_(buffers[entry.name], non_blocking=True)
        torch.cuda.synchronize()

    timed("decrypt→GPU overlap", size, results, overlapped)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=16.0)
    parser.add_argument("--shard-gb", type=float, default=5.0)
    parser.add_argument("--chunk-mib", type=int, default=16)
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: temp)")
    parser.add_argument("--keep", action="store_true", help="keep the files afterwards")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    size = int(args.size_gb * GB)
    base = Path(tempfile.mkdtemp(prefix="seal-bench-", dir=args.dir))
    results: dict[str, float] = {}
    print(
        f"{size / GB:.1f} GB in {args.shard_gb} GB shards, chunks of {args.chunk_mib} MiB, "
        f"{args.workers} workers of {os.cpu_count()} CPUs, "
        f"{torch.cuda.get_device_name() if cuda else 'no CUDA'}",
        flush=True,
    )
    try:
        make_source(base / "src", size, int(args.shard_gb * GB))
        signing_key = Ed25519PrivateKey.generate()
        keys: dict[str, bytes] = {}

        def wrap(key_id: str, data_key: bytes) -> bytes:
            keys[key_id] = data_key
            return b"bench"

        bar = tqdm(total=size, unit="B", unit_scale=True, desc="sealing", leave=False)
        timed("seal", size, results, lambda: (seal_model(
            base / "src", base / "sealed", model_id="bench/8b", key_id="bench",
            wrap_data_key=wrap, signing_key=signing_key, chunk_size=args.chunk_mib << 20,
            workers=args.workers, progress=bar.update,
        ), bar.close()))  # fmt: skip
        shutil.rmtree(base / "src")  # leave the page cache to the sealed files
        data_key = keys["bench"]
        model = SealedModel.open(base / "sealed", manifest_key=signing_key.public_key())
        entries = model.manifest.sealed_files
        read_all([base / "sealed" / e.stored_name for e in entries])  # warm the page cache
        timed("read", size, results, lambda: read_all(
            [base / "sealed" / e.stored_name for e in entries]
        ))  # fmt: skip

        target = torch.device("cuda" if cuda else "cpu")
        with SealedImages(model, data_key, target, workers=args.workers, staging=True) as images:
            ring_bytes = 2 * args.workers * (args.chunk_mib << 20)
            timed("allocate ring", ring_bytes, results, images.prepare)
            timed(f"ring→{target.type}", size, results, lambda: through_ring(images, cuda))
        measure_whole_file_buffers(model, data_key, args.workers, cuda, results)
        print(json.dumps({"size_gb": size / GB, "workers": args.workers, **results}))
    finally:
        if args.keep:
            print(f"kept {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()

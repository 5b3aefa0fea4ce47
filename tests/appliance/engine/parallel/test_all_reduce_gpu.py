"""The one-shot all-reduce (appliance.engine.parallel.all_reduce) on 2 GPUs against NCCL's:
the same sums, bit for bit (two addends: a + b rounds alike in either order), eagerly and
replayed from a CUDA graph as decode steps replay it; messages past its buffer or misaligned
go through NCCL; `one_shot=False` never maps a buffer.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
        python -m pytest -m gpu tests/appliance/engine/parallel/test_all_reduce_gpu.py
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from appliance.engine.parallel.all_reduce import ONE_SHOT_MAX_BYTES, AllReduce

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

HIDDEN = 8192
# (rows, columns): a decode row; the largest message the buffer takes; one row past it; a
# message of 6 bytes (the kernel moves 4-byte multiples).
SHAPES = ((1, HIDDEN), (ONE_SHOT_MAX_BYTES // (2 * HIDDEN), HIDDEN), (257, HIDDEN), (1, 3))


def _rank(rank: int, rendezvous: str, results) -> None:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl", init_method=f"file://{rendezvous}", rank=rank, world_size=2, device_id=device
    )
    try:
        results.put((rank, _checks(rank, device)))
    except BaseException as exc:
        results.put((rank, {"error": repr(exc)}))
    dist.barrier()
    os._exit(0)  # NCCL's teardown may block (docs/BENCHMARKS.md); the process is done


def _checks(rank: int, device: torch.device) -> dict:
    group = dist.group.WORLD
    assert group is not None
    out: dict = {"off": AllReduce.for_group(group, device, torch.bfloat16, one_shot=False).one_shot}
    all_reduce = AllReduce.for_group(group, device, torch.bfloat16, one_shot=True)
    out["on"] = all_reduce.one_shot
    g = torch.Generator(device=device).manual_seed(100 + rank)
    for rows, cols in SHAPES:
        x = torch.randn(rows, cols, generator=g, device=device).to(torch.bfloat16)
        expected = x.clone()
        dist.all_reduce(expected)
        all_reduce(x)
        out[f"eager {rows}x{cols}"] = torch.equal(x, expected)
    # Two all-reduces per layer, captured once and replayed with new contents, as decode does.
    a = torch.zeros(8, HIDDEN, dtype=torch.bfloat16, device=device)
    b = torch.zeros_like(a)
    for _ in range(2):
        all_reduce(a)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        all_reduce(a)
        b.copy_(a * 2)
        all_reduce(b)
    agree = []
    for _ in range(3):
        a.copy_(torch.randn(a.shape, generator=g, device=device))
        expected_a = a.clone()
        dist.all_reduce(expected_a)
        expected_b = expected_a * 2
        dist.all_reduce(expected_b)
        graph.replay()
        torch.cuda.synchronize()
        agree.append(torch.equal(a, expected_a) and torch.equal(b, expected_b))
    out["graph"] = all(agree)
    del graph
    all_reduce.close()
    return out


def test_one_shot_sums_equal_nccl_eagerly_and_in_cuda_graphs() -> None:
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        rendezvous = str(Path(tmp) / "rendezvous")
        procs = [context.Process(target=_rank, args=(r, rendezvous, results)) for r in range(2)]
        for proc in procs:
            proc.start()
        outcome = dict(results.get(timeout=300) for _ in procs)
        for proc in procs:
            proc.join(timeout=60)
    for rank, checks in outcome.items():
        assert "error" not in checks, f"rank {rank}: {checks['error']}"
        assert checks.pop("off") is False
        assert checks.pop("on") is True, f"rank {rank}: the one-shot buffer was not mapped"
        assert all(checks.values()), f"rank {rank}: {checks}"

"""The all-reduce that sums the tensor-parallel ranks' partial hidden rows (after each
row-parallel projection and the vocabulary-parallel embedding): NCCL's ring, or, for the small
messages of decode steps on GPUs, PyTorch's symmetric-memory one-shot all-reduce.

A decode step of a 70B model at batch 1 runs 160 all-reduces of 16 KiB, each almost all
latency: NCCL takes 21 µs for one on 2 × H200, replayed from a CUDA graph. The one-shot kernel
copies the rank's rows into a buffer that every peer has mapped (NVLink peer-to-peer: no
multicast, which the machines here require off), meets the peers at a barrier of signal flags,
reads all of their buffers and sums them in rank order, so every rank ends with the same bits;
a second barrier keeps a rank from overwriting its buffer while a peer still reads it: 6.8 µs
for the same message. Inside the engine's decode step the gain is smaller than those figures
suggest (docs/BENCHMARKS.md, "tensor parallelism with the one-shot all-reduce"). vLLM and
SGLang use the same PyTorch kernels for their small all-reduces.
Messages larger than the buffer (prefill chunks) go through NCCL, whose ring moves fewer bytes
per GPU once the message is bandwidth-bound.

Every rank sets the one-shot path up at the same point (`connect_model`, a collective) and
decides each call by the message's size alone, which every rank shares, so the ranks always run
the same kind of collective. If any rank cannot map the buffer (a machine without GPU
peer-to-peer, as in some confidential-computing configurations), all of them use NCCL.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# The largest message the one-shot path takes: a 256-row decode step of 8192-wide bf16 rows,
# which took 35.6 µs against NCCL's 50.4 on 2 × H200 and 50.6 against 61.0 on 4 (alone, in a
# CUDA graph: docs/BENCHMARKS.md). One-shot reads (n - 1) whole peer buffers: past some size
# NCCL's ring, which moves less per GPU, wins; prefill chunks stay with NCCL.
ONE_SHOT_MAX_BYTES = 4 << 20
# The kernel moves 4-, 8- or 16-byte vectors: a message must be a multiple of 4 bytes.
_ALIGNMENT = 4


class AllReduce:
    """Sums a tensor over the group's ranks, in place."""

    def __init__(self, group: dist.ProcessGroup, one_shot_buffer: torch.Tensor | None = None):
        self.group = group
        self._buffer = one_shot_buffer  # flat, symmetric memory: every rank's peers map it
        self._group_name = group.group_name

    @classmethod
    def for_group(
        cls, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype, *, one_shot: bool
    ) -> AllReduce:
        """Collective: every rank of `group` calls it with the same arguments. The one-shot
        path only on GPUs, for bf16/fp16/fp32 (what the kernel sums), and only if every rank
        mapped its buffer."""
        if not (one_shot and device.type == "cuda" and dtype in _ONE_SHOT_DTYPES):
            return cls(group)
        # PyTorch keeps the store of the first group it mapped under a name, and a process
        # group made after the last one was destroyed gets the old name again: a second
        # rendezvous under it would wait on a store that is gone. Such a process (a benchmark
        # running engines one after another; the server builds one) uses NCCL.
        name = group.group_name
        if not _all_ranks(name not in _MAPPED_GROUP_NAMES, group, device):
            logger.info("one-shot all-reduce: group %r was mapped before; NCCL only", name)
            return cls(group)
        _MAPPED_GROUP_NAMES.add(name)
        buffer: torch.Tensor | None = None
        try:
            buffer = _symmetric_buffer(group, device, dtype)
        except Exception as exc:  # any failure to map peers' memory: NCCL instead, below
            logger.warning("one-shot all-reduce unavailable (%s); NCCL all-reduces only", exc)
        if not _all_ranks(buffer is not None, group, device):
            return cls(group)
        logger.info("one-shot all-reduce for messages up to %d KiB", ONE_SHOT_MAX_BYTES >> 10)
        return cls(group, buffer)

    @property
    def one_shot(self) -> bool:
        return self._buffer is not None

    def __call__(self, x: torch.Tensor) -> None:
        nbytes = x.numel() * x.element_size()
        if (
            self._buffer is None
            or nbytes > ONE_SHOT_MAX_BYTES
            or nbytes % _ALIGNMENT
            or x.dtype != self._buffer.dtype
        ):
            dist.all_reduce(x, group=self.group)
            return
        flat = x.view(-1)
        # Copies x into this rank's buffer, sums every rank's, writes the sum back into x.
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(
            self._buffer[: flat.numel()], flat, "sum", self._group_name, flat
        )

    def close(self) -> None:
        """Drop the buffer (before the process group is destroyed)."""
        self._buffer = None


_ONE_SHOT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The group names this process has mapped symmetric memory under (see `for_group`).
_MAPPED_GROUP_NAMES: set[str] = set()


def _all_ranks(true_here: bool, group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether `true_here` holds on every rank of `group` (a collective)."""
    flag = torch.tensor([true_here], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _symmetric_buffer(
    group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    import torch.distributed._symmetric_memory as symm_mem

    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out"):
        raise RuntimeError(f"torch {torch.__version__} has no one_shot_all_reduce_copy_out")
    element = torch.empty((), dtype=dtype).element_size()
    buffer = symm_mem.empty(ONE_SHOT_MAX_BYTES // element, dtype=dtype, device=device)
    symm_mem.rendezvous(buffer, group)
    return buffer

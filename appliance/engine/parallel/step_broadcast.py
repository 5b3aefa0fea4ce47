"""How rank 0 tells the other tensor-parallel ranks what to run: no pickling, two channels.

- control (gloo, host tensors): a fixed header of `_HEADER_LEN` int64 words (the operation and
  its sizes), then, for a forward pass, the sequences' lengths, which the host side of attention
  reads (`AttentionMetadata.seq_lens`, `query_lens`). Rank 0 knows them on the host already, so
  sending them costs no device synchronization. Workers wait here between steps, for as long as
  the engine is idle: their side of this group has a practically endless timeout (a rank 0 that
  dies closes its sockets, which fails the wait at once). Rank 0's side has the step timeout
  (gloo's timeouts are each process's own): a gloo broadcast returns only once every worker
  took it, so a worker that hangs alive fails rank 0's next announcement in bounded time.
- data (NCCL on GPUs, gloo on the CPU): what lives on rank 0's device (token ids, positions,
  slots and block tables, with two KV groups the window group's too, a hybrid model's
  recurrent-state slots, packed into one int64 tensor; the hidden rows whose logits are
  wanted), and the model's own all-reduces and all-gathers. Its timeout bounds every step.

`StepBroadcast` is the model runner's view of its peers: on rank 0 (`leader`) each call
announces what the runner is about to do; on a worker (`follower`) the announcements are no-ops,
since the worker is doing it because it was told. Collective agreements (`agree_kv_budget`) run
on every rank. `receive` is the worker's side of an announcement.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from appliance.engine.errors import TensorParallelError
from appliance.engine.kv_cache import KVPools
from kernels.ops import AttentionMetadata, RecurrentStateMetadata

_HEADER_LEN = 8
# How long a failed announcement waits to learn that a worker died (its socket may close before
# its process is seen to end).
_DEATH_GRACE_S = 2.0
# gpu_memory_utilization travels as an integer number of millionths.
_PPM = 1_000_000


class Op(enum.IntEnum):
    # [T, B, W, G, S]: a forward pass of T tokens in B sequences, tables W blocks wide, G = 1
    # with the window group's slots and tables (two KV groups), else 0; S = 1 with each
    # sequence's recurrent-state slot and whether it continues a state (a hybrid model), else 0
    FORWARD = 1
    LOGITS = 2  # [N, hidden]: compute_logits of N hidden rows
    # [num_tokens, num_logit_rows, gpu_memory_utilization in ppm, graph_batch, num_window_blocks]
    PROFILE = 3
    ALLOCATE_KV = 4  # [num_blocks, num_window_blocks]
    CAPTURE_GRAPHS = 5  # [max_batch]
    STOP = 6
    ALLOCATE_STATES = 7  # [num_slots]: a hybrid model's recurrent state


# How long a worker may wait for rank 0's next announcement: as long as the engine may stay
# idle (a dead rank 0 is noticed by its closed sockets, and by the worker's parent watch).
_IDLE_TIMEOUT = timedelta(days=3650)


@dataclass(frozen=True, slots=True)
class Channels:
    control: dist.ProcessGroup  # gloo: headers and host-side lists
    data: dist.ProcessGroup  # the device's backend: device tensors and the model's collectives
    device: torch.device

    @classmethod
    def join(
        cls, rendezvous: str, rank: int, size: int, device: torch.device, step_timeout_s: float
    ) -> Channels:
        """Join the process groups of `size` ranks meeting at file `rendezvous` (on this
        machine only: no port is opened beyond loopback's gloo sockets). Each rank calls this
        once; it returns when all have joined, or raises after `step_timeout_s`."""
        on_gpu = device.type == "cuda"
        dist.init_process_group(
            "nccl" if on_gpu else "gloo",
            init_method=f"file://{rendezvous}",
            rank=rank,
            world_size=size,
            timeout=timedelta(seconds=step_timeout_s),
            device_id=device if on_gpu else None,
        )
        # Rank 0 waits at most a step for a worker to take an announcement; a worker waits as
        # long as the engine idles (module docstring).
        wait = timedelta(seconds=step_timeout_s) if rank == 0 else _IDLE_TIMEOUT
        control = dist.new_group(list(range(size)), backend="gloo", timeout=wait)
        assert dist.group.WORLD is not None
        return cls(control, dist.group.WORLD, device)


@dataclass(frozen=True, slots=True)
class Message:
    """One announcement as a worker receives it."""

    op: Op
    args: tuple[int, ...]


class StepBroadcast:
    def __init__(
        self,
        channels: Channels,
        *,
        leader: bool,
        failure: Callable[[float], TensorParallelError | None] = lambda _grace_s: None,
    ):
        """`failure(grace_s)` says why a peer died, if one did, waiting up to `grace_s` to
        learn it (rank 0 asks before every announcement, so that a step never starts on a dead
        group, and after a failed one, to name the cause)."""
        self.channels = channels
        self.leader = leader
        self._failure = failure

    @classmethod
    def follower(cls, channels: Channels) -> StepBroadcast:
        return cls(channels, leader=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        state_meta: RecurrentStateMetadata | None = None,
    ) -> None:
        """input_ids, positions, meta.slot_mapping: [T]; meta.block_tables: [B, W] (and the
        same of meta.window_group, if any); a hybrid model's state slots and
        has_initial_state: [B] (every rank holds the same slots of its share of the state)."""
        if not self.leader:
            return
        num_tokens, (batch, width) = input_ids.shape[0], meta.block_tables.shape
        groups = [meta] if meta.window_group is None else [meta, meta.window_group]
        states = state_meta is not None
        self._send_header(Op.FORWARD, num_tokens, batch, width, len(groups) - 1, int(states))
        lengths = torch.tensor([*meta.seq_lens, *meta.query_lens], dtype=torch.int64)
        dist.broadcast(lengths, 0, group=self.channels.control)
        parts = [input_ids.long(), positions.long()]
        for g in groups:
            parts += [g.slot_mapping.long(), g.block_tables.reshape(-1).long()]
        if state_meta is not None:
            parts += [state_meta.state_slots.long(), state_meta.has_initial_state.long()]
        # [2T + G*(T + B*W) + S*2B] on the device: one broadcast, no host synchronization
        dist.broadcast(torch.cat(parts), 0, group=self.channels.data)

    def logits(self, hidden: torch.Tensor) -> None:
        """hidden: [N, hidden], the rows rank 0 is about to compute logits for."""
        if not self.leader:
            return
        self._send_header(Op.LOGITS, *hidden.shape)
        dist.broadcast(hidden.contiguous(), 0, group=self.channels.data)

    def profile(
        self,
        num_tokens: int,
        num_logit_rows: int,
        gpu_memory_utilization: float,
        graph_batch: int,
        num_window_blocks: int,
    ) -> None:
        if self.leader:
            ppm = round(gpu_memory_utilization * _PPM)
            args = (num_tokens, num_logit_rows, ppm, graph_batch, num_window_blocks)
            self._send_header(Op.PROFILE, *args)

    def agree_kv_budget(self, budget: int) -> int:
        """The smallest of every rank's KV budget in bytes (every rank runs this), from which
        every rank then sizes the same pools."""
        value = torch.tensor([budget], dtype=torch.int64, device=self.channels.device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=self.channels.data)
        return int(value.item())

    def allocate_kv(self, pools: KVPools) -> None:
        if self.leader:
            self._send_header(Op.ALLOCATE_KV, pools.num_blocks, pools.num_window_blocks)

    def allocate_states(self, num_slots: int) -> None:
        if self.leader:
            self._send_header(Op.ALLOCATE_STATES, num_slots)

    def capture_graphs(self, max_batch: int) -> None:
        if self.leader:
            self._send_header(Op.CAPTURE_GRAPHS, max_batch)

    def stop(self) -> None:
        if self.leader:
            self._send_header(Op.STOP)

    def _send_header(self, op: Op, *args: int) -> None:
        if (failure := self._failure(0.0)) is not None:
            raise failure
        header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
        header[0] = op
        header[1 : 1 + len(args)] = torch.tensor(args, dtype=torch.int64)
        try:
            dist.broadcast(header, 0, group=self.channels.control)
        except RuntimeError as exc:
            if (failure := self._failure(_DEATH_GRACE_S)) is not None:
                raise failure from exc
            raise TensorParallelError(
                f"a tensor-parallel worker stopped answering ({exc}); the engine stops"
            ) from exc


# The worker's side.


def receive(channels: Channels) -> Message:
    """Wait for rank 0's next announcement (as long as it takes: see the module docstring)."""
    header = torch.empty(_HEADER_LEN, dtype=torch.int64)
    dist.broadcast(header, 0, group=channels.control)
    values = header.tolist()
    return Message(Op(values[0]), tuple(values[1:]))


def receive_forward(
    channels: Channels, num_tokens: int, batch: int, width: int, window_group: int, states: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, RecurrentStateMetadata | None]:
    """The inputs of a FORWARD announcement: input_ids, positions [T], their attention
    metadata and (a hybrid model) their recurrent-state metadata."""
    lengths = torch.empty(2 * batch, dtype=torch.int64)
    dist.broadcast(lengths, 0, group=channels.control)
    seq_lens, query_lens = lengths[:batch].tolist(), lengths[batch:].tolist()
    num_groups = 1 + window_group
    group_sizes = [num_tokens, batch * width] * num_groups
    state_sizes = [batch, batch] * states
    packed = torch.empty(
        2 * num_tokens + sum(group_sizes) + sum(state_sizes),
        dtype=torch.int64,
        device=channels.device,
    )
    dist.broadcast(packed, 0, group=channels.data)
    input_ids, positions, *rest = packed.split([num_tokens, num_tokens, *group_sizes, *state_sizes])
    groups, state_parts = rest[: len(group_sizes)], rest[len(group_sizes) :]
    tables = [t.view(batch, width).to(torch.int32) for t in groups[1::2]]
    window_slots, window_tables = (groups[2], tables[1]) if window_group else (None, None)
    meta = AttentionMetadata.build(
        groups[0],
        tables[0],
        seq_lens=seq_lens,
        query_lens=query_lens,
        window_slot_mapping=window_slots,
        window_block_tables=window_tables,
    )
    state_meta = None
    if states:
        slots, has_initial_state = state_parts
        state_meta = RecurrentStateMetadata(
            state_slots=slots.to(torch.int32),
            has_initial_state=has_initial_state.bool(),
            query_start_loc=meta.query_start_loc,
            query_lens=meta.query_lens,
            decode_only=meta.decode_only,
        )
    return input_ids, positions, meta, state_meta


def receive_hidden(channels: Channels, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """The [rows, width] hidden states of a LOGITS announcement."""
    hidden = torch.empty(rows, width, dtype=dtype, device=channels.device)
    dist.broadcast(hidden, 0, group=channels.data)
    return hidden


def utilization(ppm: int) -> float:
    return ppm / _PPM

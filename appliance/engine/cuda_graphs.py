"""Decode steps replayed from CUDA graphs, one graph per batch size of a ladder.

A decode step of a big model launches hundreds of small kernels; at batch 1 the launch overhead
alone would exceed the time the GPU needs to stream the weights. Capturing the whole forward
once per batch size and replaying it costs one launch. Inputs live in static buffers that every
graph reads; a batch is padded up to the next captured size with rows the kernels skip
(slot -1: no KV write; sequence length 0: no attention; state slot -1: no recurrent state read
or written). A hybrid model's decode steps are captured too: each row's recurrent-state slot is
one more static input, and every captured row continues its slot's state. With two KV groups
(appliance.engine.kv_cache) the window group's slots and block tables are static inputs too.

Greedy sampling inside the graph: decode batches of at most `GREEDY_MAX_BATCH` rows also get a
graph that ends in the LM head and the argmax, writing each row's token into a static buffer,
and begins by spreading one packed upload into the static inputs
(`kernels.graph_inputs`), reading each token the host does not have yet from the tokens the
previous replay wrote. A greedy step then costs one copy in, one replay and one copy out:
outside its graph it launched a dozen small kernels and copies, about 25 µs of the device's
time a token at batch 1 (docs/BENCHMARKS.md), and under serving load (W3: 50-100 rows) the
engine thread's input preparation, LM head and sampler launches for every step. Only for steps
whose every row samples greedily with nothing else asked (`ModelRunner` decides); others replay
the plain graphs.

Memory: every graph allocates from one private pool (shared with the prompt steps' graphs,
appliance.engine.prompt_graphs, captured before these), the largest batch captured first, and
each copies its hidden states into one static output buffer, so no graph's tensor outlives its
capture and each smaller graph reuses the memory the largest one's intermediates took. The pool
is then the largest graph's need, which `ModelRunner.kv_pools_for_free_memory` measures
before the KV pool is sized (docs/ARCHITECTURE.md, "GPU memory").
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import gc
from collections.abc import Callable, Iterator

import torch

from appliance.engine.models.decoder import CausalLM
from appliance.engine.models.recurrent_state import RecurrentState
from kernels.ops import AttentionMetadata, RecurrentStateMetadata

# The largest decode batch that also gets a graph sampling greedily inside it: W3's decode
# batches (50-100 rows at 20 req/s) fit. Its [rows, vocab] logits live in the graphs' pool,
# which the memory profile measures with this size's graph (`captures(only_largest=True)`).
GREEDY_MAX_BATCH = 128


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while graphs are captured (or memory measured:
    ModelRunner.kv_pools_for_free_memory). A collection may destroy an unreachable CUDA graph
    (an earlier engine's, a test's), a call CUDA refuses while any stream captures: the
    capture under way then fails (cudaErrorStreamCaptureInvalidated); one that frees memory
    during a measurement skews it. `inferno serve` has the collector paused through its start
    already (appliance.boot.collector_pause), not through the captures once ready."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def warm_and_capture(
    run: Callable[[], object], pool: tuple[int, int], stream: torch.cuda.Stream
) -> torch.cuda.CUDAGraph:
    """`run` once eagerly (autotuning, compilation and lazy set-up stay outside the graph), then
    one graph of what it launches, into `pool`, on `stream`: every decode and prompt graph is
    made so. Not `torch.cuda.graph`, which empties torch's device and pinned-host caches before
    every capture, so that each of some forty sizes' warm-ups maps its memory again (W5 on the
    H100 did not measurably change either way: docs/BENCHMARKS.md, round 8)."""
    run()
    torch.cuda.synchronize(stream.device)
    graph = torch.cuda.CUDAGraph()
    with collector_paused(), torch.cuda.stream(stream):
        graph.capture_begin(pool=pool)
        try:
            run()
        finally:
            graph.capture_end()
    torch.cuda.synchronize(stream.device)
    return graph


def batch_size_ladder(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_batch (and max_batch itself)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch]
    sizes += range(8, max_batch, 8)
    return [*sizes, max_batch]


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        max_blocks_per_seq: int,
        num_splits_for: Callable[[int], int],
        states: list[RecurrentState] | None = None,
        *,
        window_group: bool = False,
        greedy_tail: Callable[[torch.Tensor, torch.Tensor], object] | None = None,
        pool: tuple[int, int],
        stream: torch.cuda.Stream,
    ):
        """states: a hybrid model's recurrent states (models.recurrent_state), else None;
        window_group: the windowed layers' caches are in a pool of their own; greedy_tail:
        `(hidden [B, H], out [B] int64)` writing each row's greedy token into `out` (the LM head
        and argmax), to capture the greedy graphs with (None: none; not with recurrent states
        or a window group, whose extra inputs the packed upload does not carry); pool: the
        private pool to allocate from, shared with the prompt graphs; stream: the stream every
        graph is captured on (cuBLAS keeps a workspace per stream, and one made while capturing
        stays in the pool)."""
        assert greedy_tail is None or not (states or window_group)
        self.model = model
        self.greedy_tail = greedy_tail
        self.window_group = window_group
        self.kv_caches = kv_caches
        self.states = states or []
        self.num_splits_for = num_splits_for
        self.max_blocks_per_seq = max_blocks_per_seq
        self.sizes: list[int] = []
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.greedy_sizes: list[int] = []
        self._greedy_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._stream = stream
        self.pool = pool  # shared with the prompt graphs

    @property
    def max_batch(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    def captures(self, max_batch: int, *, only_largest: bool = False) -> list[Callable[[], None]]:
        """One capture per graph, to be run in this order: the ladder of batch sizes up to
        `max_batch`, largest first, then the greedy graphs, largest first (`only_largest`: the
        largest of each kind alone, to measure the pool). Each graph replays as soon as its
        capture has run; steps may run between two captures (an engine that captures while
        idle), eagerly where no captured size fits them."""
        self._allocate(max_batch)
        sizes = batch_size_ladder(max_batch)
        # Largest first, so the smaller graphs fit in the memory the largest one reserved.
        plain = sizes[-1:] if only_largest else sizes
        captures = [functools.partial(self._capture_plain, size) for size in reversed(plain)]
        if self.greedy_tail is None:
            return captures
        greedy = [size for size in sizes if size <= GREEDY_MAX_BATCH]
        greedy = greedy[-1:] if only_largest else greedy
        captures += [functools.partial(self._capture_greedy, size) for size in reversed(greedy)]
        return captures

    def _allocate(self, n: int) -> None:
        """The static inputs and output of batches of up to `n` rows."""
        device = self.model.embed_tokens.weight.device
        hidden_size = self.model.config.hidden_size
        self._hidden = torch.empty(
            n, hidden_size, dtype=self.model.embed_tokens.weight.dtype, device=device
        )
        self._input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self._positions = torch.zeros(n, dtype=torch.int64, device=device)
        self._slots = torch.full((n,), -1, dtype=torch.int64, device=device)
        self._block_tables = torch.zeros(
            n, self.max_blocks_per_seq, dtype=torch.int32, device=device
        )
        self._window_slots = torch.full((n,), -1, dtype=torch.int64, device=device)
        self._window_block_tables = torch.zeros_like(self._block_tables)
        self._seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self._query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self._state_slots = torch.full((n,), -1, dtype=torch.int32, device=device)
        self._has_initial_state = torch.ones(n, dtype=torch.bool, device=device)
        if self.greedy_tail is None:
            return
        from kernels.graph_inputs import PackedLayout

        # The greedy graphs' packed upload (zeros: a batch of no rows) and sampled tokens.
        capacity = min(n, GREEDY_MAX_BATCH)
        self.greedy_layout = PackedLayout(capacity)
        self.greedy_packed = torch.zeros(
            self.greedy_layout.words(capacity, self.max_blocks_per_seq),
            dtype=torch.int32,
            device=device,
        )
        self.greedy_sampled = torch.zeros(capacity, dtype=torch.int64, device=device)

    def _pad(self) -> None:
        """Every static row padding again (no KV write, no attention, no state read or
        written), as when allocated: a warm-up after replays must not write a real step's
        slots, whose blocks the prefix cache may still serve."""
        self._slots.fill_(-1)
        self._window_slots.fill_(-1)
        self._seq_lens.zero_()
        self._state_slots.fill_(-1)
        if self.greedy_tail is not None:
            self.greedy_packed.zero_()

    @torch.inference_mode()
    def _capture_plain(self, size: int) -> None:
        self._graphs[size] = self._warm_and_capture(
            size, lambda meta: self._hidden[:size].copy_(self._forward(size, meta))
        )
        self.sizes = sorted(self._graphs)

    @torch.inference_mode()
    def _capture_greedy(self, size: int) -> None:
        """The greedy graph of `size` rows, over the plain graphs' static inputs and pool."""
        self._greedy_graphs[size] = self._warm_and_capture(
            size, lambda meta: self._greedy_step(size, meta)
        )
        self.greedy_sizes = sorted(self._greedy_graphs)

    def _warm_and_capture(
        self, size: int, step: Callable[[AttentionMetadata], object]
    ) -> torch.cuda.CUDAGraph:
        """`step` over `size` padding rows, warmed up and captured (`warm_and_capture`)."""
        self._pad()
        meta = self._meta(size)
        return warm_and_capture(lambda: step(meta), self.pool, self._stream)

    def _greedy_step(self, size: int, meta: AttentionMetadata) -> None:
        from kernels.graph_inputs import stage_decode_inputs

        assert self.greedy_tail is not None
        stage_decode_inputs(
            self.greedy_packed,
            self.greedy_layout,
            self.greedy_sampled,
            self._input_ids[:size],
            self._positions[:size],
            self._slots[:size],
            self._seq_lens[:size],
            self._block_tables[:size],
        )
        self.greedy_tail(self._forward(size, meta), self.greedy_sampled[:size])

    @property
    def greedy_max_batch(self) -> int:
        return self.greedy_sizes[-1] if self.greedy_sizes else 0

    def run_greedy(self, batch: int) -> torch.Tensor:
        """Replay the smallest greedy graph that fits `batch` rows, its inputs already copied
        into `greedy_packed` (`greedy_layout`, sources naming rows of `greedy_sampled`);
        [batch] int64 greedy tokens: a view of `greedy_sampled`, which the next greedy replay
        overwrites (work queued before it still reads this step's)."""
        size = self.greedy_sizes[bisect.bisect_left(self.greedy_sizes, batch)]
        self._greedy_graphs[size].replay()
        return self.greedy_sampled[:batch]

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        state_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Replay the smallest graph that fits a decode batch of B rows; [B, hidden] states.

        Inputs (on the device): [B] int64 ids and positions; the batch's metadata, whose
        [B, W] block tables (the window group's too, when captured with one) have
        W <= max_blocks_per_seq; a hybrid model's [B] int32 recurrent-state slots.
        """
        batch = input_ids.shape[0]
        size = self.sizes[bisect.bisect_left(self.sizes, batch)]
        self._input_ids[:batch].copy_(input_ids, non_blocking=True)
        self._positions[:batch].copy_(positions, non_blocking=True)
        _copy_into(self._slots, self._block_tables, meta, batch)
        if self.window_group:
            assert meta.window_group is not None, "captured with the window group's tables"
            _copy_into(self._window_slots, self._window_block_tables, meta.window_group, batch)
        self._seq_lens[:batch].copy_(meta.seq_lens_t, non_blocking=True)
        if state_slots is not None:
            self._state_slots[:batch].copy_(state_slots, non_blocking=True)
        if size > batch:
            self._slots[batch:size].fill_(-1)
            self._window_slots[batch:size].fill_(-1)
            self._seq_lens[batch:size].fill_(0)
            self._state_slots[batch:size].fill_(-1)
        self._graphs[size].replay()
        return self._hidden[:batch]

    def pool_bytes(self) -> int:
        """Device memory the graphs' private pool holds (its segments in the allocator), the
        prompt graphs' included."""
        pool = tuple(self.pool)
        return sum(
            segment["total_size"]
            for segment in torch.cuda.memory_snapshot()
            if tuple(segment.get("segment_pool_id", ())) == pool
        )

    def release(self) -> None:
        """Free every captured graph (no replay after). A graph that captured NCCL collectives
        holds their communicator: it must be released before the process groups are left,
        or NCCL's teardown waits for it forever (pytorch/pytorch#115388)."""
        torch.cuda.synchronize()
        for graph in (*self._graphs.values(), *self._greedy_graphs.values()):
            graph.reset()
        self._graphs.clear()
        self._greedy_graphs.clear()
        self.sizes = []
        self.greedy_sizes = []

    def replay_only(self, size: int, *, greedy: bool = False) -> Callable[[], None]:
        """The bare replay of one captured size (`greedy`: its greedy graph, the LM head and
        argmax included), for benchmarks of the forward pass itself."""
        return (self._greedy_graphs if greedy else self._graphs)[size].replay

    def _meta(self, size: int) -> AttentionMetadata:
        meta = AttentionMetadata(
            slot_mapping=self._slots[:size],
            block_tables=self._block_tables[:size],
            seq_lens_t=self._seq_lens[:size],
            query_start_loc=self._query_start_loc[: size + 1],
            seq_lens=[1] * size,  # host copies are not read on the graph path
            query_lens=[1] * size,
            max_query_len=1,
            decode_only=True,
            num_splits=self.num_splits_for(size),
        )
        if not self.window_group:
            return meta
        return meta.with_window_group(self._window_slots[:size], self._window_block_tables[:size])

    def _state_meta(self, size: int) -> RecurrentStateMetadata | None:
        if not self.states:
            return None
        return RecurrentStateMetadata(
            state_slots=self._state_slots[:size],
            has_initial_state=self._has_initial_state[:size],
            query_start_loc=self._query_start_loc[: size + 1],
            query_lens=[1] * size,  # host copies are not read on the graph path
            decode_only=True,
        )

    def _forward(self, size: int, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(
            self._input_ids[:size],
            self._positions[:size],
            self.kv_caches,
            meta,
            self.states,
            self._state_meta(size),
        )


def _copy_into(
    slots: torch.Tensor, block_tables: torch.Tensor, meta: AttentionMetadata, batch: int
) -> None:
    """One group's slots and block tables of a decode batch into the static buffers."""
    slots[:batch].copy_(meta.slot_mapping, non_blocking=True)
    width = meta.block_tables.shape[1]
    block_tables[:batch, :width].copy_(meta.block_tables, non_blocking=True)

"""Turns one scheduled step into model inputs, runs the model, and samples.

Inputs are flattened across sequences (vLLM's varlen layout): [T] token ids and positions, a
slot for each token in the paged KV cache, and each sequence's block table (with two KV groups,
appliance.engine.kv_cache, the window group's slots and tables too); for a hybrid model also
each sequence's recurrent-state slot (appliance.engine.state_slots). Logits are computed
only where they are needed: the last position of a chunk that samples, and the prompt positions
of a request that asked for prompt log-probabilities.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Collection
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np
import torch

from appliance.engine.cuda_graphs import DecodeGraphs, collector_paused
from appliance.engine.errors import EngineConfigError
from appliance.engine.kv_cache import KVCacheSpec, KVPools
from appliance.engine.memory_profile_cache import MemoryProfileCache, ProfiledPeaks
from appliance.engine.models.decoder import CausalLM
from appliance.engine.models.recurrent_state import RecurrentState, allocate_states
from appliance.engine.outputs import TokenLogprob
from appliance.engine.packed_inputs import Uploader
from appliance.engine.parallel.step_broadcast import StepBroadcast
from appliance.engine.prompt_graphs import PROMPT_GRAPH_SIZES, PromptGraphs
from appliance.engine.sampling import greedy_tokens, sample, token_logprobs
from appliance.engine.sampling_controls import SamplingControls
from appliance.engine.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from appliance.engine.scheduler import ScheduledChunk
from appliance.engine.sequence import Sequence
from appliance.engine.structured_output import TokenMasks
from kernels.ops import AttentionMetadata, RecurrentStateMetadata

logger = logging.getLogger(__name__)

# ModelRunner.capture_stream's, per device.
_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}

# Rows of prompt logits turned into log-probabilities at once (bounds [rows, vocab] memory).
_PROMPT_LOGPROB_ROWS = 256


# The sampling a profiled step does on every logits row: the most memory any request can make
# the sampler use (sort for top-k and top-p, min-p, noise; log-probabilities of the raw logits).
_PROFILED_SAMPLING = SamplingParams(
    temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, logprobs=MAX_TOP_LOGPROBS
)


@dataclass(frozen=True, slots=True)
class MemoryProfile:
    """What sizing the KV pools measured (`ModelRunner.kv_pools_for_free_memory`), in
    bytes: the largest step's forward pass and its logits and sampling (allocated beyond what
    was in use before it; the sampling figure counts the hidden states the step keeps), what
    that step made the allocator reserve, the decode graphs' pool, what was in use on the
    device before (weights, CUDA context, other processes; with the first four read from a
    kept profile, also what the measuring build's steps had added: `ProfiledPeaks`) and the KV
    budget that was left."""

    forward_peak: int
    sampling_peak: int
    step_reserved: int
    graph_pool: int
    in_use: int
    kv_budget: int
    # Whether the first four were read from a MemoryProfileCache rather than measured.
    from_cache: bool = False


@dataclass(frozen=True, slots=True)
class _StepMemory:
    forward_peak: int
    sampling_peak: int
    reserved: int


# Not frozen: one is made per running sequence per step, and a frozen dataclass's constructor
# costs several times a plain one's (read-only by convention).
@dataclass(slots=True)
class ChunkResult:
    """What one scheduled chunk produced."""

    # The tokens sampled after it, one per step, when the chunk reached the sequence's end
    # (empty otherwise); the first one's log-probabilities when the request asked for them.
    token_ids: list[int]
    logprob: TokenLogprob | None
    # Log-probabilities of prompt tokens start+1 .. start+len, predicted at this chunk's positions.
    prompt_logprobs: list[TokenLogprob]


@dataclass(frozen=True, slots=True)
class _Batch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    query_ends: list[int]  # row of each chunk's last token
    state_meta: RecurrentStateMetadata | None  # a hybrid model's state slots


@dataclass(frozen=True, slots=True)
class _SampledLogprobs:
    """Host copies (complete once their step is done) of the sampled rows' log-probabilities."""

    chosen: torch.Tensor  # [S]
    top_ids: torch.Tensor  # [S, num_top]
    top_logprobs: torch.Tensor  # [S, num_top]


@dataclass(frozen=True, slots=True)
class _PromptLogprobs:
    """One chunk's prompt log-probabilities: the targets (known on the host) and host copies
    of what the device computed for them, in pieces of at most _PROMPT_LOGPROB_ROWS rows."""

    targets: list[int]
    pieces: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # chosen, top ids, top lps


@dataclass(frozen=True, slots=True)
class LaunchedStep:
    """A step queued on the device and not yet collected (`ModelRunner.collect`).

    Its sampled tokens stay on the device in `sampled` ([S, num_steps] int64, row r for the
    chunk `sampling_rows[r]`), where the next step reads the ones the host does not have yet.
    Everything the host needs is copied back by the step itself; `done` marks the end of it.
    """

    chunks: list[ScheduledChunk]
    num_steps: int
    sampling_rows: list[int]
    sampled: torch.Tensor | None
    sampled_on_host: torch.Tensor | None
    logprobs: _SampledLogprobs | None
    prompt_logprobs: dict[int, _PromptLogprobs]
    done: torch.cuda.Event | None
    # A greedy graph's step (or burst): the decode graphs' greedy buffer holds the last column
    # of `sampled`, row for row.
    sampled_in_graph: bool = False

    def rows_of(self) -> dict[Sequence, int]:
        """The row of `sampled` holding each sampled sequence's tokens."""
        return {self.chunks[i].seq: row for row, i in enumerate(self.sampling_rows)}


class ModelRunner:
    """Runs the model for scheduled chunks on one device; owns the KV cache tensors.

    Under tensor parallelism every rank has a runner around its shard; `peers` tells rank 0's
    forward passes, logits and set-up steps to the other ranks as they start (and is silent
    on the others, which run them because they were told: appliance.engine.parallel).
    """

    def __init__(
        self,
        model: CausalLM,
        block_size: int,
        device: torch.device | str,
        max_model_len: int,
        eos_token_ids: Collection[int] = frozenset(),
        peers: StepBroadcast | None = None,
    ):
        self.model = model
        self.peers = peers
        self.block_size = block_size
        self.device = torch.device(device)
        self.max_model_len = max_model_len
        # The tokens min_tokens holds back besides each request's stop_token_ids.
        self.eos_token_ids = eos_token_ids
        # The last sampling step's controls, whose token counts the next step may carry on.
        self._last_controls: SamplingControls | None = None
        self.kv_caches: list[torch.Tensor] = []
        # The windowed layers' caches are in a pool of their own (appliance.engine.kv_cache):
        # every step then carries the window group's slots and tables too.
        self.has_window_group = False
        # A hybrid model's linear layers' state, one slot per running sequence.
        self.recurrent_states: list[RecurrentState] = []
        self.graphs: DecodeGraphs | None = None
        self.prompt_graphs: PromptGraphs | None = None
        self.memory_profile: MemoryProfile | None = None
        self._uploader = Uploader(self.device)

    def set_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self.kv_caches = kv_caches

    def allocate_kv_caches(self, spec: KVCacheSpec, pools: KVPools) -> None:
        if self.peers is not None:
            self.peers.allocate_kv(pools)
        spec.verify_scales(self.model)
        self.kv_caches = spec.allocate(pools, self.device)
        self.has_window_group = pools.num_window_blocks > 0

    def allocate_recurrent_states(self, num_slots: int) -> None:
        """A hybrid model's state for `num_slots` sequences (before the KV pool is sized, which
        then counts it as in use)."""
        if self.peers is not None:
            self.peers.allocate_states(num_slots)
        linear = self.model.linear_attention  # this device's heads
        assert linear is not None, "only a hybrid model has a recurrent state"
        dtype = self.model.embed_tokens.weight.dtype
        self.recurrent_states = allocate_states(linear, num_slots, dtype, self.device)

    @torch.inference_mode()
    def kv_pools_for_free_memory(
        self,
        spec: KVCacheSpec,
        num_tokens: int,
        num_logit_rows: int,
        gpu_memory_utilization: float,
        graph_batch: int = 0,
        num_window_blocks: int = 0,
        cache: MemoryProfileCache | None = None,
    ) -> KVPools:
        """The KV pools that fit in `gpu_memory_utilization` of the GPU, after what is in use
        (weights, CUDA context, other processes) and what the largest step and the decode graphs
        need, measured here with a scratch cache just big enough for them (`memory_profile`):
        a prefill of `num_tokens` tokens, then logits and the sampler's most demanding path for
        `num_logit_rows` rows, then (`graph_batch` > 0) the CUDA graph of that decode batch.
        With `cache`, those peaks are read from it when it holds them, and kept in it when they
        were measured (appliance.engine.memory_profile_cache); what is in use is measured
        always. A window group's pool of `num_window_blocks` blocks comes out of that budget
        where it fits (`KVCacheSpec.pools_within`). Under tensor parallelism every rank
        profiles its own GPU and all take the smallest budget."""
        if self.peers is not None:
            self.peers.profile(
                num_tokens, num_logit_rows, gpu_memory_utilization, graph_batch, num_window_blocks
            )
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        peaks = cache.load(total) if cache is not None else None
        from_cache = peaks is not None
        if peaks is None:
            step, graph_pool = self._measure_peaks(
                spec, num_tokens, num_logit_rows, graph_batch, num_window_blocks
            )
            # The scratch cache given back: what the measuring steps left in use besides.
            torch.cuda.empty_cache()
            free_after, total = torch.cuda.mem_get_info(self.device)
            growth = max(0, free - free_after)
            free = free_after
            peaks = ProfiledPeaks(
                step.forward_peak, step.sampling_peak, step.reserved, graph_pool, growth
            )
            if cache is not None:
                cache.store(peaks)
        # In use: what is now, and, with peaks read rather than measured, what the measuring
        # build's first steps added outside torch's blocks (kernels loaded, cuBLAS's handles):
        # counted again if this process has it already, never left out.
        in_use = total - free + (peaks.first_steps_growth if from_cache else 0)
        step_need = max(peaks.step_reserved, peaks.forward_peak, peaks.sampling_peak)
        budget = int(total * gpu_memory_utilization) - in_use - step_need - peaks.graph_pool
        self.memory_profile = MemoryProfile(
            peaks.forward_peak,
            peaks.sampling_peak,
            peaks.step_reserved,
            peaks.graph_pool,
            in_use,
            budget,
            from_cache,
        )
        if self.peers is not None:
            budget = self.peers.agree_kv_budget(budget)
        how = f"read from {cache.path} the profile of" if from_cache and cache else "profiled"
        logger.info(
            "%s a %d-token step: forward peak %.2f GiB, logits and sampling peak %.2f GiB, "
            "step reserves %.2f GiB, decode graphs %.2f GiB; in use %.2f GiB, KV %.2f GiB",
            how,
            num_tokens,
            peaks.forward_peak / 2**30,
            peaks.sampling_peak / 2**30,
            peaks.step_reserved / 2**30,
            peaks.graph_pool / 2**30,
            in_use / 2**30,
            budget / 2**30,
        )
        pools = KVPools(0)
        if budget >= spec.bytes_per_block:
            pools = spec.pools_within(budget, num_window_blocks)
        if pools.num_blocks < self.max_blocks_per_seq:
            raise EngineConfigError(
                f"after the weights and activations, {budget / 2**30:.2f} GiB remain for the KV "
                f"cache: not enough for one sequence of {self.max_model_len} tokens; raise "
                "gpu_memory_utilization or lower max_model_len / max_num_batched_tokens"
            )
        return pools

    def _measure_peaks(
        self,
        spec: KVCacheSpec,
        num_tokens: int,
        num_logit_rows: int,
        graph_batch: int,
        num_window_blocks: int,
    ) -> tuple[_StepMemory, int]:
        """The largest step and the graphs' pool (`kv_pools_for_free_memory`), run on a scratch
        cache just big enough for them, which is dropped after."""
        # The collector paused: a collection that freed some earlier engine's memory during a
        # measurement would make this one's peaks look smaller (seen in the GPU tests).
        with collector_paused():
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            scratch = KVPools(-(-num_tokens // self.block_size) + 1)
            self.kv_caches = spec.allocate(scratch, self.device)
            step = self._profile_step(num_tokens, num_logit_rows)
            # The prompt steps' graphs are for models without a window group (`capture_graphs`).
            prompt_tokens = num_tokens if num_window_blocks == 0 else 0
            graph_pool = self._profile_graphs(graph_batch, prompt_tokens) if graph_batch else 0
            self.kv_caches = []
        return step, graph_pool

    def _profile_step(self, num_tokens: int, num_logit_rows: int) -> _StepMemory:
        """Run the largest step on the scratch cache: its forward pass, then logits and sampling
        as demanding as a step can ask for (every row filtered by top-k, top-p and min-p, the
        raw logits kept for log-probabilities), with the hidden states alive as in `launch`."""
        input_ids, positions, meta = self._profile_batch(num_tokens)
        state_meta = None
        if self.recurrent_states:
            # The scratch sequences' states, in the slots there are (their contents are junk).
            num_slots = self.recurrent_states[0].conv.shape[0]
            slots = [b % num_slots for b in range(len(meta.query_lens))]
            state_slots = self._to_device(slots, torch.int32)
            state_meta = self._state_meta(state_slots, [False] * len(slots), meta)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        allocated, reserved = self._allocated_and_reserved()
        hidden = self.run_model(input_ids, positions, meta, state_meta)
        torch.cuda.synchronize(self.device)
        forward_peak = torch.cuda.max_memory_allocated(self.device) - allocated
        torch.cuda.reset_peak_memory_stats(self.device)
        # Prompt log-probabilities take _PROMPT_LOGPROB_ROWS rows at a time.
        rows = max(num_logit_rows, min(num_tokens, _PROMPT_LOGPROB_ROWS))
        logits = self.model.compute_logits(hidden[:rows])
        params = [_PROFILED_SAMPLING] * rows
        sampled = sample(logits, params, [None] * rows, in_place=False)
        token_logprobs(logits, sampled, MAX_TOP_LOGPROBS)
        torch.cuda.synchronize(self.device)
        sampling_peak = torch.cuda.max_memory_allocated(self.device) - allocated
        step_reserved = torch.cuda.max_memory_reserved(self.device) - reserved
        return _StepMemory(forward_peak, sampling_peak, step_reserved)

    def _profile_graphs(self, graph_batch: int, max_prompt_tokens: int) -> int:
        """Bytes the CUDA graphs keep: those of the largest decode batch and the largest prompt
        step, captured on the scratch cache into one pool (each smaller graph reuses it:
        appliance.engine.cuda_graphs, appliance.engine.prompt_graphs)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        _, before = self._allocated_and_reserved()
        prompt_graphs, graphs, captures = self._graph_captures(
            graph_batch, max_prompt_tokens, only_largest=True
        )
        for capture in captures:
            capture()
        # The warm-up's eager activations are cached outside the pool: drop them.
        torch.cuda.empty_cache()
        _, after = self._allocated_and_reserved()
        del graphs, prompt_graphs
        return after - before

    def _allocated_and_reserved(self) -> tuple[int, int]:
        return torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device)

    def _profile_batch(
        self, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """A prefill of `num_tokens` dummy tokens in sequences of at most max_model_len, laid
        out contiguously in a scratch cache: the largest step the scheduler can produce."""
        lengths = [self.max_model_len] * (num_tokens // self.max_model_len)
        if num_tokens % self.max_model_len:
            lengths.append(num_tokens % self.max_model_len)
        tables, first = [], 0
        for n in lengths:
            num_blocks = -(-n // self.block_size)
            tables.append(list(range(first, first + num_blocks)))
            first += num_blocks
        width = max(len(t) for t in tables)
        block_tables = torch.tensor(
            [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=self.device
        )
        slots = torch.cat(
            [
                torch.arange(n, device=self.device) + t[0] * self.block_size
                for n, t in zip(lengths, tables, strict=True)
            ]
        )
        meta = AttentionMetadata.build(slots, block_tables, seq_lens=lengths, query_lens=lengths)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lengths])
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        return input_ids, positions, meta

    def release_graphs(self) -> None:
        """Free the CUDA graphs (before the tensor-parallel groups are left: the decode graphs
        hold the NCCL communicator); later steps run the model eagerly."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
        if self.prompt_graphs is not None:
            self.prompt_graphs.release()
            self.prompt_graphs = None

    def release_kv_caches(self) -> None:
        """Free the KV caches, the CUDA graphs first (the prompt graphs' recorded attention
        holds the caches), so that a next engine in this process is sized from free memory:
        this runner steps no more."""
        self.release_graphs()
        self.kv_caches = []

    def capture_graphs(self, max_batch: int, max_prompt_tokens: int = 0) -> None:
        """Capture every graph of `graph_captures` now."""
        for capture in self.graph_captures(max_batch, max_prompt_tokens):
            capture()

    def graph_captures(
        self, max_batch: int, max_prompt_tokens: int = 0
    ) -> list[Callable[[], None]]:
        """The decode graphs up to `max_batch` rows and, for a model they serve, the prompt
        steps' graphs up to `max_prompt_tokens` tokens (the step's token budget), in one pool:
        one capture per graph, to be run in order (the prompt steps' largest first, the largest
        need), each graph replayed from its capture on, steps allowed between two captures.
        Under tensor parallelism one capture, of every rank's graphs at once."""
        if self.peers is None:
            self.prompt_graphs, self.graphs, captures = self._graph_captures(
                max_batch, max_prompt_tokens
            )
            return captures
        peers = self.peers

        def capture_all() -> None:
            peers.capture_graphs(max_batch)
            self.prompt_graphs, self.graphs, captures = self._graph_captures(
                max_batch, max_prompt_tokens
            )
            for capture in captures:
                capture()

        return [capture_all]

    def _graph_captures(
        self, max_batch: int, max_prompt_tokens: int, *, only_largest: bool = False
    ) -> tuple[PromptGraphs | None, DecodeGraphs, list[Callable[[], None]]]:
        """Both kinds of graph over the current KV caches, in one new pool, and their
        captures, the prompt steps' first (`only_largest`: each kind's largest size alone, to
        measure the pool)."""
        pool = torch.cuda.graph_pool_handle()
        sizes = self._prompt_graph_sizes(max_prompt_tokens)
        prompt_graphs = None
        captures: list[Callable[[], None]] = []
        if sizes:
            prompt_graphs = PromptGraphs(
                self.model,
                self.kv_caches,
                pool,
                self.capture_stream,
                max_seqs=max_batch,
                max_blocks_per_seq=self.max_blocks_per_seq,
            )
            captures += prompt_graphs.captures(sizes[-1:] if only_largest else sizes)
        graphs = self._decode_graphs(pool)
        captures += graphs.captures(max_batch, only_largest=only_largest)
        return prompt_graphs, graphs, captures

    @property
    def max_blocks_per_seq(self) -> int:
        """The blocks of a sequence of max_model_len tokens: the widest block table."""
        return -(-self.max_model_len // self.block_size)

    @property
    def capture_stream(self) -> torch.cuda.Stream:
        """The stream every CUDA graph on this device is captured on, the same for every runner
        of the process: cuBLAS keeps a workspace per stream, and one made while capturing stays
        in that capture's pool for good (a new stream per engine would leave one behind each)."""
        stream = _CAPTURE_STREAMS.get(self.device)
        if stream is None:
            stream = _CAPTURE_STREAMS[self.device] = torch.cuda.Stream(self.device)
        return stream

    @property
    def _plain_inputs(self) -> bool:
        """One device, no recurrent states, no window group: a step's inputs are its ids,
        positions, slots and tables alone, all the greedy and prompt graphs stage."""
        return self.peers is None and not self.recurrent_states and not self.has_window_group

    def _prompt_graph_sizes(self, max_prompt_tokens: int) -> list[int]:
        """The padded token counts of the prompt steps' graphs: none for a model whose steps
        need more inputs (`_plain_inputs`)."""
        if not self._plain_inputs:
            return []
        return [size for size in PROMPT_GRAPH_SIZES if size <= max_prompt_tokens]

    def _decode_graphs(self, pool: tuple[int, int]) -> DecodeGraphs:
        """Decode graphs (not captured yet) over the current KV caches, allocating from `pool`."""
        from kernels.decode_attention import choose_num_splits

        num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        # This device's KV heads (a share of them under tensor parallelism).
        num_kv_heads = self.model.attentions[0].num_kv_heads
        max_model_len = self.max_model_len

        def num_splits_for(batch: int) -> int:
            return choose_num_splits(batch, num_kv_heads, max_model_len, num_sms)

        return DecodeGraphs(
            self.model,
            self.kv_caches,
            self.max_blocks_per_seq,
            num_splits_for,
            self.recurrent_states,
            window_group=self.has_window_group,
            greedy_tail=self._greedy_tail if self._plain_inputs else None,
            pool=pool,
            stream=self.capture_stream,
        )

    def _greedy_tail(self, hidden: torch.Tensor, out: torch.Tensor) -> None:
        # The argmax of the LM head's own output is that of its float32 copy: no copy.
        greedy_tokens(self.model.compute_logits(hidden, float32=False), out)

    def execute(
        self, chunks: Seq[ScheduledChunk], generators: Seq[torch.Generator | None]
    ) -> list[ChunkResult]:
        """Run one step and wait for it. `generators[i]` drives sampling for `chunks[i]` (None:
        global RNG)."""
        return self.collect(self.launch(chunks, 1, generators))

    @torch.inference_mode()
    def launch(
        self,
        chunks: Seq[ScheduledChunk],
        num_steps: int,
        generators: Seq[torch.Generator | None],
        previous: LaunchedStep | None = None,
    ) -> LaunchedStep:
        """Queue a step on the device and return without waiting for it.

        `num_steps` > 1 is a decode burst: single-token chunks run that many steps back to
        back, the tokens sampled in one step being the next step's inputs without leaving the
        device. A chunk whose input token is still being sampled by `previous` (asynchronous
        scheduling: `seq.num_pending_tokens`) reads it from `previous.sampled` on the device.
        No chunk with pending tokens follows a grammar (each mask needs the token before: the
        engine collects first) and a burst has none (the scheduler never bursts those).
        """
        chunks = list(chunks)
        if self._greedy_graph_fits(chunks):
            return self._launch_greedy(chunks, num_steps, previous)
        batch = self._prepare(chunks, previous)
        sampling_rows = [i for i, c in enumerate(chunks) if c.samples]
        logprobs, prompt_logprobs = None, {}
        if num_steps > 1:
            sampled = self._decode_burst(chunks, num_steps, generators, batch)
        else:
            hidden = self._forward(batch.input_ids, batch.positions, batch.meta, batch.state_meta)
            sampled, logprobs = self._sample_step(chunks, sampling_rows, generators, batch, hidden)
            prompt_logprobs = self._prompt_logprobs(chunks, hidden)
        on_host = None if sampled is None else self._copy_to_host(sampled)
        return LaunchedStep(
            chunks,
            num_steps,
            sampling_rows,
            sampled,
            on_host,
            logprobs,
            prompt_logprobs,
            self._step_done(),
        )

    def _step_done(self) -> torch.cuda.Event | None:
        """An event after everything queued for the step so far, its copies to the host
        included (None on the CPU, where nothing is queued)."""
        if self.device.type != "cuda":
            return None
        # A blocking event puts the collecting thread to sleep; a plain `tolist()` would spin on
        # the stream (a whole core for the whole step) and wait for every step queued since,
        # not only this one.
        done = torch.cuda.Event(blocking=True)
        done.record()
        return done

    def _greedy_graph_fits(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether a step runs as a greedy graph's replay: a decode batch the greedy graphs
        fit, each row sampling its next token greedily with nothing else asked (no
        log-probabilities, grammar or sampling controls)."""
        graphs = self.graphs
        if graphs is None or not 0 < len(chunks) <= graphs.greedy_max_batch:
            return False
        return all(
            c.num_new_tokens == 1
            and c.samples
            and c.seq.params.greedy
            and c.seq.params.logprobs is None
            and c.seq.grammar is None
            and not c.seq.wants_prompt_logprobs
            and not SamplingControls.adjusts(c.seq)
            for c in chunks
        )

    def _launch_greedy(
        self, chunks: list[ScheduledChunk], num_steps: int, previous: LaunchedStep | None
    ) -> LaunchedStep:
        """A greedy decode step as one packed copy in, one replay and one copy out; a burst of
        `num_steps` as one copy in of every step's inputs, a replay per step (each reading the
        tokens the replay before it wrote) and one copy out."""
        graphs = self.graphs
        assert graphs is not None
        batch, bs = len(chunks), self.block_size
        # The scheduler allocated every step's blocks: the tables serve the whole burst.
        tables = _block_tables([c.seq.block_table for c in chunks])
        starts = np.fromiter((c.start for c in chunks), np.int64, batch)
        # One token a chunk: a row of input_ids is the chunk's row.
        input_ids, pending = _input_tokens(chunks, previous)
        ids = np.asarray(input_ids, np.int64)
        sources = np.full(batch, -1, np.int64)
        if pending:
            assert previous is not None and previous.sampled is not None
            if previous.sampled_in_graph:
                # The last greedy replay's rows are the buffer's rows.
                for source, row in pending:
                    sources[row] = source
            else:
                # Gathered into the buffer's first rows, which the replay reads before writing.
                gathered = [source for source, _ in pending]
                graphs.greedy_sampled[: len(pending)] = previous.sampled[
                    self._to_device(gathered, torch.int64), -1
                ]
                for i, (_, row) in enumerate(pending):
                    sources[row] = i
        rows = np.arange(batch)
        packed = []
        for step in range(num_steps):
            positions = starts + step
            fields = {
                "ids": ids,
                "positions": positions,
                "slots": tables[rows, positions // bs].astype(np.int64) * bs + positions % bs,
                "sources": sources,
                "seq_lens": positions + 1,
            }
            packed.append(graphs.greedy_layout.pack(fields, tables))
            sources = rows  # later steps read the tokens the step before wrote, row for row
        self._last_controls = None  # as `_controls` leaves it for a step without controls
        if num_steps == 1:
            self._uploader.copy_into(packed[0], graphs.greedy_packed)
            sampled = graphs.run_greedy(batch)[:, None]
        else:
            staged = self._uploader.upload({}, {"steps": np.stack(packed)})["steps"]
            sampled = torch.empty(batch, num_steps, dtype=torch.int64, device=self.device)
            for step in range(num_steps):
                graphs.greedy_packed[: staged.shape[1]].copy_(staged[step])
                sampled[:, step] = graphs.run_greedy(batch)
        on_host = self._copy_to_host(sampled)
        return LaunchedStep(
            chunks,
            num_steps,
            list(range(batch)),
            sampled,
            on_host,
            None,
            {},
            self._step_done(),
            sampled_in_graph=True,
        )

    def collect(self, step: LaunchedStep) -> list[ChunkResult]:
        """Wait (asleep) for a launched step and return what each of its chunks produced."""
        if step.done is not None:
            step.done.synchronize()
        token_ids: dict[int, list[int]] = {}
        if step.sampled_on_host is not None:
            token_ids = dict(zip(step.sampling_rows, step.sampled_on_host.tolist(), strict=True))
        logprobs = self._collect_logprobs(step)
        prompt = {i: _collect_prompt(p) for i, p in step.prompt_logprobs.items()}
        return [
            ChunkResult(token_ids.get(i, []), logprobs.get(i), prompt.get(i, []))
            for i in range(len(step.chunks))
        ]

    def _sample_step(
        self,
        chunks: list[ScheduledChunk],
        sampling_rows: list[int],
        generators: Seq[torch.Generator | None],
        batch: _Batch,
        hidden: torch.Tensor,
    ) -> tuple[torch.Tensor | None, _SampledLogprobs | None]:
        """Sample the next token of each chunk that reaches its sequence's end: [S, 1] ids on
        the device, and host copies of their log-probabilities where asked for."""
        if not sampling_rows:
            return None, None
        seqs = [chunks[i].seq for i in sampling_rows]
        # The grammars' masks are computed here, on the host, while the device runs the forward
        # pass queued above.
        masks = TokenMasks.for_rows([s.grammar for s in seqs], self.model.config.vocab_size)
        if masks is not None:
            masks.fill()
        ends = [batch.query_ends[i] for i in sampling_rows]
        if len(ends) < hidden.shape[0]:
            hidden = hidden[self._to_device(ends, torch.int64)]
        # else every row ends its chunk (a decode step): the rows are hidden's, in order
        params = [s.params for s in seqs]
        wants_logprobs = any(p.logprobs is not None for p in params)
        controls = self._controls(seqs)
        # Greedy rows with nothing else asked take the argmax of the projection's own output,
        # the same token as of its float32 copy, which is not made (at 512 rows, 262 MB).
        plain_greedy = (
            masks is None
            and controls is None
            and not wants_logprobs
            and all(p.greedy for p in params)
        )
        logits = self._compute_logits(hidden, float32=not plain_greedy)
        adjusted = logits if controls is None else controls.apply(logits)
        if masks is not None:
            adjusted = masks.apply(adjusted)
        # The sampler overwrites what it is given, unless told to keep the raw logits that
        # log-probabilities are of (the controls and masks above copy them already).
        keep = adjusted is logits and wants_logprobs
        chosen_generators = [generators[i] for i in sampling_rows]
        sampled = sample(adjusted, params, chosen_generators, in_place=not keep)
        del adjusted
        if controls is not None:
            controls.record(sampled)
        logprobs = None
        if wants_logprobs:
            num_top = max((p.logprobs or 0) for p in params)
            chosen, top_ids, top_lps = token_logprobs(logits, sampled, num_top)
            logprobs = _SampledLogprobs(*map(self._copy_to_host, (chosen, top_ids, top_lps)))
        return sampled[:, None], logprobs

    def _decode_burst(
        self,
        chunks: list[ScheduledChunk],
        num_steps: int,
        generators: Seq[torch.Generator | None],
        batch: _Batch,
    ) -> torch.Tensor:
        """[N, num_steps] tokens of `num_steps` decode steps of single-token chunks."""
        params = [c.seq.params for c in chunks]
        controls = self._controls([c.seq for c in chunks])
        input_ids, positions, meta = batch.input_ids, batch.positions, batch.meta
        sampled: list[torch.Tensor] = []
        for step in range(num_steps):
            if step:
                # Positions and slots of later steps are known on the host: the scheduler
                # allocated every step's blocks up front.
                pos = [c.start + step for c in chunks]
                bs = self.block_size
                slots = [
                    c.seq.block_table[p // bs] * bs + p % bs
                    for c, p in zip(chunks, pos, strict=True)
                ]
                window_slots, window_tables = None, None
                if meta.window_group is not None:
                    window_slots = self._to_device(
                        [
                            c.seq.window_blocks.block_table[p // bs] * bs + p % bs
                            for c, p in zip(chunks, pos, strict=True)
                        ],
                        torch.int64,
                    )
                    window_tables = meta.window_group.block_tables
                positions = self._to_device(pos, torch.int64)
                meta = AttentionMetadata.build(
                    self._to_device(slots, torch.int64),
                    meta.block_tables,
                    seq_lens=[p + 1 for p in pos],
                    query_lens=meta.query_lens,
                    window_slot_mapping=window_slots,
                    window_block_tables=window_tables,
                )
            # The same state slots every step: each step continues the state the last left.
            hidden = self._forward(input_ids, positions, meta, batch.state_meta)
            logits = self._compute_logits(hidden)
            if controls is not None:
                logits = controls.apply(logits, step)
            input_ids = sample(logits, params, generators)
            if controls is not None:
                controls.record(input_ids)
            sampled.append(input_ids)
        return torch.stack(sampled, dim=1)

    def _copy_to_host(self, values: torch.Tensor) -> torch.Tensor:
        """A host copy of a device tensor, queued behind the work computing it (into pinned
        memory, so the copy does not wait for anything queued later)."""
        if self.device.type == "cuda":
            return values.to("cpu", non_blocking=True)
        return values

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        state_meta: RecurrentStateMetadata | None,
    ) -> torch.Tensor:
        if self.peers is not None:
            self.peers.forward(input_ids, positions, meta, state_meta)
        return self.run_model(input_ids, positions, meta, state_meta)

    def _compute_logits(self, hidden: torch.Tensor, *, float32: bool = True) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 (`float32=False`: see `CausalLM.compute_logits`).
        Every logits computation goes through here: under tensor parallelism the other ranks
        must join it, and every rank gathers float32 logits (`parallel.sharding`)."""
        if self.peers is not None:
            self.peers.logits(hidden)
            return self.model.compute_logits(hidden)
        return self.model.compute_logits(hidden, float32=float32)

    def run_model(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        state_meta: RecurrentStateMetadata | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden]: from a CUDA graph for decode batches that fit one, from
        the prompt graphs for other steps that fit those. `state_meta`: a hybrid
        model's state slots (None for any other model)."""
        graphs = self.graphs
        if meta.decode_only and graphs is not None and len(meta.query_lens) <= graphs.max_batch:
            return graphs.run(
                input_ids,
                positions,
                meta,
                None if state_meta is None else state_meta.state_slots,
            )
        prompt_graphs = self.prompt_graphs
        if prompt_graphs is not None and (pieces := prompt_graphs.pieces(meta.query_lens)):
            return prompt_graphs.run(input_ids, positions, meta, pieces)
        return self.model(
            input_ids, positions, self.kv_caches, meta, self.recurrent_states, state_meta
        )

    def _controls(self, seqs: list[Sequence]) -> SamplingControls | None:
        controls = SamplingControls.build(
            seqs,
            self.eos_token_ids,
            self.model.config.vocab_size,
            self._to_device,
            self._last_controls,
        )
        self._last_controls = controls
        return controls

    def _to_device(
        self, values: list[int] | list[float] | np.ndarray, dtype: torch.dtype
    ) -> torch.Tensor:
        host = torch.from_numpy(values) if isinstance(values, np.ndarray) else torch.tensor(values)
        host = host.to(dtype)
        if self.device.type == "cuda":
            # Pinned staging lets the copy run asynchronously with the host's next work.
            return host.pin_memory().to(self.device, non_blocking=True)
        return host

    def _prepare(self, chunks: list[ScheduledChunk], previous: LaunchedStep | None) -> _Batch:
        bs = self.block_size
        block_tables = _block_tables([c.seq.block_table for c in chunks])
        input_ids, in_flight = _input_tokens(chunks, previous)
        # Every token's position and cache slot at once: [T] arrays, no loop over tokens.
        num_new = np.fromiter((c.num_new_tokens for c in chunks), np.int64, len(chunks))
        starts = np.fromiter((c.start for c in chunks), np.int64, len(chunks))
        ends = np.cumsum(num_new)
        rows = np.repeat(np.arange(len(chunks)), num_new)
        positions = np.repeat(starts - (ends - num_new), num_new) + np.arange(ends[-1])
        slots = block_tables[rows, positions // bs].astype(np.int64) * bs + positions % bs
        query_ends = (ends - 1).tolist()
        # Every integer input of the step in one copy (appliance.engine.packed_inputs).
        int64s = {
            "input_ids": np.asarray(input_ids, np.int64),
            "positions": positions,
            "slots": slots,
        }
        int32s = {
            "block_tables": block_tables,
            "seq_lens": (starts + num_new).astype(np.int32),
            "query_start_loc": np.concatenate(([0], ends)).astype(np.int32),
        }
        if self.has_window_group:
            # The same positions in the window group's pool (its tables are as long).
            tables = _block_tables([c.seq.window_blocks.block_table for c in chunks])
            int64s["window_slots"] = (
                tables[rows, positions // bs].astype(np.int64) * bs + positions % bs
            )
            int32s["window_tables"] = tables
        if in_flight:
            sources, targets = zip(*in_flight, strict=True)
            int64s["sources"] = np.asarray(sources, np.int64)
            int64s["targets"] = np.asarray(targets, np.int64)
        if self.recurrent_states:
            # A chunk from position 0 starts a state; a later one continues its slot's (the
            # slot holds the tokens before `start`: prefix caching is off for these models).
            state_slots = [c.seq.state_slot for c in chunks]
            assert None not in state_slots, "a running sequence of a hybrid model holds a slot"
            int32s["state_slots"] = np.asarray(state_slots, np.int32)
        on_device = self._uploader.upload(int64s, int32s)
        meta = AttentionMetadata.build(
            on_device["slots"],
            on_device["block_tables"],
            seq_lens=int32s["seq_lens"].tolist(),
            query_lens=num_new.tolist(),
            window_slot_mapping=on_device.get("window_slots"),
            window_block_tables=on_device.get("window_tables"),
            device_lengths=(on_device["seq_lens"], on_device["query_start_loc"]),
        )
        state_meta = None
        if self.recurrent_states:
            continues = [c.start > 0 for c in chunks]
            state_meta = self._state_meta(on_device["state_slots"], continues, meta)
        input_ids_t = on_device["input_ids"]
        if in_flight:
            assert previous is not None and previous.sampled is not None
            # The previous step's last sampled token of each: read on the device, no waiting.
            input_ids_t[on_device["targets"]] = previous.sampled[on_device["sources"], -1]
        positions_t = on_device["positions"]
        return _Batch(input_ids_t, positions_t, meta, query_ends, state_meta)

    def _state_meta(
        self, state_slots: torch.Tensor, has_initial_state: list[bool], meta: AttentionMetadata
    ) -> RecurrentStateMetadata:
        """state_slots: [B] int32 on the device."""
        return RecurrentStateMetadata(
            state_slots=state_slots,
            has_initial_state=self._to_device(has_initial_state, torch.bool),
            query_start_loc=meta.query_start_loc,
            query_lens=meta.query_lens,
            decode_only=meta.decode_only,
        )

    @staticmethod
    def _collect_logprobs(step: LaunchedStep) -> dict[int, TokenLogprob]:
        """Log-probabilities for the rows whose request asked for them, keyed by chunk index."""
        if step.logprobs is None or step.sampled_on_host is None:
            return {}
        # One conversion each, not one per row.
        ids = step.sampled_on_host[:, 0].tolist()
        chosen = step.logprobs.chosen.tolist()
        top_ids, top_lps = step.logprobs.top_ids.tolist(), step.logprobs.top_logprobs.tolist()
        results = {}
        for row, chunk_index in enumerate(step.sampling_rows):
            k = step.chunks[chunk_index].seq.params.logprobs
            if k is None:
                continue
            top = tuple(zip(top_ids[row][:k], top_lps[row][:k], strict=True))
            results[chunk_index] = TokenLogprob(ids[row], chosen[row], top)
        return results

    def _prompt_logprobs(
        self, chunks: list[ScheduledChunk], hidden: torch.Tensor
    ) -> dict[int, _PromptLogprobs]:
        results: dict[int, _PromptLogprobs] = {}
        offset = 0
        for i, chunk in enumerate(chunks):
            seq = chunk.seq
            first = offset
            offset += chunk.num_new_tokens
            if not seq.wants_prompt_logprobs:
                continue
            # Position p predicts token p + 1; only prompt tokens count.
            last = min(chunk.start + chunk.num_new_tokens, seq.num_prompt_tokens - 1)
            num_rows = last - chunk.start
            if num_rows <= 0:
                continue
            k = seq.params.prompt_logprobs or 0
            targets = seq.token_ids[chunk.start + 1 : chunk.start + num_rows + 1]
            pieces = []
            for row in range(0, num_rows, _PROMPT_LOGPROB_ROWS):
                rows = range(row, min(row + _PROMPT_LOGPROB_ROWS, num_rows))
                logits = self._compute_logits(hidden[first + rows.start : first + rows.stop])
                piece = token_logprobs(
                    logits, self._to_device(targets[rows.start : rows.stop], torch.int64), k
                )
                pieces.append(tuple(map(self._copy_to_host, piece)))
            results[i] = _PromptLogprobs(targets, pieces)
        return results


def _input_tokens(
    chunks: list[ScheduledChunk], previous: LaunchedStep | None
) -> tuple[list[int], list[tuple[int, int]]]:
    """The step's [T] input token ids, a 0 where the host does not have the token yet (the
    step in flight, `previous`, is still sampling it), and those tokens as (row of
    previous.sampled, index into the ids)."""
    input_ids: list[int] = []
    in_flight: list[tuple[int, int]] = []
    previous_rows: dict[Sequence, int] | None = None
    for chunk in chunks:
        seq, start, end = chunk.seq, chunk.start, chunk.start + chunk.num_new_tokens
        if end > len(seq.token_ids):
            if previous_rows is None:
                assert previous is not None, "a pending token comes from the step in flight"
                previous_rows = previous.rows_of()
            in_flight.append((previous_rows[seq], len(input_ids)))
            input_ids.append(0)  # a placeholder, replaced on the device
        else:
            input_ids.extend(seq.token_ids[start:end])
    return input_ids, in_flight


def _block_tables(tables: list[list[int]]) -> np.ndarray:
    """[N, longest] int32: each sequence's block table in a row, zero-padded. Filled in one
    numpy operation rather than one per sequence (a decode step has hundreds)."""
    lengths = np.fromiter(map(len, tables), np.int64, len(tables))
    flat = np.fromiter(itertools.chain.from_iterable(tables), np.int32, int(lengths.sum()))
    block_tables = np.zeros((len(tables), int(lengths.max())), np.int32)
    block_tables[np.arange(block_tables.shape[1]) < lengths[:, None]] = flat
    return block_tables


def _collect_prompt(logprobs: _PromptLogprobs) -> list[TokenLogprob]:
    out: list[TokenLogprob] = []
    targets = iter(logprobs.targets)
    for chosen, top_ids, top_lps in logprobs.pieces:
        for lp, ids, lps in zip(chosen.tolist(), top_ids.tolist(), top_lps.tolist(), strict=True):
            out.append(TokenLogprob(next(targets), lp, tuple(zip(ids, lps, strict=True))))
    return out

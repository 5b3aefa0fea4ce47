"""The synchronous engine: submit requests, call `step()` until they finish, abort at will."""

from __future__ import annotations

import collections
import itertools
import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

import torch

from appliance.engine.block_manager import BlockManager, window_pool_num_blocks
from appliance.engine.detokenizer import detokenizer_for
from appliance.engine.engine_config import EngineConfig
from appliance.engine.errors import (
    ContextLengthExceededError,
    EngineConfigError,
    InvalidRequestError,
    TensorParallelError,
)
from appliance.engine.kv_cache import KVCacheSpec, KVPools
from appliance.engine.memory_profile_cache import MemoryProfileCache
from appliance.engine.model_runner import LaunchedStep, ModelRunner
from appliance.engine.models.config import ModelConfig
from appliance.engine.models.decoder import CausalLM
from appliance.engine.models.loader import load_model
from appliance.engine.models.recurrent_state import (
    HYBRID_PREFIX_CACHING_OFF,
    state_bytes_per_slot,
)
from appliance.engine.outputs import EngineStats, RequestOutput, RequestState
from appliance.engine.parallel.group import TensorParallelGroup
from appliance.engine.parallel.sharding import ShardPlan
from appliance.engine.parallel.worker import SealedWeights
from appliance.engine.sampling_params import SamplingParams
from appliance.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from appliance.engine.sequence import RequestId, Sequence, SequenceStatus
from appliance.engine.state_slots import StateSlots
from appliance.engine.structured_output import GrammarCompiler
from appliance.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# How long a failed step waits to learn that it failed because a worker died (the collective may
# see the closed socket before the watch thread sees the process end).
_WORKER_DEATH_GRACE_S = 2.0


def _hybrid_state_slots(
    config: EngineConfig, model_config: ModelConfig, runner: ModelRunner
) -> StateSlots | None:
    """A hybrid model's recurrent state, one slot per running sequence (max_num_seqs),
    allocated before the KV pool is sized from what remains; None for any other model."""
    if not model_config.is_hybrid:
        return None
    if config.enable_prefix_caching:
        logger.info(HYBRID_PREFIX_CACHING_OFF)
    runner.allocate_recurrent_states(config.max_num_seqs)
    linear = runner.model.linear_attention  # this GPU's share of the heads
    assert linear is not None
    logger.info(
        "recurrent state: %d slots of %.2f MiB per GPU (%d linear-attention layers)",
        config.max_num_seqs,
        state_bytes_per_slot(linear, config.torch_dtype) / 2**20,
        linear.num_linear_layers,
    )
    return StateSlots(config.max_num_seqs)


def _window_pool_num_blocks(
    config: EngineConfig, model_config: ModelConfig, max_model_len: int
) -> int:
    """The window group's pool for a model with windowed and full layers (0 for any other):
    never short for max_num_seqs sequences (block_manager.window_pool_num_blocks)."""
    window = model_config.window_group_window
    if window is None:
        return 0
    max_step_tokens = max(config.max_num_batched_tokens, config.max_num_seqs * config.decode_burst)
    return window_pool_num_blocks(
        window, config.block_size, config.max_num_seqs, max_step_tokens, max_model_len
    )


def _block_manager(
    config: EngineConfig, model_config: ModelConfig, pools: KVPools, prefix_caching: bool
) -> BlockManager:
    """The full group's block manager, keeping the window group's in step when the pools have
    two groups (prefix_caching: False for a hybrid model, whose states it cannot restore)."""
    enable = config.enable_prefix_caching and prefix_caching
    window = model_config.window_group_window
    if pools.num_window_blocks and window is not None:
        return BlockManager.with_window_group(
            pools.num_blocks,
            pools.num_window_blocks,
            config.block_size,
            window,
            enable_prefix_caching=enable,
        )
    return BlockManager(
        pools.num_blocks,
        config.block_size,
        enable_prefix_caching=enable,
        kv_window=model_config.kv_window,
    )


def _describe_pools(pools: KVPools, num_window_blocks: int, model_config: ModelConfig) -> str:
    """The start-up log's words for the KV pools (and why there is one where two could be)."""
    if pools.num_window_blocks:
        return (
            f"{pools.num_blocks} KV blocks for the full layers and {pools.num_window_blocks} "
            f"for the {len(model_config.window_group)} layers of window "
            f"{model_config.window_group_window} (KV groups)"
        )
    if num_window_blocks:
        return (
            f"{pools.num_blocks} KV blocks (one pool: a window pool of {num_window_blocks} "
            "blocks would take more than its layers' share; lower max_num_seqs for two)"
        )
    return f"{pools.num_blocks} KV blocks"


@dataclass(frozen=True, slots=True)
class Completion:
    """A finished request, as returned by `Engine.generate`."""

    text: str
    token_ids: list[int]
    finish_reason: str
    num_cached_tokens: int


class Engine:
    """Continuous batching over a paged KV cache.

    `add_request` validates and queues; each `step` schedules one batch (decodes and prefill
    chunks together), runs it, and returns an update for every request that produced a token or
    finished. Invalid requests are refused at `add_request`, so they never disturb the others.

    With `async_scheduling`, a step schedules and launches the next batch before it waits for
    the one in flight and processes its outputs, so the device always has a step queued while
    the host works (docs/ARCHITECTURE.md, "Asynchronous scheduling").
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        runner: ModelRunner,
        scheduler: Scheduler,
        *,
        vocab_size: int,
        device: torch.device | str = "cpu",
        group: TensorParallelGroup | None = None,
        async_scheduling: bool = False,
        graph_captures: Seq[Callable[[], None]] = (),
    ):
        """graph_captures: the runner's CUDA graphs still to capture, in order
        (`capture_pending_graph`)."""
        # Without a tokenizer the engine takes and returns token ids only (benchmarks).
        self.tokenizer = tokenizer
        self.runner = runner
        self.scheduler = scheduler
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.max_model_len = scheduler.config.max_model_len
        self.group = group
        self.async_scheduling = async_scheduling
        # The step launched and not yet processed (asynchronous scheduling keeps one queued).
        self._in_flight: LaunchedStep | None = None
        self._requests: dict[RequestId, RequestState] = {}
        # The unfinished sequences whose next step needs their last token on the host.
        self._host_bound: set[Sequence] = set()
        self._generators: dict[RequestId, torch.Generator] = {}
        self._arrivals = itertools.count()
        self._graph_captures = collections.deque(graph_captures)
        self._graph_capture_s = 0.0
        self.grammars = (
            None
            if tokenizer is None
            else GrammarCompiler(tokenizer.to_json, vocab_size, tokenizer.eos_token_ids)
        )

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        """Load the model directory's weights and tokenizer and build the engine around them."""
        model_dir = Path(config.model_dir)
        device = config.torch_device
        ModelConfig.from_model_dir(model_dir)  # the clearest errors first, before any heavy load
        tokenizer = Tokenizer.from_model_dir(model_dir)

        def load_weights(shard: ShardPlan | None) -> CausalLM:
            return load_model(
                model_dir,
                dtype=config.torch_dtype,
                device=device,
                ops=config.kernel_ops(),
                shard=shard,
                quantization=config.quantization,
            )

        return cls.load(config, tokenizer, load_weights)

    @classmethod
    def load(
        cls,
        config: EngineConfig,
        tokenizer: Tokenizer | None,
        load_weights: Callable[[ShardPlan | None], CausalLM],
        *,
        sealed: SealedWeights | None = None,
        random_weights: bool = False,
    ) -> Engine:
        """Start the config's tensor-parallel workers (if any), load this process's weights
        with `load_weights(shard)` (rank 0's part, or None: all of them), and build the engine
        around them. The workers are stopped if anything fails. `sealed`: the workers decrypt
        their parts of this sealed model (as `load_weights` must for rank 0); `random_weights`:
        the workers draw theirs at random (warm-up, benchmarks)."""
        group = config.start_workers(sealed=sealed, random_weights=random_weights)
        try:
            model = load_weights(None if group is None else group.plan)
            return cls.build(config, model, tokenizer, group=group)
        except BaseException:
            if group is not None:
                group.close()
            raise

    @classmethod
    def build(
        cls,
        config: EngineConfig,
        model: CausalLM,
        tokenizer: Tokenizer | None,
        *,
        group: TensorParallelGroup | None = None,
    ) -> Engine:
        """Size the KV pool, make the scheduler and runner, and capture CUDA graphs. On the CPU,
        set torch's threads (for the whole process: torch has no other kind). Under tensor
        parallelism, `model` is rank 0's shard and `group` its workers (EngineConfig.start_workers),
        which do each of these steps on their own shard as this one does it."""
        if (group is None) != (config.tensor_parallel_size == 1):
            raise EngineConfigError(
                f"tensor_parallel_size {config.tensor_parallel_size} needs its workers: "
                "build the engine with EngineConfig.start_workers' group"
            )
        if not config.on_gpu:
            torch.set_num_threads(config.rank_num_threads)
        model_config = model.config
        max_model_len = config.context_length(model_config)
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
            raise EngineConfigError(
                f"without chunked prefill, max_num_batched_tokens ({config.max_num_batched_tokens})"
                f" must be at least max_model_len ({max_model_len})"
            )
        spec = KVCacheSpec.for_model(
            model_config,
            config.block_size,
            config.torch_dtype,
            kv_cache_dtype=config.kv_cache_dtype,
            tensor_parallel_size=config.tensor_parallel_size,
        )
        eos_token_ids = tokenizer.eos_token_ids if tokenizer is not None else frozenset()
        peers = None
        if group is not None:
            group.connect(model)
            peers = group.broadcast
        runner = ModelRunner(
            model, config.block_size, config.device, max_model_len, eos_token_ids, peers=peers
        )
        state_slots = _hybrid_state_slots(config, model_config, runner)
        num_window_blocks = _window_pool_num_blocks(config, model_config, max_model_len)
        if config.num_kv_blocks is not None:
            pools = KVPools(config.num_kv_blocks, num_window_blocks)
        elif config.on_gpu:
            pools = runner.kv_pools_for_free_memory(
                spec,
                config.max_num_batched_tokens,
                config.max_num_seqs,
                config.gpu_memory_utilization,
                graph_batch=config.max_num_seqs if config.enable_cuda_graphs else 0,
                num_window_blocks=num_window_blocks,
                cache=MemoryProfileCache.for_engine(config),
            )
        else:
            state_bytes = sum(s.conv.nbytes + s.delta.nbytes for s in runner.recurrent_states)
            pools = spec.pools_within(config.kv_cache_memory_bytes - state_bytes, num_window_blocks)
        runner.allocate_kv_caches(spec, pools)
        graph_captures: list[Callable[[], None]] = []
        if config.on_gpu and config.enable_cuda_graphs:
            graph_sizes = (config.max_num_seqs, config.max_num_batched_tokens)
            if config.capture_graphs_when_idle:
                graph_captures = runner.graph_captures(*graph_sizes)
            else:
                runner.capture_graphs(*graph_sizes)
        block_manager = _block_manager(config, model_config, pools, state_slots is None)
        scheduler = Scheduler(
            SchedulerConfig(
                max_model_len=max_model_len,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                enable_chunked_prefill=config.enable_chunked_prefill,
                max_decode_burst=config.decode_burst,
            ),
            block_manager,
            state_slots,
        )
        logger.info(
            "engine ready: %s on %s, %s of %d tokens (%s, %.2f GiB per device), max_model_len %d",
            model_config.architecture,
            config.device,
            _describe_pools(pools, num_window_blocks, model_config),
            config.block_size,
            str(spec.dtype).removeprefix("torch."),
            spec.pool_bytes(pools) / 2**30,
            max_model_len,
        )
        return cls(
            tokenizer,
            runner,
            scheduler,
            vocab_size=model_config.vocab_size,
            device=config.device,
            group=group,
            async_scheduling=config.schedules_asynchronously,
            graph_captures=graph_captures,
        )

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (the engine serves nothing after). The
        decode graphs go first: they hold the NCCL communicator the groups' teardown frees.
        (Not after a worker died: a collective of the graph may wait for it, and that teardown
        is bounded in time instead.)"""
        if self.group is not None:
            if self.group.failure() is None:
                self.runner.release_graphs()
            self.group.close()

    @property
    def block_manager(self) -> BlockManager:
        """The full group's blocks (every layer's with one KV group); the window group's, if
        any, are its `window_group`."""
        return self.scheduler.block_manager

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_pending_graphs(self) -> int:
        """CUDA graphs left to capture (EngineConfig.capture_graphs_when_idle)."""
        return len(self._graph_captures)

    def capture_pending_graph(self) -> list[RequestOutput]:
        """Capture the next of the CUDA graphs left from the build, between two steps
        (AsyncEngine: when idle, and now and then under load). The step in flight, if any, is
        processed first, since a capture's warm-up overwrites the graphs' static buffers: its
        outputs are returned. Running requests go on from the next step, eagerly or from the
        graphs captured so far.

        A capture that fails on one device (out of memory, say) is logged and ends the
        captures: the graphs captured so far serve, other steps run eagerly, the server goes on
        (a sticky CUDA error fails the next step instead). Under tensor parallelism it fails
        the engine, as a failed step does: the ranks may no longer be in step."""
        if self.group is not None and (failure := self.group.failure()) is not None:
            raise failure  # as `step` refuses: the group is broken for good
        outputs = []
        if self._in_flight is not None:
            outputs = self._process(self._in_flight)
            self._in_flight = None
        started_s = time.monotonic()
        try:
            self._graph_captures.popleft()()
        except RuntimeError as exc:  # torch's errors, CUDA's included
            if self.group is not None:
                raise
            logger.error(
                "a CUDA graph capture failed (%s: %s); %d graphs are left uncaptured and the "
                "steps they would replay run eagerly",
                type(exc).__name__,
                exc,
                len(self._graph_captures) + 1,
            )
            self._graph_captures.clear()
            return outputs
        self._graph_capture_s += time.monotonic() - started_s
        if not self._graph_captures:
            logger.info(
                "CUDA graphs captured after the build, in %.2f s of the engine's time",
                self._graph_capture_s,
            )
        return outputs

    def stats(self) -> EngineStats:
        """Current counts. Safe to call from another thread while the engine steps: each field
        is read atomically, though the fields may come from different steps."""
        scheduler = self.scheduler
        compiles = self.grammars.compile_times() if self.grammars is not None else None
        window_group = self.block_manager.window_group
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            kv_cache_usage=self.block_manager.usage,
            window_kv_cache_usage=None if window_group is None else window_group.usage,
            recurrent_state_usage=None
            if scheduler.state_slots is None
            else scheduler.state_slots.usage,
            num_preemptions=scheduler.num_preemptions,
            num_prefix_cache_queries=scheduler.num_prefix_query_tokens,
            num_prefix_cache_hits=scheduler.num_prefix_hit_tokens,
            grammar_compile_counts=compiles.counts if compiles is not None else (),
            grammar_compile_seconds=compiles.sum_s if compiles is not None else 0.0,
            num_pending_graphs=self.num_pending_graphs,
        )

    def prepare_request(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str = "",
    ) -> Sequence:
        """Tokenize and validate a request without touching the engine's state (thread-safe)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this engine has no tokenizer: give token ids")
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            token_ids = list(prompt)
            bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"prompt token ids must be integers in [0, {self.vocab_size}); got {bad[0]!r}"
                )
        if not token_ids:
            raise InvalidRequestError("the prompt is empty: give at least one token")
        params.verify_token_ids(self.vocab_size)
        if self.tokenizer is None and params.stop:
            raise InvalidRequestError("stop strings need a tokenizer; use stop_token_ids")
        if len(token_ids) >= self.max_model_len:
            raise ContextLengthExceededError(
                f"the prompt has {len(token_ids)} tokens but the context holds "
                f"{self.max_model_len} (prompt plus at least one new token); shorten the prompt"
            )
        bm = self.block_manager
        num_tokens = min(len(token_ids) + params.max_tokens, self.max_model_len)
        config = self.scheduler.config
        max_chunk = max(config.max_num_batched_tokens, config.max_decode_burst)
        if bm.max_blocks_held(num_tokens, max_chunk) > bm.num_blocks:
            raise ContextLengthExceededError(
                f"prompt plus max_tokens ({num_tokens} tokens) exceeds the whole KV cache "
                f"({bm.num_blocks * bm.block_size} tokens); lower max_tokens or the prompt length"
            )
        if (
            not self.scheduler.config.enable_chunked_prefill
            and len(token_ids) > self.scheduler.config.max_num_batched_tokens
        ):
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens; without chunked prefill at most "
                f"{self.scheduler.config.max_num_batched_tokens} fit in one step"
            )
        grammar = None
        if params.structured is not None:
            if self.grammars is None:
                raise InvalidRequestError("structured outputs need a tokenizer")
            grammar = self.grammars.grammar(params.structured)
        return Sequence(
            request_id=RequestId(request_id),
            token_ids=token_ids,
            params=params,
            arrival=next(self._arrivals),
            priority=priority,
            cache_salt=cache_salt,
            grammar=grammar,
        )

    def add_request(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str = "",
    ) -> None:
        seq = self.prepare_request(
            request_id, prompt, params, priority=priority, cache_salt=cache_salt
        )
        self.add_sequence(seq)

    def add_sequence(self, seq: Sequence) -> None:
        """Queue a sequence made by `prepare_request`."""
        if seq.request_id in self._requests:
            raise InvalidRequestError(f"request id {seq.request_id!r} is already in use")
        tokenizer = self.tokenizer
        detokenizer = None
        if tokenizer is not None:
            detokenizer = detokenizer_for(
                tokenizer, skip_special_tokens=seq.params.skip_special_tokens
            )
        eos = tokenizer.eos_token_ids if tokenizer is not None else frozenset()
        self._requests[seq.request_id] = RequestState(seq, detokenizer, eos, self.max_model_len)
        if seq.grammar is not None or seq.params.penalizes:
            self._host_bound.add(seq)
        if seq.params.seed is not None:
            generator = torch.Generator(self.device)
            generator.manual_seed(seq.params.seed)
            self._generators[seq.request_id] = generator
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; None if it is unknown or already finished."""
        state = self._requests.get(RequestId(request_id))
        if state is None:
            return None
        self._finish(state.seq, SequenceStatus.FINISHED_ABORTED)
        return state.make_output(SequenceStatus.FINISHED_ABORTED)

    def abort_all(self) -> list[RequestOutput]:
        return [out for rid in list(self._requests) if (out := self.abort(rid)) is not None]

    def step(self) -> list[RequestOutput]:
        if self.group is not None and (failure := self.group.failure()) is not None:
            raise failure  # the group is broken for good: refused at once, naming the cause
        try:
            return self._step()
        except (RuntimeError, TensorParallelError) as exc:
            if self.group is None:
                raise
            # A collective failed: name the worker that died, if one did, rather than gloo's or
            # NCCL's words; either way the group is broken for good.
            failure = self.group.failure(_WORKER_DEATH_GRACE_S)
            if failure is None:
                failure = self.group.fail(
                    exc
                    if isinstance(exc, TensorParallelError)
                    else TensorParallelError(f"a tensor-parallel step failed: {exc}")
                )
            raise failure from exc

    def _step(self) -> list[RequestOutput]:
        """Schedule and launch the next step, then process the previous one's outputs (with
        asynchronous scheduling: the device runs the new step meanwhile), or this one's."""
        outputs: list[RequestOutput] = []
        if self._in_flight is not None and self._waits_for_host():
            outputs = self._process(self._in_flight)
            self._in_flight = None
        schedule = self.scheduler.schedule()
        launched = None if schedule.is_empty else self._launch(schedule)
        previous, self._in_flight = self._in_flight, launched
        if previous is not None:
            outputs += self._process(previous)
        if not self.async_scheduling and self._in_flight is not None:
            outputs += self._process(self._in_flight)
            self._in_flight = None
        return outputs

    def _waits_for_host(self) -> bool:
        """Whether a sequence with a token in flight needs that token on the host before its
        next step can be prepared: a grammar builds its next mask from it, and penalties
        rebuild their counts from the host's tokens whenever the penalized batch changes."""
        return any(seq.num_pending_tokens for seq in self._host_bound)

    def _launch(self, schedule: SchedulerOutput) -> LaunchedStep:
        chunks = schedule.chunks
        if self._generators:
            generators = [self._generators.get(c.seq.request_id) for c in chunks]
        else:  # no seeded request (most steps): nothing to look up per chunk
            generators = [None] * len(chunks)
        step = self.runner.launch(chunks, schedule.num_steps, generators, self._in_flight)
        if self.async_scheduling:  # synchronous steps are processed before the next schedule
            for chunk in chunks:
                if chunk.samples:
                    chunk.seq.num_pending_tokens += schedule.num_steps
        return step

    def _process(self, step: LaunchedStep) -> list[RequestOutput]:
        """Wait for a launched step and apply its tokens in order: stop checks, text, finishes.
        A stop drops the tokens after it (in a burst, and the extra step a sequence ran under
        asynchronous scheduling before its stop was seen)."""
        outputs = []
        for chunk, result in zip(step.chunks, self.runner.collect(step), strict=True):
            seq = chunk.seq
            state = self._requests.get(seq.request_id)
            if state is None or state.seq is not seq:
                continue  # finished or aborted after this step was launched
            if result.prompt_logprobs:
                state.add_prompt_logprobs(result.prompt_logprobs, chunk.start)
            if not result.token_ids:
                continue
            if seq.num_pending_tokens:
                seq.num_pending_tokens -= len(result.token_ids)
            finish = state.add_tokens(result.token_ids, result.logprob)
            if finish is not None:
                self._finish(seq, finish)
            outputs.append(state.make_output(finish))
        return outputs

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        self._requests.pop(seq.request_id)
        self._host_bound.discard(seq)
        self._generators.pop(seq.request_id, None)
        self.scheduler.finish(seq, status)

    def generate(
        self, prompts: Seq[str | Seq[int]], params: SamplingParams | Seq[SamplingParams]
    ) -> list[Completion]:
        """Run `prompts` as one batch to completion (for the CLI, tests and benchmarks)."""
        all_params = [params] * len(prompts) if isinstance(params, SamplingParams) else params
        ids = [f"generate-{next(self._arrivals)}" for _ in prompts]
        for request_id, prompt, p in zip(ids, prompts, all_params, strict=True):
            self.add_request(request_id, prompt, p)
        texts: dict[str, list[str]] = {i: [] for i in ids}
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.step():
                texts[out.request_id].append(out.text)
                tokens[out.request_id].extend(out.token_ids)
                if out.finished:
                    done[out.request_id] = out
        return [
            Completion(
                "".join(texts[i]), tokens[i], done[i].finish_reason or "", done[i].num_cached_tokens
            )
            for i in ids
        ]

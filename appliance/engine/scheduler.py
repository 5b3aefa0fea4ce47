"""Decides, each step, which sequences run and how many of their tokens.

One token budget per step covers everything: running sequences first (a decode costs one
token, an unfinished prefill continues with a chunk), then waiting sequences are admitted with a
chunk of their prompt while budget, blocks and the running-sequence limit allow. When a running
sequence needs a block and none is free, the lowest-ranked running sequence is preempted: its
blocks are freed and it goes back to waiting, to be recomputed (often from its own prefix-cache
blocks) when there is room again. A hybrid model's sequences also hold a recurrent-state slot
while they run (`state_slots`), given back with their blocks. Ranking is first come first
served, or by `priority` (lower runs first) then arrival. Blocks are counted in the full group
only: a model's window group (block_manager, "KV groups") is sized never to be short.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from appliance.engine.block_manager import BlockManager
from appliance.engine.errors import EngineConfigError
from appliance.engine.sequence import Sequence, SequenceStatus
from appliance.engine.state_slots import StateSlots


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # Up to this many decode steps back to back (see Scheduler._schedule_decode_burst).
    max_decode_burst: int = 1

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "max_decode_burst"):
            if getattr(self, name) < 1:
                raise EngineConfigError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(slots=True)
class ScheduledChunk:
    """Compute `seq.token_ids[start : start + num_new_tokens]` this step; `samples` when that
    reaches the end of the sequence, so the step also samples its next token. Never changed
    once made (not frozen: a frozen dataclass's constructor costs nearly twice as much, and a
    step makes one per running sequence)."""

    seq: Sequence
    start: int
    num_new_tokens: int
    samples: bool

    @classmethod
    def of(cls, seq: Sequence, start: int, num_new_tokens: int) -> ScheduledChunk:
        return cls(seq, start, num_new_tokens, start + num_new_tokens == seq.num_tokens)


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # > 1: a decode burst; every chunk is one token and runs num_steps steps, each step's
    # sampled tokens feeding the next on the device.
    num_steps: int = 1

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


def _rank(seq: Sequence) -> tuple[int, int]:
    return (seq.priority, seq.arrival)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        state_slots: StateSlots | None = None,
    ):
        """state_slots: a hybrid model's recurrent-state slots, at least max_num_seqs."""
        if state_slots is not None and state_slots.num_slots < config.max_num_seqs:
            raise EngineConfigError(
                f"{state_slots.num_slots} recurrent-state slots cannot serve max_num_seqs "
                f"{config.max_num_seqs}: one slot per running sequence"
            )
        self.config = config
        self.block_manager = block_manager
        self.state_slots = state_slots
        # Both kept sorted by rank, best first; the last running sequence is the next victim.
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        """Queue `seq`; its request id is new (the engine refuses a duplicate before this)."""
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=_rank)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Take `seq` out of the queues for good and free its blocks."""
        assert status.finished
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._free(seq)
        seq.status = status

    def schedule(self) -> SchedulerOutput:
        # Before any allocation: what the sequences this step leaves out no longer see goes back
        # (a window's pool is sized on it: block_manager.window_pool_num_blocks).
        self.block_manager.release_out_of_window(self.running)
        burst = self._schedule_decode_burst()
        if burst is not None:
            return burst
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        for chunk in out.chunks:
            chunk.seq.num_computed_tokens += chunk.num_new_tokens
        return out

    def _schedule_decode_burst(self) -> SchedulerOutput | None:
        """Several decode steps at once, when nothing needs the scheduler between them: every
        running sequence is decoding, none wants log-probabilities or follows a grammar, nobody
        waits, and the blocks for all steps are free. The host is then consulted once per burst
        instead of once per token. A burst never runs a sequence past its max_tokens or the
        context, so only a stop (EOS, stop token, stop string) can end one early; its remaining
        tokens are dropped."""
        steps = self.config.max_decode_burst
        if steps < 2 or self.waiting or not self.running:
            return None
        for seq in self.running:
            if seq.num_uncomputed_tokens != 1 or seq.params.logprobs is not None:
                return None
            if seq.grammar is not None:  # its next mask depends on the token before
                return None
            remaining = self._num_tokens_left(seq)
            steps = min(steps, remaining)
        if steps < 2:
            return None
        bm = self.block_manager
        num_needed = sum(
            max(-(-(seq.num_computed_tokens + steps) // bm.block_size) - len(seq.block_table), 0)
            for seq in self.running
        )
        if num_needed > bm.num_free_blocks:
            return None
        out = SchedulerOutput(num_steps=steps)
        for seq in self.running:
            allocated = bm.allocate(seq, steps)
            assert allocated, "the free blocks were counted above"
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, 1, True))
            seq.num_computed_tokens += steps
        return out

    def _num_tokens_left(self, seq: Sequence) -> int:
        """Tokens `seq` may still sample before its max_tokens or the context ends it."""
        limit = min(seq.num_prompt_tokens + seq.params.max_tokens, self.config.max_model_len)
        return limit - len(seq.token_ids) - seq.num_pending_tokens

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        # Once per running sequence per step: the properties and helpers it would call are
        # spelled out on locals (the engine thread's CPU per token, issue 17's W3).
        running, chunks, allocate = self.running, out.chunks, self.block_manager.allocate
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            if seq.num_pending_tokens and self._num_tokens_left(seq) <= 0:
                # Its tokens in flight end it (asynchronous scheduling): nothing left to run.
                i += 1
                continue
            num_tokens = len(seq.token_ids) + seq.num_pending_tokens
            start = seq.num_computed_tokens
            num_new = min(num_tokens - start, budget)
            while not allocate(seq, num_new):
                victim = running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                chunks.append(ScheduledChunk(seq, start, num_new, start + num_new == num_tokens))
                budget -= num_new
                i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending_tokens:
                # Preempted while a step still samples its token: admitted once the host has it.
                break
            # Prompt log-probabilities need logits at every prompt position: no cache hits.
            cached = [] if seq.wants_prompt_logprobs else bm.find_cached_prefix(seq)
            num_cached_tokens = len(cached) * bm.block_size
            num_new = seq.num_tokens - num_cached_tokens
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            if not bm.allocate(seq, num_new, cached):
                break
            self.waiting.pop(0)
            if self.state_slots is not None:
                self.state_slots.take(seq)
            self.num_prefix_query_tokens += len(seq)
            self.num_prefix_hit_tokens += num_cached_tokens
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_cached_tokens
            seq.num_computed_tokens = num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_s is None:
                seq.first_scheduled_s = time.monotonic()
            bisect.insort(self.running, seq, key=_rank)
            out.chunks.append(ScheduledChunk.of(seq, num_cached_tokens, num_new))
            budget -= num_new

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=_rank)

    def _free(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        if self.state_slots is not None:
            self.state_slots.free(seq)

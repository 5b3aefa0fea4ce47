"""A request's life in the engine: its tokens, its KV blocks and its progress."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import NewType, Protocol

from appliance.engine.sampling_params import SamplingParams

RequestId = NewType("RequestId", str)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    {
        SequenceStatus.FINISHED_STOPPED,
        SequenceStatus.FINISHED_LENGTH,
        SequenceStatus.FINISHED_ABORTED,
    }
)


class OutputGrammar(Protocol):
    """Where a structured output is in its grammar (appliance.engine.structured_output)."""

    def accept(self, token_id: int) -> bool:
        """Advance past an appended token; False if the grammar forbids it."""
        ...


@dataclass(slots=True)
class GroupBlocks:
    """A sequence's blocks in the window group's pool (block_manager, "KV groups"): the same
    positions as `Sequence.block_table`, with its own released and published counts. Entries
    below `num_released_blocks` may be a placeholder id that no attention reads (a prefix-cache
    hit takes only the blocks its first query's window sees)."""

    block_table: list[int] = field(default_factory=list)
    num_released_blocks: int = 0
    num_published_blocks: int = 0


@dataclass(eq=False)
class Sequence:
    """One request: prompt plus generated tokens, and how much of it the KV cache holds.

    `token_ids[:num_computed_tokens]` have their keys and values in the blocks of `block_table`.
    A step computes the next `num_new_tokens` of them; when that reaches the end of `token_ids`
    the step also samples one new token. So prefill, a prefill chunk, a decode step and a
    recompute after preemption are all the same thing: catching up with `token_ids`.

    Under asynchronous scheduling the next step is scheduled before the host has the tokens of
    the step in flight: those `num_pending_tokens` count as the sequence's last tokens (the
    scheduler plans with `num_tokens`), and their ids are taken from the device when needed.
    """

    request_id: RequestId
    token_ids: list[int]
    params: SamplingParams
    arrival: int
    priority: int = 0
    cache_salt: str = ""
    # The grammar a structured output stays in: the sampler masks what it forbids, and each
    # appended token advances it.
    grammar: OutputGrammar | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    num_prompt_tokens: int = field(init=False)
    num_computed_tokens: int = 0
    # Prompt tokens found in the prefix cache at first admission (reported as cached tokens).
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # Tokens sampled by a step still in flight, not yet appended to token_ids.
    num_pending_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Leading entries of `block_table` given back because no layer's window reaches them any
    # more (their ids stay, so positions still index the table; attention never reads them).
    num_released_blocks: int = 0
    # Chained hashes of this sequence's full blocks, extended as blocks fill.
    block_hashes: list[bytes] = field(default_factory=list)
    # Leading blocks of `block_table` already offered to the prefix cache.
    num_published_blocks: int = 0
    # A model with windowed and full layers keeps its windowed layers' pages in a pool of their
    # own: `block_table` and its counts above are the full group's, these the window group's.
    window_blocks: GroupBlocks = field(default_factory=GroupBlocks)
    # A hybrid model's recurrent-state slot while the sequence runs (appliance.engine.
    # state_slots); its state then holds `token_ids[:num_computed_tokens]`.
    state_slot: int | None = None
    # time.monotonic when it was queued for the engine (AsyncEngine: when it was submitted, so
    # a wait in its inbox counts), and when the scheduler first admitted it (None until then).
    queued_at_s: float = field(default_factory=time.monotonic)
    first_scheduled_s: float | None = None

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        """All tokens, those still in flight included."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens - self.num_computed_tokens

    @property
    def num_scheduled_output_tokens(self) -> int:
        """Output tokens, those still in flight included."""
        return self.num_tokens - self.num_prompt_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

"""The token-budget scheduler: ordering, chunked prefill, admission limits and preemption.

The unit tests build tiny pools where each rule is forced; the simulated engine loop (and its
property-based version) runs many sequences to completion, checking every step's invariants and
that every position a chunk attends to holds the KV of that very prefix.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.engine.block_manager import BlockManager
from appliance.engine.errors import EngineConfigError
from appliance.engine.sampling_params import SamplingParams
from appliance.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from appliance.engine.sequence import RequestId, Sequence, SequenceStatus

_request_numbers = itertools.count()


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = True,
) -> Scheduler:
    config = SchedulerConfig(
        max_model_len=num_blocks * block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=enable_chunked_prefill,
    )
    block_manager = BlockManager(
        num_blocks, block_size, enable_prefix_caching=enable_prefix_caching
    )
    return Scheduler(config, block_manager)


def make_seq(
    token_ids: list[int] | int,
    *,
    arrival: int,
    priority: int = 0,
    cache_salt: str = "",
    max_tokens: int = 16,
    prompt_logprobs: int | None = None,
) -> Sequence:
    """A sequence; an int `token_ids` is a prompt of that many distinct tokens."""
    n = next(_request_numbers)
    if isinstance(token_ids, int):
        token_ids = [1000 * (n + 1) + i for i in range(token_ids)]
    return Sequence(
        request_id=RequestId(f"req-{n}"),
        token_ids=list(token_ids),
        params=SamplingParams(max_tokens=max_tokens, prompt_logprobs=prompt_logprobs),
        arrival=arrival,
        priority=priority,
        cache_salt=cache_salt,
    )


def chunk_sizes(out: SchedulerOutput) -> list[tuple[Sequence, int, int]]:
    return [(c.seq, c.start, c.num_new_tokens) for c in out.chunks]


def sample_for(out: SchedulerOutput, token: int = 7) -> None:
    """What the engine does after a step: append a sampled token where a chunk samples."""
    for chunk in out.chunks:
        if chunk.samples:
            chunk.seq.append_token(token)


# --- budget and ordering --------------------------------------------------------------------


def test_scheduler_config_rejects_non_positive_limits() -> None:
    with pytest.raises(EngineConfigError):
        SchedulerConfig(max_model_len=16, max_num_batched_tokens=0)
    with pytest.raises(EngineConfigError):
        SchedulerConfig(max_model_len=16, max_num_seqs=0)
    with pytest.raises(EngineConfigError):
        SchedulerConfig(max_model_len=0)


def test_admitted_prompt_is_scheduled_whole_and_samples() -> None:
    sched = make_scheduler()
    seq = make_seq(10, arrival=0)
    sched.add(seq)

    out = sched.schedule()

    assert chunk_sizes(out) == [(seq, 0, 10)]
    assert out.chunks[0].samples
    assert seq.status is SequenceStatus.RUNNING
    assert seq.num_computed_tokens == 10
    assert len(seq.block_table) == 3
    assert sched.running == [seq] and sched.waiting == []


def test_running_decodes_are_scheduled_before_new_prefills() -> None:
    sched = make_scheduler(max_num_batched_tokens=12)
    first, second = make_seq(6, arrival=0), make_seq(6, arrival=1)
    sched.add(first)
    sched.add(second)
    out = sched.schedule()
    sample_for(out)
    assert [(c.seq, c.num_new_tokens) for c in out.chunks] == [(first, 6), (second, 6)]
    late = make_seq(11, arrival=2)
    sched.add(late)

    out = sched.schedule()

    assert chunk_sizes(out) == [(first, 6, 1), (second, 6, 1), (late, 0, 10)]
    assert out.num_batched_tokens == 12


def test_decodes_that_use_the_whole_budget_leave_new_prompts_waiting() -> None:
    sched = make_scheduler(max_num_batched_tokens=2)
    a, b = make_seq(2, arrival=0), make_seq(2, arrival=1)
    sched.add(a)
    sample_for(sched.schedule())
    sched.add(b)
    out = sched.schedule()
    sample_for(out)
    assert chunk_sizes(out) == [(a, 2, 1), (b, 0, 1)]
    sched.add(make_seq(5, arrival=2))

    out = sched.schedule()

    assert chunk_sizes(out) == [(a, 3, 1), (b, 1, 1)]
    assert len(sched.waiting) == 1


def test_chunked_prefill_splits_a_long_prompt_and_samples_only_on_the_last_chunk() -> None:
    sched = make_scheduler(max_num_batched_tokens=4)
    seq = make_seq(10, arrival=0)
    sched.add(seq)

    steps = []
    for _ in range(3):
        out = sched.schedule()
        steps.append([(c.start, c.num_new_tokens, c.samples) for c in out.chunks])

    assert steps == [[(0, 4, False)], [(4, 4, False)], [(8, 2, True)]]
    assert seq.num_computed_tokens == 10


def test_chunked_prefill_fills_the_budget_left_by_decodes() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    a, b = make_seq(6, arrival=0), make_seq(6, arrival=1)
    sched.add(a)
    sched.add(b)

    out = sched.schedule()

    assert chunk_sizes(out) == [(a, 0, 6), (b, 0, 2)]
    assert not out.chunks[1].samples
    assert b.status is SequenceStatus.RUNNING


def test_without_chunked_prefill_a_prompt_bigger_than_the_remaining_budget_waits() -> None:
    sched = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    a, b = make_seq(6, arrival=0), make_seq(6, arrival=1)
    sched.add(a)
    sched.add(b)

    out = sched.schedule()
    sample_for(out)
    assert chunk_sizes(out) == [(a, 0, 6)]
    assert sched.waiting == [b]
    assert b.block_table == []

    out = sched.schedule()
    assert chunk_sizes(out) == [(a, 6, 1), (b, 0, 6)]


def test_without_chunked_prefill_a_waiting_head_blocks_smaller_prompts_behind_it() -> None:
    sched = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    a, big, small = make_seq(4, arrival=0), make_seq(6, arrival=1), make_seq(1, arrival=2)
    for seq in (a, big, small):
        sched.add(seq)

    out = sched.schedule()

    assert chunk_sizes(out) == [(a, 0, 4)]
    assert sched.waiting == [big, small]


def test_max_num_seqs_caps_running_sequences() -> None:
    sched = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(3, arrival=i) for i in range(4)]
    for seq in seqs:
        sched.add(seq)

    out = sched.schedule()
    sample_for(out)
    assert [c.seq for c in out.chunks] == seqs[:2]
    assert sched.running == seqs[:2]
    assert sched.waiting == seqs[2:]

    sched.finish(seqs[0], SequenceStatus.FINISHED_STOPPED)
    out = sched.schedule()
    assert [c.seq for c in out.chunks] == [seqs[1], seqs[2]]
    assert len(sched.running) == 2


def test_waiting_sequences_are_admitted_in_arrival_order_not_add_order() -> None:
    sched = make_scheduler(max_num_seqs=1)
    seqs = [make_seq(2, arrival=i) for i in range(3)]
    for i in (2, 0, 1):
        sched.add(seqs[i])

    admitted = []
    while sched.num_unfinished:
        out = sched.schedule()
        admitted += [c.seq for c in out.chunks if c.start == 0]
        for chunk in out.chunks:
            sched.finish(chunk.seq, SequenceStatus.FINISHED_LENGTH)

    assert admitted == seqs


def test_lower_priority_value_is_admitted_first_then_arrival_order() -> None:
    sched = make_scheduler(max_num_seqs=1)
    low = make_seq(2, arrival=0, priority=5)
    high_early = make_seq(2, arrival=1, priority=-1)
    high_late = make_seq(2, arrival=2, priority=-1)
    mid = make_seq(2, arrival=3, priority=0)
    for seq in (low, high_early, high_late, mid):
        sched.add(seq)

    admitted = []
    while sched.num_unfinished:
        out = sched.schedule()
        admitted += [c.seq for c in out.chunks]
        for chunk in out.chunks:
            sched.finish(chunk.seq, SequenceStatus.FINISHED_LENGTH)

    assert admitted == [high_early, high_late, mid, low]


def test_a_better_priority_admitted_later_runs_ahead_of_older_running_sequences() -> None:
    sched = make_scheduler(max_num_batched_tokens=64)
    old = make_seq(3, arrival=0, priority=1)
    sched.add(old)
    sample_for(sched.schedule())
    urgent = make_seq(3, arrival=1, priority=0)
    sched.add(urgent)
    sample_for(sched.schedule())

    out = sched.schedule()

    assert sched.running == [urgent, old]
    assert [c.seq for c in out.chunks] == [urgent, old]


# --- preemption -----------------------------------------------------------------------------


def test_preemption_evicts_the_most_recently_admitted_sequence_and_it_resumes() -> None:
    # Four blocks of two tokens: both prompts fit, then `first` needs a third block.
    sched = make_scheduler(num_blocks=4, block_size=2)
    first, second = make_seq(4, arrival=0), make_seq(3, arrival=1)
    sched.add(first)
    sched.add(second)
    out = sched.schedule()
    sample_for(out)
    assert chunk_sizes(out) == [(first, 0, 4), (second, 0, 3)]
    assert sched.block_manager.num_free_blocks == 0
    second_prefix_block = second.block_table[0]

    out = sched.schedule()

    assert out.preempted == [second]
    assert chunk_sizes(out) == [(first, 4, 1)]
    assert second.status is SequenceStatus.WAITING
    assert second.num_computed_tokens == 0
    assert second.block_table == []
    assert second.num_preemptions == 1
    assert sched.running == [first] and sched.waiting == [second]
    assert sched.num_preemptions == 1
    assert len(first.block_table) == 3

    # Once `first` is gone, `second` recomputes, hitting its own full prefix block.
    sched.finish(first, SequenceStatus.FINISHED_LENGTH)
    out = sched.schedule()

    assert chunk_sizes(out) == [(second, 2, 2)]
    assert out.chunks[0].samples
    assert second.block_table[0] == second_prefix_block
    assert second.num_computed_tokens == 4
    assert second.num_cached_tokens == 0, "cached tokens are reported for the first admission"
    assert second.status is SequenceStatus.RUNNING


def test_step_with_a_preemption_admits_no_waiting_sequence() -> None:
    sched = make_scheduler(num_blocks=4, block_size=2)
    first, second = make_seq(4, arrival=0), make_seq(3, arrival=1)
    sched.add(first)
    sched.add(second)
    sample_for(sched.schedule())
    sched.add(make_seq(1, arrival=2))

    out = sched.schedule()

    assert out.preempted == [second]
    assert [c.seq for c in out.chunks] == [first]


def test_preemption_picks_the_worst_priority_not_the_latest_arrival() -> None:
    sched = make_scheduler(num_blocks=4, block_size=2)
    background = make_seq(3, arrival=0, priority=1)
    urgent = make_seq(4, arrival=1, priority=0)
    sched.add(background)
    sched.add(urgent)
    out = sched.schedule()
    sample_for(out)
    assert [c.seq for c in out.chunks] == [urgent, background]

    out = sched.schedule()

    assert out.preempted == [background]
    assert chunk_sizes(out) == [(urgent, 4, 1)]


def test_each_running_sequence_that_needs_a_block_preempts_from_the_back() -> None:
    # Five blocks of four tokens: `big` holds two, each small one holds one, none is free.
    sched = make_scheduler(num_blocks=5, block_size=4)
    big = make_seq(8, arrival=0)
    small = [make_seq(4, arrival=i) for i in (1, 2, 3)]
    for seq in (big, *small):
        sched.add(seq)
    sample_for(sched.schedule())
    assert sched.block_manager.num_free_blocks == 0

    out = sched.schedule()

    assert out.preempted == [small[2], small[1]]
    assert [c.seq for c in out.chunks] == [big, small[0]]
    assert sched.running == [big, small[0]]
    assert sched.waiting == [small[1], small[2]]


def test_a_prefill_chunk_preempts_as_many_victims_as_its_blocks_need() -> None:
    sched = make_scheduler(num_blocks=3, block_size=2, max_num_batched_tokens=4)
    x, y = make_seq(1, arrival=0, priority=1), make_seq(1, arrival=1, priority=1)
    sched.add(x)
    sched.add(y)
    sample_for(sched.schedule())
    urgent = make_seq(9, arrival=2, priority=0)
    sched.add(urgent)
    out = sched.schedule()
    sample_for(out)
    assert chunk_sizes(out) == [(x, 1, 1), (y, 1, 1), (urgent, 0, 2)]
    assert sched.block_manager.num_free_blocks == 0

    # urgent's next chunk of four tokens needs two more blocks: both others must go.
    out = sched.schedule()

    assert out.preempted == [y, x]
    assert chunk_sizes(out) == [(urgent, 2, 4)]
    assert not out.chunks[0].samples
    assert len(urgent.block_table) == 3


def test_a_sequence_that_cannot_grow_preempts_itself_when_it_ranks_last() -> None:
    sched = make_scheduler(num_blocks=3, block_size=2)
    first, second = make_seq(3, arrival=0), make_seq(2, arrival=1)
    sched.add(first)
    sched.add(second)
    sample_for(sched.schedule())
    # first: 4 tokens in two blocks; second: 3 tokens, needs a second block, none is free.
    assert sched.block_manager.num_free_blocks == 0

    out = sched.schedule()

    assert out.preempted == [second]
    assert chunk_sizes(out) == [(first, 3, 1)]
    assert sched.waiting == [second]


# --- finish ---------------------------------------------------------------------------------


def test_finish_of_a_running_sequence_frees_its_blocks_and_leaves_the_queues() -> None:
    sched = make_scheduler()
    seq = make_seq(9, arrival=0)
    sched.add(seq)
    sched.schedule()

    sched.finish(seq, SequenceStatus.FINISHED_STOPPED)

    assert seq.status is SequenceStatus.FINISHED_STOPPED
    assert seq.block_table == []
    assert sched.running == [] and sched.waiting == []
    assert sched.num_unfinished == 0
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_finish_of_a_waiting_sequence_removes_it_from_the_queue() -> None:
    sched = make_scheduler(max_num_seqs=1)
    a, b = make_seq(2, arrival=0), make_seq(2, arrival=1)
    sched.add(a)
    sched.add(b)
    sched.schedule()

    sched.finish(b, SequenceStatus.FINISHED_ABORTED)

    assert sched.waiting == []
    assert sched.running == [a]
    assert b.status is SequenceStatus.FINISHED_ABORTED


def test_finished_sequence_is_never_scheduled_again() -> None:
    sched = make_scheduler()
    seq = make_seq(3, arrival=0)
    sched.add(seq)
    sample_for(sched.schedule())
    sched.finish(seq, SequenceStatus.FINISHED_LENGTH)

    assert sched.schedule().is_empty


# --- prefix cache through the scheduler ----------------------------------------------------


def test_second_request_with_the_same_prompt_starts_after_the_cached_blocks() -> None:
    sched = make_scheduler(block_size=4)
    prompt = list(range(10))
    first, second = make_seq(prompt, arrival=0), make_seq(prompt, arrival=1)
    sched.add(first)
    sample_for(sched.schedule())
    sched.add(second)

    out = sched.schedule()

    assert chunk_sizes(out) == [(first, 10, 1), (second, 8, 2)]
    assert second.num_cached_tokens == 8
    assert second.block_table[:2] == first.block_table[:2]
    assert sched.num_prefix_hit_tokens == 8
    assert sched.num_prefix_query_tokens == 20


def test_request_wanting_prompt_logprobs_skips_the_prefix_cache() -> None:
    sched = make_scheduler(block_size=4)
    prompt = list(range(10))
    sched.add(make_seq(prompt, arrival=0))
    sample_for(sched.schedule())
    wants = make_seq(prompt, arrival=1, prompt_logprobs=0)
    sched.add(wants)

    out = sched.schedule()

    assert out.chunks[-1].seq is wants
    assert (out.chunks[-1].start, out.chunks[-1].num_new_tokens) == (0, 10)
    assert wants.num_cached_tokens == 0


# --- simulated engine loop ------------------------------------------------------------------


@dataclass
class Request:
    num_prompt_tokens: int
    num_output_tokens: int
    arrival_step: int = 0
    priority: int = 0
    salt: str = ""


def run_engine_loop(
    sched: Scheduler, requests: list[Request], *, vocab: int = 3, max_steps: int = 5000
) -> list[Sequence]:
    """Drive `sched` the way the engine does and check every step's invariants.

    Prompts come from a tiny vocabulary so that prefixes collide. Besides the bookkeeping, each
    step plays the model runner's part on a fake KV cache: every chunk first writes the prefix key
    of each position it computes into its slot, then every position the chunk attends to must
    hold exactly the key of that position's prefix of this sequence (with its salt).
    """
    bm = sched.block_manager
    bs = bm.block_size
    config = sched.config
    seqs = [
        make_seq(
            [(i * 7 + j * j) % vocab for j in range(r.num_prompt_tokens)],
            arrival=i,
            priority=r.priority,
            cache_salt=r.salt,
            max_tokens=r.num_output_tokens,
        )
        for i, r in enumerate(requests)
    ]
    kv: dict[tuple[int, int], tuple[str, tuple[int, ...]]] = {}
    for step in range(max_steps):
        for seq, request in zip(seqs, requests, strict=True):
            if request.arrival_step == step:
                sched.add(seq)
        if step > max(r.arrival_step for r in requests) and not sched.num_unfinished:
            break
        previously_running = list(sched.running)
        computed_before = {s.request_id: s.num_computed_tokens for s in sched.running}

        out = sched.schedule()

        assert out.num_batched_tokens <= config.max_num_batched_tokens
        assert len(sched.running) <= config.max_num_seqs
        scheduled = [c.seq for c in out.chunks]
        assert len(set(map(id, scheduled))) == len(scheduled)
        # Sequences running before the step come first, in rank order; admissions follow.
        num_old = sum(s in previously_running for s in scheduled)
        assert all(s in previously_running for s in scheduled[:num_old])
        assert scheduled[:num_old] == [s for s in sched.running if s in scheduled[:num_old]]
        if out.preempted:
            assert all(s in previously_running for s in scheduled)
        for victim in out.preempted:
            assert victim.status is SequenceStatus.WAITING
            assert victim.block_table == [] and victim.num_computed_tokens == 0
            assert victim in sched.waiting and victim not in scheduled
            assert all(
                (s.priority, s.arrival) < (victim.priority, victim.arrival) for s in sched.running
            )
        for chunk in out.chunks:
            seq = chunk.seq
            assert chunk.num_new_tokens >= 1
            assert seq.status is SequenceStatus.RUNNING
            assert chunk.start == computed_before.get(seq.request_id, chunk.start)
            assert seq.num_computed_tokens == chunk.start + chunk.num_new_tokens <= len(seq)
            assert len(seq.block_table) == -(-seq.num_computed_tokens // bs)
            if not config.enable_chunked_prefill and seq not in previously_running:
                assert chunk.samples
        held = {b for s in sched.running for b in s.block_table}
        assert bm.num_free_blocks == bm.num_blocks - len(held)
        assert all(s.block_table == [] for s in sched.waiting)

        for chunk in out.chunks:
            seq, table = chunk.seq, chunk.seq.block_table
            for p in range(chunk.start, chunk.start + chunk.num_new_tokens):
                kv[table[p // bs], p % bs] = (seq.cache_salt, tuple(seq.token_ids[: p + 1]))
        for chunk in out.chunks:
            seq, table = chunk.seq, chunk.seq.block_table
            for p in range(chunk.start + chunk.num_new_tokens):
                expected = (seq.cache_salt, tuple(seq.token_ids[: p + 1]))
                assert kv.get((table[p // bs], p % bs)) == expected

        for chunk in out.chunks:
            if chunk.samples:
                seq = chunk.seq
                seq.append_token((len(seq) * 5 + seq.arrival) % vocab)
                if seq.num_output_tokens == seq.params.max_tokens:
                    sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
    else:
        pytest.fail(f"{sched.num_unfinished} sequences unfinished after {max_steps} steps")
    return seqs


def assert_all_finished_and_pool_free(sched: Scheduler, seqs: list[Sequence]) -> None:
    bm = sched.block_manager
    assert all(s.status is SequenceStatus.FINISHED_LENGTH for s in seqs)
    assert all(s.num_output_tokens == s.params.max_tokens for s in seqs)
    assert all(s.block_table == [] for s in seqs)
    assert sched.running == [] and sched.waiting == []
    assert bm.num_free_blocks == bm.num_blocks
    assert all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))


@pytest.mark.parametrize("enable_chunked_prefill", [True, False])
def test_engine_loop_with_a_tiny_pool_finishes_every_sequence_and_frees_the_pool(
    enable_chunked_prefill: bool,
) -> None:
    sched = make_scheduler(
        num_blocks=6,
        block_size=2,
        max_num_batched_tokens=12,
        max_num_seqs=4,
        enable_chunked_prefill=enable_chunked_prefill,
    )
    requests = [
        Request(
            num_prompt_tokens=1 + (i * 5) % 7,
            num_output_tokens=1 + (i * 3) % 5,
            arrival_step=i % 4,
            salt="ab"[i % 2],
        )
        for i in range(20)
    ]

    seqs = run_engine_loop(sched, requests)

    assert_all_finished_and_pool_free(sched, seqs)
    assert sched.num_preemptions > 0, "the pool is meant to be too small to avoid preemption"
    assert sched.num_prefix_hit_tokens > 0


def test_engine_loop_with_priorities_finishes_every_sequence() -> None:
    sched = make_scheduler(num_blocks=5, block_size=2, max_num_batched_tokens=5, max_num_seqs=3)
    requests = [
        Request(
            num_prompt_tokens=2 + i % 5,
            num_output_tokens=1 + i % 4,
            arrival_step=i,
            priority=(i * 7) % 3,
        )
        for i in range(15)
    ]

    seqs = run_engine_loop(sched, requests)

    assert_all_finished_and_pool_free(sched, seqs)
    assert sched.num_preemptions > 0


@st.composite
def engine_setups(draw: st.DrawFn) -> tuple[Scheduler, list[Request]]:
    block_size = draw(st.sampled_from([1, 2, 3, 4]))
    requests = draw(
        st.lists(
            st.builds(
                Request,
                num_prompt_tokens=st.integers(1, 12),
                num_output_tokens=st.integers(1, 6),
                arrival_step=st.integers(0, 6),
                priority=st.integers(0, 2),
                salt=st.sampled_from(["", "x"]),
            ),
            min_size=1,
            max_size=10,
        )
    )
    longest = max(r.num_prompt_tokens + r.num_output_tokens for r in requests)
    # As the engine guarantees: every request fits the pool alone and, without chunked
    # prefill, every (re)computed sequence fits one step's budget.
    num_blocks = -(-longest // block_size) + draw(st.integers(0, 4))
    chunked = draw(st.booleans())
    min_budget = 1 if chunked else longest
    sched = make_scheduler(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_batched_tokens=draw(st.integers(min_budget, min_budget + 16)),
        max_num_seqs=draw(st.integers(1, 6)),
        enable_chunked_prefill=chunked,
        enable_prefix_caching=draw(st.booleans()),
    )
    return sched, requests


@settings(max_examples=150, deadline=None)
@given(setup=engine_setups())
def test_engine_loop_always_finishes_every_sequence_and_frees_the_pool(
    setup: tuple[Scheduler, list[Request]],
) -> None:
    sched, requests = setup

    seqs = run_engine_loop(sched, requests)

    assert_all_finished_and_pool_free(sched, seqs)


def _bursting_scheduler(num_blocks: int, max_decode_burst: int = 8) -> Scheduler:
    config = SchedulerConfig(
        max_model_len=256, max_num_batched_tokens=64, max_decode_burst=max_decode_burst
    )
    return Scheduler(config, BlockManager(num_blocks, 4))


def _prefill_and_sample(scheduler: Scheduler, *seqs: Sequence) -> None:
    for seq in seqs:
        scheduler.add(seq)
    scheduler.schedule()
    for seq in seqs:
        seq.append_token(7)


def test_decode_burst_allocates_every_step_and_stops_at_the_tightest_max_tokens() -> None:
    scheduler = _bursting_scheduler(num_blocks=64)
    a, b = make_seq(6, arrival=0, max_tokens=16), make_seq(5, arrival=1, max_tokens=6)
    _prefill_and_sample(scheduler, a, b)
    out = scheduler.schedule()
    # b has 5 tokens left to generate: the burst stops there for everyone.
    assert out.num_steps == 5
    assert [(c.seq, c.start, c.num_new_tokens) for c in out.chunks] == [(a, 6, 1), (b, 5, 1)]
    for seq in (a, b):
        assert seq.num_computed_tokens == len(seq) - 1 + 5
        assert len(seq.block_table) * 4 >= seq.num_computed_tokens


def test_no_decode_burst_without_free_blocks_for_all_of_it() -> None:
    # 2 blocks of 4: a 7-token sequence has room for one more token, not for eight.
    scheduler = _bursting_scheduler(num_blocks=2)
    seq = make_seq(6, arrival=0, max_tokens=16)
    _prefill_and_sample(scheduler, seq)
    out = scheduler.schedule()
    assert out.num_steps == 1
    assert [(c.start, c.num_new_tokens) for c in out.chunks] == [(6, 1)]


def test_no_decode_burst_when_it_is_turned_off() -> None:
    scheduler = _bursting_scheduler(num_blocks=64, max_decode_burst=1)
    seq = make_seq(6, arrival=0)
    _prefill_and_sample(scheduler, seq)
    assert scheduler.schedule().num_steps == 1

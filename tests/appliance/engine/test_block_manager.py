"""The KV block pool: allocation, reference counts and the salted, chained prefix cache.

The unit tests pin each documented rule of `BlockManager`; the stateful test drives it with
random admissions, prefill chunks, decodes, frees and preemptions and compares every block table
with a naive reference allocator that keys its prefix cache on the whole token prefix (no hashes).
"""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from appliance.engine.block_manager import BlockManager, hash_block, window_pool_num_blocks
from appliance.engine.errors import EngineConfigError
from appliance.engine.sampling_params import SamplingParams
from appliance.engine.sequence import RequestId, Sequence, SequenceStatus

_arrivals = itertools.count()


def make_seq(token_ids: list[int], *, cache_salt: str = "") -> Sequence:
    n = next(_arrivals)
    return Sequence(
        request_id=RequestId(f"req-{n}"),
        token_ids=list(token_ids),
        params=SamplingParams(),
        arrival=n,
        cache_salt=cache_salt,
    )


def admit(bm: BlockManager, seq: Sequence) -> list[int]:
    """Look up `seq`'s cached prefix and allocate the whole rest of it, as one prefill."""
    cached = bm.find_cached_prefix(seq)
    assert bm.allocate(seq, len(seq) - len(cached) * bm.block_size, cached)
    seq.num_computed_tokens = len(seq)
    return cached


def free_block_ids(bm: BlockManager) -> set[int]:
    return {b for b in range(bm.num_blocks) if bm.ref_count(b) == 0}


# --- allocation and freeing -----------------------------------------------------------------


@pytest.mark.parametrize("num_tokens", range(1, 14))
def test_allocate_takes_exactly_ceil_tokens_over_block_size_blocks(num_tokens: int) -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(list(range(num_tokens)))

    assert bm.allocate(seq, num_tokens)

    assert len(seq.block_table) == -(-num_tokens // 4)
    assert len(set(seq.block_table)) == len(seq.block_table)
    assert bm.num_free_blocks == 8 - len(seq.block_table)
    assert all(bm.ref_count(b) == 1 for b in seq.block_table)


def test_allocate_for_a_chunk_extends_the_table_only_as_far_as_the_chunk_reaches() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(list(range(10)))

    assert bm.allocate(seq, 5)
    assert len(seq.block_table) == 2
    seq.num_computed_tokens = 5
    assert bm.allocate(seq, 3)
    assert len(seq.block_table) == 2
    seq.num_computed_tokens = 8
    assert bm.allocate(seq, 2)

    assert len(seq.block_table) == 3
    assert bm.num_free_blocks == 5


def test_allocate_returns_false_and_changes_nothing_when_short_of_blocks() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    holder = make_seq([9] * 8)
    admit(bm, holder)
    seq = make_seq(list(range(9)))

    assert not bm.allocate(seq, 9)

    assert seq.block_table == []
    assert seq.num_published_blocks == 0
    assert bm.num_free_blocks == 1
    assert free_block_ids(bm) == set(range(3)) - set(holder.block_table)
    assert all(bm.ref_count(b) == 1 for b in holder.block_table)


def test_allocate_with_cached_hits_counts_revived_free_blocks_against_the_pool() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    first = make_seq([1, 2, 3, 4, 5])
    admit(bm, first)
    bm.free(first)
    second = make_seq([1, 2, 3, 4, 7, 8, 9])
    cached = bm.find_cached_prefix(second)
    assert len(cached) == 2

    # Two revived blocks plus two new ones: four blocks from a pool of three.
    assert not bm.allocate(second, 3, cached)

    assert second.block_table == []
    assert bm.num_free_blocks == 3
    assert all(bm.ref_count(b) == 0 for b in range(3))


def test_free_returns_every_block_and_clears_the_table() -> None:
    bm = BlockManager(num_blocks=6, block_size=4)
    a, b = make_seq(list(range(9))), make_seq(list(range(100, 105)))
    admit(bm, a)
    admit(bm, b)
    assert bm.num_free_blocks == 1

    bm.free(a)
    bm.free(b)

    assert bm.num_free_blocks == 6
    assert bm.usage == 0.0
    assert a.block_table == [] and b.block_table == []
    assert a.num_published_blocks == 0
    assert all(bm.ref_count(i) == 0 for i in range(6))


def test_block_manager_rejects_an_empty_pool_or_block() -> None:
    with pytest.raises(EngineConfigError):
        BlockManager(num_blocks=0, block_size=4)
    with pytest.raises(EngineConfigError):
        BlockManager(num_blocks=4, block_size=0)


# --- prefix cache ---------------------------------------------------------------------------


def test_second_sequence_with_same_prefix_shares_the_full_prefix_blocks() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    first = make_seq(list(range(10)))
    admit(bm, first)
    second = make_seq([*range(8), 77, 78, 79])

    cached = admit(bm, second)

    assert cached == first.block_table[:2]
    assert second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] != first.block_table[2]
    assert [bm.ref_count(b) for b in cached] == [2, 2]
    assert bm.ref_count(first.block_table[2]) == 1
    assert bm.num_free_blocks == 10 - 3 - 1


def test_find_cached_prefix_takes_no_reference() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    first = make_seq([1, 2, 3])
    admit(bm, first)
    second = make_seq([1, 2, 3])

    cached = bm.find_cached_prefix(second)

    assert cached == first.block_table[:1]
    assert bm.ref_count(cached[0]) == 1
    assert second.block_table == []


@pytest.mark.parametrize("num_blocks_in_prompt", [1, 2, 3])
def test_prompt_of_exact_block_multiple_hits_at_most_all_but_its_last_block(
    num_blocks_in_prompt: int,
) -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(4 * num_blocks_in_prompt))
    admit(bm, make_seq(prompt))

    cached = bm.find_cached_prefix(make_seq(prompt))

    assert len(cached) == num_blocks_in_prompt - 1


def test_identical_prompt_one_token_past_a_block_boundary_hits_every_full_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(9))
    first = make_seq(prompt)
    admit(bm, first)

    cached = bm.find_cached_prefix(make_seq(prompt))

    assert cached == first.block_table[:2]


def test_different_cache_salt_never_shares_blocks_for_identical_tokens() -> None:
    bm = BlockManager(num_blocks=12, block_size=4)
    prompt = list(range(13))
    alice = make_seq(prompt, cache_salt="tenant-a")
    admit(bm, alice)
    bob = make_seq(prompt, cache_salt="tenant-b")
    unsalted = make_seq(prompt)

    assert bm.find_cached_prefix(bob) == []
    assert bm.find_cached_prefix(unsalted) == []
    admit(bm, bob)

    assert not set(alice.block_table) & set(bob.block_table)
    assert bm.find_cached_prefix(make_seq(prompt, cache_salt="tenant-b")) == bob.block_table[:3]


def test_salt_isolation_holds_after_the_blocks_are_freed() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    alice = make_seq([5, 5, 5, 5, 5], cache_salt="a")
    admit(bm, alice)
    bm.free(alice)

    assert bm.find_cached_prefix(make_seq([5, 5, 5, 5, 5], cache_salt="b")) == []


def test_freed_cached_block_is_hit_until_it_is_reused() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    first = make_seq(list(range(5)))
    admit(bm, first)
    prefix_block = first.block_table[0]
    bm.free(first)
    assert bm.find_cached_prefix(make_seq(list(range(5)))) == [prefix_block]

    # The two other free blocks go first; the cached prefix survives them.
    bystander = make_seq([50 + i for i in range(8)])
    admit(bm, bystander)
    assert prefix_block not in bystander.block_table
    assert bm.find_cached_prefix(make_seq(list(range(5)))) == [prefix_block]

    admit(bm, make_seq([60, 61, 62]))

    assert bm.find_cached_prefix(make_seq(list(range(5)))) == []


def test_hit_on_a_freed_block_takes_it_out_of_the_free_pool() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    first = make_seq([1, 2, 3])
    admit(bm, first)
    prefix_block = first.block_table[0]
    bm.free(first)
    second = make_seq([1, 2, 4])

    cached = admit(bm, second)

    assert cached == [prefix_block]
    assert bm.ref_count(prefix_block) == 1
    assert bm.num_free_blocks == 2


def test_free_blocks_are_reused_least_recently_freed_first() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    a, b, c = make_seq([1, 1]), make_seq([2, 2]), make_seq([3, 3])
    for seq in (a, b, c):
        assert bm.allocate(seq, 2)
        seq.num_computed_tokens = 2
    block_a, block_b, block_c = a.block_table[0], b.block_table[0], c.block_table[0]
    bm.free(b)
    bm.free(c)
    bm.free(a)

    taker = make_seq([9] * 6)
    assert bm.allocate(taker, 2)
    assert taker.block_table == [block_b]
    taker.num_computed_tokens = 2
    assert bm.allocate(taker, 4)

    assert taker.block_table == [block_b, block_c, block_a]


def test_a_revived_block_goes_to_the_back_of_the_eviction_order_when_freed_again() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = make_seq([1, 1, 0]), make_seq([2, 2, 0])
    admit(bm, a)
    bm.free(a)
    admit(bm, b)
    bm.free(b)
    # a was freed before b, so a's prefix block would be evicted first; reviving it and freeing
    # it again must make it the most recently freed.
    again = make_seq([1, 1, 7])
    cached = bm.find_cached_prefix(again)
    assert len(cached) == 1
    assert bm.allocate(again, 1, cached)
    bm.free(again)

    taker = make_seq([8, 8, 8, 8])
    assert bm.allocate(taker, 4)

    assert bm.find_cached_prefix(make_seq([2, 2, 0])) == []
    assert bm.find_cached_prefix(make_seq([1, 1, 7])) == cached


def test_freed_sequence_evicts_its_tail_blocks_before_its_prefix() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    seq = make_seq([1, 2, 3, 4, 5, 6, 7])
    admit(bm, seq)
    table = list(seq.block_table)
    bm.free(seq)

    taker = make_seq([0] * 6)
    assert bm.allocate(taker, 6)

    assert taker.block_table == [table[3], table[2], table[1]]
    assert bm.find_cached_prefix(make_seq([1, 2, 3, 4, 5, 6, 7])) == [table[0]]


def test_same_block_tokens_after_a_different_prefix_do_not_hit() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    admit(bm, make_seq([1, 2, 3, 4, 5]))
    other = make_seq([9, 9, 7, 7, 5])
    admit(bm, other)

    # Block 0 hits `other`; block 1 holds [3, 4] like the first sequence's, after another parent.
    hits = bm.find_cached_prefix(make_seq([9, 9, 3, 4, 5]))

    assert hits == other.block_table[:1]


def test_partial_last_block_is_not_offered_to_the_prefix_cache() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    admit(bm, make_seq([1, 2, 3, 4, 5, 6]))

    # A later sequence holding the first six tokens and more can hit only the full block.
    assert len(bm.find_cached_prefix(make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9]))) == 1


def test_decode_that_fills_a_block_publishes_it() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    seq = make_seq([1, 2, 3])
    admit(bm, seq)
    assert bm.find_cached_prefix(make_seq([1, 2, 3, 4, 0])) == seq.block_table[:1]

    seq.append_token(4)
    assert bm.allocate(seq, 1)
    seq.num_computed_tokens += 1

    assert bm.find_cached_prefix(make_seq([1, 2, 3, 4, 0])) == seq.block_table[:2]


def test_chunk_publishes_only_the_blocks_it_fills() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    seq = make_seq([1, 2, 3, 4, 5, 6, 7])
    assert bm.allocate(seq, 3)

    assert bm.find_cached_prefix(make_seq([1, 2, 3, 4, 5, 6, 7])) == seq.block_table[:1]


def test_prefix_caching_disabled_never_hits() -> None:
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    first = make_seq([1, 2, 3, 4, 5])
    admit(bm, first)

    second = make_seq([1, 2, 3, 4, 5])
    assert admit(bm, second) == []
    assert not set(first.block_table) & set(second.block_table)


def test_reset_prefix_cache_forgets_every_hash_but_keeps_allocations() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    live, gone = make_seq([1, 2, 3]), make_seq([4, 5, 6])
    admit(bm, live)
    admit(bm, gone)
    bm.free(gone)

    bm.reset_prefix_cache()

    assert bm.find_cached_prefix(make_seq([1, 2, 3])) == []
    assert bm.find_cached_prefix(make_seq([4, 5, 6])) == []
    assert bm.ref_count(live.block_table[0]) == 1
    assert bm.num_free_blocks == 6


# --- sliding windows -----------------------------------------------------------------------


def test_a_decode_releases_the_blocks_no_window_reaches_and_free_skips_them() -> None:
    # Window 6, blocks of 4: the query at position p sees p - 5 ..= p.
    bm = BlockManager(num_blocks=8, block_size=4, kv_window=6)
    seq = make_seq(list(range(13)))
    admit(bm, seq)  # the prefill's first query is at 0: nothing is released
    assert seq.num_released_blocks == 0 and bm.num_free_blocks == 4
    seq.append_token(13)
    assert bm.allocate(seq, 1)  # query at 13 sees 8 ..= 13: blocks 0 and 1 are unseen
    assert seq.num_released_blocks == 2 and bm.num_free_blocks == 6
    assert set(seq.block_table[:2]) <= free_block_ids(bm)
    assert len(seq.block_table) == 4, "positions still index the table"
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.num_released_blocks == 0


def test_a_chunk_keeps_every_block_its_first_query_can_see() -> None:
    bm = BlockManager(num_blocks=10, block_size=4, kv_window=6)
    seq = make_seq(list(range(30)))
    assert bm.allocate(seq, 16)
    seq.num_computed_tokens = 16
    assert bm.allocate(seq, 8)  # the chunk's first query, at 16, sees 11 ..= 16
    assert seq.num_released_blocks == 2  # blocks 0-1 (positions 0-7); block 2 holds 11


def test_released_blocks_stay_in_the_prefix_cache_for_the_next_request() -> None:
    bm = BlockManager(num_blocks=12, block_size=4, kv_window=4)
    first = make_seq(list(range(20)))
    assert bm.allocate(first, 12)
    first.num_computed_tokens = 12
    assert bm.allocate(first, 8)
    assert first.num_released_blocks == 2
    second = make_seq([*range(20), 99])
    hits = bm.find_cached_prefix(second)
    assert hits == first.block_table[:5], "released blocks still serve as a cached prefix"


def test_without_a_window_no_block_is_released() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(list(range(13)))
    admit(bm, seq)
    seq.append_token(13)
    assert bm.allocate(seq, 1)
    assert seq.num_released_blocks == 0 and bm.num_free_blocks == 4


# --- KV groups: a window group kept in step with the full group ----------------------------

# Window 6, blocks of 4: a query at p sees p - 5 ..= p.
WINDOW = 6


def two_groups(num_blocks: int = 32, num_window_blocks: int = 16) -> BlockManager:
    return BlockManager.with_window_group(num_blocks, num_window_blocks, 4, WINDOW)


def window_of(bm: BlockManager) -> BlockManager:
    assert bm.window_group is not None
    return bm.window_group


def compute_in_chunks(bm: BlockManager, seq: Sequence, chunk: int) -> None:
    """Allocate and compute the rest of `seq`, `chunk` tokens a step, as the scheduler would."""
    while seq.num_computed_tokens < len(seq):
        num_new = min(chunk, len(seq) - seq.num_computed_tokens)
        assert bm.allocate(seq, num_new)
        seq.num_computed_tokens += num_new


def test_a_two_group_sequence_past_the_window_frees_window_blocks_and_no_full_block() -> None:
    bm = two_groups(num_blocks=8, num_window_blocks=6)
    window = window_of(bm)
    seq = make_seq(list(range(13)))
    admit(bm, seq)  # the prefill's first query is at 0: nothing is released
    assert bm.num_free_blocks == 4 and window.num_free_blocks == 2
    seq.append_token(13)
    assert bm.allocate(seq, 1)  # query at 13 sees 8 ..= 13: window blocks 0 and 1 are unseen
    assert seq.num_released_blocks == 0 and bm.num_free_blocks == 4, "the full group keeps all"
    assert seq.window_blocks.num_released_blocks == 2 and window.num_free_blocks == 4
    assert len(seq.window_blocks.block_table) == len(seq.block_table) == 4, "same positions"
    bm.free(seq)
    assert bm.num_free_blocks == 8 and window.num_free_blocks == 6
    assert seq.window_blocks.block_table == [] and seq.window_blocks.num_released_blocks == 0


def test_a_two_group_allocation_the_full_group_cannot_serve_takes_no_window_block() -> None:
    bm = two_groups(num_blocks=3, num_window_blocks=8)
    window = window_of(bm)
    seq = make_seq(list(range(20)))
    assert not bm.allocate(seq, 16)  # four full blocks needed, three free
    assert seq.block_table == [] and seq.window_blocks.block_table == []
    assert bm.num_free_blocks == 3 and window.num_free_blocks == 8
    assert bm.allocate(seq, 12)
    seq.num_computed_tokens = 12
    assert not bm.allocate(seq, 8)  # a running sequence's growth fails in both or neither
    assert len(seq.window_blocks.block_table) == len(seq.block_table) == 3
    # No block taken; block 0, which the query at 12 no longer sees, is given back either way.
    assert seq.window_blocks.num_released_blocks == 1 and window.num_free_blocks == 6


def test_the_window_group_asserts_its_pool_is_never_short() -> None:
    bm = two_groups(num_blocks=8, num_window_blocks=2)
    seq = make_seq(list(range(12)))
    with pytest.raises(AssertionError, match="window_pool_num_blocks"):
        bm.allocate(seq, 12)
    assert seq.block_table == [] and seq.window_blocks.block_table == [], "checked before taking"


def forty_tokens_cached_with_window_blocks_0_to_5_evicted(
    bm: BlockManager,
) -> tuple[list[int], list[int]]:
    """Compute and free tokens 0-39 (both groups' tables returned), then let another request
    take every window block but the last four of them: blocks 0-5 are evicted from the window
    group's prefix cache, the full group still has all ten."""
    window = window_of(bm)
    first = make_seq(list(range(40)))
    compute_in_chunks(bm, first, 8)  # the window group gives back blocks 0-5 as it goes
    assert first.window_blocks.num_released_blocks == 6
    tables = first.block_table, first.window_blocks.block_table
    bm.free(first)  # blocks 9, 8, 7, 6 join the window's free queue last, in that order
    other = make_seq([100 + t for t in range(4 * (window.num_blocks - 4))])
    assert bm.allocate(other, len(other))
    return tables


def test_a_prefix_hit_needs_only_the_window_blocks_its_first_query_sees() -> None:
    bm = two_groups(num_blocks=64, num_window_blocks=12)
    window = window_of(bm)
    full_table, window_table = forty_tokens_cached_with_window_blocks_0_to_5_evicted(bm)

    second = make_seq([*range(40), 99])
    hits = bm.find_cached_prefix(second)
    # The first uncomputed token, at 40, sees 35 ..= 40: window blocks 8 and 9, both cached.
    assert hits == full_table[:10]
    num_free = window.num_free_blocks
    assert bm.allocate(second, 1, hits)
    table = second.window_blocks.block_table
    assert second.window_blocks.num_released_blocks == 8, "placeholders before the window"
    assert table[8:10] == window_table[8:10]
    assert window.num_free_blocks == num_free - 3, "blocks 8 and 9 revived, one new; no more"
    assert all(window.ref_count(b) == 1 for b in table[8:])
    # Placeholders are never offered to the prefix cache: blocks 0-5 stay uncached in the
    # window group, so a prompt of six blocks still misses there.
    assert second.window_blocks.num_published_blocks == 10
    assert bm.find_cached_prefix(make_seq([*range(24), 99])) == []
    bm.free(second)
    assert window.num_free_blocks == num_free


def test_a_prefix_hit_shortens_to_the_longest_whose_window_blocks_are_cached() -> None:
    bm = two_groups(num_blocks=64, num_window_blocks=12)
    full_table, _ = forty_tokens_cached_with_window_blocks_0_to_5_evicted(bm)
    # One more eviction takes block 9 (the first of the four in the free queue): a hit of ten
    # blocks would need it; one of nine (first uncomputed token at 36 sees 31 ..= 36) needs
    # blocks 7 and 8 only.
    assert bm.allocate(make_seq([200 + t for t in range(4)]), 4)
    assert bm.find_cached_prefix(make_seq([*range(40), 99])) == full_table[:9]
    window_of(bm).reset_prefix_cache()
    assert bm.find_cached_prefix(make_seq([*range(40), 99])) == [], "every hit needs a block"


@pytest.mark.parametrize(("budget", "burst"), [(16, 1), (10, 3)])
def test_window_pool_num_blocks_holds_every_scheduling_of_random_requests(
    budget: int, burst: int
) -> None:
    """The real scheduler over random requests (priorities, so that a sequence admitted late
    can outrank one mid-prefill, which then holds its last chunk's blocks through a step; a
    full group small enough to preempt; chunked prefill; decode bursts), with the window pool
    exactly `window_pool_num_blocks`: its allocation never comes up short (it asserts so; with
    (16, 1) it would without the scheduler's release of what its left-out sequences no longer
    see), and the bound is reached."""
    from appliance.engine.scheduler import Scheduler, SchedulerConfig

    max_num_seqs, max_model_len = 4, 64
    step_tokens = max(budget, max_num_seqs * burst)
    bound = window_pool_num_blocks(WINDOW, 4, max_num_seqs, step_tokens, max_model_len)
    most_held = num_preemptions = 0
    for seed in range(60):
        rng = random.Random(seed)
        bm = BlockManager.with_window_group(40, bound, 4, WINDOW)
        window = window_of(bm)
        config = SchedulerConfig(
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_decode_burst=burst,
        )
        scheduler = Scheduler(config, bm)
        for _ in range(150):
            if rng.random() < 0.3:
                seq = make_seq([rng.randrange(3) for _ in range(rng.randint(1, 40))])
                seq.params = SamplingParams(max_tokens=rng.randint(1, 20))
                seq.priority = rng.randrange(3)
                scheduler.add(seq)
            out = scheduler.schedule()
            most_held = max(most_held, window.num_blocks - window.num_free_blocks)
            for chunk in out.chunks:
                if chunk.samples and not chunk.seq.status.finished:
                    for _ in range(out.num_steps):
                        chunk.seq.append_token(rng.randrange(3))
                    if chunk.seq.num_output_tokens >= chunk.seq.params.max_tokens:
                        scheduler.finish(chunk.seq, SequenceStatus.FINISHED_LENGTH)
        num_preemptions += scheduler.num_preemptions
    assert num_preemptions, "the full group should be tight enough to preempt"
    assert bound - 1 <= most_held <= bound


# --- hash_block -----------------------------------------------------------------------------


def test_hash_block_is_deterministic_and_32_bytes() -> None:
    parent = hash_block(None, [1, 2, 3], "")

    assert hash_block(parent, [4, 5, 6], "s") == hash_block(parent, (4, 5, 6), "s")
    assert len(parent) == 32


@pytest.mark.parametrize(
    ("left", "right"),
    [
        ((None, (1, 2), ""), (None, (1, 2), "x")),
        ((None, (1, 2), "ab"), (None, (1, 2), "a")),
        ((None, (1, 2), ""), (None, (2, 1), "")),
        ((None, (1, 2), ""), (None, (1, 2, 0), "")),
        ((None, (1, 2), ""), (b"\x01" * 32, (1, 2), "")),
        ((b"\x01" * 32, (1, 2), ""), (b"\x02" * 32, (1, 2), "")),
    ],
    ids=["salt", "salt-prefix", "token-order", "length", "root-vs-parent", "parent"],
)
def test_hash_block_differs_when_salt_parent_or_tokens_differ(
    left: tuple[bytes | None, tuple[int, ...], str],
    right: tuple[bytes | None, tuple[int, ...], str],
) -> None:
    assert hash_block(*left) != hash_block(*right)


def test_hash_block_does_not_let_salt_bytes_masquerade_as_tokens() -> None:
    # The salt is length-prefixed, so moving bytes between salt and tokens changes the hash.
    assert hash_block(None, [0x64636261], "") != hash_block(None, [], "abcd")


# --- stateful comparison with a naive reference allocator ----------------------------------

PrefixKey = tuple[str, tuple[int, ...]]


class NaiveAllocator:
    """The documented behaviour, spelled out with whole-prefix keys instead of chained hashes.

    Free blocks sit in a list, next-to-reuse first. A block filled with the tokens of positions
    [0, (i+1)*block_size) of a sequence with salt s is cached under (s, those tokens).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.ref = dict.fromkeys(range(num_blocks), 0)
        self.free: list[int] = list(range(num_blocks))
        self.cache: dict[PrefixKey, int] = {}
        self.key_of: dict[int, PrefixKey] = {}
        self.tables: dict[RequestId, list[int]] = {}
        self.published: dict[RequestId, int] = {}

    def key(self, seq: Sequence, block_index: int) -> PrefixKey:
        return (seq.cache_salt, tuple(seq.token_ids[: (block_index + 1) * self.block_size]))

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        hits = []
        for i in range((len(seq) - 1) // self.block_size):
            block = self.cache.get(self.key(seq, i))
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate(self, seq: Sequence, num_new: int, cached: list[int]) -> bool:
        table = self.tables.setdefault(seq.request_id, [])
        num_tokens = seq.num_computed_tokens + len(cached) * self.block_size + num_new
        num_needed = -(-num_tokens // self.block_size) - len(table) - len(cached)
        num_revived = sum(1 for b in cached if self.ref[b] == 0)
        if max(num_needed, 0) + num_revived > len(self.free):
            return False
        for b in cached:
            if self.ref[b] == 0:
                self.free.remove(b)
            self.ref[b] += 1
            table.append(b)
        while len(table) * self.block_size < num_tokens:
            b = self.free.pop(0)
            old = self.key_of.pop(b, None)
            if old is not None and self.cache.get(old) == b:
                del self.cache[old]
            self.ref[b] = 1
            table.append(b)
        num_full = min(num_tokens, len(seq)) // self.block_size
        published = self.published.get(seq.request_id, 0)
        for i in range(published, num_full):
            k = self.key(seq, i)
            if table[i] not in self.key_of and k not in self.cache:
                self.key_of[table[i]] = k
                self.cache[k] = table[i]
        self.published[seq.request_id] = max(published, num_full)
        return True

    def free_seq(self, seq: Sequence) -> None:
        for b in reversed(self.tables.pop(seq.request_id, [])):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free.append(b)
        self.published.pop(seq.request_id, None)


class BlockManagerMachine(RuleBasedStateMachine):
    waiting = Bundle("waiting")

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[RequestId, Sequence] = {}
        # The tokens each block actually holds, by the prefix they complete: filled in as
        # sequences compute, checked whenever a block is read again.
        self.written: dict[int, PrefixKey] = {}

    @initialize(num_blocks=st.integers(2, 10), block_size=st.sampled_from([1, 2, 3]))
    def make_pool(self, num_blocks: int, block_size: int) -> None:
        self.bm = BlockManager(num_blocks, block_size)
        self.model = NaiveAllocator(num_blocks, block_size)

    @rule(
        target=waiting,
        tokens=st.lists(st.integers(0, 2), min_size=1, max_size=10),
        salt=st.sampled_from(["a", "b"]),
    )
    def add_sequence(self, tokens: list[int], salt: str) -> Sequence:
        return make_seq(tokens, cache_salt=salt)

    @rule(
        target=waiting,
        other=waiting,
        num_shared=st.integers(1, 10),
        tail=st.lists(st.integers(0, 2), max_size=4),
        salt=st.sampled_from(["a", "b"]),
    )
    def add_sequence_sharing_a_prefix(
        self, other: Sequence, num_shared: int, tail: list[int], salt: str
    ) -> Sequence:
        return make_seq(other.token_ids[:num_shared] + tail, cache_salt=salt)

    @rule(seq=waiting, chunk=st.integers(1, 12))
    def admit(self, seq: Sequence, chunk: int) -> None:
        if seq.request_id in self.live or seq.status.finished:
            return
        assert seq.block_table == [] and seq.num_computed_tokens == 0
        cached = self.bm.find_cached_prefix(seq)
        assert cached == self.model.find_cached_prefix(seq)
        num_cached_tokens = len(cached) * self.bm.block_size
        assert num_cached_tokens < len(seq)
        num_new = min(chunk, len(seq) - num_cached_tokens)
        expected = self.model.allocate(seq, num_new, cached)
        assert self.bm.allocate(seq, num_new, cached) is expected
        if not expected:
            assert seq.block_table == []
            self.model.tables.pop(seq.request_id)
            return
        self.live[seq.request_id] = seq
        seq.num_computed_tokens = num_cached_tokens
        self._compute(seq, num_new, num_kept_blocks=len(cached))

    @precondition(lambda self: any(s.num_uncomputed_tokens > 0 for s in self.live.values()))
    @rule(data=st.data(), chunk=st.integers(1, 12))
    def continue_prefill(self, data: st.DataObject, chunk: int) -> None:
        candidates = [s for s in self.live.values() if s.num_uncomputed_tokens > 0]
        seq = data.draw(st.sampled_from(sorted(candidates, key=lambda s: s.arrival)))
        self._allocate_more(seq, min(chunk, seq.num_uncomputed_tokens))

    @precondition(lambda self: any(s.num_uncomputed_tokens == 0 for s in self.live.values()))
    @rule(data=st.data(), token=st.integers(0, 2))
    def decode(self, data: st.DataObject, token: int) -> None:
        candidates = [s for s in self.live.values() if s.num_uncomputed_tokens == 0]
        seq = data.draw(st.sampled_from(sorted(candidates, key=lambda s: s.arrival)))
        seq.append_token(token)
        self._allocate_more(seq, 1)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), preempt=st.booleans())
    def free(self, data: st.DataObject, preempt: bool) -> None:
        seq = data.draw(st.sampled_from(sorted(self.live.values(), key=lambda s: s.arrival)))
        del self.live[seq.request_id]
        self.bm.free(seq)
        self.model.free_seq(seq)
        assert seq.block_table == []
        # A preempted sequence keeps its tokens and may be admitted again (a recompute);
        # a finished one never comes back.
        seq.num_computed_tokens = 0
        if not preempt:
            seq.status = seq.status.FINISHED_LENGTH

    def _allocate_more(self, seq: Sequence, num_new: int) -> None:
        num_kept_blocks = len(seq.block_table)
        expected = self.model.allocate(seq, num_new, [])
        assert self.bm.allocate(seq, num_new, []) is expected
        if expected:
            self._compute(seq, num_new, num_kept_blocks=num_kept_blocks)

    def _compute(self, seq: Sequence, num_new: int, *, num_kept_blocks: int) -> None:
        """Advance `seq` past a chunk, recording what each now-full block holds.

        Blocks after the first `num_kept_blocks` were just taken from the free pool: whatever
        they held before is overwritten. Every other full block must already hold this
        sequence's prefix, which is what a prefix-cache hit promises.
        """
        for block in seq.block_table[num_kept_blocks:]:
            self.written.pop(block, None)
        seq.num_computed_tokens += num_new
        for i in range(seq.num_computed_tokens // self.bm.block_size):
            key = self.model.key(seq, i)
            assert self.written.setdefault(seq.block_table[i], key) == key

    @invariant()
    def block_tables_match_the_reference(self) -> None:
        for rid, seq in self.live.items():
            assert seq.block_table == self.model.tables[rid]

    @invariant()
    def free_and_referenced_blocks_partition_the_pool(self) -> None:
        referenced = {b for b in range(self.bm.num_blocks) if self.bm.ref_count(b) > 0}
        assert self.bm.num_free_blocks + len(referenced) == self.bm.num_blocks
        assert self.bm.num_free_blocks == len(self.model.free)
        assert not referenced & set(self.model.free)

    @invariant()
    def ref_counts_equal_the_number_of_tables_holding_each_block(self) -> None:
        for b in range(self.bm.num_blocks):
            holders = sum(b in s.block_table for s in self.live.values())
            assert self.bm.ref_count(b) == holders == self.model.ref[b]

    @invariant()
    def no_table_holds_a_block_twice(self) -> None:
        for seq in self.live.values():
            assert len(set(seq.block_table)) == len(seq.block_table)

    @invariant()
    def tables_cover_exactly_the_computed_tokens(self) -> None:
        for seq in self.live.values():
            assert len(seq.block_table) == -(-seq.num_computed_tokens // self.bm.block_size)

    @invariant()
    def different_salts_never_share_a_block(self) -> None:
        salts_by_block: dict[int, set[str]] = {}
        for seq in self.live.values():
            for b in seq.block_table:
                salts_by_block.setdefault(b, set()).add(seq.cache_salt)
        assert all(len(salts) == 1 for salts in salts_by_block.values())


BlockManagerMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockManagerAgainstNaiveAllocator = BlockManagerMachine.TestCase

"""Fixed-size KV-cache blocks: allocation, reference counts and the prefix cache.

A block holds the keys and values of `block_size` consecutive tokens of one sequence. A full
block is identified by a chained hash: SHA-256 over the parent block's hash, the cache salt and
the block's token ids, so equal hashes mean an equal whole prefix in the same isolation domain
(requests with different salts never share a block). Full blocks are registered in the prefix
cache as soon as their tokens are scheduled; later sequences with the same prefix take a
reference instead of recomputing. A block whose last reference is dropped goes to the back of the
free queue but keeps its hash, so it can still be hit until it is reused, least recently freed
first.

KV groups (docs/ARCHITECTURE.md, "KV groups"): a model whose KV-owning layers are some windowed
and some full keeps the windowed layers' pages in a pool of their own, managed by a second
BlockManager (`window_group`) that the full group's keeps in step. The window group gives back a
sequence's blocks as they leave the window, so its pool holds about a window per running
sequence; it is sized so that it is never short (`window_pool_num_blocks`), which leaves every
scheduling and preemption decision to the full group.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Tokens
from dataclasses import dataclass
from typing import Protocol

from appliance.engine.errors import EngineConfigError
from appliance.engine.sequence import Sequence

# The id standing in the window group's table for a block of a prefix-cache hit that no query
# of the sequence will see: never referenced, never read.
_UNSEEN_BLOCK = 0


def hash_block(parent: bytes | None, token_ids: Tokens[int], cache_salt: str) -> bytes:
    """The chained hash of one full block (a cryptographic hash: a collision would leak KV
    across isolation domains, so Python's `hash()` is not good enough)."""
    salt = cache_salt.encode()
    h = hashlib.sha256()
    h.update(parent or b"\x00" * 32)
    h.update(struct.pack("<I", len(salt)))
    h.update(salt)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return h.digest()


class BlockHolding(Protocol):
    """One group's blocks of a sequence: a `Sequence` itself (the full group's) or its
    `window_blocks`."""

    block_table: list[int]
    num_released_blocks: int
    num_published_blocks: int


def _full_group(seq: Sequence) -> BlockHolding:
    return seq


def _window_group(seq: Sequence) -> BlockHolding:
    return seq.window_blocks


def window_pool_num_blocks(
    window: int, block_size: int, max_num_seqs: int, max_step_tokens: int, max_model_len: int
) -> int:
    """The window group's pool size that is never short: the most blocks its running sequences
    can hold at once.

    A sequence of the window group holds the blocks from the one holding position c - W + 1 to
    the one holding its last allocated token, where c is its first uncomputed position: every
    step first gives back, for every running sequence, the blocks wholly before c - W + 1
    (`release_out_of_window`, and `allocate` before it takes a block), and a step that
    computes n more of its tokens then holds positions c - W + 1 .. c + n - 1, L = W - 1 + n
    tokens. L tokens from any offset span at most floor((L - 2) / B) + 2 blocks of B tokens
    (the first and last may be partial: the straddle). Over the at most S = `max_num_seqs`
    running sequences, whose n add up to at most N = `max_step_tokens` in a step (a waiting
    sequence holds no block), and since a sum of floors is at most the floor of the sum:

        held <= sum_i floor((W - 3 + n_i) / B) + 2 <= floor((S (W - 3) + N) / B) + 2 S.

    N is the scheduler's token budget, or a decode burst's S * max_decode_burst if larger. No
    sequence holds more than its whole table either: at most S ceil(max_model_len / B)."""
    held = (max_num_seqs * (window - 3) + max_step_tokens) // block_size + 2 * max_num_seqs
    whole_tables = max_num_seqs * -(-max_model_len // block_size)
    return max(min(held, whole_tables), 1)


@dataclass(slots=True)
class _Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


class BlockManager:
    """Owns the block pool; sequences hold block ids in `Sequence.block_table` (and, for the
    window group's manager, in `Sequence.window_blocks`)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        kv_window: int | None = None,
    ):
        """kv_window: when every layer of the model attends only to its last W tokens, the
        largest W; a sequence's blocks wholly older than that are released as it advances."""
        if num_blocks < 1 or block_size < 1:
            raise EngineConfigError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}"
            )
        if kv_window is not None and kv_window < 1:
            raise EngineConfigError(f"kv_window must be None or >= 1, got {kv_window}")
        self.kv_window = kv_window
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order: the first is reused next. Values unused.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self._holding: Callable[[Sequence], BlockHolding] = _full_group
        # A model with windowed and full layers: the windowed layers' pool (module docstring).
        self.window_group: BlockManager | None = None

    @classmethod
    def with_window_group(
        cls,
        num_blocks: int,
        num_window_blocks: int,
        block_size: int,
        window: int,
        *,
        enable_prefix_caching: bool = True,
    ) -> BlockManager:
        """The full group's manager, keeping in step a window group of `num_window_blocks`
        blocks (at least `window_pool_num_blocks`) for layers that see their last `window`
        tokens."""
        manager = cls(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
        window_group = cls(
            num_window_blocks,
            block_size,
            enable_prefix_caching=enable_prefix_caching,
            kv_window=window,
        )
        window_group._holding = _window_group
        manager.window_group = window_group
        return manager

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by at least one sequence."""
        return 1.0 - len(self._free) / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a sequence of `num_tokens` tokens holds at once, computed in steps
        of at most `max_chunk` tokens: all of its blocks, or with a window those from the
        step's first query's window to the step's end (one more where they straddle a block)."""
        num_blocks = -(-num_tokens // self.block_size)
        if self.kv_window is None:
            return num_blocks
        span = self.kv_window - 1 + max_chunk
        return min(num_blocks, -(-span // self.block_size) + 1)

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks that hold the longest prefix of `seq`, for a sequence with no blocks.

        At least one token is always left to compute, since the last position's logits are
        needed. With a window group, the prefix is also one whose blocks the window group still
        has where the first uncomputed token's window sees them. Takes no references: pass the
        result to `allocate`.
        """
        assert not seq.block_table, "prefix lookup is for a sequence that holds no blocks"
        if not self.enable_prefix_caching:
            return []
        self._extend_hashes(seq, len(seq) // self.block_size)
        usable = (len(seq) - 1) // self.block_size
        hits: list[int] = []
        for block_hash in seq.block_hashes[:usable]:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        if self.window_group is not None:
            del hits[self.window_group._longest_visible_prefix(seq, len(hits)) :]
        return hits

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] = ()) -> bool:
        """Make `seq`'s block tables cover its computed tokens, the `cached` prefix blocks and
        `num_new_tokens` more. Returns False, taking no block, when the full group has not
        enough free blocks (blocks that no query from the first new token on sees are given
        back either way).

        `cached` (from `find_cached_prefix`, only for a sequence holding no blocks) is appended
        with a reference taken on each block; the caller advances `num_computed_tokens` past them.
        """
        first_query = seq.num_computed_tokens + len(cached) * self.block_size
        num_tokens = first_query + num_new_tokens
        window = self.window_group
        if not cached and num_tokens <= len(seq.block_table) * self.block_size:
            # Most decode steps: the last block still has room (in both groups' tables, which
            # cover the same positions). Without a window nothing is given back, and a block
            # is published only when it fills: most such steps return at once.
            for manager in (self, window):
                if manager is not None:
                    if manager.kv_window is not None:
                        manager._release_out_of_window(seq, first_query)
                    manager._register_full_blocks(seq, num_tokens)
            return True
        window_cached = window._visible_prefix(seq, len(cached)) if window and cached else []
        self._release_out_of_window(seq, first_query)
        if window is not None:
            window._release_out_of_window(seq, first_query)
        if self._num_blocks_to_take(seq, num_tokens, cached) > len(self._free):
            return False
        if window is not None:
            # Checked before either group takes a block: a short window pool is a sizing bug,
            # and it leaves the sequence as it was.
            assert window._num_blocks_to_take(seq, num_tokens, window_cached) <= len(
                window._free
            ), "window_pool_num_blocks bounds what the running sequences hold"
            window._take(seq, num_tokens, window_cached)
        self._take(seq, num_tokens, cached)
        return True

    def release_out_of_window(self, seqs: Iterable[Sequence]) -> None:
        """Give back the blocks no query of these (running) sequences will see any more, from
        their first uncomputed token on: each step does this before it allocates, so that a
        sequence the step leaves out holds no more than a window (`window_pool_num_blocks`)."""
        for manager in (self, self.window_group):
            if manager is not None and manager.kv_window is not None:
                for seq in seqs:
                    manager._release_out_of_window(seq, seq.num_computed_tokens)

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references. Its blocks keep their hashes, tail first in the free queue so
        that a shared prefix outlives the unique suffixes behind it."""
        holding = self._holding(seq)
        for block_id in reversed(holding.block_table[holding.num_released_blocks :]):
            self._drop_reference(block_id)
        holding.block_table = []
        holding.num_published_blocks = 0
        holding.num_released_blocks = 0
        if self.window_group is not None:
            self.window_group.free(seq)

    def _num_unseen(self, first_query: int) -> int:
        """Leading blocks that no query from position `first_query` on sees: a query at p
        sees keys p - W + 1 ..= p, and later queries see less of the past."""
        if self.kv_window is None:
            return 0
        return max(first_query - self.kv_window + 1, 0) // self.block_size

    def _release_out_of_window(self, seq: Sequence, first_query: int) -> None:
        """Give back `seq`'s blocks that no layer can see from position `first_query` (the
        step's earliest query) on. They keep their hashes, so the prefix cache can still hit
        them."""
        holding = self._holding(seq)
        num_unseen = min(self._num_unseen(first_query), len(holding.block_table))
        for block_id in holding.block_table[holding.num_released_blocks : num_unseen]:
            self._drop_reference(block_id)
        holding.num_released_blocks = max(holding.num_released_blocks, num_unseen)

    def _longest_visible_prefix(self, seq: Sequence, num_blocks: int) -> int:
        """The longest prefix of at most `num_blocks` blocks (hashed already) whose blocks that
        its first uncomputed token's window sees are all cached here: the n for which the
        cached run ending at block n - 1 reaches back to the first block that window sees."""
        best = run = 0
        for i, block_hash in enumerate(seq.block_hashes[:num_blocks]):
            run = run + 1 if block_hash in self._cached else 0
            num_prefix = i + 1
            if run >= num_prefix - self._num_unseen(num_prefix * self.block_size):
                best = num_prefix
        return best

    def _visible_prefix(self, seq: Sequence, num_blocks: int) -> list[int]:
        """This group's table for a prefix hit of `num_blocks` blocks (`_longest_visible_prefix`
        admitted it): the cached blocks the first uncomputed token's window sees, after
        placeholders for those it does not."""
        num_unseen = self._num_unseen(num_blocks * self.block_size)
        visible = [self._cached[h] for h in seq.block_hashes[num_unseen:num_blocks]]
        return [_UNSEEN_BLOCK] * num_unseen + visible

    def _drop_reference(self, block_id: int) -> None:
        block = self._blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed more often than allocated"
        if block.ref_count == 0:
            self._free[block_id] = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use stay allocated, just no longer shareable)."""
        self._cached.clear()
        for block in self._blocks:
            block.block_hash = None
        if self.window_group is not None:
            self.window_group.reset_prefix_cache()

    def _num_blocks_to_take(self, seq: Sequence, num_tokens: int, cached: list[int]) -> int:
        holding = self._holding(seq)
        num_needed = -(-num_tokens // self.block_size) - len(holding.block_table) - len(cached)
        # Cached hits that sit in the free queue are taken out of it too (not those no query
        # will see, which are not referenced).
        num_unseen = self._num_unseen(len(cached) * self.block_size)
        num_revived = sum(1 for b in cached[num_unseen:] if self._blocks[b].ref_count == 0)
        return max(num_needed, 0) + num_revived

    def _take(self, seq: Sequence, num_tokens: int, cached: list[int]) -> None:
        """Append `cached` (referencing those a query will see) and free blocks up to
        `num_tokens` tokens; the caller checked there are enough."""
        holding = self._holding(seq)
        if cached:
            num_unseen = self._num_unseen(len(cached) * self.block_size)
            for block_id in cached[num_unseen:]:
                block = self._blocks[block_id]
                if block.ref_count == 0:
                    del self._free[block_id]
                block.ref_count += 1
            holding.block_table.extend(cached)
            holding.num_released_blocks = num_unseen
        while len(holding.block_table) * self.block_size < num_tokens:
            holding.block_table.append(self._take_free_block())
        self._register_full_blocks(seq, num_tokens)

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self._blocks[block_id]
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def _extend_hashes(self, seq: Sequence, num_full_blocks: int) -> None:
        bs = self.block_size
        for i in range(len(seq.block_hashes), num_full_blocks):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            seq.block_hashes.append(hash_block(parent, tokens, seq.cache_salt))

    def _register_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Publish the blocks that will be full once `num_tokens` tokens are computed (not the
        released ones: they may be placeholders, or reused by now)."""
        if not self.enable_prefix_caching:
            return
        holding = self._holding(seq)
        # Not len(seq): no __len__ call, in a call made per running sequence per step.
        num_full = min(num_tokens, len(seq.token_ids)) // self.block_size
        first = max(holding.num_published_blocks, holding.num_released_blocks)
        if num_full <= first:
            return
        self._extend_hashes(seq, num_full)
        for i in range(first, num_full):
            block = self._blocks[holding.block_table[i]]
            block_hash = seq.block_hashes[i]
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                self._cached[block_hash] = block.block_id
        holding.num_published_blocks = num_full

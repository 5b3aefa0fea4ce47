"""Fixed-size KV-cache blocks: allocation, reference counts and the prefix cache.

A block holds the keys and values of `block_size` consecutive tokens of one sequence. A full
block is identified by a chained hash: SHA-256 over the parent block's hash, the cache salt and
the block's token ids, so equal hashes mean an equal whole prefix in the same isolation domain
(requests with different salts never share a block). Full blocks are registered in the prefix
cache as soon as their tokens are scheduled; later sequences with the same prefix take a
reference instead of recomputing. A block whose last reference is dropped goes to the back of the
free queue but keeps its hash, so it can still be hit until it is reused, least recently freed
first.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence as Tokens
from dataclasses import dataclass

from appliance.engine.errors import EngineConfigError
from appliance.engine.sequence import Sequence


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


@dataclass(slots=True)
class _Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


class BlockManager:
    """Owns the block pool; sequences hold block ids in `Sequence.block_table`."""

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
        needed. Takes no references: pass the result to `allocate`.
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
        return hits

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] = ()) -> bool:
        """Make `seq`'s block table cover its computed tokens, the `cached` prefix blocks and
        `num_new_tokens` more. Returns False, changing nothing, when there are not enough free
        blocks.

        `cached` (from `find_cached_prefix`, only for a sequence holding no blocks) is appended
        with a reference taken on each block; the caller advances `num_computed_tokens` past them.
        """
        num_tokens = seq.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        if not cached and num_tokens <= len(seq.block_table) * self.block_size:
            # Most decode steps: the last block still has room.
            self._register_full_blocks(seq, num_tokens)
            self._release_out_of_window(seq, seq.num_computed_tokens)
            return True
        if self._num_blocks_to_take(seq, num_new_tokens, cached) > len(self._free):
            return False
        for block_id in cached:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        while len(seq.block_table) * self.block_size < num_tokens:
            seq.block_table.append(self._take_free_block())
        self._register_full_blocks(seq, num_tokens)
        self._release_out_of_window(seq, num_tokens - num_new_tokens)
        return True

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references. Its blocks keep their hashes, tail first in the free queue so
        that a shared prefix outlives the unique suffixes behind it."""
        for block_id in reversed(seq.block_table[seq.num_released_blocks :]):
            self._drop_reference(block_id)
        seq.block_table = []
        seq.num_published_blocks = 0
        seq.num_released_blocks = 0

    def _release_out_of_window(self, seq: Sequence, first_query: int) -> None:
        """Give back `seq`'s blocks that no layer can see from position `first_query` (the
        step's earliest query) on: a query at p sees keys p - W + 1 ..= p, and later queries
        see less of the past. They keep their hashes, so the prefix cache can still hit them."""
        if self.kv_window is None:
            return
        num_unseen = max(first_query - self.kv_window + 1, 0) // self.block_size
        for block_id in seq.block_table[seq.num_released_blocks : num_unseen]:
            self._drop_reference(block_id)
        seq.num_released_blocks = max(seq.num_released_blocks, num_unseen)

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

    def _num_blocks_to_take(self, seq: Sequence, num_new_tokens: int, cached: list[int]) -> int:
        num_tokens = seq.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        num_needed = -(-num_tokens // self.block_size) - len(seq.block_table) - len(cached)
        # Cached hits that sit in the free queue are taken out of it too.
        num_revived = sum(1 for b in cached if self._blocks[b].ref_count == 0)
        return max(num_needed, 0) + num_revived

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
        """Publish the blocks that will be full once `num_tokens` tokens are computed."""
        if not self.enable_prefix_caching:
            return
        num_full = min(num_tokens, len(seq)) // self.block_size
        if num_full <= seq.num_published_blocks:
            return
        self._extend_hashes(seq, num_full)
        for i in range(seq.num_published_blocks, num_full):
            block = self._blocks[seq.block_table[i]]
            block_hash = seq.block_hashes[i]
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                self._cached[block_hash] = block.block_id
        seq.num_published_blocks = num_full

"""Steps with prompts replayed from CUDA graphs, attention included.

A step that carries a prompt chunk (alone or beside decode rows) runs its forward pass eagerly:
every norm, projection, activation and attention call is a kernel launched from Python, about
400 launches for a 32-layer model, so such a step costs the host 10 ms and more whatever its
size. Under serving load those steps are a third of the server's CPU (docs/BENCHMARKS.md,
"Issue 17, round 6"). So the whole forward pass is captured once per padded token count T of a
ladder, and a step of at most T tokens replays it.

What varies between two steps of T tokens is how the tokens divide into sequences and how long
each context is: attention's metadata. The prefill kernel (kernels.prefill_attention) reads it
from device memory and takes the longest query only to size its grid, so the graph reads it
from static buffers sized for `max_seqs` sequences, with T as the longest query: row tiles past
a sequence's own query length return at once, and padding sequences (query length 0, length 0)
are skipped. A mixed step's decode rows (its leading sequences of one query token) go to the
decode kernel, as in an eager pass: the prefill kernel would give each of them a 128-row tile
for its Hq / Hkv query rows. Their count is in a static buffer too
(`AttentionMetadata.device_decodes`): the decode kernel's grid spans every sequence the size
can hold, its programs past the count return at once, and the prefill kernel skips the
sequences before it.
Replay: the step's ids, positions and slots go into the static inputs (padding rows: slot -1,
no KV write), its block tables, lengths and query starts into the static metadata (padding
sequences past its own: every query start at the step's token count, length 0), then one
replay; the last layer's hidden states land in the static `hidden` buffer. Padding rows compute
garbage that no row reads.

A step longer than the largest size (a burst's worth of arrivals beside the decode rows: two
512-token prompts and 50 decode rows are 1,074 tokens) replays in pieces (`pieces`): runs of
whole sequences in the step's order, each within the largest size, one replay each, their
hidden states copied out in turn. The pieces are independent but for the prefix cache: a
block is published when allocated, so a sequence may read blocks that one scheduled before it
in the same step writes. Such a reader comes later in the step's order, so in the same piece
(which writes each layer's keys and values before attending, as the eager pass does) or a
later one (which runs after every layer of the earlier ones). A piece much shorter than the
largest size reads all the weights for little work (the 8B on an H100: 16 GB, 5.3 ms, against
256 tokens' 5.1 ms of matmul), and many pieces run their matmuls below the rate of one large
one, so a step whose pieces would be more than `MAX_PIECES`, or would leave one under
`MIN_PIECE_FRACTION` of the largest size, runs eagerly.

Memory: the graphs allocate from the decode graphs' private pool (appliance.engine.
cuda_graphs), the largest size captured first, so each smaller one reuses what the largest
took. The pool is then the largest of all the graphs' needs, measured by
`ModelRunner.kv_pools_for_free_memory` before the KV pool is sized.

Only for models on one device without recurrent states or a window group (`ModelRunner`
decides): their steps need no inputs past the ones above.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable

import torch

from appliance.engine.cuda_graphs import warm_and_capture
from appliance.engine.models.decoder import CausalLM
from kernels.ops import AttentionMetadata

# Padded token counts captured (up to the step's token budget). W3's steps (a 512-token prompt
# beside ~80 decode rows) pad to 640. The graphs' pool holds the largest size's activations:
# with Llama-3.1-8B 86 MiB up to 640 tokens, 126 MiB up to 1,024, which W6 (non-weight, non-KV
# memory at most 1.5 GiB, 1.48 with these sizes) has no room for (docs/BENCHMARKS.md, "Issue
# 17, round 8"). Larger steps replay in pieces or run eagerly (module docstring).
PROMPT_GRAPH_SIZES = (128, 256, 384, 512, 640)
# A longer step in at most this many pieces, none under this share of the largest size
# (module docstring).
MAX_PIECES = 4
MIN_PIECE_FRACTION = 0.4


# (first sequence, end of sequences, first token, end of tokens) of one piece of a step.
Piece = tuple[int, int, int, int]


class PromptGraphs:
    """One graph per captured size, replayed with the step's metadata (module docstring)."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        pool: tuple[int, int],
        stream: torch.cuda.Stream,
        *,
        max_seqs: int,
        max_blocks_per_seq: int,
    ):
        """pool: the private pool to allocate from (the decode graphs'); stream: the stream to
        capture on (theirs); max_seqs: the most sequences a step holds; max_blocks_per_seq:
        the block-table width of the longest context."""
        self.model = model
        self.stream = stream
        self.kv_caches = kv_caches
        self.pool = pool
        self.max_seqs = max_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.sizes: list[int] = []
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}

    @property
    def max_tokens(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    def captures(self, sizes: list[int]) -> list[Callable[[], None]]:
        """One capture per padded token count in `sizes`, to be run in this order (largest
        first, so that the smaller sizes fit in the memory the largest one took). Each size
        replays as soon as its capture has run; steps may run between two captures."""
        self._allocate(max(sizes))
        return [functools.partial(self._capture_size, size) for size in sorted(sizes, reverse=True)]

    def _allocate(self, n: int) -> None:
        """The static inputs and output of steps of up to `n` tokens, and their metadata."""
        weight = self.model.embed_tokens.weight
        device = weight.device
        self._input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self._positions = torch.zeros(n, dtype=torch.int64, device=device)
        self._slots = torch.full((n,), -1, dtype=torch.int64, device=device)
        self._hidden = torch.empty(
            n, self.model.config.hidden_size, dtype=weight.dtype, device=device
        )
        seqs = self.max_seqs
        self._block_tables = torch.zeros(
            seqs, self.max_blocks_per_seq, dtype=torch.int32, device=device
        )
        self._seq_lens = torch.zeros(seqs, dtype=torch.int32, device=device)
        self._query_start_loc = torch.zeros(seqs + 1, dtype=torch.int32, device=device)
        self._num_decodes = torch.zeros(1, dtype=torch.int32, device=device)

    def _pad(self) -> None:
        """Every row and sequence padding (no KV write, nothing attended), as when allocated:
        a warm-up after replays must not write a real step's slots, whose blocks the prefix
        cache may still serve."""
        self._slots.fill_(-1)
        self._seq_lens.zero_()
        self._query_start_loc.zero_()
        self._num_decodes.zero_()

    @torch.inference_mode()
    def _capture_size(self, size: int) -> None:
        self._pad()
        self._graphs[size] = warm_and_capture(
            lambda: self._hidden[:size].copy_(self._forward(size)), self.pool, self.stream
        )
        self.sizes = sorted(self._graphs)

    def _forward(self, size: int) -> torch.Tensor:
        """The forward pass over the static inputs and metadata, `size` the longest query. A
        step of `size` tokens holds at most `size` sequences: attention's grid spans no more."""
        seqs = min(self.max_seqs, size)
        meta = AttentionMetadata(
            slot_mapping=self._slots[:size],
            block_tables=self._block_tables[:seqs],
            seq_lens_t=self._seq_lens[:seqs],
            query_start_loc=self._query_start_loc[: seqs + 1],
            seq_lens=[],  # host copies are not read on the graph path
            query_lens=[],
            max_query_len=size,
            decode_only=False,
            device_decodes=self._num_decodes,
        )
        return self.model(self._input_ids[:size], self._positions[:size], self.kv_caches, meta)

    def pieces(self, query_lens: list[int]) -> list[Piece] | None:
        """How a step whose sequences bring `query_lens` new tokens replays: one piece when it
        fits a size (at most `max_tokens` tokens of at most `max_seqs` sequences), else the
        fewest runs of whole sequences that fit, in order (module docstring); None when it runs
        eagerly."""
        limit, max_seqs = self.max_tokens, self.max_seqs
        num_tokens = sum(query_lens)
        if num_tokens <= limit and len(query_lens) <= max_seqs:
            return [(0, len(query_lens), 0, num_tokens)] if limit else None
        if num_tokens > MAX_PIECES * limit:
            return None
        pieces: list[Piece] = []
        first_seq = first_token = token = 0
        for seq, n in enumerate(query_lens):
            if token + n - first_token > limit or seq - first_seq == max_seqs:
                pieces.append((first_seq, seq, first_token, token))
                first_seq, first_token = seq, token
            token += n
        pieces.append((first_seq, len(query_lens), first_token, token))
        shortest = MIN_PIECE_FRACTION * limit
        if len(pieces) > MAX_PIECES or any(
            not shortest <= end - first <= limit for _, _, first, end in pieces
        ):
            return None  # also when a sequence alone is longer than every size
        return pieces

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        pieces: list[Piece],
    ) -> torch.Tensor:
        """Replay, for each of the step's `pieces`, the smallest size that fits it: [T, hidden]
        states. With one piece, a view of the static buffer the next replay of any size
        overwrites."""
        if len(pieces) == 1:
            self._graphs[self._stage(input_ids, positions, meta, pieces[0])].replay()
            return self._hidden[: input_ids.shape[0]]
        hidden = self._hidden.new_empty(input_ids.shape[0], self._hidden.shape[1])
        for piece in pieces:
            first, end = piece[2], piece[3]
            self._graphs[self._stage(input_ids, positions, meta, piece)].replay()
            hidden[first:end].copy_(self._hidden[: end - first])
        return hidden

    def _stage(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        piece: Piece,
    ) -> int:
        """One piece of the step (its tokens and sequences, their query starts counted from
        its first token) into the static buffers, the rest padding; the size to replay."""
        first_seq, end_seq, first, end = piece
        num_tokens, num_seqs = end - first, end_seq - first_seq
        width = meta.block_tables.shape[1]
        size = self.sizes[bisect.bisect_left(self.sizes, num_tokens)]
        self._input_ids[:num_tokens].copy_(input_ids[first:end], non_blocking=True)
        self._positions[:num_tokens].copy_(positions[first:end], non_blocking=True)
        self._slots[:num_tokens].copy_(meta.slot_mapping[first:end], non_blocking=True)
        if size > num_tokens:
            self._slots[num_tokens:size].fill_(-1)
        tables = meta.block_tables[first_seq:end_seq]
        self._block_tables[:num_seqs, :width].copy_(tables, non_blocking=True)
        self._seq_lens[:num_seqs].copy_(meta.seq_lens_t[first_seq:end_seq], non_blocking=True)
        starts = self._query_start_loc[: num_seqs + 1]
        starts.copy_(meta.query_start_loc[first_seq : end_seq + 1], non_blocking=True)
        if first:
            starts.sub_(first)
        if num_seqs < self.max_seqs:
            self._seq_lens[num_seqs:].zero_()
            self._query_start_loc[num_seqs + 1 :].fill_(num_tokens)
        # The step's leading decode rows that fall in this piece, as the eager pass routes them.
        self._num_decodes.fill_(min(max(meta.num_leading_decodes - first_seq, 0), num_seqs))
        return size

    def release(self) -> None:
        torch.cuda.synchronize()
        for graph in self._graphs.values():
            graph.reset()
        self._graphs.clear()
        self.sizes = []

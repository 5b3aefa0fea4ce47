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
are skipped. A mixed step's decode rows are sequences of one query token in the same kernel.
Replay: the step's ids, positions and slots go into the static inputs (padding rows: slot -1,
no KV write), its block tables, lengths and query starts into the static metadata (padding
sequences past its own: every query start at the step's token count, length 0), then one
replay; the last layer's hidden states land in the static `hidden` buffer. Padding rows compute
garbage that no row reads.

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
# 17, round 8"). Larger steps run eagerly, their launches a smaller share of their time.
PROMPT_GRAPH_SIZES = (128, 256, 384, 512, 640)


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

    def _pad(self) -> None:
        """Every row and sequence padding (no KV write, nothing attended), as when allocated:
        a warm-up after replays must not write a real step's slots, whose blocks the prefix
        cache may still serve."""
        self._slots.fill_(-1)
        self._seq_lens.zero_()
        self._query_start_loc.zero_()

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
        )
        return self.model(self._input_ids[:size], self._positions[:size], self.kv_caches, meta)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Replay the smallest size that fits a step of T tokens (T <= max_tokens) of at most
        `max_seqs` sequences: [T, hidden] states, a view of the static buffer the next replay
        of any size overwrites."""
        self._graphs[self._stage(input_ids, positions, meta)].replay()
        return self._hidden[: input_ids.shape[0]]

    def _stage(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> int:
        """The step's inputs and metadata into the static buffers, the rest padding; the size
        to replay."""
        num_tokens = input_ids.shape[0]
        num_seqs, width = meta.block_tables.shape
        size = self.sizes[bisect.bisect_left(self.sizes, num_tokens)]
        self._input_ids[:num_tokens].copy_(input_ids, non_blocking=True)
        self._positions[:num_tokens].copy_(positions, non_blocking=True)
        self._slots[:num_tokens].copy_(meta.slot_mapping, non_blocking=True)
        if size > num_tokens:
            self._slots[num_tokens:size].fill_(-1)
        self._block_tables[:num_seqs, :width].copy_(meta.block_tables, non_blocking=True)
        self._seq_lens[:num_seqs].copy_(meta.seq_lens_t, non_blocking=True)
        self._query_start_loc[: num_seqs + 1].copy_(meta.query_start_loc, non_blocking=True)
        if num_seqs < self.max_seqs:
            self._seq_lens[num_seqs:].zero_()
            self._query_start_loc[num_seqs + 1 :].fill_(num_tokens)
        return size

    def release(self) -> None:
        torch.cuda.synchronize()
        for graph in self._graphs.values():
            graph.reset()
        self._graphs.clear()
        self.sizes = []

"""Steps with prompts replayed from CUDA graphs, piece by piece around attention.

A step that carries a prompt chunk (alone or beside decode rows) runs its forward pass eagerly:
every norm, projection and activation is a kernel launched from Python, about 400 launches for
a 32-layer model, so such a step costs the host 10 ms and more whatever its size. Under
serving load those steps are a third of the server's CPU (docs/BENCHMARKS.md, "Issue 17,
round 6"). What varies between two such steps of the same token count is only attention: how
the tokens divide into sequences, how long each context is. So, as vLLM's piecewise graphs
do, everything between two attention calls is captured once per padded token count T of a
ladder, and replayed; attention runs eagerly between the pieces, with the step's own metadata.

Capture: the forward pass runs once under capture with every attention layer's kernel ops
replaced by `_SplitAtAttention`, whose `paged_attention` ends the graph being captured (after
copying q into the static `q` buffer), records what the layer's attention reads (its caches,
scale, window, FP8 scales, sinks), begins the next graph and returns
the static `out` buffer as the attention's output. A model of L attention layers gives L + 1
pieces. Replay: the step's ids, positions and slots go into the static inputs (padding rows:
slot -1, no KV write), then piece 0, attention 0 from `q` into `out`, piece 1, ... and the last
piece copies the final hidden states into the static `hidden` buffer. Padding rows compute
garbage that no row reads (in a piece, each row's result depends on that row alone); `out`'s
rows past a step's tokens are zeroed once and otherwise hold an earlier step's values, so they
stay finite.

Memory: the pieces allocate from the decode graphs' private pool (appliance.engine.
cuda_graphs), the largest size captured first; a tensor that crosses an attention call (the
residual stream) lives in the pool from its piece to the next, which no other graph replays
in between. The pool is then the largest of all the graphs' needs, measured by
`ModelRunner.kv_pools_for_free_memory` before the KV pool is sized.

Only for models on one device without recurrent states or a window group, whose attention
layers share one width (`ModelRunner` decides): their pieces need no inputs past the three
above, and every layer's q and output fit the same two buffers.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from appliance.engine.cuda_graphs import collector_paused
from appliance.engine.models.decoder import CausalLM
from appliance.engine.models.layers import Attention
from kernels.ops import AttentionMetadata, KernelOps

# Padded token counts captured (up to the step's token budget). W3's steps (a 512-token prompt
# beside ~80 decode rows) pad to 640. The graphs' pool holds the largest size's activations:
# with Llama-3.1-8B 86 MiB up to 640 tokens, 126 MiB up to 1,024, which W6 (non-weight, non-KV
# memory at most 1.5 GiB, 1.48 with these sizes) has no room for (docs/BENCHMARKS.md, "Issue
# 17, round 8"). Larger steps run eagerly, their launches a smaller share of their time.
PROMPT_GRAPH_SIZES = (128, 256, 384, 512, 640)


@dataclass(frozen=True, eq=False)
class _AttentionCall:
    """What one attention layer reads, recorded at capture and replayed eagerly."""

    ops: KernelOps
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    scale: float
    sliding_window: int | None
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    sinks: torch.Tensor | None

    def run(self, q: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor) -> None:
        """The layer's attention over a step's own metadata, written into `out`."""
        self.ops.paged_attention(
            q,
            self.k_cache,
            self.v_cache,
            meta,
            self.scale,
            sliding_window=self.sliding_window,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            sinks=self.sinks,
            out=out,
        )


class _SplitAtAttention:
    """An attention layer's kernel ops while a size is captured: everything passes through
    except `paged_attention`, which hands the capture to `split` and returns its output."""

    def __init__(self, ops: KernelOps, split: Callable[..., torch.Tensor]):
        self._ops = ops
        self._split = split

    def __getattr__(self, name: str):
        return getattr(self._ops, name)

    def paged_attention(self, q, k_cache, v_cache, meta, scale, **per_layer) -> torch.Tensor:
        call = _AttentionCall(self._ops, k_cache, v_cache, scale, **per_layer)
        return self._split(q, call)


class PromptGraphs:
    """The pieces of every captured size, replayed around eager attention (module docstring)."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        pool: tuple[int, int],
        stream: torch.cuda.Stream,
    ):
        """pool: the private pool to allocate from (the decode graphs'); stream: the stream to
        capture on (theirs)."""
        self.model = model
        self.stream = stream
        self.kv_caches = kv_caches
        self.pool = pool
        self.sizes: list[int] = []
        self._pieces: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self._calls: list[_AttentionCall] = []

    @property
    def max_tokens(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    def captures(self, sizes: list[int]) -> list[Callable[[], None]]:
        """One capture per padded token count in `sizes`, to be run in this order (largest
        first, so that the smaller sizes fit in the memory the largest one's pieces took). Each
        size replays as soon as its capture has run; steps may run between two captures."""
        self._allocate(max(sizes))
        return [functools.partial(self._capture_size, size) for size in sorted(sizes, reverse=True)]

    @torch.inference_mode()
    def _capture_size(self, size: int) -> None:
        device = self.model.embed_tokens.weight.device
        # Replays may have left a step's slots: the warm-up must write no KV (its attention
        # reads nothing, so what it would write is garbage), the prefix cache may serve them.
        self._slots.fill_(-1)
        self._forward(size, None)  # warm-up: compilation and lazy set-up stay outside
        torch.cuda.synchronize(device)
        with collector_paused(), torch.cuda.stream(self.stream):
            self._pieces[size] = self._capture_pieces(size)
        torch.cuda.synchronize(device)
        self.sizes = sorted(self._pieces)

    def _allocate(self, n: int) -> None:
        """The static inputs and outputs of steps of up to `n` tokens."""
        weight = self.model.embed_tokens.weight
        device = weight.device
        attention = self.model.attentions[0]
        width = attention.num_heads * attention.head_dim
        self._input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self._positions = torch.zeros(n, dtype=torch.int64, device=device)
        self._slots = torch.full((n,), -1, dtype=torch.int64, device=device)
        self._hidden = torch.empty(
            n, self.model.config.hidden_size, dtype=weight.dtype, device=device
        )
        # Every layer's q and attention output pass through these (one head width: the layers
        # of a model with per-layer head dims would need one per width, and are not captured).
        self._q = torch.zeros(
            n, attention.num_heads, attention.head_dim, dtype=weight.dtype, device=device
        )
        self._out = torch.zeros_like(self._q)
        assert all(a.num_heads * a.head_dim == width for a in self.model.attentions)

    def _capture_pieces(self, size: int) -> list[torch.cuda.CUDAGraph]:
        pieces: list[torch.cuda.CUDAGraph] = []
        graph: torch.cuda.CUDAGraph | None = None

        def begin() -> None:
            nonlocal graph
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self.pool)

        def end() -> None:
            nonlocal graph
            assert graph is not None
            ended, graph = graph, None
            ended.capture_end()
            pieces.append(ended)

        def split(q: torch.Tensor, call: _AttentionCall) -> torch.Tensor:
            self._q[:size].copy_(q)
            end()
            index = len(pieces) - 1
            if index == len(self._calls):  # the first size captured records the calls
                self._calls.append(call)
            # Every size makes the same calls in the same order.
            assert self._calls[index].k_cache.data_ptr() == call.k_cache.data_ptr()
            begin()
            return self._out[:size]

        begin()
        try:
            self._hidden[:size].copy_(self._forward(size, split))
            end()
        finally:
            if graph is not None:  # a failed capture: end it, so the stream is usable again
                graph.capture_end()
        return pieces

    def _forward(self, size: int, split: Callable[..., torch.Tensor] | None) -> torch.Tensor:
        """The forward pass over the static inputs, each attention call handed to `split`
        (None: the warm-up, whose attention reads nothing and returns `out`)."""
        if split is None:

            def split(q: torch.Tensor, call: _AttentionCall) -> torch.Tensor:
                self._q[:size].copy_(q)
                return self._out[:size]

        meta = AttentionMetadata(
            slot_mapping=self._slots[:size],
            block_tables=torch.empty(0, 0, dtype=torch.int32),  # attention is not captured
            seq_lens_t=torch.empty(0, dtype=torch.int32),
            query_start_loc=torch.empty(0, dtype=torch.int32),
            seq_lens=[],
            query_lens=[],
            max_query_len=0,
            decode_only=False,
        )
        attentions: list[Attention] = self.model.attentions
        kept = [a.ops for a in attentions]
        for a in attentions:
            a.ops = _SplitAtAttention(a.ops, split)
        try:
            return self.model(self._input_ids[:size], self._positions[:size], self.kv_caches, meta)
        finally:
            for a, ops in zip(attentions, kept, strict=True):
                a.ops = ops

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Replay the smallest size that fits a step of T tokens (T <= max_tokens): [T, hidden]
        states, a view of the static buffer the next replay of any size overwrites."""
        num_tokens = input_ids.shape[0]
        size = self.sizes[bisect.bisect_left(self.sizes, num_tokens)]
        self._input_ids[:num_tokens].copy_(input_ids, non_blocking=True)
        self._positions[:num_tokens].copy_(positions, non_blocking=True)
        self._slots[:num_tokens].copy_(meta.slot_mapping, non_blocking=True)
        if size > num_tokens:
            self._slots[num_tokens:size].fill_(-1)
        q, out = self._q[:num_tokens], self._out[:num_tokens]
        pieces = self._pieces[size]
        for piece, call in zip(pieces, self._calls, strict=False):
            piece.replay()
            call.run(q, meta, out)
        pieces[-1].replay()
        return self._hidden[:num_tokens]

    def release(self) -> None:
        torch.cuda.synchronize()
        for pieces in self._pieces.values():
            for piece in pieces:
                piece.reset()
        self._pieces.clear()
        self.sizes = []

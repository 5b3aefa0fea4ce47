"""The contract between the model code and a kernel backend.

`kernels.reference` implements it in plain torch; `kernels.triton_ops` implements the same
functions with the same semantics on the GPU, so the model never knows which one it runs on.

The paged KV cache is either in the model's dtype or FP8 (`kernels.launch_checks.KV_CACHE_FP8`);
`write_kv_cache` and `paged_attention` take the FP8 cache's per-tensor K and V scales as
one-element device tensors (`kernels.reference.quantize_kv` defines the encoding), and ignore
them for a cache in the model's dtype.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch

from kernels.moe_spec import ClampedSwiglu, Router


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Where one forward pass finds each sequence's KV cache.

    A flattened, variable-length batch: sequence b owns `query_lens[b]` consecutive rows of the
    batch, the last of its `seq_lens[b]` tokens.

    slot_mapping: [T] int64, where each new token's key and value are written (-1: padding)
    block_tables: [B, max_blocks] int32, each sequence's block ids (padding: 0)
    seq_lens_t: [B] int32, seq_lens on the device (0 marks a padding row)
    query_start_loc: [B + 1] int32, cumulative query_lens on the device
    seq_lens, query_lens: the same on the host (the reference path and input preparation)
    decode_only: every query_len is 1, so the decode kernel (and CUDA graphs) can run
    num_splits: split-KV factor of the decode kernel (fixed per captured graph)
    num_leading_decodes: how many sequences at the start of the batch have query_len 1 (a
        mixed batch's decode rows, which the scheduler places first): the GPU backend runs
        them through the decode kernel and only the rest through the prefill kernel
    device_decodes: None, or the same count as a [1] int32 tensor on the device, which the GPU
        backend routes by instead (a prompt graph's metadata: one capture serves every split
        of its steps into decode rows and prompts, so the count is known only when replayed)
    window_group: with two KV groups (appliance.engine.kv_cache), the same batch in the window
        group's pool: its own slot_mapping and block_tables (a token's slot differs per pool),
        the lengths shared; the windowed layers attend with it. Entries of its tables before a
        sequence's window hold placeholder ids, which no kernel reads: attention with a window
        W reads only the blocks of the last W keys. None with one group.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens_t: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: list[int]
    query_lens: list[int]
    max_query_len: int
    decode_only: bool
    num_splits: int = 1
    num_leading_decodes: int = 0
    device_decodes: torch.Tensor | None = None
    window_group: AttentionMetadata | None = None

    @classmethod
    def build(
        cls,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: list[int],
        query_lens: list[int],
        *,
        num_splits: int = 1,
        window_slot_mapping: torch.Tensor | None = None,
        window_block_tables: torch.Tensor | None = None,
        device_lengths: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> AttentionMetadata:
        """Derive the device-side lengths from host lists (one small copy each), unless
        `device_lengths` brings them (seq_lens_t, query_start_loc: copied with the rest of a
        step's inputs); with the window group's slots and tables, its metadata too."""
        device = slot_mapping.device
        num_leading_decodes = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
        if device_lengths is None:
            starts = [0]
            for n in query_lens:
                starts.append(starts[-1] + n)
            device_lengths = (
                torch.tensor(seq_lens, dtype=torch.int32).to(device, non_blocking=True),
                torch.tensor(starts, dtype=torch.int32).to(device, non_blocking=True),
            )
        meta = cls(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            seq_lens_t=device_lengths[0],
            query_start_loc=device_lengths[1],
            seq_lens=seq_lens,
            query_lens=query_lens,
            max_query_len=max(query_lens, default=0),
            decode_only=num_leading_decodes == len(query_lens),
            num_splits=num_splits,
            num_leading_decodes=num_leading_decodes,
        )
        if window_slot_mapping is None or window_block_tables is None:
            return meta
        return meta.with_window_group(window_slot_mapping, window_block_tables)

    def with_window_group(
        self, slot_mapping: torch.Tensor, block_tables: torch.Tensor
    ) -> AttentionMetadata:
        """This batch with the window group's [T] slots and [B, max_blocks] tables."""
        window = dataclasses.replace(self, slot_mapping=slot_mapping, block_tables=block_tables)
        return dataclasses.replace(self, window_group=window)


@dataclass(frozen=True, slots=True)
class RecurrentStateMetadata:
    """Where one forward pass finds each sequence's recurrent state (linear-attention layers).

    A linear-attention layer (Gated DeltaNet) keeps a fixed-size state per sequence instead of
    a growing KV cache: the last K-1 inputs of its causal convolution and the delta rule's
    [Dk, Dv] matrix per value head. Each running sequence owns one slot of the layer's state
    tensors; the batch is the same flattened variable-length batch as `AttentionMetadata`'s.

    state_slots: [B] int32, each sequence's slot (negative: a padding row, whose outputs are
        zeros and which writes no state)
    has_initial_state: [B] bool, False where the sequence starts in this pass (its slot's old
        contents are ignored and read as zeros)
    query_start_loc: [B + 1] int32, cumulative query_lens on the device
    query_lens: the same on the host (the reference path)
    decode_only: every query_len is 1 (the recurrent step; what CUDA graphs capture)
    """

    state_slots: torch.Tensor
    has_initial_state: torch.Tensor
    query_start_loc: torch.Tensor
    query_lens: list[int]
    decode_only: bool


@dataclass(frozen=True, slots=True)
class Fp8Weight:
    """A projection weight in FP8 (e4m3) with a scale per output channel: the weight it stands
    for is `weight * scale[:, None]`. A projection with it is W8A8: its input is quantized to
    FP8 too, per token (dynamically, `kernels.fp8.quantize_rows`), or with one static scale
    when `input_scale` is given; the FP8 products are summed in float32 and scaled by both.

    weight: [N, K] float8_e4m3fn (nn.Linear's layout); scale: [N] float32;
    input_scale: [1] float32 or None. A mixture's stacked experts (`KernelOps.fused_moe`):
    weight [E, N, K], scale [E, N], input_scale None (activations per token).
    """

    weight: torch.Tensor
    scale: torch.Tensor
    input_scale: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class Fp8Rows:
    """Activations already quantized for an FP8 projection (`KernelOps.add_rms_norm` with
    `quantize_for`): the rows x stands for are `q * scale[:, None]`, x being of `dtype`, the
    dtype the projection returns. `KernelOps.linear` takes them in x's place with the
    `Fp8Weight` they were quantized for, and skips its own quantization.

    q: [T, K] float8_e4m3fn; scale: [T] float32 (each row's, or the weight's static input
    scale repeated).
    """

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    def __getitem__(self, rows: slice) -> Fp8Rows:
        """A run of rows (a long step's MLP takes its rows in pieces)."""
        return Fp8Rows(self.q[rows], self.scale[rows], self.dtype)


class KernelOps(Protocol):
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        quantize_for: Fp8Weight | None = None,
    ) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor]:
        """`residual + x`, then RMSNorm of the sum: (normed, new residual). With
        `quantize_for` (the FP8 projection that alone reads the normed rows), normed may come
        quantized for it as `Fp8Rows`, wherever `linear` with that weight would quantize the
        rows itself. The projection's output is the same either way, up to the order in which
        a GPU kernel sums a row's squares (`kernels.rmsnorm.add_rms_norm_fp8`)."""
        ...

    def rotary_embedding(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def linear(
        self,
        x: torch.Tensor | Fp8Rows,
        weight: torch.Tensor | Fp8Weight,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """x @ weight.T + bias; x as `Fp8Rows` only with the `Fp8Weight` it was quantized
        for."""
        ...

    def silu_mul_linear(
        self, x: torch.Tensor, weight: torch.Tensor | Fp8Weight
    ) -> torch.Tensor: ...

    def gelu_tanh_mul_linear(
        self, x: torch.Tensor, weight: torch.Tensor | Fp8Weight
    ) -> torch.Tensor: ...

    def fused_moe(
        self,
        x: torch.Tensor,
        gate_up: torch.Tensor | Fp8Weight,
        down: torch.Tensor | Fp8Weight,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        gate_up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
        clamped_swiglu: ClampedSwiglu | None = None,
        activation: str = "silu",
    ) -> torch.Tensor: ...

    def route_experts(
        self,
        logits: torch.Tensor,
        router: Router,
        selection_bias: torch.Tensor | None = None,
        expert_scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A mixture of experts' routing, as `router` declares it.

        logits: [T, E] (the router projection's, any float dtype; scored in float32);
        selection_bias: [E], with `router.selection_bias`; expert_scale: [E], with
        `router.per_expert_scale`. Returns (weights [T, k] float32, expert ids [T, k]
        integer), each row's experts by descending choice. Equal values are ordered as
        torch.topk orders them in the reference, the lower expert id first in the Triton
        kernel (`kernels.reference.route_experts` says why they differ).
        """
        ...

    def write_kv_cache(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None: ...

    def rotary_write_kv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`rotary_embedding` then `write_kv_cache` in one: returns q rotated; k is not
        (the cache holds its rotation)."""
        ...

    def paged_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def causal_conv1d(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        conv_state: torch.Tensor,
        meta: RecurrentStateMetadata,
    ) -> torch.Tensor:
        """silu(depthwise causal convolution of x), continuing each sequence's convolution.

        x: [T, D] in the model's dtype; weight: [D, K]; bias: [D] or None;
        conv_state: [num_slots, D, K - 1] in x's dtype, updated in place: afterwards a
        sequence's slot holds its last K - 1 inputs (zeros before its first token).
        Returns [T, D] in x's dtype.
        """
        ...

    def gated_delta_rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        meta: RecurrentStateMetadata,
    ) -> torch.Tensor:
        """The gated delta rule (Gated DeltaNet), continuing each sequence's state.

        q, k: [T, Hk, Dk]; v: [T, Hv, Dv] with Hv a multiple of Hk (value head h reads key
        head h // (Hv // Hk)); g: [T, Hv] float32 log-decay (<= 0); beta: [T, Hv] float32.
        q and k are L2-normalised inside (eps 1e-6 under the square root, as fla's
        `use_qk_l2norm_in_kernel`) and q is scaled by Dk ** -0.5. Per token and value head:
        S = exp(g) * S; S = S + k^T (beta * (v - k S)); o = q S.
        state: [num_slots, Hv, Dk, Dv] float32, updated in place.
        Returns o: [T, Hv, Dv] in v's dtype.
        """
        ...

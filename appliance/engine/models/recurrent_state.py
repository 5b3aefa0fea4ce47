"""The recurrent state of the linear-attention layers (models.linear_attention): their shapes
and each layer's state tensors, one slot per running sequence.

Where a full-attention layer's KV cache grows with the context, a Gated DeltaNet layer keeps a
fixed-size state per sequence: the last K - 1 inputs of its causal convolution and the delta
rule's [Dk, Dv] matrix per value head. The engine gives each running sequence one slot of every
linear layer's state (appliance.engine.state_slots) beside the paged KV pool that the
full-attention layers use.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

# Why a hybrid model serves without the prefix cache (the engine logs it at start-up, `inferno
# model inspect` shows it): a cached prefix would skip its tokens, but the linear layers need
# their state after exactly those tokens, and no state is kept per block (vLLM's hybrid prefix
# caching keeps such snapshots; not built here).
HYBRID_PREFIX_CACHING_OFF = (
    "prefix caching is off for this hybrid model: a cached KV prefix is useless to its "
    "linear-attention layers without their recurrent state after the same tokens, which is not "
    "kept per block"
)

# The delta rule accumulates in float32 whatever the model's dtype (as fla and transformers do).
DELTA_STATE_DTYPE = torch.float32


@dataclass(frozen=True, slots=True)
class LinearAttentionConfig:
    """The linear-attention layers' shapes (config.json's `linear_*` keys) and which layers
    they are (`layer_types` "linear_attention"; the others are full attention)."""

    num_key_heads: int
    num_value_heads: int  # a multiple of num_key_heads
    key_head_dim: int
    value_head_dim: int
    conv_kernel_size: int
    layers: tuple[bool, ...]

    @property
    def key_size(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_size(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v."""
        return 2 * self.key_size + self.value_size

    @property
    def num_linear_layers(self) -> int:
        return sum(self.layers)

    def per_rank(self, num_ranks: int) -> LinearAttentionConfig:
        """One tensor-parallel rank's share: 1/num_ranks of the key heads and of the value heads
        (value head h reads key head h // (Hv / Hk), so each rank's value heads read its own key
        heads), and so of the projections, the convolution's channels and the state."""
        if num_ranks == 1:
            return self
        return dataclasses.replace(
            self,
            num_key_heads=self.num_key_heads // num_ranks,
            num_value_heads=self.num_value_heads // num_ranks,
        )

    def bytes_per_slot(self, model_dtype: torch.dtype) -> int:
        """One sequence's state in every linear layer (on one GPU: of its heads, per_rank)."""
        conv = self.conv_dim * (self.conv_kernel_size - 1) * model_dtype.itemsize
        delta = self.num_value_heads * self.key_head_dim * self.value_head_dim
        return self.num_linear_layers * (conv + delta * DELTA_STATE_DTYPE.itemsize)

    def allocate(
        self, num_slots: int, model_dtype: torch.dtype, device: torch.device | str
    ) -> list[RecurrentState]:
        """Zero-filled states of `num_slots` slots, one per linear layer, in layer order."""
        return [
            RecurrentState(
                conv=torch.zeros(
                    num_slots,
                    self.conv_dim,
                    self.conv_kernel_size - 1,
                    dtype=model_dtype,
                    device=device,
                ),
                delta=torch.zeros(
                    num_slots,
                    self.num_value_heads,
                    self.key_head_dim,
                    self.value_head_dim,
                    dtype=DELTA_STATE_DTYPE,
                    device=device,
                ),
            )
            for _ in range(self.num_linear_layers)
        ]


@dataclass(frozen=True, slots=True)
class RecurrentState:
    """One linear-attention layer's state for every slot.

    conv: [num_slots, conv_dim, K - 1] in the model's dtype;
    delta: [num_slots, Hv, Dk, Dv] float32.
    """

    conv: torch.Tensor
    delta: torch.Tensor

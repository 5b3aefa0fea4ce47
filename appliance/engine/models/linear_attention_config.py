"""A hybrid model's linear-attention (Gated DeltaNet) layers as data: `LinearAttentionConfig`,
their shapes and which layers they are.

A family declares it (models.families); the layers (models.linear_attention) and their
per-sequence state (models.recurrent_state) are built from it. No torch here: a model's config
is read by the start-up before torch is imported (docs/ARCHITECTURE.md, "Start-up").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


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

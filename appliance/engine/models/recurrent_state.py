"""The recurrent state of the linear-attention layers (models.linear_attention): each layer's
state tensors, one slot per running sequence, in the shapes of the model's
`LinearAttentionConfig` (models.linear_attention_config).

Where a full-attention layer's KV cache grows with the context, a Gated DeltaNet layer keeps a
fixed-size state per sequence: the last K - 1 inputs of its causal convolution and the delta
rule's [Dk, Dv] matrix per value head. The engine gives each running sequence one slot of every
linear layer's state (appliance.engine.state_slots) beside the paged KV pool that the
full-attention layers use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from appliance.engine.models.linear_attention_config import LinearAttentionConfig

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
class RecurrentState:
    """One linear-attention layer's state for every slot.

    conv: [num_slots, conv_dim, K - 1] in the model's dtype;
    delta: [num_slots, Hv, Dk, Dv] float32.
    """

    conv: torch.Tensor
    delta: torch.Tensor


def state_bytes_per_slot(linear: LinearAttentionConfig, model_dtype: torch.dtype) -> int:
    """One sequence's state in every linear layer of `linear` (on one GPU: of its heads,
    LinearAttentionConfig.per_rank)."""
    conv = linear.conv_dim * (linear.conv_kernel_size - 1) * model_dtype.itemsize
    delta = linear.num_value_heads * linear.key_head_dim * linear.value_head_dim
    return linear.num_linear_layers * (conv + delta * DELTA_STATE_DTYPE.itemsize)


def allocate_states(
    linear: LinearAttentionConfig,
    num_slots: int,
    model_dtype: torch.dtype,
    device: torch.device | str,
) -> list[RecurrentState]:
    """Zero-filled states of `num_slots` slots, one per linear layer of `linear`, in layer
    order."""
    return [
        RecurrentState(
            conv=torch.zeros(
                num_slots,
                linear.conv_dim,
                linear.conv_kernel_size - 1,
                dtype=model_dtype,
                device=device,
            ),
            delta=torch.zeros(
                num_slots,
                linear.num_value_heads,
                linear.key_head_dim,
                linear.value_head_dim,
                dtype=DELTA_STATE_DTYPE,
                device=device,
            ),
        )
        for _ in range(linear.num_linear_layers)
    ]

"""Gated DeltaNet: the linear-attention layer of the hybrid Qwen (Qwen3.5 / Qwen3.6).

Where a full-attention layer keeps every earlier token's keys and values, this layer keeps a
fixed-size recurrent state per sequence (models.recurrent_state), so its memory does not grow
with the context. The maths is transformers' Qwen3_5GatedDeltaNet:

    [qkv; z; b; a] = x W_in                       (one fused projection here)
    q, k, v = split(silu(causal_conv1d(qkv)))     (the conv continues each sequence's state)
    beta = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)   (per value head)
    o = gated_delta_rule(q, k, v, g, beta)        (kernels.ops; continues the state)
    out = W_out (RMSNorm(o) * silu(z))            (the gated norm, per value head)

Both recurrent ops go through the kernel ops (`causal_conv1d`, `gated_delta_rule`), whose
metadata (`RecurrentStateMetadata`) names each sequence's slot.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from appliance.engine.models.layers import RMSNorm
from appliance.engine.models.linear_attention_config import LinearAttentionConfig
from appliance.engine.models.projections import projection_weight
from appliance.engine.models.recurrent_state import RecurrentState
from kernels.ops import KernelOps, RecurrentStateMetadata

# The gated output norm scales by its weight as stored: unlike the model's other norms it is
# not zero-centred (transformers' Qwen3_5RMSNormGated), so the loader adds no offset to it.
GATED_NORM_WEIGHT = "linear_attn.norm.weight"


class GatedDeltaNet(nn.Module):
    """`in_proj` holds [in_proj_qkv; in_proj_z; in_proj_b; in_proj_a] rows (models.loader
    fuses them), so the layer issues one input matmul."""

    def __init__(self, linear: LinearAttentionConfig, hidden_size: int, eps: float, ops: KernelOps):
        super().__init__()
        self.ops = ops
        self.config = linear
        num_heads = linear.num_value_heads
        self.in_proj = nn.Linear(
            hidden_size, linear.conv_dim + linear.value_size + 2 * num_heads, bias=False
        )
        # As checkpoints store it: [conv_dim, 1, K] (depthwise), no bias.
        self.conv1d = nn.Conv1d(
            linear.conv_dim,
            linear.conv_dim,
            linear.conv_kernel_size,
            groups=linear.conv_dim,
            bias=False,
        )
        self.A_log = nn.Parameter(torch.empty(num_heads))
        self.dt_bias = nn.Parameter(torch.empty(num_heads))
        self.norm = RMSNorm(linear.value_head_dim, eps)
        self.out_proj = nn.Linear(linear.value_size, hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, state: RecurrentState, meta: RecurrentStateMetadata
    ) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]; `state`'s slots of the batch's sequences updated."""
        ops, c = self.ops, self.config
        num_tokens = x.shape[0]
        projected = ops.linear(x, projection_weight(self.in_proj), None)
        mixed, z, b, a = projected.split(
            [c.conv_dim, c.value_size, c.num_value_heads, c.num_value_heads], dim=-1
        )
        mixed = ops.causal_conv1d(
            mixed.contiguous(), self.conv1d.weight[:, 0], None, state.conv, meta
        )  # [T, conv_dim]
        q, k, v = mixed.split([c.key_size, c.key_size, c.value_size], dim=-1)
        q = q.reshape(num_tokens, c.num_key_heads, c.key_head_dim)
        k = k.reshape(num_tokens, c.num_key_heads, c.key_head_dim)
        v = v.reshape(num_tokens, c.num_value_heads, c.value_head_dim)
        # In the model's dtype then float32, as transformers computes them.
        beta = b.sigmoid().float()  # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [T, Hv], <= 0
        o = ops.gated_delta_rule(q, k, v, g, beta, state.delta, meta)  # [T, Hv, Dv]
        o = self._gated_norm(o, z.reshape(num_tokens, c.num_value_heads, c.value_head_dim))
        return ops.linear(
            o.reshape(num_tokens, c.value_size), projection_weight(self.out_proj), None
        )

    def _gated_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm of each value head's output, then times silu(z) in float32 (transformers'
        Qwen3_5RMSNormGated). o, z: [T, Hv, Dv]."""
        flat = o.reshape(-1, o.shape[-1])
        normed = self.ops.rms_norm(flat, self.norm.weight, self.norm.eps).view(o.shape)
        return (normed * F.silu(z.float())).to(o.dtype)

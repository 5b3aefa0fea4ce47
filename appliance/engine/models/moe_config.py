"""A family's mixture of experts as data: its `MoeConfig`, which holds its router.

A family declares both (models.families); the sparse block (models.sparse_moe) builds itself
from them. The router (`kernels.moe_spec.Router`) is the kernels' type: the routing is a kernel
op (`KernelOps.route_experts`) that reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kernels.moe_spec import ClampedSwiglu, Router


@dataclass(frozen=True, slots=True)
class MoeConfig:
    router: Router
    expert_size: int  # each expert's intermediate size
    # Per layer: a sparse MoE block (True) or the dense MLP of `intermediate_size` (False).
    moe_layers: tuple[bool, ...]
    # A dense expert every token passes through, added to the routed ones (0: none), and
    # whether its output is scaled by sigmoid(x @ gate) first (Qwen2-MoE).
    shared_expert_size: int = 0
    shared_expert_gated: bool = False
    # Each expert's projections have biases, and its activation is the clamped SwiGLU (None:
    # SwiGLU) (gpt-oss).
    expert_bias: bool = False
    clamped_swiglu: ClampedSwiglu | None = None
    # The experts' gated activation: "silu" or "gelu_tanh" (Gemma 4).
    activation: str = "silu"
    # The block sits beside the dense MLP, not in its place (Gemma 4's enable_moe_block): the
    # layer keeps its MLP and adds the two outputs, each normed (models.decoder).
    beside_dense_mlp: bool = False

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

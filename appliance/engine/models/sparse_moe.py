"""The sparse mixture-of-experts block: a decoder layer's alternative to the dense MLP.

A router projection scores the experts for each token, `models.routing.route` picks the top k
and their weights as the family's `Router` declares, and one kernel op (`fused_moe`) runs every
token through its k experts and sums their outputs, weighted. The experts' weights are stacked
([E, 2I, H] gate/up rows, [E, H, I] down), whatever the checkpoint stores (models.loader). An
optional shared expert (Qwen2-MoE) is a dense MLP every token passes through, its output scaled
by a sigmoid gate and added. gpt-oss's experts have biases and a clamped SwiGLU
(`kernels.ops.ClampedSwiglu`). Gemma 4's block sits beside the dense MLP (models.decoder): its
router reads the layer's un-normed input, normed and scaled its own way (`Router.normed_input`),
its experts a differently normed one, and they gate with GELU-tanh. Under expert parallelism a
block holds some of the experts and its output is its part of the sum
(appliance.engine.parallel.sharding).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from appliance.engine.models.config import ModelConfig
from appliance.engine.models.layers import MLP
from appliance.engine.models.routing import MoeConfig, route
from kernels.ops import KernelOps


def is_sparse_layer(config: ModelConfig, layer_index: int) -> bool:
    return config.moe is not None and config.moe.moe_layers[layer_index]


class Experts(nn.Module):
    """The stacked expert weights: gate_up_proj [E, 2I, H] ([gate; up] rows of each expert, as
    the dense MLP's), down_proj [E, H, I]; with `expert_bias` (gpt-oss) their biases
    gate_up_proj_bias [E, 2I] and down_proj_bias [E, H]. Under expert parallelism
    (appliance.engine.parallel.sharding) only the experts in `held` ([E] on one device)."""

    def __init__(self, moe: MoeConfig, hidden_size: int, held: range | None = None):
        super().__init__()
        self.held = range(moe.router.num_experts) if held is None else held
        self.all_held = len(self.held) == moe.router.num_experts
        num_experts, size = len(self.held), moe.expert_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, size))
        self.gate_up_proj_bias: nn.Parameter | None = None
        self.down_proj_bias: nn.Parameter | None = None
        if moe.expert_bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * size))
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size))

    def local_ids(self, expert_ids: torch.Tensor) -> torch.Tensor:
        """The expert map: global expert ids [T, k] -> indices into the held experts, -1 for
        one held elsewhere (kernels' fused_moe skips those)."""
        if self.all_held:
            return expert_ids
        local = expert_ids - self.held.start
        return torch.where((local >= 0) & (local < len(self.held)), local, -1)


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelOps):
        super().__init__()
        assert config.moe is not None, "only a mixture of experts has sparse layers"
        moe, hidden = config.moe, config.hidden_size
        self.ops = ops
        self.router = moe.router
        self.clamped_swiglu = moe.clamped_swiglu
        self.gate = nn.Linear(hidden, moe.router.num_experts, bias=moe.router.logit_bias)
        if moe.router.selection_bias:
            # Where DeepSeek-V3 checkpoints keep it: mlp.gate.e_score_correction_bias.
            bias = nn.Parameter(torch.empty(moe.router.num_experts))
            self.gate.register_parameter("e_score_correction_bias", bias)
        if moe.router.normed_input:  # Gemma 4's router.scale, [H]
            self.gate.register_parameter("scale", nn.Parameter(torch.empty(hidden)))
        if moe.router.per_expert_scale:  # Gemma 4's router.per_expert_scale, [E]
            scales = nn.Parameter(torch.empty(moe.router.num_experts))
            self.gate.register_parameter("per_expert_scale", scales)
        self.activation = moe.activation
        self.eps = config.rms_norm_eps
        self.experts = Experts(moe, hidden)
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if moe.shared_expert_size:
            # The dense MLP, at the shared expert's size.
            shared = dataclasses.replace(config, intermediate_size=moe.shared_expert_size)
            self.shared_expert = MLP(shared, ops)
        if moe.shared_expert_gated:
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor, router_input: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, H] -> [T, H]. `router_input` ([T, H]): what the router scores, where it is
        not x (Gemma 4)."""
        ops = self.ops
        logits = ops.linear(self._router_rows(x, router_input), self.gate.weight, self.gate.bias)
        selection_bias = getattr(self.gate, "e_score_correction_bias", None)
        expert_scale = getattr(self.gate, "per_expert_scale", None)
        weights, expert_ids = route(logits, self.router, selection_bias, expert_scale)  # [T, k]
        experts = self.experts
        out = ops.fused_moe(
            x,
            experts.gate_up_proj,
            experts.down_proj,
            weights,
            experts.local_ids(expert_ids),
            gate_up_bias=experts.gate_up_proj_bias,
            down_bias=experts.down_proj_bias,
            clamped_swiglu=self.clamped_swiglu,
            activation=self.activation,
        )
        if self.shared_expert is None:
            return out
        shared = self.shared_expert(x)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(ops.linear(x, self.shared_expert_gate.weight, None)) * shared
        return out + shared

    def _router_rows(self, x: torch.Tensor, router_input: torch.Tensor | None) -> torch.Tensor:
        rows = x if router_input is None else router_input
        if not self.router.normed_input:
            return rows
        # transformers' Gemma4TextRouter: RMSNorm(rows) * scale * hidden_size ** -0.5.
        scaled = self.ops.rms_norm(rows, self.gate.scale, self.eps)
        return scaled * rows.shape[-1] ** -0.5

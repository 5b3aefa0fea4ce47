"""The sparse mixture-of-experts block: a decoder layer's alternative to the dense MLP.

A router projection scores the experts for each token, one kernel op (`route_experts`) picks the
top k and their weights as the family's `Router` declares, and another (`fused_moe`) runs every
token through its k experts and sums their outputs, weighted. The experts' weights are stacked
([E, 2I, H] gate/up rows, [E, H, I] down), whatever the checkpoint stores (models.loader). An
optional shared expert (Qwen2-MoE) is a dense MLP every token passes through, its output scaled
by a sigmoid gate and added. gpt-oss's experts have biases and a clamped SwiGLU
(`kernels.moe_spec.ClampedSwiglu`). Gemma 4's block sits beside the dense MLP (models.decoder): its
router reads the layer's un-normed input, normed and scaled its own way (`Router.normed_input`),
its experts a differently normed one, and they gate with GELU-tanh. Under expert parallelism a
block holds some of the experts and its output is its part of the sum
(appliance.engine.parallel.sharding). FP8 experts (`Experts.use_fp8`) hold their stacked weights
in e4m3 with a float32 scale per output channel of each expert, as the dense FP8 projections do
(models.projections), and the kernels read them so (kernels.moe).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from appliance.engine.models.config import ModelConfig
from appliance.engine.models.layers import MLP
from appliance.engine.models.moe_config import MoeConfig
from kernels.fp8 import FP8_DTYPE, quantize_rows
from kernels.ops import Fp8Weight, KernelOps

# The stacked expert weights, each FP8 with its `<name>_scale` in FP8 experts.
_WEIGHTS = ("gate_up_proj", "down_proj")


def is_sparse_layer(config: ModelConfig, layer_index: int) -> bool:
    return config.moe is not None and config.moe.moe_layers[layer_index]


class Experts(nn.Module):
    """The stacked expert weights: gate_up_proj [E, 2I, H] ([gate; up] rows of each expert, as
    the dense MLP's), down_proj [E, H, I]; with `expert_bias` (gpt-oss) their biases
    gate_up_proj_bias [E, 2I] and down_proj_bias [E, H]. Under expert parallelism
    (appliance.engine.parallel.sharding) only the experts in `held` ([E] on one device).
    FP8 (`use_fp8`): both weights float8_e4m3fn, with gate_up_proj_scale [E, 2I, 1] and
    down_proj_scale [E, H, 1] float32, one scale per output channel of each expert (the
    biases stay in the model's dtype)."""

    def __init__(self, moe: MoeConfig, hidden_size: int, held: range | None = None):
        super().__init__()
        self.held = range(moe.router.num_experts) if held is None else held
        self.all_held = len(self.held) == moe.router.num_experts
        num_experts, size = len(self.held), moe.expert_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, size))
        self.gate_up_proj_bias: nn.Parameter | None = None
        self.down_proj_bias: nn.Parameter | None = None
        self.gate_up_proj_scale: nn.Parameter | None = None
        self.down_proj_scale: nn.Parameter | None = None
        if moe.expert_bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * size))
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size))

    @property
    def fp8(self) -> bool:
        return self.gate_up_proj_scale is not None

    def use_fp8(self) -> None:
        """Replace both weights by empty FP8 ones of their shapes (and empty scales), on their
        device: before a load that fills them (models.loader), on the meta device."""
        for name in _WEIGHTS:
            self._replace_by_fp8(name)

    def quantize(self) -> None:
        """Quantize loaded weights in the model's dtype to FP8 in place, per output channel
        (`quantize_expert_rows`), one weight at a time: each is freed once replaced."""
        assert not self.fp8, "the experts are FP8 already"
        for name in _WEIGHTS:
            weight = getattr(self, name).data
            self._replace_by_fp8(name)
            quantize_expert_rows(weight, getattr(self, name).data, self.scale_of(name))

    def _replace_by_fp8(self, name: str) -> None:
        weight = getattr(self, name)
        fp8 = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
        scale = torch.empty(*weight.shape[:2], 1, dtype=torch.float32, device=weight.device)
        setattr(self, name, nn.Parameter(fp8, requires_grad=False))
        setattr(self, f"{name}_scale", nn.Parameter(scale, requires_grad=False))

    def scale_of(self, name: str) -> torch.Tensor:
        """The [E, N, 1] scales of FP8 weight `name` ("gate_up_proj" or "down_proj")."""
        scale = getattr(self, f"{name}_scale")
        assert scale is not None, "only FP8 experts have scales"
        return scale.data

    def kernel_weights(self) -> tuple[torch.Tensor | Fp8Weight, torch.Tensor | Fp8Weight]:
        """(gate_up, down) as the kernel ops take them (kernels.ops.KernelOps.fused_moe)."""
        if not self.fp8:
            return self.gate_up_proj, self.down_proj
        return (
            Fp8Weight(self.gate_up_proj, self.scale_of("gate_up_proj")[..., 0]),
            Fp8Weight(self.down_proj, self.scale_of("down_proj")[..., 0]),
        )

    def local_ids(self, expert_ids: torch.Tensor) -> torch.Tensor:
        """The expert map: global expert ids [T, k] -> indices into the held experts, -1 for
        one held elsewhere (kernels' fused_moe skips those)."""
        if self.all_held:
            return expert_ids
        local = expert_ids - self.held.start
        return torch.where((local >= 0) & (local < len(self.held)), local, -1)


def quantize_expert_rows(weight: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """Experts' weights [E, N, K] (any float dtype, any device) quantized per output channel
    (kernels.fp8.quantize_rows) into q [E, N, K] float8_e4m3fn and scale [E, N, 1] float32, one
    expert at a time on q's device: the float32 working copy is one expert's, never a layer's."""
    for expert in range(weight.shape[0]):
        rows, row_scales = quantize_rows(weight[expert].to(q.device))
        q[expert].copy_(rows)
        scale[expert].copy_(row_scales[:, None])


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
        weights, expert_ids = ops.route_experts(logits, self.router, selection_bias, expert_scale)
        experts = self.experts
        gate_up, down = experts.kernel_weights()
        out = ops.fused_moe(
            x,
            gate_up,
            down,
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

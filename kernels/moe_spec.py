"""What a mixture of experts' kernel ops read as data: its router (`KernelOps.route_experts`)
and its experts' activation (`KernelOps.fused_moe`).

A family declares both in its model's config (appliance.engine.models.moe_config), which the
start-up reads before torch is imported (docs/ARCHITECTURE.md, "Start-up"): so no torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class ClampedSwiglu:
    """gpt-oss's expert activation (transformers' GptOssExperts): the gate clamped above at
    `limit`, the up projection to [-limit, limit], then `(up + 1) * gate * sigmoid(alpha *
    gate)`. None in its place means SwiGLU: `silu(gate) * up`."""

    alpha: float
    limit: float


@dataclass(frozen=True, slots=True)
class Router:
    """How a mixture of experts picks each token's experts, declared as data by its family
    (appliance.engine.models.families): `KernelOps.route_experts` reads it, so a new MoE
    family is a declaration, not a code path. The variants:

    - Mixtral, Qwen2/3-MoE: softmax over all experts, top-k, renormalised (`norm_topk_prob`);
    - gpt-oss: top-k of the logits (the router projection has a bias), softmax over the k chosen;
    - DeepSeek-V3 style: sigmoid scores, a selection bias added for choosing only, top-k within
      the best `topk_groups` of `num_groups` expert groups, renormalised, times a scale;
    - Gemma 4: the router projects its own RMS-normed, learned-scaled input, softmax over all,
      top-k, renormalised, each chosen weight times its expert's learned scale.

    `logit_bias` and `normed_input` shape the router's projection (the model's); the routing
    itself reads the rest.
    """

    num_experts: int
    top_k: int
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    # Top-k of the raw logits, then the scoring over the k chosen (gpt-oss); else scoring over
    # all experts, then top-k of the scores.
    score_after_topk: bool = False
    # The chosen weights divided by their sum (Mixtral always; Qwen's norm_topk_prob).
    renormalize: bool = False
    # The router projection has a bias (gpt-oss).
    logit_bias: bool = False
    # A per-expert bias added to the scores for choosing only, not to the weights (DeepSeek-V3's
    # e_score_correction_bias).
    selection_bias: bool = False
    # Group-limited choice: the experts in `num_groups` equal groups, each group scored by the
    # sum of its best two, and only the best `topk_groups` groups' experts chosen from.
    num_groups: int = 1
    topk_groups: int = 1
    scaling_factor: float = 1.0  # applied to the final weights (routed_scaling_factor)
    # The router projects RMSNorm(x) * scale * hidden_size ** -0.5, `scale` a learned [H]
    # vector, not x (Gemma 4's Gemma4TextRouter).
    normed_input: bool = False
    # Each chosen weight is multiplied by a learned per-expert scale, after renormalising
    # (Gemma 4's per_expert_scale).
    per_expert_scale: bool = False

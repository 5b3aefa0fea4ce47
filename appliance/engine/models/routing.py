"""How a mixture-of-experts layer picks each token's experts: the router as data.

A family declares its `Router` (models.families) and its `MoeConfig`; the one `route` below
reads those fields, so a new MoE family is a declaration, not a code path. The variants:

- Mixtral, Qwen2/3-MoE: softmax over all experts, top-k, renormalised (`norm_topk_prob`);
- gpt-oss: top-k of the logits (the router projection has a bias), softmax over the k chosen;
- DeepSeek-V3 style: sigmoid scores, a selection bias added for choosing only, top-k within
  the best `topk_groups` of `num_groups` expert groups, renormalised, times a scale;
- Gemma 4: the router projects its own RMS-normed, learned-scaled input, softmax over all,
  top-k, renormalised, each chosen weight times its expert's learned scale.

Pure torch on the logits ([T, E], a few KB): the same ops on the CPU and the GPU, no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kernels.ops import ClampedSwiglu


@dataclass(frozen=True, slots=True)
class Router:
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


def route(
    logits: torch.Tensor,
    router: Router,
    selection_bias: torch.Tensor | None = None,
    expert_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] -> (weights [T, k] float32, expert ids [T, k] int64).

    The scores are computed in float32 and the choice is `torch.topk`'s, as transformers'
    routers do, so ties go the same way (the lower expert id first on the CPU). With
    `router.selection_bias`, `selection_bias` is its [E] float32 tensor; with
    `router.per_expert_scale`, `expert_scale` is its [E] tensor.
    """
    logits = logits.float()
    if router.score_after_topk:
        top_logits, ids = torch.topk(logits, router.top_k, dim=-1)
        weights = _score(top_logits, router.scoring)
    else:
        scores = _score(logits, router.scoring)  # [T, E]
        choice = scores
        if router.selection_bias:
            assert selection_bias is not None, "a selection-bias router is given its bias"
            choice = scores + selection_bias
        if router.num_groups > 1:
            choice = _best_groups_only(choice, router.num_groups, router.topk_groups)
        ids = torch.topk(choice, router.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
    if router.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if router.scaling_factor != 1.0:
        weights = weights * router.scaling_factor
    if router.per_expert_scale:
        assert expert_scale is not None, "a per-expert-scale router is given its scales"
        weights = weights * expert_scale.float()[ids]
    return weights, ids


def _score(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    return logits.softmax(dim=-1) if scoring == "softmax" else logits.sigmoid()


def _best_groups_only(choice: torch.Tensor, num_groups: int, topk_groups: int) -> torch.Tensor:
    """[T, E] -> the same, -inf outside each token's best `topk_groups` groups."""
    grouped = choice.view(choice.shape[0], num_groups, -1)  # [T, G, E / G]
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
    best = torch.topk(group_scores, topk_groups, dim=-1)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)

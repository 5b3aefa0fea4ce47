"""`kernels.reference.route_experts` against transformers' own routers, one per variant the
`Router` declares: softmax then top-k, renormalised or not (Mixtral, Qwen2/3-MoE); top-k of
biased logits then softmax (gpt-oss); sigmoid scores with a selection bias, group-limited
top-k, renormalised and scaled (DeepSeek-V3). Each router is transformers' module with random
weights; ours is given the same logits (their projection is a plain linear, the model tests
cover ours)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from kernels.moe_spec import Router
from kernels.reference import route_experts

NUM_TOKENS, HIDDEN, NUM_EXPERTS = 40, 32, 16


def _random_router(module: torch.nn.Module) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            tensor.copy_(torch.randn(tensor.shape, generator=generator))
    return module


def _ours(module, x: torch.Tensor, router: Router) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(x, module.weight, getattr(module, "bias", None))
    return route_experts(logits, router, getattr(module, "e_score_correction_bias", None))


def _by_expert(weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[T, E]: each token's weight on every expert (0 where not chosen), order-free."""
    return torch.zeros(ids.shape[0], NUM_EXPERTS).scatter_(1, ids, weights.float())


def _inputs() -> torch.Tensor:
    return torch.randn(NUM_TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_softmax_then_topk_matches_qwen3_moe(norm_topk_prob):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=NUM_EXPERTS, num_experts_per_tok=4,
                            norm_topk_prob=norm_topk_prob)  # fmt: skip
    module = _random_router(Qwen3MoeTopKRouter(config))
    x = _inputs()
    _, weights, ids = module(x)
    ours = _ours(module, x, Router(NUM_EXPERTS, 4, renormalize=norm_topk_prob))
    assert torch.equal(ours[1], ids)
    torch.testing.assert_close(ours[0], weights, rtol=1e-6, atol=1e-7)


def test_topk_of_biased_logits_then_softmax_matches_gpt_oss():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    config = GptOssConfig(hidden_size=HIDDEN, num_local_experts=NUM_EXPERTS, num_experts_per_tok=4)
    module = _random_router(GptOssTopKRouter(config))
    x = _inputs()
    _, weights, ids = module(x)
    router = Router(NUM_EXPERTS, 4, score_after_topk=True, logit_bias=True)
    ours = _ours(module, x, router)
    assert torch.equal(ours[1], ids)
    torch.testing.assert_close(ours[0], weights, rtol=1e-6, atol=1e-7)


def test_sigmoid_with_selection_bias_and_groups_matches_deepseek_v3():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(hidden_size=HIDDEN, n_routed_experts=NUM_EXPERTS,
                              num_experts_per_tok=4, n_group=4, topk_group=2,
                              norm_topk_prob=True, routed_scaling_factor=2.5)  # fmt: skip
    module = _random_router(DeepseekV3TopkRouter(config))
    x = _inputs()
    _, weights, ids = module(x)
    router = Router(NUM_EXPERTS, 4, scoring="sigmoid", renormalize=True, selection_bias=True,
                    num_groups=4, topk_groups=2, scaling_factor=2.5)  # fmt: skip
    ours_weights, ours_ids = _ours(module, x, router)
    # DeepSeek's top-k is unsorted: compare each token's weight per expert.
    expected = _by_expert(weights, ids)
    torch.testing.assert_close(_by_expert(ours_weights, ours_ids), expected, rtol=1e-6, atol=1e-7)
    # The groups mattered: without them some token would choose otherwise.
    ungrouped = _by_expert(*_ours(module, x, Router(NUM_EXPERTS, 4, scoring="sigmoid",
                                                     renormalize=True, selection_bias=True,
                                                     scaling_factor=2.5)))  # fmt: skip
    assert not torch.equal(ungrouped != 0, expected != 0)

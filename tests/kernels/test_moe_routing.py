"""The routing kernel (`kernels.moe_routing`) against `kernels.reference.route_experts`, for
every variant a `Router` declares: ids equal, weights within 1e-6.

Without a GPU the kernel runs in Triton's interpreter on tiny shapes: E a power of two or not,
k from 1 to 8, one row or several. Ties are deliberate where they matter: the kernel puts the
lower expert id first, torch.topk on the CPU (the reference's) does not always, so the cases
with equal values compare against the reference with its top-k made a stable sort
(`lowest_id_first`), which is that order. The `gpu` cases use Qwen3-MoE's and Qwen3.5's router
sizes (128 and 256 experts, top 8) up to a prefill of 8192 tokens, and a CUDA graph's replay.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import pytest
import torch

from kernels import reference
from kernels.errors import KernelInputError
from kernels.moe_routing import route_experts
from kernels.moe_spec import Router

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The families' variants (appliance.engine.models.families) and the rest the Router declares,
# each a function of (E, k).
VARIANTS: dict[str, Callable[[int, int], Router]] = {
    # Mixtral, Qwen3-MoE (norm_topk_prob), the hybrid Qwen3.5's MoE.
    "softmax-renormalised": lambda e, k: Router(e, k, renormalize=True),
    "softmax": lambda e, k: Router(e, k),  # Qwen2-MoE without norm_topk_prob
    "topk-then-softmax": lambda e, k: Router(e, k, score_after_topk=True, logit_bias=True),
    "per-expert-scale": lambda e, k: Router(  # Gemma 4
        e, k, renormalize=True, normed_input=True, per_expert_scale=True
    ),
    "sigmoid-grouped": lambda e, k: Router(  # DeepSeek-V3's
        e,
        k,
        scoring="sigmoid",
        renormalize=True,
        selection_bias=True,
        num_groups=next(g for g in (4, 5, 3) if e % g == 0),
        topk_groups=2,
        scaling_factor=2.5,
    ),
    "sigmoid-scaled": lambda e, k: Router(e, k, scoring="sigmoid", scaling_factor=2.5),
    "topk-then-sigmoid": lambda e, k: Router(
        e, k, scoring="sigmoid", score_after_topk=True, renormalize=True
    ),
}
# (E, k): E of no power of two (6, 10, 12), k = 1 and 8, groups of 2, 3 and 4 experts.
SHAPES = [(6, 1), (10, 2), (12, 3), (16, 8)]

Routing = tuple[torch.Tensor, torch.Tensor]
# A router and what it is given: logits, a selection bias, per-expert scales.
Case = tuple[Router, torch.Tensor, torch.Tensor, torch.Tensor]


@pytest.fixture
def lowest_id_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference with equal values ordered as the kernel orders them, the lower id first:
    its every top-k a stable descending sort (which also puts NaN first, as torch.topk does)."""

    def stable_top_k(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        ordered = torch.sort(values, dim=-1, descending=True, stable=True)
        return ordered.values[..., :k], ordered.indices[..., :k]

    monkeypatch.setattr(reference, "_top_k", stable_top_k)


def _vectors(num_experts: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A selection bias and per-expert scales: every router is given both, and reads what it
    declares (as the reference does)."""
    bias = torch.randn(num_experts, generator=generator)
    scale = torch.rand(num_experts, generator=generator) + 0.5
    return bias.to(DEVICE), scale.to(DEVICE)


def _case(variant: str, num_experts: int, top_k: int, logits: torch.Tensor, seed: object) -> Case:
    generator = torch.Generator().manual_seed(zlib.crc32(repr(seed).encode()))
    return (
        VARIANTS[variant](num_experts, top_k),
        logits.to(DEVICE),
        *_vectors(num_experts, generator),
    )


def _assert_same_routing(ours: Routing, expected: Routing) -> None:
    (weights, ids), (expected_weights, expected_ids) = ours, expected
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.long().cpu(), expected_ids.cpu())
    torch.testing.assert_close(
        weights.cpu(), expected_weights.cpu(), atol=1e-6, rtol=0, equal_nan=True
    )


def _check(router: Router, logits: torch.Tensor, bias: torch.Tensor, scale: torch.Tensor) -> None:
    ours = route_experts(logits, router, bias, scale)
    _assert_same_routing(ours, reference.route_experts(logits, router, bias, scale))


@pytest.mark.parametrize("num_tokens", [1, 5])
@pytest.mark.parametrize(("num_experts", "top_k"), SHAPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_routing_matches_the_reference(variant, num_experts, top_k, num_tokens):
    """float32 logits at random: no two equal, so any top-k order is the reference's."""
    seed = (variant, num_experts, top_k, num_tokens)
    generator = torch.Generator().manual_seed(zlib.crc32(repr(seed).encode()))
    logits = torch.randn(num_tokens, num_experts, generator=generator)
    _check(*_case(variant, num_experts, top_k, logits, seed))


@pytest.mark.parametrize(("num_experts", "top_k"), SHAPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_equal_values_go_to_the_lower_expert_id_first(variant, num_experts, top_k, lowest_id_first):
    """Logits of three values, biases of two: ties inside the top k, across its edge, between
    groups' scores, in the selection bias's sums; a row of one value throughout, and one where
    -0.0 ties with 0.0."""
    seed = ("ties", variant, num_experts, top_k)
    generator = torch.Generator().manual_seed(zlib.crc32(repr(seed).encode()))
    logits = torch.randint(-1, 2, (6, num_experts), generator=generator).float()
    logits[0] = 0.5
    logits[1] = torch.tensor([-0.0, 0.0]).repeat(num_experts // 2)
    router, logits, _, scale = _case(variant, num_experts, top_k, logits, seed)
    bias = torch.randint(0, 2, (num_experts,), generator=generator).float().to(DEVICE)
    _check(router, logits, bias, scale)


@pytest.mark.parametrize("variant", VARIANTS)
def test_bfloat16_logits_route_as_their_float32_values(variant, lowest_id_first):
    """bfloat16 logits (the GPU engine's) tie often: 8 significant bits."""
    generator = torch.Generator().manual_seed(zlib.crc32(variant.encode()))
    logits = (torch.randn(5, 60, generator=generator) * 4).to(torch.bfloat16)
    assert any(row.unique().numel() < 60 for row in logits), "the case has ties"
    _check(*_case(variant, 60, 8, logits, variant))


def test_ties_go_to_the_lower_id_where_torch_topk_on_the_cpu_may_not():
    """Why the tie cases compare against `lowest_id_first`: the reference's torch.topk on the
    CPU (std::nth_element at this size, which is not stable) gives the later of two equal best
    logits."""
    router = Router(6, 1)
    logits = torch.tensor([[2.0, 0.0, 0.0, 1.0, 0.0, 2.0]], device=DEVICE)
    assert reference.route_experts(logits.cpu(), router)[1].tolist() == [[5]]
    weights, ids = route_experts(logits, router)
    assert ids.tolist() == [[0]]
    torch.testing.assert_close(weights.cpu(), reference.route_experts(logits.cpu(), router)[0])


def test_rows_of_equal_logits_choose_the_first_experts_with_equal_weights():
    logits = torch.tensor([[0.0] * 6, [3.0, 1.0, 1.0, 0.0, 1.0, 0.0]], device=DEVICE)
    weights, ids = route_experts(logits, Router(6, 3, renormalize=True))
    assert ids.tolist() == [[0, 1, 2], [0, 1, 2]]
    torch.testing.assert_close(weights[0].cpu(), torch.full((3,), 1 / 3))


def test_a_group_limit_leaving_fewer_experts_than_k_chooses_the_rest_lower_id_first(
    lowest_id_first,
):
    """5 groups of 2, the best 2 kept: 4 experts for k = 8, so 4 come from outside them (the
    reference's -inf choices), lowest id first."""
    router = Router(10, 8, scoring="sigmoid", renormalize=True, num_groups=5, topk_groups=2)
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 10, generator=generator).to(DEVICE)
    ids = route_experts(logits, router)[1]
    assert (ids[:, 4:] >= 0).all() and (ids[:, 4:] < 10).all()
    _check(router, logits, *_vectors(10, generator))


# numpy, under Triton's interpreter, warns of the softmax's max over the row of NaN.
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
@pytest.mark.parametrize("variant", VARIANTS)
def test_nan_logits_count_as_the_largest_and_route_to_real_experts(variant, lowest_id_first):
    """A padding row of a CUDA graph may hold anything: every id must be a real expert (NaN
    ordered as torch.topk orders it, above every number, whatever its sign bit)."""
    nan = float("nan")
    logits = torch.tensor([[0.5, 1.0, nan, -1.0, 2.0, -nan, 1.5, -0.5], [nan] * 8, [1.0, 0.0] * 4])
    router, logits, bias, scale = _case(variant, 8, 3, logits, variant)
    ids = route_experts(logits, router, bias, scale)[1]
    assert ((ids >= 0) & (ids < 8)).all()
    _check(router, logits, bias, scale)


def test_no_tokens_give_empty_routing():
    weights, ids = route_experts(torch.empty(0, 8, device=DEVICE), Router(8, 2))
    assert weights.shape == ids.shape == (0, 2)


@pytest.mark.parametrize(
    ("router", "logits_shape", "vectors", "message"),
    [
        (Router(8, 2), (3, 6), {}, r"logits must be \[T, 8\]"),
        (Router(8, 9), (3, 8), {}, "top_k 9 must be between 1 and the 8 experts"),
        (Router(8, 2, per_expert_scale=True), (3, 8), {}, "this router reads expert_scale"),
        (Router(8, 2, scoring="sigmoid", selection_bias=True), (3, 8),
         {"selection_bias": torch.zeros(6)}, r"selection_bias must be a \[8\]"),
        (Router(12, 2, num_groups=5, topk_groups=2), (3, 12), {}, "12 experts do not split"),
        (Router(12, 2, num_groups=4, topk_groups=5), (3, 12), {}, "topk_groups 5 must be"),
        (Router(2048, 2), (3, 2048), {}, "1 to 1024 of them"),
    ],
)  # fmt: skip
def test_routing_it_cannot_run_is_refused_by_name(router, logits_shape, vectors, message):
    logits = torch.zeros(logits_shape, device=DEVICE)
    vectors = {name: vector.to(DEVICE) for name, vector in vectors.items()}
    with pytest.raises(KernelInputError, match=message):
        route_experts(logits, router, **vectors)


def _grid_case(variant: str, num_experts: int, num_tokens: int, dtype: torch.dtype) -> Case:
    """Each row a random permutation of a grid of E values 8 / E apart (exact in bfloat16, so
    both dtypes route alike), every third row with two pairs of equal logits. Apart from those,
    no two choices are within rounding of each other: a near-tie would be decided by the last
    bits of the kernel's exp against torch's, not by the rule under test. The selection bias
    keeps the groups' scores apart for the same reason (4 per group's rank, then 0 or 1)."""
    generator = torch.Generator().manual_seed(zlib.crc32(repr((variant, num_experts)).encode()))
    order = torch.argsort(torch.rand(num_tokens, num_experts, generator=generator), dim=-1)
    logits = (order - num_experts // 2) * (8 / num_experts)
    logits[::3, 1] = logits[::3, 0]
    logits[::3, -1] = logits[::3, 2]
    router = VARIANTS[variant](num_experts, 8)
    groups = router.num_groups
    group_rank = torch.randperm(groups, generator=generator).repeat_interleave(
        num_experts // groups
    )
    bias = 4.0 * group_rank + torch.randint(0, 2, (num_experts,), generator=generator)
    scale = torch.rand(num_experts, generator=generator) + 0.5
    return router, logits.to(dtype), bias, scale


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 16, 512, 8192])
@pytest.mark.parametrize("num_experts", [128, 256])
@pytest.mark.parametrize("variant", VARIANTS)
def test_routing_matches_the_reference_on_the_gpu(
    variant, num_experts, num_tokens, dtype, lowest_id_first
):
    """Against the reference on the CPU (the order of ties defined there, `lowest_id_first`)."""
    router, logits, bias, scale = _grid_case(variant, num_experts, num_tokens, dtype)
    ours = route_experts(logits.cuda(), router, bias.cuda(), scale.cuda())
    _assert_same_routing(ours, reference.route_experts(logits, router, bias, scale))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
def test_routing_replays_in_a_cuda_graph(variant):
    """Captured once, replayed on new logits in the same buffer: as a decode step runs."""
    router, *tensors = _grid_case(variant, 128, 16, torch.bfloat16)
    logits, bias, scale = (tensor.cuda() for tensor in tensors)
    static = logits.clone()
    route_experts(static, router, bias, scale)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = route_experts(static, router, bias, scale)
    static.copy_(logits.flip(0))
    graph.replay()
    expected = route_experts(logits.flip(0), router, bias, scale)
    assert torch.equal(captured[1], expected[1])
    assert torch.equal(captured[0], expected[0])

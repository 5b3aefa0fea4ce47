"""Triton mixture-of-experts routing: each token's top k experts and their weights, one launch.

Semantics are `kernels.reference.route_experts`'s for every variant a `kernels.moe_spec.Router`
declares (softmax or sigmoid scores, top-k before or after the scoring, a selection-only bias,
group-limited choice, renormalisation, a final scale, per-expert scales), steps and float32
rounding points included. The reference is a chain of a dozen small torch ops (softmax, topk,
gather, sum, divide, ...), each a kernel of its own, whose fixed cost, not its arithmetic, is
what it costs at batch 1.

One program routes one token: its row of E logits lives in registers (E up to `MAX_EXPERTS`),
and the k choices are k unrolled passes (k up to `MAX_TOP_K`), each one max over int64 keys
that hold a value's order above its expert's rank (`_order_keys`), the chosen expert's key then
taken out: one reduction a choice, the value and the id both read from the key. Among equal
values the lower expert id comes first, the order of a stable descending sort, and the one
torch.topk on CUDA uses to select among values equal to the k-th (its gathering pass writes
them in index order). torch.topk on the CPU, the reference's, orders them as std::partial_sort
or std::nth_element leaves them (neither is stable), so the two agree on every row without
ties, and on rows with ties only where the reference happens to put the lower id first
(`kernels.reference.route_experts`). NaN counts as larger than any number, as in torch.topk, so
every id is a real expert even for a row of NaN logits (a padding row of a CUDA graph must not
send `fused_moe` out of bounds).

No host sync and shapes fixed by the batch: a decode step's routing replays in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.errors import KernelInputError
from kernels.launch_checks import FLOAT_DTYPES, check_devices
from kernels.moe_spec import Router

# A token's logits live in one program's registers (Qwen3-Next has 512 experts); 4 warps hold
# 1024 floats at 8 a thread.
MAX_EXPERTS = 1024
# Each choice is one unrolled pass (Qwen3-Next chooses 10).
MAX_TOP_K = 32
# Each group's score is two unrolled passes (DeepSeek-V3 has 8 groups).
MAX_GROUPS = 32


# Below every value's key (-inf's is -2139095041 * 2**32): the key of a lane already taken.
_TAKEN: tl.constexpr = tl.constexpr(-(2**63))


@triton.jit
def _order_keys(values, avail, lanes, BLOCK: tl.constexpr):
    """int64 keys in torch.topk's order of float32 `values` (NaN above every number, -0.0 equal
    to 0.0), equal values the lower lane first; `_TAKEN` where not `avail`. A choice is then
    one max: the value's order-preserving int32 bits above the lane's rank."""
    values = tl.where(values == 0.0, 0.0, values)  # -0.0 as 0.0: one key for equal values
    bits = values.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # negative floats' order reversed back
    key = tl.where(values != values, 0x7FFFFFFF, key)  # every NaN above +inf
    keys = (key.to(tl.int64) << 32) | (BLOCK - 1 - lanes).to(tl.int64)
    return tl.where(avail, keys, _TAKEN)


@triton.jit
def _take_largest(keys, lanes, BLOCK: tl.constexpr):
    """(the lane of the largest key, its value in float32, the keys with that lane taken)."""
    best = tl.max(keys, axis=0)
    lane = BLOCK - 1 - best.to(tl.int32)  # the low 32 bits: the lane's rank
    key = (best >> 32).to(tl.int32)
    value = tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
    return lane, value, tl.where(lanes == lane, _TAKEN, keys)


@triton.jit
def _value_at(values, lanes, lane):
    """values[lane], exactly: one term and zeros (a gather from registers)."""
    return tl.sum(tl.where(lanes == lane, values, 0.0), axis=0)


@triton.jit
def _score(x, mask, SIGMOID: tl.constexpr):
    """Sigmoid of each masked lane, or the softmax over them (0 elsewhere), in float32."""
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        shifted = tl.exp(x - tl.max(tl.where(mask, x, float("-inf")), axis=0))
        shifted = tl.where(mask, shifted, 0.0)
        scores = shifted / tl.sum(shifted, axis=0)
    return tl.where(mask, scores, 0.0)


@triton.jit
def _best_groups_only(
    choice,
    valid,
    experts,
    group_size,
    NUM_GROUPS: tl.constexpr,
    TOPK_GROUPS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    """choice with -inf outside the best TOPK_GROUPS groups, each group scored by the sum of
    its best two (`kernels.reference._best_groups_only`)."""
    group_of = experts // group_size  # padding lanes fall past the last group
    groups = tl.arange(0, BLOCK_G)
    group_scores = tl.zeros([BLOCK_G], dtype=tl.float32)
    for g in tl.static_range(NUM_GROUPS):
        keys = _order_keys(choice, valid & (group_of == g), experts, BLOCK_E)
        _, best, keys = _take_largest(keys, experts, BLOCK_E)
        _, second, _ = _take_largest(keys, experts, BLOCK_E)
        group_scores = tl.where(groups == g, best + second, group_scores)
    group_keys = _order_keys(group_scores, groups < NUM_GROUPS, groups, BLOCK_G)
    in_kept = experts < 0
    for _rank in tl.static_range(TOPK_GROUPS):
        group, _, group_keys = _take_largest(group_keys, groups, BLOCK_G)
        in_kept = in_kept | (group_of == group)
    return tl.where(in_kept, choice, float("-inf"))


@triton.jit
def _route_kernel(
    logits_ptr,  # [T, E], unit column stride
    selection_bias_ptr,  # [E]: added to the scores for choosing only (HAS_SELECTION_BIAS)
    expert_scale_ptr,  # [E]: each chosen expert's weight factor (HAS_EXPERT_SCALE)
    weights_ptr,  # [T, TOP_K] float32, contiguous
    ids_ptr,  # [T, TOP_K] int32, contiguous
    num_experts,
    group_size,  # experts per group (NUM_GROUPS > 1)
    logits_row_stride,
    scaling_factor,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,  # next power of two of TOP_K
    BLOCK_E: tl.constexpr,  # next power of two of E
    SIGMOID: tl.constexpr,  # sigmoid scores, else softmax
    SCORE_AFTER_TOPK: tl.constexpr,  # top-k of the logits, then the scoring over the k
    RENORMALIZE: tl.constexpr,
    HAS_SELECTION_BIAS: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    TOPK_GROUPS: tl.constexpr,
    BLOCK_G: tl.constexpr,  # next power of two of NUM_GROUPS
    HAS_EXPERT_SCALE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    logits = tl.load(logits_ptr + row * logits_row_stride + experts, mask=valid, other=0.0)
    logits = logits.to(tl.float32)
    slots = tl.arange(0, BLOCK_K)  # the k choices, in order
    in_k = slots < TOP_K
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    if SCORE_AFTER_TOPK:
        keys = _order_keys(logits, valid, experts, BLOCK_E)
        for j in tl.static_range(TOP_K):
            pick, value, keys = _take_largest(keys, experts, BLOCK_E)
            ids = tl.where(slots == j, pick, ids)
            weights = tl.where(slots == j, value, weights)
        weights = _score(weights, in_k, SIGMOID)
    else:
        scores = _score(logits, valid, SIGMOID)
        choice = scores
        if HAS_SELECTION_BIAS:
            bias = tl.load(selection_bias_ptr + experts, mask=valid, other=0.0)
            choice = scores + bias.to(tl.float32)
        if NUM_GROUPS > 1:
            choice = _best_groups_only(
                choice, valid, experts, group_size, NUM_GROUPS, TOPK_GROUPS, BLOCK_E, BLOCK_G
            )
        keys = _order_keys(choice, valid, experts, BLOCK_E)
        for j in tl.static_range(TOP_K):
            pick, value, keys = _take_largest(keys, experts, BLOCK_E)
            if HAS_SELECTION_BIAS or NUM_GROUPS > 1:  # the choice is not the score
                value = _value_at(scores, experts, pick)
            ids = tl.where(slots == j, pick, ids)
            weights = tl.where(slots == j, value, weights)
    if RENORMALIZE:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    weights = weights * scaling_factor  # exact when 1.0, as the reference's skipped product
    if HAS_EXPERT_SCALE:
        weights = weights * tl.load(expert_scale_ptr + ids, mask=in_k, other=0.0).to(tl.float32)
    out = row * TOP_K + slots
    tl.store(weights_ptr + out, weights, mask=in_k)
    tl.store(ids_ptr + out, ids, mask=in_k)


def route_experts(
    logits: torch.Tensor,
    router: Router,
    selection_bias: torch.Tensor | None = None,
    expert_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] float32, bfloat16 or float16 with unit column stride; selection_bias: [E]
    contiguous, with `router.selection_bias`; expert_scale: [E] contiguous, with
    `router.per_expert_scale` -> (weights [T, k] float32, expert ids [T, k] int32).

    See `kernels.reference.route_experts` (ties: the module docstring). Raises
    `KernelInputError` for any shape, dtype, device, layout or router it cannot handle.
    """
    _validate(logits, router)
    # The reference reads neither the selection bias nor the groups when it scores after top-k.
    uses_bias = router.selection_bias and not router.score_after_topk
    uses_groups = router.num_groups > 1 and not router.score_after_topk
    if uses_bias:
        _validate_vector("selection_bias", selection_bias, logits)
    if router.per_expert_scale:
        _validate_vector("expert_scale", expert_scale, logits)
    if uses_groups:
        _validate_groups(router)
    num_tokens, num_experts = logits.shape
    top_k = router.top_k
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    num_groups = router.num_groups if uses_groups else 1
    block_e = triton.next_power_of_2(num_experts)
    _route_kernel[(num_tokens,)](
        logits,
        selection_bias if uses_bias else logits,  # unread without HAS_SELECTION_BIAS
        expert_scale if router.per_expert_scale else logits,  # unread without HAS_EXPERT_SCALE
        weights,
        ids,
        num_experts,
        num_experts // num_groups,
        logits.stride(0),
        float(router.scaling_factor),
        TOP_K=top_k,
        BLOCK_K=triton.next_power_of_2(top_k),
        BLOCK_E=block_e,
        SIGMOID=router.scoring == "sigmoid",
        SCORE_AFTER_TOPK=router.score_after_topk,
        RENORMALIZE=router.renormalize,
        HAS_SELECTION_BIAS=uses_bias,
        NUM_GROUPS=num_groups,
        TOPK_GROUPS=router.topk_groups if uses_groups else 1,
        BLOCK_G=triton.next_power_of_2(num_groups),
        HAS_EXPERT_SCALE=router.per_expert_scale,
        num_warps=max(1, min(4, block_e // 256)),  # 8 experts a thread at most
    )
    return weights, ids


def _validate(logits: torch.Tensor, router: Router) -> None:
    """logits [T, E] fit the router, and the router fits the kernel."""
    if not isinstance(router, Router):
        raise KernelInputError(
            f"router must be a kernels.moe_spec.Router, got {type(router).__name__}"
        )
    if not isinstance(logits, torch.Tensor):
        raise KernelInputError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    check_devices({"logits": logits})
    num_experts = router.num_experts
    if logits.dim() != 2 or logits.shape[1] != num_experts:
        raise KernelInputError(
            f"logits must be [T, {num_experts}] (the router's experts), got {tuple(logits.shape)}"
        )
    if logits.dtype not in FLOAT_DTYPES:
        raise KernelInputError(
            f"logits dtype {logits.dtype} is not one of float16, bfloat16, float32"
        )
    if num_experts > 1 and logits.stride(1) != 1:
        raise KernelInputError(f"logits rows must be contiguous, got strides {logits.stride()}")
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise KernelInputError(
            f"{num_experts} experts: the routing kernel holds a token's logits in registers, "
            f"1 to {MAX_EXPERTS} of them"
        )
    if not 1 <= router.top_k <= min(num_experts, MAX_TOP_K):
        raise KernelInputError(
            f"top_k {router.top_k} must be between 1 and the {num_experts} experts, and at most "
            f"{MAX_TOP_K} (one unrolled pass each)"
        )
    if router.scoring not in ("softmax", "sigmoid"):
        raise KernelInputError(f"scoring {router.scoring!r} is not 'softmax' or 'sigmoid'")


def _validate_vector(name: str, vector: torch.Tensor | None, logits: torch.Tensor) -> None:
    """An [E] tensor the router reads: given, floating-point, contiguous, on logits' device."""
    if not isinstance(vector, torch.Tensor):
        raise KernelInputError(
            f"this router reads {name}, an [E] tensor; got {type(vector).__name__}"
        )
    check_devices({"logits": logits, name: vector})
    num_experts = logits.shape[1]
    if vector.shape != (num_experts,) or vector.dtype not in FLOAT_DTYPES:
        raise KernelInputError(
            f"{name} must be a [{num_experts}] floating-point tensor, got "
            f"{tuple(vector.shape)} {vector.dtype}"
        )
    if vector.stride(0) != 1:
        raise KernelInputError(f"{name} must be contiguous, got stride {vector.stride()}")


def _validate_groups(router: Router) -> None:
    """Group-limited choice: equal groups of at least two experts (each group is scored by its
    best two), and a number of them to keep that exists."""
    num_experts, num_groups = router.num_experts, router.num_groups
    if num_groups > MAX_GROUPS or num_experts % num_groups or num_experts // num_groups < 2:
        raise KernelInputError(
            f"{num_experts} experts do not split into {num_groups} equal groups of at least 2 "
            f"(at most {MAX_GROUPS} groups)"
        )
    if not 1 <= router.topk_groups <= num_groups:
        raise KernelInputError(
            f"topk_groups {router.topk_groups} must be between 1 and the {num_groups} groups"
        )

"""Plain-torch reference ops: the exact semantics every Triton kernel must reproduce.

The CPU path of the engine runs these directly. Tensor layouts are those of the paged KV cache:
`k_cache`/`v_cache` are `[num_blocks, block_size, num_kv_heads, head_dim]`, a token at position
`p` of a sequence lives in block `block_table[p // block_size]` at offset `p % block_size`, and
its flat slot is `block_id * block_size + offset`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.fp8 import P_SCALE, quantize_rows
from kernels.launch_checks import KV_CACHE_FP8, check_kv_cache_encoding
from kernels.moe_spec import ClampedSwiglu, Router
from kernels.ops import AttentionMetadata, Fp8Rows, Fp8Weight, RecurrentStateMetadata

_FP8_MAX = torch.finfo(KV_CACHE_FP8).max
_LOG2_E = 1.4426950408889634


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, then scaled by `weight`.

    A weight in x's dtype (or wider than a float32 x) scales the normed x rounded to x's dtype,
    as Llama does. A float32 weight of a narrower x scales in float32 and the product is
    rounded once to x's dtype: Gemma's and Qwen3.5's zero-centred norms, whose `1 + w` the
    loader keeps in float32, as transformers computes them (`x * (1 + w.float())`).

    x: [T, H], weight: [H]
    """
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype == torch.float32 and x.dtype != torch.float32:
        return (x32 * weight).to(x.dtype)
    return weight * x32.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    quantize_for: Fp8Weight | None = None,
) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor]:
    """`residual + x`, then RMSNorm of the sum. Returns (normed, new residual); with
    `quantize_for`, normed quantized as `linear` quantizes its rows for that weight (this
    reference's `linear` quantizes every row count)."""
    residual = residual + x
    normed = rms_norm(residual, weight, eps)
    if quantize_for is None:
        return normed, residual
    return Fp8Rows(*quantize_rows(normed, quantize_for.input_scale), normed.dtype), residual


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by their positions (the "rotate half" layout of Llama in Hugging Face).

    q: [T, Hq, D], k: [T, Hkv, D], cos/sin: [T, D] (float32; each half repeats the frequencies)
    """
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
        return ((x.float() * cos) + (rotated.float() * sin)).to(x.dtype)

    return rotate(q), rotate(k)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up, for the fused gate/up projection output x: [T, 2I] -> [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GELU(gate) * up, GELU with the tanh approximation (Gemma), for x: [T, 2I] -> [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def clamped_swiglu_and_mul(x: torch.Tensor, activation: ClampedSwiglu) -> torch.Tensor:
    """gpt-oss's activation (`ClampedSwiglu`) for the fused x = [gate | up]: [T, 2I] -> [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    gate = gate.clamp(max=activation.limit)
    up = up.clamp(-activation.limit, activation.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * activation.alpha))


def linear(
    x: torch.Tensor | Fp8Rows, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ weight.T + bias: x [T, K], weight [N, K] (nn.Linear's layout), bias [N] or None.

    An FP8 weight makes it W8A8 (`Fp8Weight`): x is quantized per token (or with the weight's
    static input scale), the FP8 products summed in float32 and scaled by x's scale, then the
    weight's, the bias added in float32, and the sum rounded once to x's dtype. x may come
    quantized already (`Fp8Rows`, for this weight).
    """
    if isinstance(x, Fp8Rows):
        assert isinstance(weight, Fp8Weight), "quantized rows are for an FP8 projection"
        xq, x_scale, dtype = x.q, x.scale, x.dtype
    elif not isinstance(weight, Fp8Weight):
        return F.linear(x, weight, bias)
    else:
        (xq, x_scale), dtype = quantize_rows(x, weight.input_scale), x.dtype  # [T, K] fp8, [T]
    out = xq.float() @ weight.weight.float().T  # [T, N]: exact products, float32 sums
    out = out * x_scale[:, None] * weight.scale[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(dtype)


def silu_mul_linear(x: torch.Tensor, weight: torch.Tensor | Fp8Weight) -> torch.Tensor:
    """The MLP's down projection of SiLU(gate) * up, for the fused x = [gate | up]: [T, 2I].
    With an FP8 weight, the product (in x's dtype) is what is quantized."""
    return linear(silu_and_mul(x), weight, None)


def gelu_tanh_mul_linear(x: torch.Tensor, weight: torch.Tensor | Fp8Weight) -> torch.Tensor:
    """The MLP's down projection of GELU(gate) * up, GELU with the tanh approximation (Gemma),
    for the fused x = [gate | up]: [T, 2I]."""
    return linear(gelu_tanh_and_mul(x), weight, None)


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor | Fp8Weight,
    down: torch.Tensor | Fp8Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    clamped_swiglu: ClampedSwiglu | None = None,
    activation: str = "silu",
) -> torch.Tensor:
    """Each token through its k experts, their outputs weighted and summed (a mixture of
    experts' SwiGLU experts, GELU-tanh gated ones with `activation="gelu_tanh"` (Gemma 4), or
    gpt-oss's `clamped_swiglu` ones), one expert at a time.

    x: [T, H]; gate_up: [E, 2I, H] ([gate; up] rows per expert); down: [E, H, I];
    topk_weights: [T, k] float32; topk_ids: [T, k] integer, each in 0..E-1, or -1 for an expert
    another rank holds (expert parallelism: the pair adds nothing) -> [T, H].
    gate_up_bias: [E, 2I] and down_bias: [E, H], added to each expert's projections (gpt-oss).
    FP8 experts: gate_up and down as `Fp8Weight`s ([E, N, K] e4m3, scales [E, N]), each
    expert's projections then W8A8 as `linear`'s (its rows quantized per token).
    Rounding: each expert's output is in x's dtype (as the dense MLP's: the gate/up product,
    SiLU(gate) * up and the down product each rounded), times its weight in float32, rounded
    to x's dtype; the k of a token are summed in float32 and rounded once.
    """
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)  # [T * k]: row t * k + j is token t's j-th expert
    flat_weights = topk_weights.reshape(-1, 1).float()
    tokens = torch.arange(num_tokens * top_k, device=x.device) // top_k
    weighted = torch.zeros(num_tokens * top_k, x.shape[1], dtype=x.dtype, device=x.device)
    for expert in flat_ids[flat_ids >= 0].unique().tolist():
        rows = (flat_ids == expert).nonzero().squeeze(1)
        gate_up_b = None if gate_up_bias is None else gate_up_bias[expert]
        down_b = None if down_bias is None else down_bias[expert]
        h = linear(x[tokens[rows]], _expert(gate_up, expert), gate_up_b)
        if clamped_swiglu is not None:
            h = clamped_swiglu_and_mul(h, clamped_swiglu)
        else:
            h = gelu_tanh_and_mul(h) if activation == "gelu_tanh" else silu_and_mul(h)
        y = linear(h, _expert(down, expert), down_b)
        weighted[rows] = (y.float() * flat_weights[rows]).to(x.dtype)
    return weighted.view(num_tokens, top_k, -1).float().sum(dim=1).to(x.dtype)


def _expert(weight: torch.Tensor | Fp8Weight, expert: int) -> torch.Tensor | Fp8Weight:
    """One expert's [N, K] weight of a stacked [E, N, K] one."""
    if isinstance(weight, Fp8Weight):
        return Fp8Weight(weight.weight[expert], weight.scale[expert])
    return weight[expert]


def route_experts(
    logits: torch.Tensor,
    router: Router,
    selection_bias: torch.Tensor | None = None,
    expert_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A mixture of experts' routing as `router` declares it (`kernels.moe_spec.Router`): logits
    [T, E] -> (weights [T, k] float32, expert ids [T, k] int64), by descending choice.

    The scores are computed in float32 and the choice is `torch.topk`'s, as transformers'
    routers do, so on one device ties go the same way as theirs. That order among equal values
    is torch.topk's own: on the CPU std::partial_sort's or std::nth_element's (neither is
    stable), which may put the higher expert id first (tests/kernels/test_moe_routing.py shows
    a case); the Triton kernel's (`kernels.moe_routing`) is the lower id first. With
    `router.selection_bias`, `selection_bias` is its [E] float32 tensor; with
    `router.per_expert_scale`, `expert_scale` is its [E] tensor.
    """
    logits = logits.float()
    if router.score_after_topk:
        top_logits, ids = _top_k(logits, router.top_k)
        weights = _score(top_logits, router.scoring)
    else:
        scores = _score(logits, router.scoring)  # [T, E]
        choice = scores
        if router.selection_bias:
            assert selection_bias is not None, "a selection-bias router is given its bias"
            choice = scores + selection_bias
        if router.num_groups > 1:
            choice = _best_groups_only(choice, router.num_groups, router.topk_groups)
        ids = _top_k(choice, router.top_k)[1]
        weights = scores.gather(1, ids)
    if router.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if router.scaling_factor != 1.0:
        weights = weights * router.scaling_factor
    if router.per_expert_scale:
        assert expert_scale is not None, "a per-expert-scale router is given its scales"
        weights = weights * expert_scale.float()[ids]
    return weights, ids


def _top_k(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, N] -> the k largest of each row and their indices, [T, k] each: every choice the
    routing makes, so that equal values are ordered in one place (torch.topk's order)."""
    return torch.topk(values, k, dim=-1)


def _score(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    return logits.softmax(dim=-1) if scoring == "softmax" else logits.sigmoid()


def _best_groups_only(choice: torch.Tensor, num_groups: int, topk_groups: int) -> torch.Tensor:
    """[T, E] -> the same, -inf outside each token's best `topk_groups` groups."""
    grouped = choice.view(choice.shape[0], num_groups, -1)  # [T, G, E / G]
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
    best = _top_k(group_scores, topk_groups)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale in float32, saturated to e4m3's finite range (+-448) and rounded to nearest
    even: what an FP8 cache stores. Saturation, not overflow to NaN, keeps an outlier finite;
    dequantized, a value is `stored.float() * scale`."""
    scaled = x.float() / scale.float()
    return scaled.clamp(-_FP8_MAX, _FP8_MAX).to(KV_CACHE_FP8)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store each token's key and value at its slot; slots < 0 are padding and skipped.

    k, v: [T, Hkv, D]; slot_mapping: [T] int64. An FP8 cache stores `quantize_kv(k, k_scale)`
    and `quantize_kv(v, v_scale)` (one-element scales); a cache in k's dtype ignores them.
    """
    if check_kv_cache_encoding(k.dtype, k_cache, v_cache, k_scale, v_scale):
        assert k_scale is not None and v_scale is not None  # checked above
        k, v = quantize_kv(k, k_scale), quantize_kv(v, v_scale)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    num_kv_heads, head_dim = k_cache.shape[2:]
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = k[keep]
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = v[keep]


def rotary_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`rotary_embedding` of q and k, then `write_kv_cache` of the rotated k and v; returns the
    rotated q."""
    q, k = rotary_embedding(q, k, cos, sin)
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached context: all of it, or
    with `sliding_window` W the last W tokens up to and including each query's own.

    `sinks` ([Hq], gpt-oss's learned attention sinks): each head's logit joins every softmax's
    denominator, so it takes probability mass but contributes no value (transformers'
    GptOssAttention: the scores and the sink are softmaxed together, the sink's column dropped).

    Sequence b owns `meta.query_lens[b]` consecutive rows of q (in batch order), the last
    `query_lens[b]` of its `meta.seq_lens[b]` tokens, whose keys and values are already in the
    cache.
    A decode step is `query_lens[b] == 1`; a first prefill has `query_lens[b] == seq_lens[b]`.
    Heads are grouped (GQA): query head h reads KV head h // (Hq // Hkv).

    An FP8 cache (`write_kv_cache`) is read as `stored.float() * k_scale` (and v_scale), by
    FP8 arithmetic in float32 (`fp8_attention`), as the GPU kernels run it on the tensor cores.

    q: [T, Hq, D] -> out: [T, Hq, D]
    """
    fp8 = check_kv_cache_encoding(q.dtype, k_cache, v_cache, k_scale, v_scale)
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    out = torch.empty_like(q)
    start = 0
    for b, (seq_len, query_len) in enumerate(zip(meta.seq_lens, meta.query_lens, strict=True)):
        if query_len == 0:  # a padding sequence
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = meta.block_tables[b, :num_blocks]
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        q_b = q[start : start + query_len]
        # Query i sits at position p = seq_len - query_len + i and sees keys 0 ..= p, or with a
        # window W keys p - W + 1 ..= p.
        q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        if fp8:
            assert k_scale is not None and v_scale is not None  # checked above
            o = fp8_attention(q_b, k, v, mask, scale, k_scale, v_scale, sinks)
        elif sinks is not None:
            o = _attention_with_sinks(q_b, k, v, mask, scale, sinks)
        else:
            o = F.scaled_dot_product_attention(
                q_b.transpose(0, 1),  # [Hq, Tq, D]
                k.transpose(0, 1),  # [Hkv, S, D]
                v.transpose(0, 1),
                attn_mask=mask,
                scale=scale,
                enable_gqa=True,
            ).transpose(0, 1)
        out[start : start + query_len] = o.to(q.dtype)
        start += query_len
    return out


def _attention_with_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """Attention of one sequence's queries with a sink logit per head, in float32.

    q: [Tq, Hq, D]; k, v: [S, Hkv, D]; mask: [Tq, S] bool; sinks: [Hq] -> [Tq, Hq, D] float32.
    """
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, S, D]
    v = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.float().transpose(0, 1) @ k.transpose(1, 2) * scale  # [Hq, Tq, S]
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)  # [Hq, Tq, 1]
    p = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
    return (p @ v).transpose(0, 1)


def fp8_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one sequence's queries over its FP8 keys and values, both products on e4m3
    operands as `kernels.fp8_attention` runs them on the tensor cores.

    q: [Tq, Hq, D]; k, v: [S, Hkv, D] float8_e4m3fn (stored values, read as `stored * scale`);
    mask: [Tq, S] bool, True where a query sees a key (at least one per query)
    -> [Tq, Hq, D] float32.

    1. Each query row (one token, one head) is quantized with its own scale (`quantize_rows`);
       scores are the exact FP8 products summed in float32, times both scales and `scale`,
       in log2 units as the kernels keep them.
    2. Softmax in float32 against each row's maximum rounded up to a whole number (log2
       units), which makes p round to e4m3 as the kernels' p against their running maxima
       does; the probabilities are quantized as `p * P_SCALE`, the row sums use them before.
    3. P V on the stored values, times v_scale / P_SCALE, over the row sums.

    With `sinks` ([Hq]), each head's sink logit joins the maximum and the row sums, no value.
    """
    num_queries, num_q_heads, head_dim = q.shape
    group = num_q_heads // k.shape[1]
    q8, q_scale = quantize_rows(q.reshape(-1, head_dim))
    q8 = q8.float().view(num_queries, num_q_heads, head_dim).transpose(0, 1)  # [Hq, Tq, D]
    q_scale = q_scale.view(num_queries, num_q_heads).T[:, :, None]  # [Hq, Tq, 1]
    k = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, S, D]
    v = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q8 @ k.transpose(1, 2) * (q_scale * (k_scale.float() * (scale * _LOG2_E)))
    scores = scores.masked_fill(~mask, float("-inf"))  # [Hq, Tq, S], log2 units
    row_max = scores.amax(dim=-1, keepdim=True)  # [Hq, Tq, 1]
    row_sum_extra = torch.zeros_like(row_max)
    if sinks is not None:
        sink = (sinks.float() * _LOG2_E)[:, None, None]  # [Hq, 1, 1], log2 units
        row_max = torch.maximum(row_max, sink)
        row_sum_extra = torch.exp2(sink - row_max.ceil())
    row_max = row_max.ceil()
    p = torch.exp2(scores - row_max)
    p8 = (p * P_SCALE).to(KV_CACHE_FP8)  # p <= 1: nothing to saturate
    row_sum = p.sum(dim=-1, keepdim=True) + row_sum_extra
    o = (p8.float() @ v) * (v_scale.float() / P_SCALE) / row_sum
    return o.transpose(0, 1)  # [Tq, Hq, D]


def _recurrent_rows(meta: RecurrentStateMetadata) -> list[tuple[slice, int, bool]]:
    """(rows of the flat batch, state slot, has_initial_state) of each sequence that is not a
    padding row (its slot negative)."""
    slots = meta.state_slots.tolist()
    initial = meta.has_initial_state.tolist()
    found, start = [], 0
    for slot, has_initial, num_rows in zip(slots, initial, meta.query_lens, strict=True):
        if slot >= 0 and num_rows > 0:
            found.append((slice(start, start + num_rows), slot, has_initial))
        start += num_rows
    return found


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    meta: RecurrentStateMetadata,
) -> torch.Tensor:
    """silu(depthwise causal convolution), each sequence continuing from its slot of
    `conv_state` (kernels.ops.KernelOps.causal_conv1d). The convolution runs in the weight's
    dtype, as transformers' `causal_conv1d_fn` does.

    x: [T, D]; weight: [D, K]; conv_state: [num_slots, D, K - 1] -> [T, D]
    """
    num_channels, width = weight.shape
    out = torch.zeros_like(x)
    for rows, slot, has_initial in _recurrent_rows(meta):
        history = conv_state[slot] if has_initial else conv_state.new_zeros(num_channels, width - 1)
        inputs = torch.cat((history, x[rows].t()), dim=1)  # [D, K - 1 + n]
        y = F.conv1d(inputs[None].to(weight.dtype), weight[:, None, :], bias, groups=num_channels)
        out[rows] = F.silu(y[0]).t().to(x.dtype)  # [n, D]
        conv_state[slot] = inputs[:, inputs.shape[1] - (width - 1) :]
    return out


def _l2_normalize(x: torch.Tensor) -> torch.Tensor:
    # fla's use_qk_l2norm_in_kernel (and transformers' l2norm): eps inside the square root.
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    meta: RecurrentStateMetadata,
) -> torch.Tensor:
    """The gated delta rule one token at a time, in float32, each sequence continuing from
    its slot of `state` (kernels.ops.KernelOps.gated_delta_rule; transformers'
    `torch_recurrent_gated_delta_rule` per sequence).

    q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g, beta: [T, Hv]; state: [num_slots, Hv, Dk, Dv]
    -> [T, Hv, Dv] in v's dtype
    """
    num_k_heads, key_dim = q.shape[1:]
    num_v_heads, value_dim = v.shape[1:]
    group = num_v_heads // num_k_heads  # value head h reads key head h // group
    q = _l2_normalize(q.float()).repeat_interleave(group, dim=1) * key_dim**-0.5  # [T, Hv, Dk]
    k = _l2_normalize(k.float()).repeat_interleave(group, dim=1)
    out_dtype = v.dtype
    v, g, beta = v.float(), g.float(), beta.float()
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)  # [T, Hv, Dv]
    for rows, slot, has_initial in _recurrent_rows(meta):
        s = state[slot].clone() if has_initial else state.new_zeros(num_v_heads, key_dim, value_dim)
        for t in range(rows.start, rows.stop):
            s = s * g[t].exp()[:, None, None]
            predicted = (s * k[t][:, :, None]).sum(dim=-2)  # k S: [Hv, Dv]
            delta = (v[t] - predicted) * beta[t][:, None]
            s = s + k[t][:, :, None] * delta[:, None, :]
            out[t] = (s * q[t][:, :, None]).sum(dim=-2)
        state[slot] = s
    return out.to(out_dtype)

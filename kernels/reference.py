"""Plain-torch reference ops: the exact semantics every Triton kernel must reproduce.

The CPU path of the engine runs these directly. Tensor layouts are those of the paged KV cache:
`k_cache`/`v_cache` are `[num_blocks, block_size, num_kv_heads, head_dim]`, a token at position
`p` of a sequence lives in block `block_table[p // block_size]` at offset `p % block_size`, and
its flat slot is `block_id * block_size + offset`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.launch_checks import KV_CACHE_FP8, check_kv_cache_encoding
from kernels.ops import AttentionMetadata

_FP8_MAX = torch.finfo(KV_CACHE_FP8).max


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, scaled by `weight` in the input dtype (as Llama does).

    x: [T, H], weight: [H]
    """
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual + x`, then RMSNorm of the sum. Returns (normed, new residual)."""
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias: x [T, K], weight [N, K] (nn.Linear's layout), bias [N] or None."""
    return F.linear(x, weight, bias)


def silu_mul_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The MLP's down projection of SiLU(gate) * up, for the fused x = [gate | up]: [T, 2I]."""
    return F.linear(silu_and_mul(x), weight)


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


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole cached context.

    Sequence b owns `meta.query_lens[b]` consecutive rows of q (in batch order), the last
    `query_lens[b]` of its `meta.seq_lens[b]` tokens, whose keys and values are already in the
    cache.
    A decode step is `query_lens[b] == 1`; a first prefill has `query_lens[b] == seq_lens[b]`.
    Heads are grouped (GQA): query head h reads KV head h // (Hq // Hkv).

    An FP8 cache (`write_kv_cache`) is read as `stored.float() * k_scale` (and v_scale), and the
    attention then runs in float32.

    q: [T, Hq, D] -> out: [T, Hq, D]
    """
    fp8 = check_kv_cache_encoding(q.dtype, k_cache, v_cache, k_scale, v_scale)
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    out = torch.empty_like(q)
    start = 0
    for b, (seq_len, query_len) in enumerate(zip(meta.seq_lens, meta.query_lens, strict=True)):
        num_blocks = -(-seq_len // block_size)
        blocks = meta.block_tables[b, :num_blocks]
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        q_b = q[start : start + query_len]
        if fp8:
            assert k_scale is not None and v_scale is not None  # checked above
            k, v = k.float() * k_scale.float(), v.float() * v_scale.float()
            q_b = q_b.float()
        # Query i sits at position seq_len - query_len + i and sees keys 0 ..= that position.
        q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(
            q_b.transpose(0, 1),  # [Hq, Tq, D]
            k.transpose(0, 1),  # [Hkv, S, D]
            v.transpose(0, 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[start : start + query_len] = o.transpose(0, 1).to(q.dtype)
        start += query_len
    return out

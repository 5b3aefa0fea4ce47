"""The Llama family (Llama 2/3/3.1, SmolLM2, Mistral, Qwen2): pure single-device math.

Projections are fused: one `qkv_proj` ([q; k; v] rows) and one `gate_up_proj` ([gate; up] rows),
so each layer issues two large matmuls instead of five. The forward pass takes a flat batch of
tokens from many sequences ([T] ids and positions); every projection, norm and attention call
(and so every read and write of the paged KV cache) goes through the kernel ops it was given.
"""

from __future__ import annotations

import torch
from torch import nn

import kernels.reference
from appliance.engine.models.config import ModelConfig
from appliance.engine.models.rotary import cos_sin_table
from kernels.ops import AttentionMetadata, KernelOps


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelOps):
        super().__init__()
        self.ops = ops
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        # An FP8 KV cache stores k / k_scale and v / v_scale (kernels.reference.quantize_kv):
        # 1 unless the checkpoint ships scales (models.loader). Device tensors, so CUDA graphs
        # read them where they are; the kernels ignore them for a cache in the model's dtype.
        self.register_buffer("k_scale", torch.ones(1), persistent=False)
        self.register_buffer("v_scale", torch.ones(1), persistent=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.ops.linear(x, self.qkv_proj.weight, self.qkv_proj.bias)  # [T, (Hq+2Hkv) D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.ops.rotary_embedding(q, k, cos, sin)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        k_scale, v_scale = self.k_scale, self.v_scale
        self.ops.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        o = self.ops.paged_attention(q, k_cache, v_cache, meta, self.scale, k_scale, v_scale)
        o = o.reshape(num_tokens, self.q_size)
        return self.ops.linear(o, self.o_proj.weight, self.o_proj.bias)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelOps):
        super().__init__()
        self.ops = ops
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.ops.linear(x, self.gate_up_proj.weight, None)
        return self.ops.silu_mul_linear(gate_up, self.down_proj.weight)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelOps):
        super().__init__()
        self.ops = ops
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, ops)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        norm = self.input_layernorm
        if residual is None:
            residual = x
            h = self.ops.rms_norm(x, norm.weight, norm.eps)
        else:
            h, residual = self.ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        h = self.self_attn(h, cos, sin, kv_cache, meta)
        norm = self.post_attention_layernorm
        h, residual = self.ops.add_rms_norm(h, residual, norm.weight, norm.eps)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """Build under `torch.device("meta")` and load weights with `models.loader`; then call
    `init_rope_tables` on the real device."""

    def __init__(self, config: ModelConfig, ops: KernelOps = kernels.reference):
        super().__init__()
        self.config = config
        self.ops = ops
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, ops) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Tied models (SmolLM2) project with the embedding matrix itself.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
        )
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    def reset_kv_scales(self) -> None:
        """Every layer's KV-cache scales to 1, in float32 on the model's device: after
        `to_empty` (which leaves them unset) and a cast to the weights' dtype."""
        device = self.embed_tokens.weight.device
        for layer in self.layers:
            layer.self_attn.k_scale = torch.ones(1, device=device)
            layer.self_attn.v_scale = torch.ones(1, device=device)

    def init_rope_tables(self, max_len: int) -> None:
        device = self.embed_tokens.weight.device
        self.cos, self.sin = cos_sin_table(self.config.rope, self.config.head_dim, max_len, device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden] (normed)."""
        assert self.cos is not None and self.sin is not None, "call init_rope_tables first"
        cos, sin = self.cos[positions], self.sin[positions]  # [T, D]
        x = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos, sin, kv_cache, meta)
        x, _ = self.ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head
        return self.ops.linear(hidden, weight, None).float()

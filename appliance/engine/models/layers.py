"""The layers every decoder family is built from, each with the options families differ in.

Pure single-device math on a flat batch of tokens ([T] rows from many sequences): every
projection, norm and attention call (and so every read and write of the paged KV cache) goes
through the kernel ops the layer was given. Projections are fused: one `qkv_proj` ([q; k; v]
rows) and one `gate_up_proj` ([gate; up] rows), so a layer issues two large matmuls, not five.
A projection may be FP8 (`models.projections`): the kernel ops take its weight either way.
"""

from __future__ import annotations

import torch
from torch import nn

from appliance.engine.models.config import ModelConfig
from appliance.engine.models.projections import fp8_weight, projection_weight
from kernels.ops import AttentionMetadata, Fp8Rows, Fp8Weight, KernelOps


class RMSNorm(nn.Module):
    """Holds the weight the kernels scale by (Gemma's 1 + w already added by the loader)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps


class Attention(nn.Module):
    """Grouped-query attention over the paged KV cache, with the options of the families:
    per-head q/k RMSNorm before rope (Qwen3, Gemma 3), rope on a leading part of each head
    (Phi-4-mini), a sliding window (Mistral, Gemma 3's local layers), a softmax scale other
    than head_dim ** -0.5 (Gemma 3's query_pre_attn_scalar, Granite's attention_multiplier),
    attention sinks (gpt-oss) and an output gate (Qwen3.5: the query projection yields each
    head's query and then its gate, [q_h; gate_h] per head, and sigmoid(gate) scales the
    attention output before o_proj). Gemma 4's: a head dim and KV heads of the layer's own,
    values that are the keys (one projection, `values_are_keys`), RMS-normed without a weight
    (`value_norm`), and a layer that attends over an earlier layer's cache (`owns_kv` False):
    it projects only q and writes nothing."""

    def __init__(self, config: ModelConfig, ops: KernelOps, layer_index: int):
        super().__init__()
        self.ops = ops
        self.eps = config.rms_norm_eps
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads_of(layer_index)
        self.head_dim = head_dim = config.head_dim_of(layer_index)
        self.rotary_dim = config.rotary_dim_of(layer_index)
        self.q_size = config.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.scale = config.attention_scale or head_dim**-0.5
        self.sliding_window = config.layer_windows[layer_index]
        self.owns_kv = config.kv_source_of(layer_index) == layer_index
        self.values_are_keys = config.values_are_keys(layer_index)
        self.value_norm = config.value_norm
        self.output_gate = config.attention_output_gate
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_rows + self.kv_rows, bias=config.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        qk_norm = config.qk_norm
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm and self.owns_kv else None
        # gpt-oss: a learned logit per query head in each softmax's denominator.
        self.sinks = nn.Parameter(torch.empty(config.num_heads)) if config.attention_sinks else None
        # An FP8 KV cache stores k / k_scale and v / v_scale (kernels.reference.quantize_kv):
        # 1 unless the checkpoint ships scales (models.loader). Device tensors, so CUDA graphs
        # read them where they are; the kernels ignore them for a cache in the model's dtype.
        self.register_buffer("k_scale", torch.ones(1), persistent=False)
        self.register_buffer("v_scale", torch.ones(1), persistent=False)

    @property
    def q_rows(self) -> int:
        """Rows of q_proj in qkv_proj: the queries, and with the output gate the gates too
        (derived, so tensor parallelism's smaller q_size carries over)."""
        return self.q_size * (2 if self.output_gate else 1)

    @property
    def kv_rows(self) -> int:
        """Rows of k_proj and v_proj in qkv_proj: none in a layer that reads another's KV, the
        keys alone where the values are the keys (derived, as q_rows)."""
        if not self.owns_kv:
            return 0
        return (1 if self.values_are_keys else 2) * self.kv_size

    def input_fp8_weight(self) -> Fp8Weight | None:
        """The FP8 weight of the one projection that reads this block's input, which the norm
        before it may quantize for (`KernelOps.add_rms_norm`); None in the model's dtype."""
        return fp8_weight(self.qkv_proj)

    def forward(
        self,
        x: torch.Tensor | Fp8Rows,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """x: [T, hidden], or quantized for `input_fp8_weight`; kv_cache: this layer's
        [2, blocks, block_size, Hkv, D], or the one it shares."""
        num_tokens = x.shape[0]
        qkv_weight = projection_weight(self.qkv_proj)
        qkv = self.ops.linear(x, qkv_weight, self.qkv_proj.bias)  # [T, (Hq+2Hkv) D]
        q = qkv[:, : self.q_rows]
        gate = None
        if self.output_gate:
            q, gate = q.view(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(num_tokens, self.q_size)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self._norm_heads(q, self.q_norm)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        k_scale, v_scale = self.k_scale, self.v_scale
        if self.owns_kv:
            k, v = self._keys_values(qkv[:, self.q_rows :])
            if self.rotary_dim == self.head_dim:  # rotated and stored in one launch
                q = self.ops.rotary_write_kv(
                    q, k, v, cos, sin, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale
                )
            else:
                q, k = self._rotate(q, k, cos, sin)
                self.ops.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        else:  # the cache holds this step's keys already, written by the layer that owns it
            # The rotary op rotates in place on the GPU (kernels.rotary): q with a scratch key.
            q, _ = self._rotate(q, q.new_zeros(num_tokens, 1, self.head_dim), cos, sin)
        o = self.ops.paged_attention(
            q,
            k_cache,
            v_cache,
            meta,
            self.scale,
            sliding_window=self.sliding_window,
            k_scale=k_scale,
            v_scale=v_scale,
            sinks=self.sinks,
        )
        o = o.reshape(num_tokens, self.q_size)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.ops.linear(o, projection_weight(self.o_proj), self.o_proj.bias)

    def _keys_values(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """kv: [T, 2 Hkv D] (or [T, Hkv D] when the values are the keys) -> k, v: [T, Hkv, D],
        k normed (qk_norm) but not yet rotated, v normed (value_norm)."""
        shape = (kv.shape[0], self.num_kv_heads, self.head_dim)
        k = kv[:, : self.kv_size].view(shape)
        v = k if self.values_are_keys else kv[:, self.kv_size :].view(shape)
        if self.k_norm is not None:
            k = self._norm_heads(k, self.k_norm)
        if self.value_norm:
            # RMSNorm without a weight (transformers' Gemma4RMSNorm(with_scale=False)), into a
            # new tensor: values that are the keys stay unrotated when k is rotated in place.
            mean_square = v.float().pow(2).mean(-1, keepdim=True)
            v = (v.float() * torch.rsqrt(mean_square + self.eps)).to(v.dtype)
        return k, v

    def _norm_heads(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """[T, H, D] -> the same, each head's vector RMS-normalised."""
        flat = x.reshape(-1, self.head_dim)  # [T * H, D]
        return self.ops.rms_norm(flat, norm.weight, norm.eps).view(x.shape)

    def _rotate(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [T, rotary_dim]; the dims past rotary_dim pass through unrotated."""
        if self.rotary_dim == self.head_dim:
            return self.ops.rotary_embedding(q, k, cos, sin)
        r = self.rotary_dim
        q_rot, k_rot = self.ops.rotary_embedding(q[..., :r], k[..., :r], cos, sin)
        return torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)


# Rows of a long step's MLP computed at once. The [T, 2I] gate/up output and its [T, I]
# activation are a step's largest transients (Llama-3.1-8B at 8,192 tokens: 470 + 235 MB); in
# pieces of 2,048 rows they are a quarter of that, and each piece is still a matmul of 2,048 rows,
# large enough for cuBLAS's full rate (docs/ARCHITECTURE.md, "GPU memory").
MLP_CHUNK_TOKENS = 2048


class MLP(nn.Module):
    """Gated MLP: down(act(gate) * up), act SiLU or tanh-approximated GELU (Gemma), over at most
    `chunk_tokens` rows at a time (each row's result does not depend on the others)."""

    def __init__(
        self,
        config: ModelConfig,
        ops: KernelOps,
        chunk_tokens: int = MLP_CHUNK_TOKENS,
        *,
        intermediate_size: int | None = None,
    ):
        super().__init__()
        self.ops = ops
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * size, bias=False)
        self.down_proj = nn.Linear(size, config.hidden_size, bias=False)
        self.gelu_tanh = config.activation == "gelu_tanh"
        self.chunk_tokens = chunk_tokens

    def input_fp8_weight(self) -> Fp8Weight | None:
        """As `Attention.input_fp8_weight`: the gate/up projection's."""
        return fp8_weight(self.gate_up_proj)

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        """x: [T, hidden], or quantized for `input_fp8_weight`."""
        num_tokens = x.shape[0]
        if num_tokens <= self.chunk_tokens:
            return self._project(x)
        out = torch.empty(
            num_tokens, self.down_proj.out_features, dtype=x.dtype, device=x.device
        )  # [T, hidden]
        for start in range(0, num_tokens, self.chunk_tokens):
            rows = slice(start, start + self.chunk_tokens)
            out[rows] = self._project(x[rows])
        return out

    def _project(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        gate_up = self.ops.linear(x, projection_weight(self.gate_up_proj), None)  # [T, 2I]
        down = projection_weight(self.down_proj)
        if self.gelu_tanh:
            return self.ops.gelu_tanh_mul_linear(gate_up, down)
        return self.ops.silu_mul_linear(gate_up, down)

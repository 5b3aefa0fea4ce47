"""The decoder every supported family runs: embeddings, layers of attention (or linear attention,
models.linear_attention) and MLP (or a sparse mixture of experts, models.sparse_moe) with their
norms, final norm and logits. A family's
differences are ModelConfig fields (declared in `models.families`), read once here when the
modules are built; there is no per-family branch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

import kernels.reference
from appliance.engine.models.config import ModelConfig, RopeConfig
from appliance.engine.models.layers import MLP, Attention, RMSNorm
from appliance.engine.models.linear_attention import GatedDeltaNet
from appliance.engine.models.recurrent_state import RecurrentState
from appliance.engine.models.rotary import cos_sin_table
from appliance.engine.models.sparse_moe import SparseMoeBlock, is_sparse_layer
from kernels.ops import AttentionMetadata, KernelOps, RecurrentStateMetadata


class DecoderLayer(nn.Module):
    """Llama's pre-norm block, or with `sandwich_norms` Gemma 3's: the attention and MLP outputs
    are normed again before their residual add, and the MLP has its own pre-norm. In a hybrid
    model's linear layers, Gated DeltaNet (`linear_attn`) takes attention's place."""

    def __init__(self, config: ModelConfig, ops: KernelOps, layer_index: int):
        super().__init__()
        self.ops = ops
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        linear = config.linear_attention
        self.self_attn: Attention | None = None
        self.linear_attn: GatedDeltaNet | None = None
        if linear is not None and linear.layers[layer_index]:
            self.linear_attn = GatedDeltaNet(linear, config.hidden_size, eps, ops)
        else:
            self.self_attn = Attention(config, ops, layer_index)
        # Llama: the MLP's pre-norm. Gemma 3: the norm of the attention output.
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm: RMSNorm | None = None
        self.post_feedforward_layernorm: RMSNorm | None = None
        if config.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp: nn.Module
        if is_sparse_layer(config, layer_index):
            self.mlp = SparseMoeBlock(config, ops)  # a mixture of experts in the MLP's place
        else:
            self.mlp = MLP(config, ops)
        self.residual_multiplier = config.residual_multiplier

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: torch.Tensor | RecurrentState,
        meta: AttentionMetadata,
        state_meta: RecurrentStateMetadata | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, not yet added to `residual` (None: x is the
        embedding); `cache`: the layer's KV cache, or a linear layer's recurrent state. Returns
        (this layer's output, residual), for the next layer to add."""
        ops = self.ops
        norm = self.input_layernorm
        if residual is None:
            residual = x
            h = ops.rms_norm(x, norm.weight, norm.eps)
        else:
            h, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        if self.linear_attn is not None:
            assert isinstance(cache, RecurrentState) and state_meta is not None
            h = self.linear_attn(h, cache, state_meta)
        else:
            assert self.self_attn is not None and isinstance(cache, torch.Tensor)
            h = self.self_attn(h, cos, sin, cache, meta)
        h = self._scaled(h)
        post, pre_ff = self.post_attention_layernorm, self.pre_feedforward_layernorm
        if pre_ff is None:
            h, residual = ops.add_rms_norm(h, residual, post.weight, post.eps)
            return self._scaled(self.mlp(h)), residual
        h = ops.rms_norm(h, post.weight, post.eps)
        h, residual = ops.add_rms_norm(h, residual, pre_ff.weight, pre_ff.eps)
        post_ff = self.post_feedforward_layernorm
        assert post_ff is not None, "sandwich norms come in pairs"
        return ops.rms_norm(self.mlp(h), post_ff.weight, post_ff.eps), residual

    def _scaled(self, h: torch.Tensor) -> torch.Tensor:
        # Granite scales each block's output before its residual add.
        return h if self.residual_multiplier == 1.0 else h * self.residual_multiplier


class CausalLM(nn.Module):
    """Build under `torch.device("meta")` and load weights with `models.loader`; then call
    `init_rope_tables` on the real device."""

    def __init__(self, config: ModelConfig, ops: KernelOps = kernels.reference):
        super().__init__()
        self.config = config
        self.ops = ops
        # Given its (empty) weight, nn.Embedding skips its random init, whose first call imports
        # torch._dynamo (seconds of a cold start, W5) even on the meta device.
        self.embed_tokens = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size),
        )
        self.layers = nn.ModuleList(DecoderLayer(config, ops, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Tied models (SmolLM2, Gemma) project with the embedding matrix itself.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
        )
        # Each layer's rope: Gemma 3's windowed layers have their own base frequency.
        self.layer_ropes = [
            config.local_rope if window is not None and config.local_rope else config.rope
            for window in config.layer_windows
        ]
        # rope -> (cos, sin), each [max_len, rotary_dim] float32
        self.rope_tables: dict[RopeConfig, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def attentions(self) -> list[Attention]:
        """The attention of each layer that has one (all but a hybrid's linear layers), in
        order: the layers of `config.kv_cache_layers`."""
        return [layer.self_attn for layer in self.layers if layer.self_attn is not None]

    def reset_kv_scales(self) -> None:
        """Every layer's KV-cache scales to 1, in float32 on the model's device: after
        `to_empty` (which leaves them unset) and a cast to the weights' dtype."""
        device = self.embed_tokens.weight.device
        for attention in self.attentions:
            attention.k_scale = torch.ones(1, device=device)
            attention.v_scale = torch.ones(1, device=device)

    def init_rope_tables(self, max_len: int) -> None:
        device = self.embed_tokens.weight.device
        self.rope_tables = {
            rope: cos_sin_table(rope, self.config.rotary_dim, max_len, device)
            for rope in set(self.layer_ropes)
        }

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        states: Sequence[RecurrentState] = (),
        state_meta: RecurrentStateMetadata | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden] (normed).

        kv_caches: one per layer of `config.kv_cache_layers`; states: one per linear layer of a
        hybrid model (models.recurrent_state), each sequence's slot named by `state_meta`."""
        assert self.rope_tables, "call init_rope_tables first"
        rows = {
            rope: (cos[positions], sin[positions]) for rope, (cos, sin) in self.rope_tables.items()
        }
        x = self.embed_tokens(input_ids)  # [T, hidden]
        multiplier = self.config.embedding_multiplier
        if multiplier != 1.0:
            # In the weights' dtype, as transformers rounds Gemma's sqrt(hidden_size).
            x = x * torch.tensor(multiplier, dtype=x.dtype)
        residual = None
        caches = self._layer_caches(kv_caches, states)
        for layer, rope, cache in zip(self.layers, self.layer_ropes, caches, strict=True):
            cos, sin = rows[rope]  # [T, rotary_dim]
            x, residual = layer(x, residual, cos, sin, cache, meta, state_meta)
        x, _ = self.ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)
        return x

    def _layer_caches(
        self, kv_caches: list[torch.Tensor], states: Sequence[RecurrentState]
    ) -> list[torch.Tensor | RecurrentState]:
        """Each layer's cache in layer order: the next KV cache, or a linear layer's state."""
        is_linear = [layer.linear_attn is not None for layer in self.layers]
        assert len(states) == sum(is_linear) and len(kv_caches) == is_linear.count(False), (
            "a KV cache per attention layer and a recurrent state per linear layer"
        )
        kv, state = iter(kv_caches), iter(states)
        return [next(state) if linear else next(kv) for linear in is_linear]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head
        logits = self.ops.linear(hidden, weight, None).float()
        config = self.config
        if config.logits_divisor != 1.0:
            logits = logits / config.logits_divisor
        if config.final_logit_softcapping is not None:
            cap = config.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

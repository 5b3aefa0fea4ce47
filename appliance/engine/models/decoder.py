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
from appliance.engine.models.linear_attention_config import LinearAttentionConfig
from appliance.engine.models.recurrent_state import RecurrentState
from appliance.engine.models.rotary import cos_sin_table
from appliance.engine.models.sparse_moe import SparseMoeBlock, is_sparse_layer
from kernels.ops import AttentionMetadata, Fp8Rows, KernelOps, RecurrentStateMetadata


class DecoderLayer(nn.Module):
    """Llama's pre-norm block, or with `sandwich_norms` Gemma 3's: the attention and MLP outputs
    are normed again before their residual add, and the MLP has its own pre-norm. In a hybrid
    model's linear layers, Gated DeltaNet (`linear_attn`) takes attention's place.

    Gemma 4's on top (transformers' Gemma4TextDecoderLayer): a MoE block beside the MLP, the
    two outputs each normed and summed before the MLP's post-norm; then a gated projection of
    the layer's per-layer input added; then the whole stream times the layer's scalar."""

    def __init__(self, config: ModelConfig, ops: KernelOps, layer_index: int):
        super().__init__()
        self.ops = ops
        eps = config.rms_norm_eps
        hidden = config.hidden_size
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
        self.moe: SparseMoeBlock | None = None
        dense = MLP(config, ops, intermediate_size=config.intermediate_size_of(layer_index))
        if not is_sparse_layer(config, layer_index):
            self.mlp = dense
        elif config.moe is not None and config.moe.beside_dense_mlp:
            self.mlp, self.moe = dense, SparseMoeBlock(config, ops)
            self.post_feedforward_layernorm_1 = RMSNorm(hidden, eps)  # the MLP's output
            self.pre_feedforward_layernorm_2 = RMSNorm(hidden, eps)  # the experts' input
            self.post_feedforward_layernorm_2 = RMSNorm(hidden, eps)  # the experts' output
        else:
            self.mlp = SparseMoeBlock(config, ops)  # a mixture of experts in the MLP's place
        self.residual_multiplier = config.residual_multiplier
        self.per_layer_input_gate: nn.Linear | None = None
        if config.per_layer_input_size:
            size = config.per_layer_input_size
            self.per_layer_input_gate = nn.Linear(hidden, size, bias=False)
            self.per_layer_projection = nn.Linear(size, hidden, bias=False)
            self.post_per_layer_input_norm = RMSNorm(hidden, eps)
        self.layer_scalar = nn.Parameter(torch.empty(1)) if config.layer_scalars else None

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: torch.Tensor | RecurrentState,
        meta: AttentionMetadata,
        state_meta: RecurrentStateMetadata | None,
        per_layer_input: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: the previous layer's output, not yet added to `residual` (None: x is the whole
        stream, the embedding or a Gemma 4 layer's output); `cache`: the layer's KV cache, or a
        linear layer's recurrent state. Returns (this layer's output, residual), for the next
        layer to add. per_layer_input: [T, per_layer_input_size]."""
        out, residual = self._blocks(x, residual, cos, sin, cache, meta, state_meta)
        if self.per_layer_input_gate is None and self.layer_scalar is None:
            return out, residual
        stream = residual + out
        if per_layer_input is not None:
            stream = stream + self._per_layer_input_block(stream, per_layer_input)
        if self.layer_scalar is not None:
            stream = stream * self.layer_scalar
        return stream, None

    def _blocks(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: torch.Tensor | RecurrentState,
        meta: AttentionMetadata,
        state_meta: RecurrentStateMetadata | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention (or Gated DeltaNet) and MLP (or experts), each with its norms and residual
        add."""
        ops = self.ops
        norm = self.input_layernorm
        h: torch.Tensor | Fp8Rows
        if residual is None:
            residual = x
            h = ops.rms_norm(x, norm.weight, norm.eps)
        else:
            attn_input = None if self.self_attn is None else self.self_attn.input_fp8_weight()
            h, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps, attn_input)
        if self.linear_attn is not None:
            assert isinstance(h, torch.Tensor), "quantized only for an attention block"
            assert isinstance(cache, RecurrentState) and state_meta is not None
            h = self.linear_attn(h, cache, state_meta)
        else:
            assert self.self_attn is not None and isinstance(cache, torch.Tensor)
            h = self.self_attn(h, cos, sin, cache, meta)
        h = self._scaled(h)
        post, pre_ff = self.post_attention_layernorm, self.pre_feedforward_layernorm
        mlp_input = self.mlp.input_fp8_weight() if isinstance(self.mlp, MLP) else None
        if pre_ff is None:
            h, residual = ops.add_rms_norm(h, residual, post.weight, post.eps, mlp_input)
            return self._scaled(self.mlp(h)), residual
        h = ops.rms_norm(h, post.weight, post.eps)
        h, residual = ops.add_rms_norm(h, residual, pre_ff.weight, pre_ff.eps, mlp_input)
        post_ff = self.post_feedforward_layernorm
        assert post_ff is not None, "sandwich norms come in pairs"
        h = self.mlp(h)
        if self.moe is not None:
            h = self._beside_experts(h, residual)
        return ops.rms_norm(h, post_ff.weight, post_ff.eps), residual

    def _beside_experts(self, mlp_out: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
        """Gemma 4: the MLP's output and the experts' (their router scoring the un-normed
        stream), each normed, summed."""
        ops, moe = self.ops, self.moe
        assert moe is not None, "called for a layer with a MoE block beside its MLP"
        post_1, pre_2 = self.post_feedforward_layernorm_1, self.pre_feedforward_layernorm_2
        post_2 = self.post_feedforward_layernorm_2
        experts_out = moe(ops.rms_norm(stream, pre_2.weight, pre_2.eps), router_input=stream)
        return ops.rms_norm(mlp_out, post_1.weight, post_1.eps) + ops.rms_norm(
            experts_out, post_2.weight, post_2.eps
        )

    def _per_layer_input_block(self, stream: torch.Tensor, per_layer_input: torch.Tensor):
        """Gemma 4: norm(projection(GELU-tanh(gate(stream)) * per_layer_input)), [T, hidden]."""
        ops, gate = self.ops, self.per_layer_input_gate
        assert gate is not None, "called for a layer with per-layer inputs"
        h = torch.nn.functional.gelu(ops.linear(stream, gate.weight, None), approximate="tanh")
        h = ops.linear(h * per_layer_input, self.per_layer_projection.weight, None)
        norm = self.post_per_layer_input_norm
        return ops.rms_norm(h, norm.weight, norm.eps)

    def _scaled(self, h: torch.Tensor) -> torch.Tensor:
        # Granite scales each block's output before its residual add.
        return h if self.residual_multiplier == 1.0 else h * self.residual_multiplier


def _scaled(embedding: torch.Tensor, multiplier: float) -> torch.Tensor:
    # In the weights' dtype, as transformers rounds Gemma's sqrt(hidden_size).
    if multiplier == 1.0:
        return embedding
    return embedding * torch.tensor(multiplier, dtype=embedding.dtype)


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
        # Gemma 4's per-layer inputs: a table of every layer's, side by side, and a projection of
        # the embedding to the same width (transformers' Gemma4TextModel).
        self.embed_tokens_per_layer: nn.Embedding | None = None
        if config.per_layer_input_size:
            width = config.num_layers * config.per_layer_input_size
            self.embed_tokens_per_layer = nn.Embedding(
                config.per_layer_vocab_size,
                width,
                _weight=torch.empty(config.per_layer_vocab_size, width),
            )
            self.per_layer_model_projection = nn.Linear(config.hidden_size, width, bias=False)
            self.per_layer_projection_norm = RMSNorm(
                config.per_layer_input_size, config.rms_norm_eps
            )
        # Each layer's index into the forward's kv_caches: that of the layer whose KV it reads
        # (engine.kv_cache allocates one cache per KV-owning layer, config.kv_layers); None for
        # a hybrid's linear layers, which read their recurrent state instead.
        kv_layers = config.kv_layers
        self.kv_cache_index: list[int | None] = [
            None if layer.linear_attn is not None else kv_layers.index(config.kv_source_of(i))
            for i, layer in enumerate(self.layers)
        ]
        # Whether each layer reads a cache of the window group (config.window_group): it then
        # attends through the window group's tables and slots, when the engine keeps that group
        # in a pool of its own (AttentionMetadata.window_group).
        window_group = set(config.window_group)
        self.reads_window_group = [
            index is not None and kv_layers[index] in window_group for index in self.kv_cache_index
        ]
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Tied models (SmolLM2, Gemma) project with the embedding matrix itself.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
        )
        # Each layer's rope and rotary dims: Gemma 3's windowed layers have their own base
        # frequency, Gemma 4's global layers their own head dim too.
        self.layer_ropes = [
            (
                config.local_rope if window is not None and config.local_rope else config.rope,
                config.rotary_dim_of(i),
            )
            for i, window in enumerate(config.layer_windows)
        ]
        # (rope, rotary_dim) -> (cos, sin), each [max_len, rotary_dim] float32
        self.rope_tables: dict[tuple[RopeConfig, int], tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def attentions(self) -> list[Attention]:
        """The attention of each layer that has one (all but a hybrid's linear layers), in
        layer order."""
        return [layer.self_attn for layer in self.layers if layer.self_attn is not None]

    @property
    def linear_attention(self) -> LinearAttentionConfig | None:
        """The shapes of this device's linear-attention layers (a hybrid model's; under tensor
        parallelism a share of the heads, LinearAttentionConfig.per_rank), for its recurrent
        state; None for any other model."""
        linear = (layer.linear_attn for layer in self.layers if layer.linear_attn is not None)
        return next((la.config for la in linear), None)

    def reset_kv_scales(self) -> None:
        """Every layer's KV-cache scales to 1, in float32 on the model's device: after
        `to_empty` (which leaves them unset) and a cast to the weights' dtype. A layer that
        reads another's cache (Gemma 4's KV-shared layers) shares that layer's scale tensors,
        so the scales a checkpoint sets for the owner (models.loader) decode for both."""
        device = self.embed_tokens.weight.device
        for index, layer in enumerate(self.layers):
            if layer.self_attn is None:
                continue  # a hybrid's linear layer: no KV cache
            owner = self.layers[self.config.kv_source_of(index)].self_attn
            if owner is layer.self_attn:
                owner.k_scale = torch.ones(1, device=device)
                owner.v_scale = torch.ones(1, device=device)
            else:  # an earlier layer, whose scales are set already
                layer.self_attn.k_scale, layer.self_attn.v_scale = owner.k_scale, owner.v_scale

    def init_rope_tables(self, max_len: int) -> None:
        device = self.embed_tokens.weight.device
        self.rope_tables = {
            (rope, dim): cos_sin_table(rope, dim, max_len, device)
            for rope, dim in set(self.layer_ropes)
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

        kv_caches: one per KV-owning layer (config.kv_layers), a window group's layer's in its
        group's pool when `meta.window_group` is given; states: one per linear layer of a hybrid
        model (models.recurrent_state), each sequence's slot named by `state_meta`."""
        assert self.rope_tables, "call init_rope_tables first"
        rows = {
            key: (cos[positions], sin[positions]) for key, (cos, sin) in self.rope_tables.items()
        }
        x = _scaled(self.embed_tokens(input_ids), self.config.embedding_multiplier)  # [T, hidden]
        per_layer_inputs = self._per_layer_inputs(input_ids, x)  # [T, layers, P] or None
        residual = None
        caches = self._layer_caches(kv_caches, states)
        window_meta = meta.window_group
        layers = zip(self.layers, self.layer_ropes, caches, self.reads_window_group, strict=True)
        for i, (layer, rope, cache, in_window_group) in enumerate(layers):
            cos, sin = rows[rope]  # [T, rotary_dim]
            per_layer_input = None if per_layer_inputs is None else per_layer_inputs[:, i]
            layer_meta = window_meta if in_window_group and window_meta is not None else meta
            x, residual = layer(
                x, residual, cos, sin, cache, layer_meta, state_meta, per_layer_input
            )
        if residual is None:
            return self.ops.rms_norm(x, self.norm.weight, self.norm.eps)
        x, _ = self.ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)
        return x

    def _layer_caches(
        self, kv_caches: list[torch.Tensor], states: Sequence[RecurrentState]
    ) -> list[torch.Tensor | RecurrentState]:
        """Each layer's cache in layer order: the KV cache it reads (its own, or a KV-shared
        layer's owner's), or a linear layer's recurrent state."""
        assert len(kv_caches) == len(self.config.kv_layers), "a KV cache per KV-owning layer"
        assert len(states) == self.kv_cache_index.count(None), "a state per linear layer"
        state = iter(states)
        return [next(state) if i is None else kv_caches[i] for i in self.kv_cache_index]

    def _per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """Gemma 4: each token's input to every layer, [T, layers, P] (transformers'
        get_per_layer_inputs, then project_per_layer_inputs): the token's row of the table,
        scaled by sqrt(P), and the embedding's projection, normed, averaged (times 2 ** -0.5)."""
        table = self.embed_tokens_per_layer
        if table is None:
            return None
        config = self.config
        shape = (x.shape[0], config.num_layers, config.per_layer_input_size)
        looked_up = _scaled(table(input_ids), config.per_layer_input_size**0.5).view(shape)
        projected = self.ops.linear(x, self.per_layer_model_projection.weight, None)
        projected = (projected * config.hidden_size**-0.5).view(shape)
        norm = self.per_layer_projection_norm
        projected = self.ops.rms_norm(projected.reshape(-1, shape[2]), norm.weight, norm.eps)
        return (projected.view(shape) + looked_up) * 2.0**-0.5

    def compute_logits(self, hidden: torch.Tensor, *, float32: bool = True) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32; with `float32=False`, in the projection's dtype
        where nothing else transforms them: the same values (an argmax needs no copy)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head
        logits = self.ops.linear(hidden, weight, None)
        config = self.config
        if float32 or config.logits_divisor != 1.0 or config.final_logit_softcapping is not None:
            logits = logits.float()
        if config.logits_divisor != 1.0:
            logits = logits / config.logits_divisor
        if config.final_logit_softcapping is not None:
            cap = config.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

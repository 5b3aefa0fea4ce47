"""Our fused projections' rows: which canonical checkpoint projections each fused parameter
stacks (`FUSED_PARTS`), and how many rows each part takes in every layer (`fused_row_sizes`).

A decoder layer fuses its projections that read the same input into one matmul: q, k and v
into `self_attn.qkv_proj`, gate and up into `mlp.gate_up_proj` (and a shared expert's into
`mlp.shared_expert.gate_up_proj`), Qwen3.5's four linear-attention input projections into
`linear_attn.in_proj`. The loader copies each checkpoint tensor into its part's rows (and a
block-scaled FP8 weight's scales beside them), on one device or on a tensor-parallel rank,
whose fused rows are its share of every part, in order. The sizes differ from layer to layer
in some families, so they are a table per layer, read from the config.
"""

from __future__ import annotations

from appliance.engine.models.config import ModelConfig

FUSED_PARTS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.shared_expert.gate_proj": ("mlp.shared_expert.gate_up_proj", 0),
    "mlp.shared_expert.up_proj": ("mlp.shared_expert.gate_up_proj", 1),
    "linear_attn.in_proj_qkv": ("linear_attn.in_proj", 0),
    "linear_attn.in_proj_z": ("linear_attn.in_proj", 1),
    "linear_attn.in_proj_b": ("linear_attn.in_proj", 2),
    "linear_attn.in_proj_a": ("linear_attn.in_proj", 3),
}
"""Canonical checkpoint projection (inside a layer) -> (the fused parameter holding it, its
part: the index into that parameter's row sizes)."""


def fused_row_sizes(config: ModelConfig, num_ranks: int = 1) -> dict[str, list[int]]:
    """Rows of each layer's fused projections (`layers.{i}.self_attn.qkv_proj`, ...), in
    checkpoint order ([q; k; v] and [gate; up]), on each of `num_ranks` tensor-parallel ranks.
    Gemma 4's layers differ: wide global heads, values that are the keys (no v), layers that
    reuse another's KV (q only), double-wide MLPs. Qwen3.5's full-attention layers project a
    gate beside each query (twice the q rows); its linear layers fuse their four input
    projections, a rank's share of each by head (its q, k and v heads of in_proj_qkv's rows:
    appliance.engine.parallel.sharding's grouped_part)."""
    sizes = {}
    linear = config.linear_attention
    gates = 2 if config.attention_output_gate else 1
    for i in range(config.num_layers):
        if config.is_linear_layer(i):
            assert linear is not None
            share = linear.per_rank(num_ranks)
            heads = share.num_value_heads
            sizes[f"layers.{i}.linear_attn.in_proj"] = [
                share.conv_dim, share.value_size, heads, heads
            ]  # fmt: skip
        else:
            head_dim = config.head_dim_of(i)
            kv = config.num_kv_heads_of(i) * head_dim // num_ranks
            num_kv = (1 if config.values_are_keys(i) else 2) if config.kv_source_of(i) == i else 0
            sizes[f"layers.{i}.self_attn.qkv_proj"] = [
                gates * config.num_heads * head_dim // num_ranks,
                *[kv] * num_kv,
            ]
        mlp = config.intermediate_size_of(i) // num_ranks
        sizes[f"layers.{i}.mlp.gate_up_proj"] = [mlp, mlp]
        if config.moe is not None and config.moe.shared_expert_size:
            shared = config.moe.shared_expert_size // num_ranks
            sizes[f"layers.{i}.mlp.shared_expert.gate_up_proj"] = [shared, shared]
    return sizes

"""A small Llama-shaped model with random weights on the GPU, through the Triton kernels: what
the engine's GPU tests of graphs and memory run (no checkpoint, no tokenizer)."""

from __future__ import annotations

from typing import Any

import torch

from appliance.engine.models.config import ModelConfig
from appliance.engine.models.decoder import CausalLM
from appliance.engine.models.loader import build_model, fill_randomly

VOCAB_SIZE = 32000
MAX_POSITIONS = 1024


def llama_shape(**changes: Any) -> dict[str, Any]:
    """A config.json of three layers, 256 wide, grouped-query attention (4 heads, 2 KV heads),
    a 32k vocabulary and 1,024 positions, with `changes` applied."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        **changes,
    }


def random_llama(shape: dict[str, Any], dtype: torch.dtype) -> CausalLM:
    """`shape`'s model on the GPU, weights drawn with seed 0, rope tables for every position."""
    from kernels import triton_ops

    config = ModelConfig.from_dict(shape)
    model = build_model(config, dtype=dtype, device="cuda", ops=triton_ops, shard=None)
    fill_randomly(model, 0)
    model.init_rope_tables(shape["max_position_embeddings"])
    return model.eval()

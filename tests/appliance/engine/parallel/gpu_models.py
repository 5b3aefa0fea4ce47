"""A small random Llama checkpoint for the tensor-parallel GPU tests: widths the Triton kernels
serve (head_dim 64), GQA (8 query, 4 KV heads), O(1) activations (the tiny models' re-draw)."""

from __future__ import annotations

import math
from pathlib import Path

import torch


def save_gpu_test_model(model_dir: Path, seed: int = 0) -> Path:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=512,
        intermediate_size=1024,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        num_hidden_layers=4,
        vocab_size=4096,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            elif "embed_tokens" in name:
                param.copy_(0.25 * noise)
            else:
                param.copy_(noise * (1.5 / math.sqrt(param.shape[1])))
    model.save_pretrained(model_dir, safe_serialization=True)
    return model_dir

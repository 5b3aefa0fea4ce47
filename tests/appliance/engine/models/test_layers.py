"""The shared layers' own contracts, on the CPU reference ops in float32."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kernels.reference
from appliance.engine.models.config import ModelConfig
from appliance.engine.models.layers import MLP
from appliance.engine.models.projections import Fp8Linear
from kernels.fp8 import quantize_rows
from kernels.ops import Fp8Rows

_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
}


def _mlp(chunk_tokens: int, activation: str, fp8: bool) -> MLP:
    config = dataclasses.replace(ModelConfig.from_dict(_CONFIG), activation=activation)
    mlp = MLP(config, kernels.reference, chunk_tokens=chunk_tokens)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for projection in (mlp.gate_up_proj, mlp.down_proj):
            projection.weight.copy_(torch.randn(projection.weight.shape, generator=generator))
            projection.weight.mul_(projection.in_features**-0.5)
    if fp8:
        mlp.gate_up_proj = Fp8Linear.quantize(mlp.gate_up_proj)
        mlp.down_proj = Fp8Linear.quantize(mlp.down_proj)
    return mlp


@pytest.mark.parametrize(
    ("activation", "fp8"), [("silu", False), ("gelu_tanh", False), ("silu", True)]
)
def test_a_long_step_chunked_through_the_mlp_matches_it_whole(activation: str, fp8: bool) -> None:
    # 37 rows in pieces of 8: four whole pieces and a ragged one of 5.
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(1))
    chunked = _mlp(8, activation, fp8)
    whole = _mlp(64, activation, fp8)
    with torch.no_grad():
        expected = whole(x)
        got = chunked(x)
    assert got.shape == expected.shape == (37, 64)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    # Steps no longer than a piece take the unchunked path itself.
    with torch.no_grad():
        assert torch.equal(chunked(x[:8]), whole(x[:8]))
    if fp8:  # rows quantized by the norm before the MLP are chunked as they are
        weight = chunked.input_fp8_weight()
        assert weight is not None and weight.weight is chunked.gate_up_proj.weight
        with torch.no_grad():
            rows = Fp8Rows(*quantize_rows(x), x.dtype)
            assert torch.equal(chunked(rows), got)

"""Our rotary tables equal transformers' bit for bit, and Llama 3.1 scaling bends the right band.

transformers' rope init functions (`ROPE_INIT_FUNCTIONS`, and `LlamaRotaryEmbedding` for the
default type, which transformers 5 no longer lists there) are the outside reference. Our
`RopeConfig` is parsed from the transformers config's own dict, so the parsing is checked too.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from appliance.engine.models.config import ModelConfig, RopeConfig
from appliance.engine.models.rotary import cos_sin_table, inverse_frequencies

ROPE_PARAMETERS = [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "default", "rope_theta": 500000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.5},
    {  # Llama 3.1 8B
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    {  # Llama 3.2 1B
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
]
HEAD_DIMS = [64, 128]


def _hf_config(rope_parameters: dict, head_dim: int) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=131072,
        rope_parameters=dict(rope_parameters),
    )


def _our_rope(hf_config: LlamaConfig) -> RopeConfig:
    raw = {**hf_config.to_dict(), "architectures": ["LlamaForCausalLM"]}
    return ModelConfig.from_dict(raw).rope


def _hf_inverse_frequencies(hf_config: LlamaConfig) -> torch.Tensor:
    rope_type = hf_config.rope_parameters["rope_type"]
    if rope_type == "default":
        inv_freq, scaling = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_config)
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    assert scaling == 1.0, "these rope types do not rescale cos/sin"
    return inv_freq


def _label(params: dict) -> str:
    return f"{params['rope_type']}-{params['rope_theta']:g}-x{params.get('factor', 1)}"


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("rope_parameters", ROPE_PARAMETERS, ids=_label)
def test_inverse_frequencies_equal_transformers_bitwise(rope_parameters, head_dim):
    hf_config = _hf_config(rope_parameters, head_dim)
    ours = inverse_frequencies(_our_rope(hf_config), head_dim)
    theirs = _hf_inverse_frequencies(hf_config)
    assert ours.dtype == theirs.dtype == torch.float32
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("rope_parameters", ROPE_PARAMETERS, ids=_label)
def test_cos_sin_table_equals_transformers_rotary_embedding_bitwise(rope_parameters, head_dim):
    hf_config = _hf_config(rope_parameters, head_dim)
    max_len = 9000  # past Llama 3.1's original 8192 positions
    cos, sin = cos_sin_table(_our_rope(hf_config), head_dim, max_len)
    rotary = LlamaRotaryEmbedding(hf_config)
    x = torch.zeros(1, max_len, head_dim)
    hf_cos, hf_sin = rotary(x, torch.arange(max_len)[None])
    assert cos.shape == sin.shape == (max_len, head_dim)
    assert torch.equal(cos, hf_cos[0])
    assert torch.equal(sin, hf_sin[0])


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_llama3_scaling_slows_low_frequencies_and_keeps_high_ones(head_dim):
    llama3 = RopeConfig(
        theta=500000.0,
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    plain = inverse_frequencies(RopeConfig(theta=500000.0), head_dim)
    scaled = inverse_frequencies(llama3, head_dim)
    wavelen = 2 * math.pi / plain
    high = wavelen < 8192 / 4.0  # short wavelengths: untouched
    low = wavelen > 8192 / 1.0  # long wavelengths: slowed by the full factor
    medium = ~high & ~low
    assert high.any() and low.any() and medium.any(), "head_dim should span all three bands"
    assert torch.equal(scaled[high], plain[high])
    assert torch.equal(scaled[low], plain[low] / 8.0)
    # The band between is interpolated: strictly slower than before, strictly faster than /8.
    assert (scaled[medium] < plain[medium]).all()
    assert (scaled[medium] > plain[medium] / 8.0).all()


def test_linear_scaling_divides_every_frequency_by_the_factor():
    plain = inverse_frequencies(RopeConfig(theta=10000.0), 64)
    linear = inverse_frequencies(RopeConfig(theta=10000.0, rope_type="linear", factor=4.0), 64)
    assert torch.equal(linear, plain / 4.0)


def test_legacy_rope_scaling_config_parses_like_transformers_5_rope_parameters():
    """Meta's Llama 3.1 config.json (pre transformers 5): top-level rope_theta plus a
    `rope_scaling` dict; older ones still spell the type key `type`."""
    base = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 512,
    }
    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    legacy = ModelConfig.from_dict(
        {**base, "rope_theta": 500000.0, "rope_scaling": {**scaling, "rope_type": "llama3"}}
    )
    current = ModelConfig.from_dict(
        {**base, "rope_parameters": {**scaling, "rope_type": "llama3", "rope_theta": 500000.0}}
    )
    assert legacy.rope == current.rope == RopeConfig(theta=500000.0, rope_type="llama3", **scaling)
    oldest = ModelConfig.from_dict(
        {**base, "rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}}
    )
    assert oldest.rope == RopeConfig(theta=1e4, rope_type="linear", factor=2.0)


# Qwen3's long-context recipe (YaRN x4 over 32k), DeepSeek-style mscale, and Phi-4-mini's
# LongRoPE on 96 of 128 head dims (factors here are made up; the shapes are Phi-4-mini's).
SCALED_ROPES = {
    "yarn-qwen3": (
        "Qwen3ForCausalLM",
        {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
         "original_max_position_embeddings": 32768},
        1.0,
    ),
    "yarn-mscale": (
        "Qwen3ForCausalLM",
        {"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0, "mscale": 1.0,
         "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
         "original_max_position_embeddings": 3277},
        1.0,
    ),
    "longrope-phi4-mini": (
        "Phi3ForCausalLM",
        {"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.75,
         "short_factor": [1.0 + 0.05 * i for i in range(48)],
         "long_factor": [1.5 + 0.5 * i for i in range(48)]},
        0.75,
    ),
}  # fmt: skip


def _scaled_hf_config(arch: str, params: dict):
    import transformers

    config_class = {
        "Qwen3ForCausalLM": transformers.Qwen3Config,
        "Phi3ForCausalLM": transformers.Phi3Config,
    }[arch]
    extra = {"original_max_position_embeddings": 4096} if arch == "Phi3ForCausalLM" else {}
    return config_class(
        hidden_size=512,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=131072,
        rope_parameters=dict(params),
        **extra,
    )


@pytest.mark.parametrize("name", sorted(SCALED_ROPES))
def test_yarn_and_longrope_tables_equal_transformers(name):
    arch, params, partial = SCALED_ROPES[name]
    hf_config = _scaled_hf_config(arch, params)
    config = ModelConfig.from_dict({**hf_config.to_dict(), "architectures": [arch]})
    assert config.rotary_dim == int(128 * partial)
    init = ROPE_INIT_FUNCTIONS[params["rope_type"]]
    hf_short, hf_factor = init(hf_config, "cpu")
    assert torch.equal(inverse_frequencies(config.rope, config.rotary_dim), hf_short)
    original = config.rope.original_max_position_embeddings
    cos, _ = cos_sin_table(config.rope, config.rotary_dim, original + 8)
    assert cos.shape == (original + 8, config.rotary_dim)
    positions = torch.tensor([0, 1, original - 1, original, original + 7], dtype=torch.float32)
    hf_long, _ = init(hf_config, "cpu", seq_len=original + 1)  # longrope's long factors
    inv = torch.stack([hf_short if p < original else hf_long for p in positions.tolist()])
    freqs = positions[:, None] * inv
    expected = torch.cat((freqs, freqs), dim=-1).cos() * hf_factor
    assert torch.equal(cos[positions.long()], expected)
    if params["rope_type"] == "longrope":
        assert not torch.equal(hf_long, hf_short), "the long factors must be in use past 4096"

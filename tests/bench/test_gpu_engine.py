"""bench/gpu_engine.py's parts that decide what its figures mean: the bytes a decoded token
reads (W1's copy-ceiling fraction), the engine build's split (the methods it times exist, the
profile's captures count apart), and the peer's hand-over, which gives Inferno transformers'
own model's weights (the same weights, so a mixture of experts routes the same).

The hand-over runs as in the bench on every --model shape made tiny (two layers, two heads,
small vocabulary and experts; each shape's own head size, rope, windows, biases, sinks and
routing kept): in float32 on the CPU against transformers' logits, and (gpu) from a peer built
on the GPU into Inferno's engine. Shapes whose architecture Inferno does not build yet skip.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from appliance.engine.cuda_graphs import DecodeGraphs
from appliance.engine.engine import Engine
from appliance.engine.engine_config import EngineConfig
from appliance.engine.model_runner import ModelRunner
from appliance.engine.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from appliance.engine.models.loader import build_model
from appliance.engine.prompt_graphs import PromptGraphs
from bench.gpu_engine import SHAPES, BuildClock, inferno_model_from, peer_model, weight_bytes

from ..appliance.engine.models.conftest import redraw_weights
from ..appliance.engine.models.test_architectures import PagedBatch, _hf_logits
from ..appliance.engine.models.test_families_gpu import _hf_prompt_logprobs, _prompt_logprobs

BF16 = 2  # bytes


def _decode_bytes(shape: str) -> tuple[int, int]:
    config = ModelConfig.from_dict(SHAPES[shape])
    model = build_model(config, dtype=torch.bfloat16, device="meta", ops=None, shard=None)
    return weight_bytes(model)


def test_the_build_clock_times_the_engine_s_methods_and_the_profile_s_captures_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stand-ins for the methods it wraps (their names are the engine's: a renamed method fails
    here, not on the GPU machine), called as a build calls them: the profile captures the
    largest prompt and decode graphs, then the build captures every graph."""
    calls: list[str] = []

    def profile(self, *args: object) -> None:
        calls.append("profile")
        PromptGraphs._capture_size(None, 640)  # the wrapped methods, as the profile calls them
        DecodeGraphs._capture_plain(None, 64)

    for owner, name in (
        (PromptGraphs, "_capture_size"),
        (DecodeGraphs, "_capture_plain"),
        (DecodeGraphs, "_capture_greedy"),
        (ModelRunner, "allocate_kv_caches"),
    ):
        assert callable(getattr(owner, name))
        monkeypatch.setattr(owner, name, lambda self, *args, _name=name: calls.append(_name))
    monkeypatch.setattr(ModelRunner, "kv_pools_for_free_memory", profile)
    kept = ModelRunner.kv_pools_for_free_memory
    with BuildClock() as clock:
        ModelRunner.kv_pools_for_free_memory(None)
        ModelRunner.allocate_kv_caches(None)
        for size in (640, 128):
            PromptGraphs._capture_size(None, size)
        DecodeGraphs._capture_plain(None, 64)
        DecodeGraphs._capture_greedy(None, 8)
    assert ModelRunner.kv_pools_for_free_memory is kept  # unwrapped again
    assert calls == [
        "profile",
        "_capture_size",
        "_capture_plain",
        "allocate_kv_caches",
        "_capture_size",
        "_capture_size",
        "_capture_plain",
        "_capture_greedy",
    ]
    assert set(clock.seconds) == {
        "ModelRunner.kv_pools_for_free_memory",
        "profile: PromptGraphs._capture_size",
        "profile: DecodeGraphs._capture_plain",
        "ModelRunner.allocate_kv_caches",
        "PromptGraphs._capture_size",
        "DecodeGraphs._capture_plain",
        "DecodeGraphs._capture_greedy",
    }
    assert "graphs captured" in clock.summary()


def test_qwen3_30b_a3b_token_reads_its_8_of_128_experts_attention_norms_and_lm_head():
    # Qwen3-30B-A3B's config.json: hidden 2048, 48 layers, 32 query / 4 KV heads of 128,
    # 128 experts of 768 (top 8), vocab 151936, untied; q/k norms over a head.
    hidden, layers, head, vocab = 2048, 48, 128, 151936
    attention = (32 + 4 + 4) * head * hidden + hidden * 32 * head + 2 * head  # qkv, o, q/k norm
    norms = 2 * hidden
    router = 128 * hidden
    expert = 3 * 768 * hidden  # gate, up, down
    per_layer = attention + norms + router + 8 * expert
    expected = BF16 * (layers * per_layer + hidden + hidden + vocab * hidden)  # norm, row, head
    total, read = _decode_bytes("qwen3-30b-a3b")
    assert read == expected
    assert total - read == BF16 * (layers * 120 * expert + (vocab - 1) * hidden)


def test_qwen3_30b_a3b_fp8_experts_read_one_byte_a_weight_and_a_scale_a_row():
    """`--quantization fp8`: a token's 8 experts per layer in e4m3 (one byte a weight) with a
    float32 scale per output channel, against 2 bytes a weight in bf16."""
    config = ModelConfig.from_dict(SHAPES["qwen3-30b-a3b"])
    fp8 = build_model(config, dtype=torch.bfloat16, device="meta", ops=None, shard=None,
                      quantization="fp8")  # fmt: skip
    hidden, size, layers = 2048, 768, 48
    weights = 3 * size * hidden  # gate, up, down
    scales = 4 * (2 * size + hidden)  # float32, one per row of gate/up and of down
    saved = layers * 8 * (BF16 * weights - (weights + scales))
    assert _decode_bytes("qwen3-30b-a3b")[1] - weight_bytes(fp8)[1] == saved


def test_gpt_oss_20b_token_reads_biases_sinks_router_and_4_of_32_bf16_experts():
    # gpt-oss-20b's config.json: hidden 2880, 24 layers, 64 query / 8 KV heads of 64, biased
    # attention with a sink per query head, 32 experts of 2880 (top 4) with biases, MXFP4
    # experts dequantized to bf16 on load, vocab 201088, untied.
    hidden, layers, head, size, vocab = 2880, 24, 64, 2880, 201088
    qkv = (64 + 8 + 8) * head
    attention = qkv * hidden + qkv + hidden * 64 * head + hidden + 64  # weights, biases, sinks
    norms = 2 * hidden
    router = 32 * hidden + 32
    expert = 2 * size * hidden + 2 * size + hidden * size + hidden  # gate/up, down, biases
    per_layer = attention + norms + router + 4 * expert
    expected = BF16 * (layers * per_layer + hidden + hidden + vocab * hidden)
    assert _decode_bytes("gpt-oss-20b")[1] == expected


def test_a_tied_model_reads_its_embedding_whole_as_lm_head():
    total, read = _decode_bytes("phi-4-mini")
    # Every weight is read once, the embedding whole as the LM head, and one row of it more.
    assert read == total + BF16 * 3072


def _tiny(shape: dict[str, Any]) -> dict[str, Any]:
    """`shape` with two layers (its last two: one of each kind) of two heads (one KV head), a
    512-token vocabulary, 4 experts (2 per token), small shared experts and linear-attention
    heads, windows of 16 tokens, 4,096 positions; its head sizes, rope type and parameters,
    biases and sinks kept."""
    head_dim = shape.get("head_dim", shape["hidden_size"] // shape["num_attention_heads"])
    tiny = {
        **shape,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "hidden_size": 2 * head_dim,
        "intermediate_size": 64,
        "vocab_size": 512,
        "pad_token_id": 0,  # inside the vocabulary (Phi-3's default, 32000, is not)
        "max_position_embeddings": 4096,  # rope tables of 4,096 rows, not 131,072
    }
    if "layer_types" in shape:
        tiny["layer_types"] = shape["layer_types"][-2:]  # the last two: one of each kind
    if "sliding_window" in shape:
        tiny["sliding_window"] = 16
    if "sliding_window_pattern" in shape:
        tiny["sliding_window_pattern"] = 2  # one windowed layer, one global
    if "num_experts" in shape:
        tiny |= {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    if "num_local_experts" in shape:
        tiny |= {"num_local_experts": 4, "num_experts_per_tok": 2}
    if "shared_expert_intermediate_size" in shape:
        tiny["shared_expert_intermediate_size"] = 32
    if "linear_num_key_heads" in shape:  # Gated DeltaNet: 2 QK heads, 4 V heads
        tiny |= {"linear_num_key_heads": 2, "linear_num_value_heads": 4}
    if "num_global_key_value_heads" in shape:  # Gemma 4's global layers
        tiny["num_global_key_value_heads"] = 1
    if "vocab_size_per_layer_input" in shape:
        tiny["vocab_size_per_layer_input"] = 512
    return tiny


def _tiny_shape(name: str) -> dict[str, Any]:
    architecture = SHAPES[name]["architectures"][0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        pytest.skip(f"Inferno does not build {architecture} yet (issue 23)")
    return _tiny(SHAPES[name])


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_the_peer_s_weights_in_inferno_give_transformers_logits(name):
    shape = _tiny_shape(name)
    peer = peer_model(shape, device="cpu", dtype=torch.float32)
    redraw_weights(peer, seed=0)  # O(1) activations: normal(0, 0.02) would hide mistakes
    model = inferno_model_from(peer, shape, device="cpu", dtype=torch.float32, ops=None)
    prompt = torch.randint(512, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    [ours] = PagedBatch(model, [prompt]).step([(0, 0, len(prompt))])
    theirs = _hf_logits(peer, prompt)
    diff = (ours.log_softmax(-1) - theirs.log_softmax(-1)).abs().max().item()
    assert diff <= 1e-4, f"{name}: max |log-prob difference| {diff:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_on_the_gpu_the_peer_hands_its_weights_over_through_host_memory(name):
    """The bench's GPU path: the peer built on the GPU, moved to the host by the hand-over,
    and Inferno's engine (Triton kernels, CUDA graphs) on the weights it left; float32 prompt
    log-probabilities within 2e-3 of the peer's own on the CPU (test_families_gpu's bound)."""
    shape = _tiny_shape(name)
    peer = peer_model(shape, device="cuda", dtype=torch.float32)
    redraw_weights(peer, seed=0)
    model = inferno_model_from(peer, shape, dtype=torch.float32)
    assert peer.device.type == "cpu", "the hand-over leaves the peer on the host"
    settings = EngineConfig(
        model_dir=Path("peer"), device="cuda", dtype="float32", max_model_len=512,
        max_num_batched_tokens=64, gpu_memory_utilization=0.2,
    )  # fmt: skip
    engine = Engine.build(settings, model, None)
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(512, (n,), generator=generator).tolist() for n in (130, 9)]
    ours = _prompt_logprobs(engine, prompts)
    theirs = _hf_prompt_logprobs(peer, prompts)
    for a, b in zip(ours, theirs, strict=True):
        assert (a - b).abs().max() <= 2e-3, f"{name}: prompt log-probabilities"

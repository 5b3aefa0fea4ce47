"""Tensor parallelism of Gemma 4 and the hybrid Qwen on the CPU (gloo): two processes give the
logits one process gives (float32, within 1e-5 of the largest logit: Gemma's hidden states,
the embedding times sqrt(hidden), are large enough that the ranks' other order of summation
moves a logit of 2 by 1.2e-5) and the same greedy tokens for prefill, chunked prefill and decode of
sequences of different lengths; the hybrid's linear-attention heads, their projections,
convolution channels and recurrent state are split by head (a sequence preempted with its
state live and recomputed too); each rank holds its share of every per-layer shape; a head
count that does not divide is refused by name."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from appliance.engine.engine import Engine
from appliance.engine.errors import EngineConfigError, ModelLoadError
from appliance.engine.models.config import ModelConfig
from appliance.engine.models.loader import load_model
from appliance.engine.models.recurrent_state import allocate_states, state_bytes_per_slot
from appliance.engine.parallel.sharding import ShardPlan, verify_divisible
from appliance.engine.sampling_params import SamplingParams
from tests.appliance.engine.models.conftest import build_hf_model, save_checkpoint
from tests.appliance.engine.parallel.test_tensor_parallel import build_engine, compare, prompt_ids

# Gemma 4 with two global KV heads (conftest's TP_VARIANTS): uneven head dims (16 windowed, 32
# global), values that are the keys, KV-shared layers, per-layer inputs, double-wide MLPs,
# softcapped logits; its MoE block beside the MLP. The hybrid Qwen: 2 key and 4 value heads in
# its Gated DeltaNet layers, a gated full-attention layer; the MoE with its gated shared expert.
GEMMA4 = ["gemma4-tp", "gemma4-moe-tp"]
HYBRID = ["qwen3.5", "qwen3.5-moe"]
# A hybrid's pool of 5 blocks of 16 tokens cannot hold three prompts of 30, 21 and 12 tokens
# and their completions: sequences are preempted with their state live (test_hybrid_qwen.py).
HYBRID_SETTINGS = {"num_kv_blocks": 5, "max_num_seqs": 3}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        name: save_checkpoint(build_hf_model(name), tmp_path_factory.mktemp(name))
        for name in GEMMA4 + HYBRID
    }


@pytest.fixture(scope="module", params=GEMMA4 + HYBRID)
def engines(
    request: pytest.FixtureRequest, checkpoints: dict[str, Path]
) -> Iterator[tuple[Engine, Engine]]:
    """(one process, two processes) around the same tiny checkpoint, built once per variant."""
    settings = HYBRID_SETTINGS if request.param in HYBRID else {}
    model_dir = checkpoints[request.param]
    single = build_engine(model_dir, 1, **settings)
    parallel = build_engine(model_dir, 2, **settings)
    yield single, parallel
    parallel.close()


def test_prefill_chunked_prefill_and_decode_match_one_process(engines) -> None:
    """Three sequences of 30, 9 and 5 prompt tokens: the first prefilled in 16-token chunks
    beside the others' prefill and decode, every prompt position's logits and then eight
    decode steps' (log-probabilities keep each a single step)."""
    params = SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=1, logprobs=1
    )
    prompts = [prompt_ids(30), prompt_ids(9, offset=40), prompt_ids(5, offset=90)]
    assert compare(engines, prompts, params, scale_by_logits=True) >= 8 + 3


def test_decode_bursts_match_one_process(engines) -> None:
    """Bursts of four steps on the device: a hybrid's state slots reach the workers with each."""
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    prompts = [prompt_ids(5), prompt_ids(7, offset=11)]
    assert compare(engines, prompts, params, scale_by_logits=True) == 9


def test_a_preempted_hybrid_sequence_resumes_as_in_one_process(engines) -> None:
    single, parallel = engines
    if single.scheduler.state_slots is None:
        pytest.skip("a hybrid model's test")
    preempted = parallel.scheduler.num_preemptions
    # Seven tokens: the tiny MoE's eighth step here is ill-conditioned (weights perturbed by
    # 1e-7 of themselves move its logits by 3e-4, ten times any other step's), past 1e-5.
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, logprobs=1)
    prompts = [prompt_ids(30), prompt_ids(21, offset=40), prompt_ids(12, offset=90)]
    compare(engines, prompts, params, scale_by_logits=True)
    assert parallel.scheduler.num_preemptions > preempted, "the pool is meant to force it"
    assert parallel.scheduler.state_slots.num_free == 3


def _gemma4_config(checkpoints: dict[str, Path]) -> ModelConfig:
    return ModelConfig.from_model_dir(checkpoints["gemma4-tp"])


def test_each_gemma4_rank_holds_its_share_of_every_layers_own_heads(checkpoints) -> None:
    """Windowed layers (4 query heads of 16, 2 KV heads) and global ones (4 of 32, 2 KV heads,
    values the keys, no v rows), the KV-shared last two (q rows only), double-wide MLPs, the
    per-layer table split by vocabulary: each rank's shapes, and its rows the whole model's."""
    config = _gemma4_config(checkpoints)
    whole = load_model(checkpoints["gemma4-tp"])
    for rank in range(2):
        model = load_model(checkpoints["gemma4-tp"], shard=ShardPlan.for_model(config, rank, 2))
        for i, layer in enumerate(model.layers):
            attn, head_dim = layer.self_attn, config.head_dim_of(i)
            assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (2, 1, head_dim)
            kv_rows = {0: 0, 1: head_dim, 2: 2 * head_dim}[
                0 if config.kv_source_of(i) != i else 1 if config.values_are_keys(i) else 2
            ]
            assert attn.qkv_proj.weight.shape == (2 * head_dim + kv_rows, config.hidden_size)
            assert attn.o_proj.weight.shape == (config.hidden_size, 2 * head_dim)
            half = config.intermediate_size_of(i) // 2
            assert layer.mlp.gate_up_proj.weight.shape == (2 * half, config.hidden_size)
            q_rows = slice(rank * 2 * head_dim, (rank + 1) * 2 * head_dim)
            whole_q = whole.layers[i].self_attn.qkv_proj.weight[: 4 * head_dim]
            assert torch.equal(attn.qkv_proj.weight[: 2 * head_dim], whole_q[q_rows])
        rows = config.per_layer_vocab_size // 2
        table = model.embed_tokens_per_layer.weight
        expected = whole.embed_tokens_per_layer.weight[rank * rows : (rank + 1) * rows]
        assert torch.equal(table, expected)
        assert torch.equal(  # replicated
            model.per_layer_model_projection.weight, whole.per_layer_model_projection.weight
        )
    assert {config.head_dim_of(i) for i in range(config.num_layers)} == {16, 32}


def test_each_gemma4_rank_holds_half_the_experts_beside_the_mlp(checkpoints) -> None:
    """Experts 3r .. 3r + 2 of six, the router and its scales whole."""
    model_dir = checkpoints["gemma4-moe-tp"]
    config = ModelConfig.from_model_dir(model_dir)
    whole = dict(load_model(model_dir).named_parameters())
    for rank in range(2):
        model = load_model(model_dir, shard=ShardPlan.for_model(config, rank, 2))
        num_checked = 0
        for name, param in model.named_parameters():
            if ".moe.experts." in name:
                assert torch.equal(param, whole[name][3 * rank : 3 * rank + 3]), name
                num_checked += 1
            elif ".moe.gate." in name:
                assert torch.equal(param, whole[name]), name
        assert num_checked == 2 * config.num_layers


def test_each_hybrid_rank_holds_its_heads_of_q_k_v_and_of_the_state(checkpoints) -> None:
    """in_proj: this rank's key head of q and of k, its two value heads of v, then of z, b
    and a; the convolution's channels with them; A_log, dt_bias by value head; out_proj by
    columns; the recurrent state of its heads only (half the bytes per slot)."""
    model_dir = checkpoints["qwen3.5"]
    config = ModelConfig.from_model_dir(model_dir)
    linear = config.linear_attention
    whole = load_model(model_dir)
    whole_la = whole.layers[0].linear_attn
    k, v, hv = linear.key_size, linear.value_size, linear.num_value_heads
    for rank in range(2):
        model = load_model(model_dir, shard=ShardPlan.for_model(config, rank, 2))
        la = model.layers[0].linear_attn
        share = model.linear_attention
        assert (share.num_key_heads, share.num_value_heads) == (1, 2)
        assert state_bytes_per_slot(share, torch.float32) * 2 == state_bytes_per_slot(
            linear, torch.float32
        )

        qkv = [_half(rank, 0, k), _half(rank, k, k), _half(rank, 2 * k, v)]
        end = 2 * k + v
        zba = [_half(rank, end, v), _half(rank, end + v, hv), _half(rank, end + v + hv, hv)]
        expected = torch.cat([whole_la.in_proj.weight[rows] for rows in qkv + zba])
        assert torch.equal(la.in_proj.weight, expected)
        conv = torch.cat([whole_la.conv1d.weight[rows] for rows in qkv])
        assert torch.equal(la.conv1d.weight, conv)
        assert torch.equal(la.A_log, whole_la.A_log[_half(rank, 0, hv)])
        assert torch.equal(la.dt_bias, whole_la.dt_bias[_half(rank, 0, hv)])
        assert torch.equal(la.out_proj.weight, whole_la.out_proj.weight[:, _half(rank, 0, v)])
        assert torch.equal(la.norm.weight, whole_la.norm.weight)  # per head dim: whole
        states = allocate_states(share, 3, torch.float32, "cpu")
        assert states[0].delta.shape == (3, 2, linear.key_head_dim, linear.value_head_dim)
        assert states[0].conv.shape == (3, share.conv_dim, linear.conv_kernel_size - 1)


def _half(rank: int, start: int, size: int) -> slice:
    """Rank `rank`'s half of `size` rows from `start`."""
    return slice(start + rank * size // 2, start + (rank + 1) * size // 2)


@pytest.mark.parametrize(
    ("variant", "size", "named"),
    [
        ("gemma4", 2, r"does not divide the model's key-value heads of layer 1 \(1\)"),
        ("gemma4-tp", 4, r"does not divide the model's num_key_value_heads \(2\)"),
    ],
)
def test_a_head_count_that_does_not_divide_is_refused_by_name(
    tmp_path: Path, variant: str, size: int, named: str
) -> None:
    """Gemma 4's one global KV head; its windowed layers' two at four ranks."""
    model_dir = save_checkpoint(build_hf_model(variant), tmp_path)
    with pytest.raises(EngineConfigError, match=named):
        verify_divisible(ModelConfig.from_model_dir(model_dir), size)


def test_linear_attention_heads_that_do_not_divide_are_refused_by_name(checkpoints) -> None:
    config = ModelConfig.from_model_dir(checkpoints["qwen3.5"])
    linear = dataclasses.replace(config.linear_attention, num_key_heads=1)
    with pytest.raises(EngineConfigError, match=r"the model's linear_num_key_heads \(1\)"):
        verify_divisible(dataclasses.replace(config, linear_attention=linear), 2)


def test_block_scaled_fp8_linear_attention_inputs_are_refused_under_tensor_parallelism(
    checkpoints,
) -> None:
    """Their block grid would need a rank's three ranges of rows too (not built)."""
    plan = ShardPlan.for_model(ModelConfig.from_model_dir(checkpoints["qwen3.5"]), 1, 2)
    scales = torch.ones(1, 1)
    with pytest.raises(ModelLoadError, match=r"block-scaled FP8 linear-attention input"):
        plan.grouped_part("model.layers.0.linear_attn.in_proj_qkv.weight_scale_inv", scales)
    with pytest.raises(ModelLoadError, match=r"has 3 rows; the config's linear attention has 64"):
        plan.grouped_part("model.layers.0.linear_attn.conv1d.weight", torch.ones(3, 1, 4))

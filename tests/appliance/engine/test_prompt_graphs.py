"""The prompt graphs' split of the forward pass (appliance.engine.prompt_graphs), on the CPU.

Capturing needs a GPU (test_prompt_graphs_gpu.py); what decides whether the pieces are right
does not: the forward pass run with every attention layer's ops wrapped hands each attention
call, with what it reads (caches, scale, window, FP8 scales, sinks), to the split, in layer
order. Here the split does what a replay does between two pieces, the recorded call run on the
step's own metadata into the static output buffer, and the result must be the plain forward's,
for a Llama shape and a Mistral one (a window on every layer), over a cache in the model's dtype
and an FP8 one, with the reference kernels, on a step mixing a decode row, a prompt and the
extension of a cached one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kernels.reference
from appliance.engine.engine import Engine
from appliance.engine.engine_config import EngineConfig
from appliance.engine.models.config import ModelConfig
from appliance.engine.models.loader import build_model, fill_randomly
from appliance.engine.prompt_graphs import PromptGraphs
from kernels.ops import AttentionMetadata
from tests.appliance.engine.random_llama import llama_shape

_SHAPE = llama_shape(
    hidden_size=64, intermediate_size=128, vocab_size=256, max_position_embeddings=256
)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("window", [None, 5], ids=["llama", "mistral-window"])
def test_each_recorded_attention_call_run_between_the_pieces_gives_the_plain_forward(
    kv_cache_dtype: str, window: int | None
) -> None:
    shape = dict(_SHAPE)
    if window is not None:
        shape |= {"architectures": ["MistralForCausalLM"], "sliding_window": window}
    config = ModelConfig.from_dict(shape)
    model = build_model(
        config, dtype=torch.float32, device="cpu", ops=kernels.reference, shard=None
    )
    fill_randomly(model, 0)
    model.init_rope_tables(256)
    engine = Engine.build(
        EngineConfig(
            model_dir=Path("random-model"),
            device="cpu",
            max_model_len=256,
            num_kv_blocks=16,
            kv_cache_dtype=kv_cache_dtype,
        ),
        model,
        tokenizer=None,
    )
    runner = engine.runner
    # A decode row (9 tokens cached), a 7-token prompt and a 4-token extension of 3 cached
    # tokens, one cache block each: a mixed step of 12 tokens, padded to 16 as a replay pads it.
    block = engine.block_manager.block_size
    seq_lens, query_lens = [10, 7, 7], [1, 7, 4]
    positions = torch.tensor([9, *range(7), *range(3, 7)])
    rows = torch.tensor([0] + [1] * 7 + [2] * 4)
    meta = AttentionMetadata.build(
        rows * block + positions,
        torch.arange(3, dtype=torch.int32)[:, None],
        seq_lens=seq_lens,
        query_lens=query_lens,
    )
    input_ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(3))
    # The cached tokens' keys and values: the same random ones for both passes.
    generator = torch.Generator().manual_seed(4)
    initial = [torch.randn(c.shape, generator=generator).to(c.dtype) for c in runner.kv_caches]
    for cache, values in zip(runner.kv_caches, initial, strict=True):
        cache.copy_(values)
    with torch.inference_mode():
        expected = model(input_ids, positions, runner.kv_caches, meta)
        for cache, values in zip(runner.kv_caches, initial, strict=True):
            cache.copy_(values)

        stream = None  # nothing is captured here
        graphs = PromptGraphs(model, runner.kv_caches, (0, 0), stream)  # type: ignore[arg-type]
        size = 16
        graphs._allocate(size)
        graphs._input_ids[:12] = input_ids
        graphs._positions[:12] = positions
        graphs._slots[:12] = meta.slot_mapping
        calls = []

        def replay_attention(q: torch.Tensor, call) -> torch.Tensor:
            """What `PromptGraphs.run` does between two pieces."""
            calls.append(call)
            graphs._q[:size].copy_(q)
            call.run(graphs._q[:12], meta, graphs._out[:12])
            return graphs._out[:size]

        hidden = graphs._forward(size, replay_attention)

    torch.testing.assert_close(hidden[:12], expected, atol=1e-5, rtol=1e-5)
    attentions = model.attentions
    assert len(calls) == len(attentions)
    for call, attention, cache in zip(calls, attentions, runner.kv_caches, strict=True):
        assert call.k_cache.data_ptr() == cache[0].data_ptr()
        assert call.v_cache.data_ptr() == cache[1].data_ptr()
        assert call.sliding_window == window
        assert call.k_scale is attention.k_scale and call.v_scale is attention.v_scale
        assert call.ops is kernels.reference
    # The wrapping is gone after the pass.
    assert all(a.ops is kernels.reference for a in attentions)

"""The prompt graphs' forward pass over their static buffers (appliance.engine.prompt_graphs),
on the CPU.

Capturing needs a GPU (test_prompt_graphs_gpu.py); what decides whether a replay is right does
not: the step's inputs and metadata staged into the static buffers (`_stage`, what a replay
does before it replays), padded to the captured size and to `max_seqs` sequences, and the
forward pass the graph records (`_forward`: the longest query taken as the padded size, a mixed
step's decode rows counted on the device for the decode kernel) must give the plain forward's
hidden states. Attention is the Triton kernels' (in the interpreter), every other op the
reference's; a Llama shape and a Mistral one (a window on every layer), a cache in the model's
dtype and an FP8 one; a step mixing a decode row, a prompt and the extension of a cached one.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

import kernels.reference
from appliance.engine.engine import Engine
from appliance.engine.engine_config import EngineConfig
from appliance.engine.models.config import ModelConfig
from appliance.engine.models.loader import build_model, fill_randomly
from appliance.engine.prompt_graphs import PromptGraphs
from kernels import triton_ops
from kernels.ops import AttentionMetadata
from tests.appliance.engine.random_llama import llama_shape

_SHAPE = llama_shape(
    hidden_size=64, intermediate_size=128, vocab_size=256, max_position_embeddings=256
)


# The reference kernels, but the GPU backend's attention: only it reads the metadata from device
# memory, as a captured graph must.
_OPS = types.SimpleNamespace(
    **{**vars(kernels.reference), "paged_attention": triton_ops.paged_attention}
)


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="Triton's interpreter on CPU tensors; test_prompt_graphs_gpu.py replays on the GPU",
)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("window", [None, 5], ids=["llama", "mistral-window"])
def test_a_step_staged_into_the_padded_static_buffers_gives_the_plain_forward(
    kv_cache_dtype: str, window: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    shape = dict(_SHAPE)
    if window is not None:
        shape |= {"architectures": ["MistralForCausalLM"], "sliding_window": window}
    config = ModelConfig.from_dict(shape)
    model = build_model(config, dtype=torch.float32, device="cpu", ops=_OPS, shard=None)
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
        # Nothing is captured here: no pool, no stream. Room for 20 sequences of 4 blocks, of
        # which a step of 16 tokens can hold only 16: attention's grid spans those.
        graphs = PromptGraphs(
            model, runner.kv_caches, (0, 0), None, max_seqs=20, max_blocks_per_seq=4
        )  # type: ignore[arg-type]
        graphs._allocate(16)
        graphs.sizes = [8, 16]
        size = graphs._stage(input_ids, positions, meta, (0, 3, 0, 12))
        counts = []  # the device count each decode-kernel launch was given
        decode = triton_ops.paged_decode_attention
        monkeypatch.setattr(
            triton_ops,
            "paged_decode_attention",
            lambda *a, **kw: counts.append(kw["num_rows"]) or decode(*a, **kw),
        )
        hidden = graphs._forward(size)
        assert counts and all(c is graphs._num_decodes for c in counts)
        assert size == 16
        torch.testing.assert_close(hidden[:12], expected, atol=1e-5, rtol=1e-5)
        # Padding: no KV written for rows 12..15, no sequence past the third attended.
        assert graphs._slots[12:].eq(-1).all()
        assert graphs._seq_lens.tolist() == [10, 7, 7] + [0] * 17
        assert graphs._query_start_loc.tolist() == [0, 1, 8] + [12] * 18
        assert graphs._num_decodes.tolist() == [1]  # the decode row, for the decode kernel

        # The same step in two pieces, as a step longer than every size replays: the decode
        # row with the prompt (8 tokens), then the extension (4, its query starts counted
        # from its first token), on the cache as it was.
        for cache, values in zip(runner.kv_caches, initial, strict=True):
            cache.copy_(values)
        pieces = []
        for piece in [(0, 2, 0, 8), (2, 3, 8, 12)]:
            size = graphs._stage(input_ids, positions, meta, piece)
            pieces.append(graphs._forward(size)[: piece[3] - piece[2]].clone())
            assert graphs._seq_lens.tolist()[:3] == [*seq_lens[piece[0] : piece[1]], 0, 0][:3]
            assert graphs._num_decodes.tolist() == [1 if piece[0] == 0 else 0]
        assert graphs._query_start_loc.tolist()[:3] == [0, 4, 4]
        torch.testing.assert_close(torch.cat(pieces), expected, atol=1e-5, rtol=1e-5)


def _graphs(sizes: list[int], max_seqs: int) -> PromptGraphs:
    """Prompt graphs with `sizes` captured, as far as `pieces` reads them (nothing allocated)."""
    graphs = PromptGraphs(None, [], (0, 0), None, max_seqs=max_seqs, max_blocks_per_seq=1)  # type: ignore[arg-type]
    graphs.sizes = sizes
    return graphs


def test_a_step_longer_than_every_size_replays_in_pieces_of_whole_sequences() -> None:
    graphs = _graphs([128, 256, 384, 512, 640], max_seqs=256)
    decodes = [1] * 46
    # W3's steps: a 512-token prompt beside 46 decode rows fits the largest size; two or three
    # take a piece each, the decode rows going with the first.
    assert graphs.pieces([*decodes, 512]) == [(0, 47, 0, 558)]
    assert graphs.pieces([*decodes, 512, 512]) == [(0, 47, 0, 558), (47, 48, 558, 1070)]
    assert graphs.pieces([*decodes, 512, 300, 200, 512]) == [
        (0, 47, 0, 558),
        (47, 49, 558, 1058),
        (49, 50, 1058, 1570),
    ]
    assert graphs.pieces([640] * 4) == [(i, i + 1, 640 * i, 640 * (i + 1)) for i in range(4)]


@pytest.mark.parametrize(
    "query_lens",
    [
        [641],  # a sequence longer than every size
        [300, 700],
        [600, 100],  # a piece of 100 tokens would read all the weights for little work
        [400] * 6,  # six pieces (2,400 tokens)
        [8192],  # W2's prompt steps
    ],
)
def test_a_step_runs_eagerly_when_its_pieces_would_be_too_long_too_short_or_too_many(
    query_lens: list[int],
) -> None:
    assert _graphs([128, 256, 384, 512, 640], max_seqs=256).pieces(query_lens) is None


def test_pieces_respect_the_sequences_a_size_holds_and_the_sizes_captured_so_far() -> None:
    # Five sequences of 150 tokens: 750 would fit two sizes, but a replay holds 3 sequences.
    assert _graphs([512, 640], max_seqs=3).pieces([150] * 5) == [(0, 3, 0, 450), (3, 5, 450, 750)]
    # Nothing captured yet: every step runs eagerly.
    assert _graphs([], max_seqs=256).pieces([1]) is None
    # Only the largest captured so far (captures run largest first).
    assert _graphs([640], max_seqs=256).pieces([100, 200]) == [(0, 2, 0, 300)]

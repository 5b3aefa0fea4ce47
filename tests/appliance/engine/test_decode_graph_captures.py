"""Which decode graphs `DecodeGraphs.captures` hands out, and in what order, on the CPU.

Capturing needs a GPU (test_greedy_graphs_gpu.py, test_idle_captures_gpu.py); the list of
captures does not. Its order is what the shared pool needs (largest first, so each smaller
graph reuses what the largest took), and `only_largest` is what the memory profile captures to
measure that pool before the KV pool is sized: it must hold the largest graph of each kind,
since the largest greedy graph's [rows, vocab] logits can need more than the largest plain
graph (a small model's big vocabulary).
"""

from __future__ import annotations

import pytest
import torch

import kernels.reference
from appliance.engine.cuda_graphs import GREEDY_MAX_BATCH, DecodeGraphs, batch_size_ladder
from appliance.engine.models.config import ModelConfig
from appliance.engine.models.loader import build_model
from tests.appliance.engine.random_llama import llama_shape


@pytest.fixture(scope="module")
def model():
    config = ModelConfig.from_dict(llama_shape(hidden_size=64, intermediate_size=128))
    return build_model(config, dtype=torch.float32, device="cpu", ops=kernels.reference, shard=None)


def _graphs(model, *, greedy: bool) -> DecodeGraphs:
    # Nothing is captured here: no pool, no stream.
    return DecodeGraphs(
        model,
        [],
        4,
        lambda batch: 1,
        greedy_tail=(lambda hidden, out: None) if greedy else None,
        pool=(0, 0),
        stream=None,  # type: ignore[arg-type]
    )


def _listed(captures) -> list[tuple[str, int]]:
    return [(capture.func.__name__, *capture.args) for capture in captures]


@pytest.mark.parametrize("max_batch", [64, GREEDY_MAX_BATCH, 200])
def test_every_size_is_captured_largest_first_plain_then_greedy(model, max_batch) -> None:
    ladder = batch_size_ladder(max_batch)
    listed = _listed(_graphs(model, greedy=True).captures(max_batch))
    greedy = [size for size in ladder if size <= GREEDY_MAX_BATCH]
    assert listed == [("_capture_plain", size) for size in reversed(ladder)] + [
        ("_capture_greedy", size) for size in reversed(greedy)
    ]


@pytest.mark.parametrize("max_batch", [64, 200])
def test_the_memory_profile_captures_the_largest_graph_of_each_kind(model, max_batch) -> None:
    listed = _listed(_graphs(model, greedy=True).captures(max_batch, only_largest=True))
    assert listed == [
        ("_capture_plain", max_batch),
        ("_capture_greedy", min(max_batch, GREEDY_MAX_BATCH)),
    ]


def test_a_model_without_greedy_graphs_gets_plain_captures_only(model) -> None:
    graphs = _graphs(model, greedy=False)
    assert _listed(graphs.captures(64, only_largest=True)) == [("_capture_plain", 64)]
    assert {name for name, _ in _listed(graphs.captures(64))} == {"_capture_plain"}

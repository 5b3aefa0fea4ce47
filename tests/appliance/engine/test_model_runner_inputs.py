"""A step's inputs as `ModelRunner` prepares them: every integer input in one host-to-device
copy, each a view of it, with the values the kernels read, and each view 16-byte aligned (Triton
compiles another variant of a kernel for a pointer that is not: mid-serving, seconds)."""

from __future__ import annotations

import torch

from appliance.engine.model_runner import ModelRunner
from appliance.engine.models.config import ModelConfig
from appliance.engine.models.decoder import CausalLM
from appliance.engine.sampling_params import SamplingParams
from appliance.engine.scheduler import ScheduledChunk
from appliance.engine.sequence import RequestId, Sequence
from tests.appliance.engine.test_warmup import TINY_LLAMA

BLOCK = 4


def _sequence(name: str, num_tokens: int, blocks: list[int]) -> Sequence:
    seq = Sequence(RequestId(name), list(range(100, 100 + num_tokens)), SamplingParams(), 0)
    seq.block_table = blocks
    return seq


def test_a_mixed_steps_inputs_are_aligned_views_with_the_kernels_values():
    with torch.device("meta"):
        model = CausalLM(ModelConfig.from_dict(TINY_LLAMA))
    runner = ModelRunner(model, BLOCK, "cpu", max_model_len=64)
    decode = _sequence("d", 7, [5, 9])  # its 7th token decoded: position 6, block 9 slot 2
    prefill = _sequence("p", 5, [3, 1])  # a prompt of 5 (odd lengths: unaligned ends)
    chunks = [ScheduledChunk.of(decode, 6, 1), ScheduledChunk.of(prefill, 0, 5)]
    batch = runner._prepare(chunks, None)
    meta = batch.meta
    tensors = {
        "input_ids": (batch.input_ids, [106, 100, 101, 102, 103, 104]),
        "positions": (batch.positions, [6, 0, 1, 2, 3, 4]),
        "slots": (meta.slot_mapping, [9 * BLOCK + 2, 12, 13, 14, 15, 4]),
        "block_tables": (meta.block_tables, [[5, 9], [3, 1]]),
        "seq_lens": (meta.seq_lens_t, [7, 5]),
        "query_start_loc": (meta.query_start_loc, [0, 1, 6]),
    }
    storages = {t.untyped_storage().data_ptr() for t, _ in tensors.values()}
    assert len(storages) == 1, "one buffer, so one copy to the device"
    for name, (tensor, expected) in tensors.items():
        assert tensor.tolist() == expected, name
        assert tensor.storage_offset() * tensor.element_size() % 16 == 0, f"{name} unaligned"
    assert meta.num_leading_decodes == 1 and not meta.decode_only

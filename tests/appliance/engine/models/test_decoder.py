"""The decoder layer leaves a decode row's pre-norms to the projections after them
(`DecoderLayer._pre_norm`, `KernelOps.rms_norm_linear`): end to end through the engine on the
GPU path's kernels (Triton's interpreter here, float32), a batch-1 greedy decode gives the tokens
it gives with each norm a kernel of its own, and transformers' tokens, its log-probabilities
within float32 noise of the unfused run's."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

import kernels.triton_ops
from appliance.engine.engine import Engine, EngineConfig
from appliance.engine.models.loader import load_model
from appliance.engine.outputs import TokenLogprob
from appliance.engine.sampling_params import SamplingParams

from .test_architectures import _hf_greedy, _prompts

ATOL = 1e-4  # as test_architectures': far above float32 noise here
NUM_NEW = 3
NUM_TOP = 5
RECORDED = ("rms_norm_linear", "add_rms_norm")


def _recording_triton_ops() -> tuple[SimpleNamespace, Counter[tuple[str, int]]]:
    """kernels.triton_ops, counting the calls of `RECORDED` by (name, rows of x)."""
    calls: Counter[tuple[str, int]] = Counter()
    ops = {name: getattr(kernels.triton_ops, name) for name in kernels.triton_ops.__all__}

    def recording(name: str):
        def call(x: torch.Tensor, *args: object) -> object:
            calls[name, x.shape[0]] += 1
            return ops[name](x, *args)

        return call

    return SimpleNamespace(**ops | {name: recording(name) for name in RECORDED}), calls


def _greedy(engine: Engine, prompt: list[int]) -> tuple[list[int], list[TokenLogprob]]:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=NUM_TOP)
    engine.add_request("r0", prompt, params)
    tokens: list[int] = []
    logprobs: list[TokenLogprob] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.token_ids
            logprobs += out.logprobs or []
    return tokens, logprobs


# Llama's pre-norm blocks; Qwen2's qkv bias; Gemma 3's sandwich norms (the MLP's own pre-norm
# fused, the post-norms kernels) and `1 + w` weights.
@pytest.mark.parametrize("variant", ["llama3.1", "qwen2", "gemma3"])
def test_batch_1_decode_with_the_norms_in_the_projections_matches_it_without(
    tiny_checkpoints, variant: str
) -> None:
    model_dir, hf_model = tiny_checkpoints(variant)
    ops, calls = _recording_triton_ops()
    model = load_model(model_dir, ops=ops)
    config = EngineConfig(model_dir=model_dir, num_kv_blocks=8, block_size=16, max_num_seqs=1)
    prompt = _prompts((9,), seed=7)[0]
    runs, counted = {}, {}
    for fused in (True, False):
        model.set_pre_norm_fusion(fused)
        calls.clear()
        runs[fused] = _greedy(Engine.build(config, model, None), prompt)
        counted[fused] = calls.copy()

    (tokens, logprobs), (unfused_tokens, unfused_logprobs) = runs[True], runs[False]
    assert tokens == unfused_tokens == _hf_greedy(hf_model, prompt, NUM_NEW)
    for ours, theirs in zip(logprobs, unfused_logprobs, strict=True):
        assert abs(ours.logprob - theirs.logprob) <= ATOL
        assert [t for t, _ in ours.top] == [t for t, _ in theirs.top]
        assert max(abs(a - b) for (_, a), (_, b) in zip(ours.top, theirs.top, strict=True)) <= ATOL
    # Each one-row step (the NUM_NEW - 1 decodes after the prefill's token): every layer's two
    # pre-norms in its projections, only the final norm a kernel of its own; the prefill's rows
    # and the unfused run never take the fused path.
    one_row = {name: n for (name, rows), n in counted[True].items() if rows == 1}
    num_decodes = NUM_NEW - 1
    assert one_row == {
        "rms_norm_linear": 2 * model.config.num_layers * num_decodes,
        "add_rms_norm": num_decodes,
    }
    assert all(name != "rms_norm_linear" for name, rows in counted[True] if rows > 1)
    assert all(name != "rms_norm_linear" for name, _ in counted[False])

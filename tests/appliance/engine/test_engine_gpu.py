"""The GPU path (Triton kernels, CUDA graphs) against transformers on the embedded model.

float32: the same greedy token-for-token equality as the CPU path. bfloat16: greedy tokens are
not comparable (a bf16 rounding flips near-ties), so prompt log-probabilities are compared with
transformers' float32 log-softmax instead. bf16 keeps 8 significant bits, so each of the 30
layers perturbs activations by ~0.4% relative; on this model that moves log-probabilities by a
few hundredths on average: the mean absolute difference must stay below 0.05 and the worst
below 0.5 nats, a bound that a wrong kernel (wrong mask, wrong head mapping, stale KV) exceeds
by orders of magnitude.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from appliance.engine.engine import Engine, EngineConfig
from appliance.engine.sampling_params import SamplingParams

from .test_engine_vs_transformers import NUM_NEW_TOKENS

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def prompts(smollm2_dir: Path) -> list[list[int]]:
    from appliance.engine.tokenizer import Tokenizer

    from .test_engine_vs_transformers import CHAT_QUESTIONS, PLAIN_PROMPTS, _chat_ids

    tok = Tokenizer.from_model_dir(smollm2_dir)
    plain = [tok.encode(p, add_special_tokens=True) for p in PLAIN_PROMPTS]
    return plain + [_chat_ids(tok, q) for q in CHAT_QUESTIONS]


@pytest.fixture(scope="module")
def hf_cuda(smollm2_dir: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    return model.to("cuda").eval()


def _gpu_engine(model_dir: Path, dtype: str, **overrides) -> Engine:
    config = EngineConfig(
        model_dir=model_dir, device="cuda", dtype=dtype, max_model_len=1024, **overrides
    )
    return Engine.from_config(config)


@torch.inference_mode()
def _reference(hf_cuda, prompts: list[list[int]]) -> list[list[int]]:
    ref = []
    for p in prompts:
        out = hf_cuda(torch.tensor([p], device="cuda"), use_cache=True)
        ids: list[int] = []
        for _ in range(NUM_NEW_TOKENS):
            ids.append(int(out.logits[0, -1].argmax()))
            out = hf_cuda(
                torch.tensor([[ids[-1]]], device="cuda"),
                past_key_values=out.past_key_values,
                use_cache=True,
            )
        ref.append(ids)
    return ref


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # one batch, decode steps from CUDA graphs
        {"enable_cuda_graphs": False},
        {"num_kv_blocks": 12},  # preemption
        {"max_num_batched_tokens": 24, "enable_prefix_caching": False},  # chunked prefill
    ],
    ids=["graphs", "eager", "preemption", "chunked"],
)
def test_float32_greedy_on_gpu_matches_transformers(smollm2_dir, prompts, hf_cuda, overrides):
    engine = _gpu_engine(smollm2_dir, "float32", **overrides)
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    completions = engine.generate(prompts, greedy)
    assert [c.token_ids for c in completions] == _reference(hf_cuda, prompts)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    if "num_kv_blocks" in overrides:
        assert engine.scheduler.num_preemptions > 0


@torch.inference_mode()
def test_bfloat16_prompt_logprobs_agree_with_float32_transformers(smollm2_dir, prompts, hf_cuda):
    engine = _gpu_engine(smollm2_dir, "bfloat16", max_num_batched_tokens=40)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    ours: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                ours[out.request_id] = out.prompt_logprobs
    diffs = []
    for i, p in enumerate(prompts):
        ref = hf_cuda(torch.tensor([p], device="cuda")).logits[0].float().log_softmax(-1)
        for pos in range(1, len(p)):
            diffs.append(abs(ours[f"r{i}"][pos].logprob - ref[pos - 1, p[pos]].item()))
    diffs_t = torch.tensor(diffs)
    assert diffs_t.mean() < 0.05
    assert diffs_t.max() < 0.5

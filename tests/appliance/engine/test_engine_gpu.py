"""The GPU path (Triton kernels, CUDA graphs) against transformers on the embedded model.

float32: the same greedy token-for-token equality as the CPU path. bfloat16: greedy tokens are
not comparable (a bf16 rounding flips near-ties), so prompt log-probabilities are compared with
transformers' float32 log-softmax instead. The tolerance is transformers' own: bf16 keeps 8
significant bits, and rounding the weights and activations of 30 layers moves log-probabilities
by about 0.05 nats on average on this model whatever the kernels do. So our mean bf16 error must
be at most 10% (plus 0.005 nats) above the mean error of transformers' model cast to bf16, and
our worst position at most twice its worst (single positions are noisy: a different but equally
exact summation order moves one near-tie more than another). A wrong kernel (mask, head
mapping, stale KV) misses that by orders of magnitude; faithful kernels that accumulate in
float32 land at or below it.
"""

from __future__ import annotations

import copy
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
    # A modest share of the GPU, so an engine and transformers' model fit side by side.
    settings = {"gpu_memory_utilization": 0.3, **overrides}
    config = EngineConfig(
        model_dir=model_dir, device="cuda", dtype=dtype, max_model_len=1024, **settings
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
                cache=out.cache,
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
        {"max_decode_burst": 8},  # device-fed decode bursts through the graphs
        # The next step launched before the previous one is collected: input ids from the
        # device, host copies in pinned memory, one blocking event per step.
        {"async_scheduling": True, "max_num_batched_tokens": 24},
        {"async_scheduling": True, "max_decode_burst": 8, "num_kv_blocks": 12},
    ],
    ids=["graphs", "eager", "preemption", "chunked", "burst", "async", "async-burst-preemption"],
)
def test_float32_greedy_on_gpu_matches_transformers(smollm2_dir, prompts, hf_cuda, overrides):
    engine = _gpu_engine(smollm2_dir, "float32", **overrides)
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    completions = engine.generate(prompts, greedy)
    assert [c.token_ids for c in completions] == _reference(hf_cuda, prompts)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    if "num_kv_blocks" in overrides:
        assert engine.scheduler.num_preemptions > 0


def _prompt_logprob_errors(logprobs_of, prompts, reference) -> torch.Tensor:
    errors = []
    for i, p in enumerate(prompts):
        ours = logprobs_of(i, p)
        errors += [
            abs(ours[pos - 1] - reference[i][pos - 1, p[pos]].item()) for pos in range(1, len(p))
        ]
    return torch.tensor(errors)


@torch.inference_mode()
def test_bfloat16_prompt_logprobs_are_as_close_to_float32_as_transformers_bf16(
    smollm2_dir, prompts, hf_cuda
):
    engine = _gpu_engine(smollm2_dir, "bfloat16", max_num_batched_tokens=40)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    ours: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                ours[out.request_id] = out.prompt_logprobs

    def logits(model, p):
        return model(torch.tensor([p], device="cuda")).logits[0].float().log_softmax(-1)

    fp32 = [logits(hf_cuda, p) for p in prompts]
    hf_bf16 = copy.deepcopy(hf_cuda).to(torch.bfloat16)
    hf_bf16_lps = [logits(hf_bf16, p) for p in prompts]
    our_err = _prompt_logprob_errors(
        lambda i, p: [e.logprob for e in ours[f"r{i}"][1:]], prompts, fp32
    )
    hf_err = _prompt_logprob_errors(
        lambda i, p: [hf_bf16_lps[i][pos - 1, p[pos]].item() for pos in range(1, len(p))],
        prompts,
        fp32,
    )
    assert our_err.mean() <= 1.1 * hf_err.mean() + 0.005
    assert our_err.max() <= 2 * hf_err.max()

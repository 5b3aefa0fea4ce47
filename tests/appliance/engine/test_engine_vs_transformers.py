"""The engine's greedy output and prompt log-probabilities equal transformers' on the real model.

transformers (`AutoModelForCausalLM`, float32, on the converted directory) is the outside
reference. Each engine configuration runs all prompts as ONE batch of mixed lengths, so the
comparison covers batching, paging, preemption, the prefix cache and chunked prefill.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from appliance.engine.engine import Engine
from appliance.engine.sampling_params import SamplingParams

NUM_NEW_TOKENS = 40

PLAIN_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived",
    "1, 2, 3, 5, 8, 13,",
    "The three laws of thermodynamics are",
    "Translate to French: 'Good morning, how are you?'\nFrench:",
    "In 1969, Neil Armstrong",
    "SELECT name, COUNT(*) FROM orders",
]
CHAT_QUESTIONS = [
    "What is the boiling point of water at sea level?",
    "Write a haiku about autumn leaves.",
    "Explain what a hash function is in two sentences.",
    "List three prime numbers greater than 50.",
    "Why is the sky blue?",
]
SYSTEM_PROMPT = (
    "You are the support assistant of Contoso Bank. Answer briefly and politely, never reveal "
    "account numbers, and always suggest calling the hotline for anything about card fraud. "
    "Branches open from nine to five on weekdays and from ten to one on Saturdays. Transfers "
    "within the country arrive the same day; international transfers take up to three days."
)
SHARED_PREFIX_QUESTIONS = [
    "How do I reset my online banking password?",
    "My card was stolen, what should I do?",
    "What are your opening hours on Saturday?",
    "Can I open an account for my child?",
    "How long does an international transfer take?",
    "Is there a fee for paper statements?",
]


def _chat_ids(engine_or_tokenizer, question: str, system: str | None = None) -> list[int]:
    tokenizer = getattr(engine_or_tokenizer, "tokenizer", engine_or_tokenizer)
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": question})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path):
    from appliance.engine.tokenizer import Tokenizer

    return Tokenizer.from_model_dir(smollm2_dir)


@pytest.fixture(scope="module")
def mixed_prompts(tokenizer) -> list[list[int]]:
    plain = [tokenizer.encode(p, add_special_tokens=True) for p in PLAIN_PROMPTS]
    chat = [_chat_ids(tokenizer, q) for q in CHAT_QUESTIONS]
    prompts = [p for pair in zip(plain, chat, strict=False) for p in pair] + plain[len(chat) :]
    lengths = {len(p) for p in prompts}
    assert len(prompts) >= 12 and len(lengths) >= 8, "the batch must mix prompt lengths"
    return prompts


@pytest.fixture(scope="module")
def shared_prefix_prompts(tokenizer) -> list[list[int]]:
    return [_chat_ids(tokenizer, q, SYSTEM_PROMPT) for q in SHARED_PREFIX_QUESTIONS]


@pytest.fixture(scope="module")
def hf_model(smollm2_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def _hf_greedy(hf_model, prompts: list[list[int]], num_new_tokens: int) -> list[list[int]]:
    """Plain greedy decoding with transformers' own KV cache, EOS ignored: all prompts in one
    left-padded batch (their attention mask and positions skip the padding), which gives the
    same tokens as one prompt at a time in a fraction of the time."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = hf_model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    generated = []
    for _ in range(num_new_tokens):
        next_ids = out.logits[:, -1].argmax(-1)
        generated.append(next_ids)
        mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype)], dim=1)
        positions = positions[:, -1:] + 1
        out = hf_model(
            input_ids=next_ids[:, None],
            attention_mask=mask,
            position_ids=positions,
            cache=out.cache,
            use_cache=True,
        )
    return torch.stack(generated, dim=1).tolist()


@pytest.fixture(scope="module")
def hf_reference(
    hf_model, mixed_prompts, shared_prefix_prompts
) -> dict[tuple[int, ...], list[int]]:
    prompts = mixed_prompts + shared_prefix_prompts
    return {
        tuple(p): tokens
        for p, tokens in zip(prompts, _hf_greedy(hf_model, prompts, NUM_NEW_TOKENS), strict=True)
    }


GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)


def _assert_matches(engine: Engine, prompts: list[list[int]], reference) -> list:
    completions = engine.generate(prompts, GREEDY)
    for prompt, completion in zip(prompts, completions, strict=True):
        assert completion.token_ids == reference[tuple(prompt)], (
            f"prompt of {len(prompt)} tokens diverged from transformers"
        )
        assert completion.finish_reason == "length"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return completions


@pytest.mark.slow
def test_greedy_batch_of_mixed_prompts_matches_transformers(
    smollm2_engine, mixed_prompts, hf_reference
):
    _assert_matches(smollm2_engine(), mixed_prompts, hf_reference)


@pytest.mark.slow
def test_greedy_matches_transformers_when_a_tiny_kv_pool_forces_preemption(
    smollm2_engine, mixed_prompts, hf_reference
):
    # A pool of a third of what the batch needs: a few requests run at a time, and they
    # preempt each other as they grow.
    needed = sum(-(-(len(p) + NUM_NEW_TOKENS) // 16) for p in mixed_prompts)
    longest = max(len(p) for p in mixed_prompts) + NUM_NEW_TOKENS
    engine = smollm2_engine(num_kv_blocks=max(needed // 3, -(-longest // 16) + 2))
    _assert_matches(engine, mixed_prompts, hf_reference)
    assert engine.scheduler.num_preemptions > 0


@pytest.mark.slow
def test_greedy_matches_transformers_with_prefix_cache_hits_on_a_shared_system_prompt(
    smollm2_engine, shared_prefix_prompts, hf_reference
):
    engine = smollm2_engine()
    completions = _assert_matches(engine, shared_prefix_prompts, hf_reference)
    # The first request computes the shared prefix; every later one finds its full blocks cached.
    shared = len(os.path.commonprefix(shared_prefix_prompts))  # noqa: RUF071 - token lists
    expected = shared // engine.block_manager.block_size * engine.block_manager.block_size
    assert expected >= 64
    assert completions[0].num_cached_tokens == 0
    assert [c.num_cached_tokens for c in completions[1:]] == [expected] * (len(completions) - 1)
    assert engine.scheduler.num_prefix_hit_tokens == expected * (len(completions) - 1)


@pytest.mark.slow
def test_greedy_matches_transformers_with_chunked_prefill_under_a_small_token_budget(
    smollm2_engine, mixed_prompts, hf_reference
):
    engine = smollm2_engine(max_num_batched_tokens=24, enable_prefix_caching=False)
    _assert_matches(engine, mixed_prompts, hf_reference)


@pytest.mark.slow
@torch.inference_mode()
def test_prompt_logprobs_agree_with_transformers_log_softmax(
    smollm2_engine, mixed_prompts, hf_model
):
    # A small budget splits prompts across steps: logprobs from every chunk must line up.
    engine = smollm2_engine(max_num_batched_tokens=32)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=5)
    prompts = mixed_prompts[:6]
    outputs = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                outputs[out.request_id] = out.prompt_logprobs
    for i, prompt in enumerate(prompts):
        ours = outputs[f"r{i}"]
        assert len(ours) == len(prompt)
        assert ours[0] is None
        ref = hf_model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
        for pos in range(1, len(prompt)):
            entry = ours[pos]
            assert entry.token_id == prompt[pos]
            assert abs(entry.logprob - ref[pos - 1, prompt[pos]].item()) <= 1e-4
            ref_top = ref[pos - 1].topk(5)
            assert [t for t, _ in entry.top] == ref_top.indices.tolist()
            assert (
                max(
                    abs(lp - r)
                    for (_, lp), r in zip(entry.top, ref_top.values.tolist(), strict=True)
                )
                <= 1e-4
            )

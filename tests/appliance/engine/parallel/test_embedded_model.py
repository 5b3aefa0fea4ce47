"""The embedded model (SmolLM2-135M) on three CPU processes (gloo) gives the logits of one, in
float32, through chunked prefill, every prompt position and decode steps.

Within 1e-5 of the largest logit's magnitude, not 1e-5 absolute: splitting o_proj and down_proj
sums each output as partial sums added in another order than one matmul's, a rounding
difference (about 1e-7 relative per sum) that 30 layers grow to 2e-5..5e-5 on logits of
magnitude 17..33 (measured: at most 1.8e-6 of the largest logit)."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.engine.sampling_params import SamplingParams
from appliance.engine.tokenizer import Tokenizer
from tests.appliance.engine.parallel.test_tensor_parallel import build_engine, compare


@pytest.mark.slow
def test_embedded_model_on_three_processes_matches_one(smollm2_dir: Path) -> None:
    """SmolLM2-135M has 9 query and 3 KV heads: it splits in 3, not 2."""
    tokenizer = Tokenizer.from_model_dir(smollm2_dir)
    settings = {"max_num_batched_tokens": 8, "num_kv_blocks": 32}
    single = build_engine(smollm2_dir, 1, tokenizer, **settings)
    parallel = build_engine(smollm2_dir, 3, tokenizer, **settings)
    try:
        prompt = tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
        # A prompt of more than 8 tokens: chunked prefill, then decode steps.
        assert len(prompt) > 8
        assert compare((single, parallel), [prompt], params, scale_by_logits=True) >= 4
    finally:
        parallel.close()

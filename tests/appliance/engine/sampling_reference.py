"""A plain per-request reference of the sampling controls, token by token, as vLLM's
documentation states them (min_tokens, logit_bias, then the repetition, frequency and presence
penalties), for the tests to compare the batched sampler against."""

from __future__ import annotations

from collections.abc import Collection

import torch

from appliance.engine.sampling_params import SamplingParams


def reference_controls(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt: list[int],
    output: list[int],
    eos_token_ids: Collection[int],
) -> torch.Tensor:
    """logits: [V] of the next token after `prompt` + `output` -> adjusted [V] (a copy)."""
    row = logits.clone()
    if len(output) < params.min_tokens:
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        for token_id in stops:
            row[token_id] = float("-inf")
    for token_id, bias in params.logit_bias:
        row[token_id] += bias
    if params.repetition_penalty != 1.0:
        for token_id in set(prompt) | set(output):
            if row[token_id] > 0:
                row[token_id] /= params.repetition_penalty
            else:
                row[token_id] *= params.repetition_penalty
    for token_id in set(output):
        row[token_id] -= params.frequency_penalty * output.count(token_id)
        row[token_id] -= params.presence_penalty
    return row

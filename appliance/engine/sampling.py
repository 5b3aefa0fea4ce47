"""Next-token selection and log-probabilities for a batch of rows, each with its own parameters.

Sampling uses the exponential race: `argmax(p / q)` with `q ~ Exp(1)` i.i.d. picks token i with
probability `p_i`, needs no cumulative sum or host synchronisation, and draws a fixed number of
random numbers per row, so a request with a seed gets the same tokens whatever else is batched.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from appliance.engine.sampling_params import SamplingParams

# Logits sampled at once (rows x vocabulary) when a batch is not all greedy. Filtering needs 22
# bytes per logit of temporaries (sorted values 4, their int64 order 8, two masks 2, probabilities
# 4, cumulative mass 4), drawing 9; in pieces of 2**23 logits (65 rows of Llama 3's 128,256)
# that stays under 200 MB at any batch size, where 512 rows at once needed over 2 GB. Every
# operation is per row, so the pieces change no result.
SAMPLING_CHUNK_LOGITS = 2**23


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    *,
    in_place: bool = True,
) -> torch.Tensor:
    """logits: [N, V] float32 -> chosen token ids [N] int64, left on the device.

    With `in_place`, OVERWRITES `logits` unless every row is greedy (temperature and filters
    are applied in place); without, each piece of rows is filtered in a copy of its own, so
    `logits` stays as it was for one piece's bytes more. Every decision that depends on the
    parameters is taken on the host from `params`, so nothing here waits for the device.
    """
    greedy_ids = greedy_tokens(logits)
    if all(p.greedy for p in params):
        return greedy_ids
    num_rows = max(1, SAMPLING_CHUNK_LOGITS // logits.shape[-1])
    pieces = []
    for start in range(0, len(params), num_rows):
        rows = slice(start, start + num_rows)
        if all(p.greedy for p in params[rows]):
            pieces.append(greedy_ids[rows])
        else:
            piece = logits[rows] if in_place else logits[rows].clone()
            pieces.append(_sample_rows(piece, params[rows], generators[rows]))
    sampled_ids = torch.cat(pieces)
    greedy = torch.tensor([p.greedy for p in params]).to(logits.device, non_blocking=True)
    return torch.where(greedy, greedy_ids, sampled_ids)


def _sample_rows(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """The exponential race over rows [R, V] of the caller's logits (overwritten) -> [R]."""
    device = logits.device
    temperature = torch.tensor(
        [p.temperature if not p.greedy else 1.0 for p in params], dtype=logits.dtype
    ).to(device, non_blocking=True)
    logits.div_(temperature[:, None])
    _apply_top_k_top_p(logits, params)
    probs = logits.softmax(dim=-1)
    min_p = [p.min_p for p in params]
    if any(min_p):
        threshold = torch.tensor(min_p).to(device, non_blocking=True)[:, None]
        probs.masked_fill_(probs < threshold * probs.amax(-1, keepdim=True), 0.0)
    q = torch.empty_like(probs).exponential_()
    for row, generator in enumerate(generators):
        if generator is not None:
            q[row].exponential_(generator=generator)
    return greedy_tokens(probs.div_(q))


def _apply_top_k_top_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Set to -inf, in place, every token outside each row's top-k and top-p nucleus."""
    vocab = logits.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    if all(k == vocab for k in top_k) and all(p >= 1.0 for p in top_p):
        return
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    device = logits.device
    rank = torch.arange(vocab, device=device)[None, :]
    drop = rank >= torch.tensor(top_k).to(device, non_blocking=True)[:, None]
    # In place: the top-p mask below only adds to the top-k one.
    probs = sorted_logits.masked_fill_(drop, float("-inf")).softmax(dim=-1)
    # Keep a token while the mass strictly before it is below top_p (so the top one always is).
    mass_before = probs.cumsum(dim=-1).sub_(probs)
    del probs
    drop |= mass_before >= torch.tensor(top_p).to(device, non_blocking=True)[:, None]
    del mass_before
    logits.scatter_(-1, order, sorted_logits.masked_fill_(drop, float("-inf")))


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of the model's raw distribution (before temperature or filtering),
    in pieces of SAMPLING_CHUNK_LOGITS (a [N, V] log-softmax would double the logits' bytes).

    logits: [N, V], token_ids: [N] -> (chosen [N], top ids [N, num_top], top logprobs [N, num_top])
    """
    num_rows = max(1, SAMPLING_CHUNK_LOGITS // logits.shape[-1])
    pieces = [
        _token_logprobs(
            logits[start : start + num_rows], token_ids[start : start + num_rows], num_top
        )
        for start in range(0, logits.shape[0], num_rows)
    ]
    if len(pieces) == 1:
        return pieces[0]
    chosen, top_ids, top_logprobs = zip(*pieces, strict=True)
    return torch.cat(chosen), torch.cat(top_ids), torch.cat(top_logprobs)


def _token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(-1, token_ids[:, None]).squeeze(-1)
    top_logprobs, top_ids = (
        logprobs.topk(num_top, dim=-1)
        if num_top
        else (
            logprobs[:, :0],
            token_ids[:, None][:, :0],
        )
    )
    return chosen, top_ids, top_logprobs


def greedy_tokens(rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, V] -> [N] int64, the first maximum of each row (written into `out` when given): the
    token `sample` picks for a greedy row, and what a decode graph samples greedily with. On a
    GPU, `kernels.argmax` spreads a row over many programs: torch reduces a row in one thread
    block, 28 µs of every batch-1 decode step over a 128k vocabulary on an H100."""
    if not rows.is_cuda:
        return torch.argmax(rows, dim=-1, out=out)
    from kernels.argmax import argmax_rows  # Triton: a CPU-only install has none

    return argmax_rows(rows if rows.stride(-1) == 1 else rows.contiguous(), out=out)

"""Sampling on synthetic logits: filters, seeds, and log-probabilities."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from appliance.engine.errors import InvalidRequestError
from appliance.engine.sampling import sample, token_logprobs
from appliance.engine.sampling_params import SamplingParams

VOCAB = 50


def _logits(rows: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _draw(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    row = logits[:1]
    return torch.stack([sample(row, [params], [generator])[0] for _ in range(n)])


def test_greedy_picks_the_argmax_of_every_row() -> None:
    logits = _logits()
    params = [SamplingParams(temperature=0.0)] * 4
    assert torch.equal(sample(logits, params, [None] * 4), logits.argmax(-1))


def test_top_k_one_is_greedy_at_any_temperature() -> None:
    logits = _logits()
    params = [SamplingParams(temperature=5.0, top_k=1)] * 4
    for _ in range(20):
        assert torch.equal(sample(logits, params, [None] * 4), logits.argmax(-1))


def test_top_k_never_samples_outside_the_k_best() -> None:
    logits = _logits()
    drawn = _draw(logits, SamplingParams(temperature=10.0, top_k=3), 300)
    assert set(drawn.tolist()) <= set(logits[0].topk(3).indices.tolist())
    assert len(set(drawn.tolist())) == 3


def test_top_p_keeps_the_smallest_nucleus_reaching_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    drawn = set(_draw(logits, SamplingParams(top_p=0.8), 400).tolist())
    # 0.5 + 0.3 reaches 0.8: tokens 2 and 3 are outside the nucleus.
    assert drawn == {0, 1}


def test_min_p_drops_tokens_below_the_fraction_of_the_best() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    drawn = set(_draw(logits, SamplingParams(min_p=0.5), 400).tolist())
    assert drawn == {0, 1}


def test_sampling_frequencies_follow_the_softmax() -> None:
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    drawn = _draw(torch.log(probs)[None], SamplingParams(temperature=1.0), 4000)
    freq = torch.bincount(drawn, minlength=4).float() / len(drawn)
    # 4000 draws: the standard error of each frequency is below 0.008.
    assert torch.allclose(freq, probs, atol=0.03)


def test_same_seed_gives_same_tokens_whatever_else_is_in_the_batch() -> None:
    logits = _logits(rows=3)
    params = SamplingParams(temperature=1.0, seed=7)
    alone = sample(logits[:1], [params], [torch.Generator().manual_seed(7)])
    gen = torch.Generator().manual_seed(7)
    batched = sample(
        logits, [params, SamplingParams(temperature=2.0), SamplingParams()], [gen, None, None]
    )
    assert batched[0] == alone[0]


def test_token_logprobs_are_the_raw_log_softmax_with_top_alternatives() -> None:
    logits = _logits()
    chosen_ids = torch.tensor([3, 1, 4, 1])
    chosen, top_ids, top_lps = token_logprobs(logits, chosen_ids, 5)
    ref = logits.log_softmax(-1)
    assert torch.allclose(chosen, ref.gather(-1, chosen_ids[:, None]).squeeze(-1))
    assert torch.equal(top_ids, ref.topk(5).indices)
    assert torch.allclose(top_lps, ref.topk(5).values)
    _, none_ids, none_lps = token_logprobs(logits, chosen_ids, 0)
    assert none_ids.shape == (4, 0) and none_lps.shape == (4, 0)


def test_token_logprobs_in_pieces_of_rows_are_those_of_the_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import appliance.engine.sampling as sampling

    logits, chosen_ids = _logits(rows=5), torch.tensor([3, 1, 4, 1, 5])
    whole = token_logprobs(logits, chosen_ids, 5)
    monkeypatch.setattr(sampling, "SAMPLING_CHUNK_LOGITS", 2 * VOCAB)
    for got, want in zip(token_logprobs(logits, chosen_ids, 5), whole, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"seed": -3}, "seed"),
        ({"stop": ("",)}, "stop"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"stop_token_ids": tuple(range(65))}, "stop_token_ids"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"logit_bias": ((3, 100.5),)}, "logit_bias"),
        ({"logit_bias": ((3, math.nan),)}, "logit_bias"),
        ({"logit_bias": ((-3, 1.0),)}, "logit_bias"),
        ({"logit_bias": ((3, 1.0), (3, 2.0))}, "logit_bias"),
        ({"logit_bias": tuple((t, 1.0) for t in range(301))}, "logit_bias"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -2.01}, "presence_penalty"),
        ({"presence_penalty": math.nan}, "presence_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ],
)
def test_bad_sampling_parameter_is_refused_naming_it(kwargs: dict, name: str) -> None:
    with pytest.raises(InvalidRequestError, match=repr(name)) as refused:
        SamplingParams(**kwargs)
    assert refused.value.param == name


def test_the_bounds_themselves_are_accepted() -> None:
    SamplingParams(
        max_tokens=5,
        min_tokens=5,
        stop_token_ids=tuple(range(64)),
        logit_bias=tuple((t, -100.0 if t % 2 else 100.0) for t in range(300)),
        frequency_penalty=-2.0,
        presence_penalty=2.0,
        repetition_penalty=1e-3,
    )


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"stop_token_ids": (3, VOCAB)}, "stop_token_ids"),
        ({"logit_bias": ((VOCAB, 1.0),)}, "logit_bias"),
    ],
)
def test_token_ids_outside_the_vocabulary_are_refused_naming_the_field(
    kwargs: dict, name: str
) -> None:
    params = SamplingParams(**kwargs)
    params.verify_token_ids(VOCAB + 1)
    with pytest.raises(InvalidRequestError, match=f"{name!r}.*outside the vocabulary") as refused:
        params.verify_token_ids(VOCAB)
    assert refused.value.param == name


def test_sampling_in_pieces_of_rows_gives_every_seeded_row_the_same_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import appliance.engine.sampling as sampling

    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.5, top_k=5, seed=1),
        SamplingParams(temperature=0.7, top_p=0.6, seed=2),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, min_p=0.2, seed=3),
        SamplingParams(temperature=2.0, top_k=10, top_p=0.9, min_p=0.05, seed=4),
    ]
    logits = _logits(rows=len(params), seed=5)

    def draw() -> torch.Tensor:
        generators = [torch.Generator().manual_seed(p.seed) if p.seed else None for p in params]
        return torch.stack([sample(logits.clone(), params, generators) for _ in range(30)])

    whole = draw()
    # Two rows per piece: pieces of sampled and greedy rows, one all greedy (rows 3 and 4).
    monkeypatch.setattr(sampling, "SAMPLING_CHUNK_LOGITS", 2 * VOCAB)
    assert torch.equal(draw(), whole)
    assert torch.equal(whole[:, [0, 3, 4]], logits[[0, 3, 4]].argmax(-1).expand(30, 3))


def test_the_sampler_filters_in_place_and_leaves_greedy_batches_untouched() -> None:
    logits = _logits()
    before = logits.clone()
    sample(logits, [SamplingParams(temperature=0.0)] * 4, [None] * 4)
    assert torch.equal(logits, before)
    sample(logits, [SamplingParams(temperature=0.5, top_k=3)] * 4, [None] * 4)
    # Divided by the temperature, all but each row's 3 best at -inf: nothing else was copied.
    assert torch.equal(torch.isfinite(logits).sum(-1), torch.full((4,), 3))
    kept = torch.isfinite(logits)
    assert torch.equal(logits[kept], (before / 0.5)[kept])
    # Told to keep them, it leaves them as they were and draws the same tokens.
    params = [SamplingParams(temperature=0.8, top_p=0.7, min_p=0.1, seed=9)] * 4

    def seeded() -> list[torch.Generator | None]:
        return [torch.Generator().manual_seed(9) for _ in range(4)]

    kept_ids = sample(before, params, seeded(), in_place=False)
    assert torch.equal(before, _logits())
    assert torch.equal(kept_ids, sample(before.clone(), params, seeded()))


def test_sampling_on_the_cpu_imports_no_triton() -> None:
    """A CPU-only install has no Triton (`./bootstrap demo` installs none): the serving path's
    modules and a sampled step must not import it. Run where importing it fails."""
    code = """
import sys
sys.modules["triton"] = None  # an import of it raises ImportError here
import torch
import appliance.app, appliance.engine.engine, appliance.engine.model_runner
from appliance.engine.sampling import sample
from appliance.engine.sampling_params import SamplingParams
params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=3)]
print(sample(torch.randn(2, 50), params, [None, None]).tolist())
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert len(json.loads(result.stdout)) == 2


@pytest.mark.gpu
def test_greedy_on_the_gpu_takes_logits_of_any_layout() -> None:
    """The GPU's argmax kernel reads rows with unit stride: a transposed view is copied first,
    not refused mid-step."""
    torch.manual_seed(0)
    logits = torch.randn(50, 4, device="cuda").t()  # [4, 50], stride (1, 4)
    params = [SamplingParams(temperature=0.0)] * 4
    assert torch.equal(sample(logits, params, [None] * 4), logits.argmax(dim=-1))

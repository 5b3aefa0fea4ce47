"""The batched sampling controls against a plain per-request reference, on random logits."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from appliance.engine.sampling_controls import SamplingControls
from appliance.engine.sampling_params import SamplingParams
from appliance.engine.sequence import RequestId, Sequence
from tests.appliance.engine.sampling_reference import reference_controls

VOCAB = 64
EOS = frozenset({0, 1})


def _to_device(values: list[int] | list[float] | np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    host = torch.from_numpy(values) if isinstance(values, np.ndarray) else torch.tensor(values)
    return host.to(dtype)


def _seq(params: SamplingParams, prompt: list[int], output: list[int]) -> Sequence:
    seq = Sequence(RequestId(f"r{random.random()}"), list(prompt), params, arrival=0)
    for token_id in output:
        seq.append_token(token_id)
    return seq


def _build(seqs: list[Sequence]) -> SamplingControls | None:
    return SamplingControls.build(seqs, EOS, VOCAB, _to_device)


def _reference(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    prompt = seq.token_ids[: seq.num_prompt_tokens]
    return reference_controls(logits, seq.params, prompt, seq.output_token_ids, EOS)


def _random_params(rng: random.Random) -> SamplingParams:
    """Each control present or absent at random (about one row in eight has none)."""

    def maybe(value):
        return value if rng.random() < 0.5 else None

    bias_ids = rng.sample(range(VOCAB), rng.randint(1, 5))
    chosen = {
        "min_tokens": maybe(rng.randint(1, 6)),
        "stop_token_ids": maybe(tuple(rng.sample(range(2, VOCAB), 2))),
        "ignore_eos": maybe(True),
        "logit_bias": maybe(tuple((t, rng.uniform(-100, 100)) for t in bias_ids)),
        "repetition_penalty": maybe(rng.choice([0.5, 1.3, 2.0])),
        "frequency_penalty": maybe(rng.uniform(-2, 2)),
        "presence_penalty": maybe(rng.uniform(-2, 2)),
    }
    return SamplingParams(max_tokens=32, **{k: v for k, v in chosen.items() if v is not None})


def _random_batch(seed: int, rows: int) -> tuple[torch.Tensor, list[Sequence]]:
    rng = random.Random(seed)
    seqs = []
    for _ in range(rows):
        params = SamplingParams() if rng.random() < 0.25 else _random_params(rng)
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))]
        # Few distinct output tokens, so that counts above one are common.
        output = [rng.randrange(8) for _ in range(rng.randint(0, 12))]
        seqs.append(_seq(params, prompt, output))
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 4
    return logits, seqs


def test_batched_controls_match_the_per_request_reference_on_random_batches() -> None:
    for seed in range(20):
        logits, seqs = _random_batch(seed, rows=9)
        controls = _build(seqs)
        if controls is None:
            assert all(_reference(logits[i], s).equal(logits[i]) for i, s in enumerate(seqs))
            continue
        got = controls.apply(logits)
        want = torch.stack([_reference(logits[i], s) for i, s in enumerate(seqs)])
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5, msg=f"seed {seed}")


def test_penalties_applied_in_pieces_of_rows_match_them_applied_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import appliance.engine.sampling_controls as sampling_controls

    batches = [_random_batch(seed, rows=9) for seed in range(20)]
    whole = [(logits, _build(seqs)) for logits, seqs in batches]
    monkeypatch.setattr(sampling_controls, "SAMPLING_CHUNK_LOGITS", 2 * VOCAB)
    for seed, ((logits, seqs), (_, controls)) in enumerate(zip(batches, whole, strict=True)):
        if controls is None:
            continue
        pieces = _build(seqs)
        assert pieces is not None
        assert torch.equal(pieces.apply(logits), controls.apply(logits)), f"seed {seed}"


def test_rows_without_controls_are_left_bit_for_bit_and_the_input_is_not_changed() -> None:
    logits, _ = _random_batch(0, rows=3)
    before = logits.clone()
    seqs = [
        _seq(SamplingParams(), [5, 6], [7]),
        _seq(SamplingParams(presence_penalty=1.0, logit_bias=((3, 5.0),)), [5, 6], [7]),
        _seq(SamplingParams(), [9], []),
    ]
    got = _build(seqs).apply(logits)
    assert torch.equal(logits, before), "apply works out of place: the raw logits stay"
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])
    assert not torch.equal(got[1], logits[1])


def test_a_batch_without_controls_builds_nothing() -> None:
    seqs = [_seq(SamplingParams(temperature=0.5, top_k=3), [1, 2, 3], [4, 5]) for _ in range(4)]
    # min_tokens already reached: nothing left to hold back.
    seqs.append(_seq(SamplingParams(min_tokens=2), [1], [4, 5]))
    assert _build(seqs) is None


def test_a_burst_counts_its_sampled_tokens_and_releases_min_tokens_on_time() -> None:
    logits, seqs = _random_batch(3, rows=6)
    controls = _build(seqs)
    assert controls is not None
    rng = random.Random(3)
    for step in range(4):
        got = controls.apply(logits, step)
        want = torch.stack([_reference(logits[i], s) for i, s in enumerate(seqs)])
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5, msg=f"step {step}")
        sampled = [rng.randrange(8) for _ in seqs]
        controls.record(torch.tensor(sampled))
        for seq, token_id in zip(seqs, sampled, strict=True):
            seq.append_token(token_id)


def _build_after(seqs: list[Sequence], previous: SamplingControls) -> SamplingControls:
    controls = SamplingControls.build(seqs, EOS, VOCAB, _to_device, previous)
    assert controls is not None
    return controls


def _counts(controls: SamplingControls) -> torch.Tensor:
    return controls._penalties.output_counts


def test_counts_carry_on_to_the_next_step_while_they_count_the_same_outputs() -> None:
    logits, seqs = _random_batch(5, rows=6)
    controls = _build(seqs)
    for step in range(3):
        sampled = logits.argmax(-1)
        controls.record(sampled)
        for seq, token_id in zip(seqs, sampled.tolist(), strict=True):
            seq.append_token(token_id)
        carried = _build_after(seqs, controls)
        assert _counts(carried) is _counts(controls), f"step {step}: counted again"
        want = torch.stack([_reference(logits[i], s) for i, s in enumerate(seqs)])
        torch.testing.assert_close(carried.apply(logits), want, rtol=1e-6, atol=1e-5)
        controls = carried


def test_counts_are_rebuilt_when_the_batch_or_an_output_differs_from_what_was_counted() -> None:
    logits, seqs = _random_batch(6, rows=6)
    controls = _build(seqs)
    # A token appended that was never recorded (as when a sampled token is not kept).
    seqs[0].append_token(3)
    rebuilt = _build_after(seqs, controls)
    assert _counts(rebuilt) is not _counts(controls)
    reordered = _build_after(seqs[::-1], rebuilt)
    assert _counts(reordered) is not _counts(rebuilt)
    want = torch.stack([_reference(logits[i], s) for i, s in enumerate(seqs[::-1])])
    torch.testing.assert_close(reordered.apply(logits), want, rtol=1e-6, atol=1e-5)


def test_min_tokens_holds_back_eos_and_stop_tokens_but_not_when_eos_is_ignored() -> None:
    logits = torch.zeros(2, VOCAB)
    params = SamplingParams(min_tokens=3, stop_token_ids=(7,))
    seqs = [_seq(params, [5], [9, 9]), _seq(SamplingParams(min_tokens=3, ignore_eos=True), [5], [])]
    got = _build(seqs).apply(logits)
    assert got[0, [0, 1, 7]].eq(float("-inf")).all()
    assert got[0].isfinite().sum() == VOCAB - 3
    assert got[1].isfinite().all()


def _to_cuda(values: list[int] | list[float] | np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """As the model runner sends them: pinned host memory, copied without waiting."""
    return _to_device(values, dtype).pin_memory().to("cuda", non_blocking=True)


@pytest.mark.gpu
def test_on_a_gpu_the_controls_match_the_reference_through_a_burst_of_recorded_steps() -> None:
    """The same batched operations on CUDA tensors, with the counts carried on the device from
    step to step (`record`, then `build` with the previous controls), against the reference
    on the CPU."""
    for seed in range(10):
        logits, seqs = _random_batch(seed, rows=9)
        controls = SamplingControls.build(seqs, EOS, VOCAB, _to_cuda)
        if controls is None:
            continue
        device_logits = logits.cuda()
        for step in range(3):
            got = controls.apply(device_logits).cpu()
            want = torch.stack([_reference(logits[i], s) for i, s in enumerate(seqs)])
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5, msg=f"{seed}/{step}")
            sampled = device_logits.argmax(-1)
            controls.record(sampled)
            for seq, token_id in zip(seqs, sampled.tolist(), strict=True):
                seq.append_token(token_id)
            carried = SamplingControls.build(seqs, EOS, VOCAB, _to_cuda, controls)
            if carried is None:  # every control was a min_tokens now reached
                break
            controls = carried


@pytest.mark.parametrize("seed", range(200))
def test_adjusts_holds_wherever_build_gives_controls(seed: int) -> None:
    """`adjusts` lets a greedy step skip the controls (the decode graphs' greedy replay), so it
    must answer yes for every sequence `build` would give controls for; and no for plain ones."""
    rng = random.Random(seed)
    params = _random_params(rng)
    seq = _seq(params, [5, 6, 7], [rng.randrange(VOCAB) for _ in range(rng.randint(0, 8))])
    if _build([seq]) is not None:
        assert SamplingControls.adjusts(seq)
    plain = _seq(SamplingParams(max_tokens=32, stop_token_ids=(3,)), [5], [4])
    assert not SamplingControls.adjusts(plain) and _build([plain]) is None

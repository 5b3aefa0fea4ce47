"""Asynchronous scheduling gives exactly the outputs of synchronous steps: tokens, finish and stop
reasons, log-probabilities, prompt log-probabilities, with preemption, aborts, decode bursts,
stop strings, penalties and structured outputs; and it does overlap (the next step is launched
before the previous one is collected).

Log-probabilities are compared within 1e-5, not exactly: a sequence that stops runs one step
more under asynchronous scheduling (its token dropped), so the batches, and hence the
float32 matmuls' blocking, are not the same row for row. Tokens are compared exactly.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from appliance.engine.engine import Engine
from appliance.engine.engine_config import EngineConfig
from appliance.engine.engine_settings import EngineSettings
from appliance.engine.models.loader import load_model
from appliance.engine.outputs import RequestOutput
from appliance.engine.sampling_params import SamplingParams, StructuredOutput
from kernels.backend import kernel_ops_for
from tests.appliance.engine.models.conftest import build_hf_model, save_checkpoint

LOGPROB_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_checkpoint(build_hf_model("llama3.1"), tmp_path_factory.mktemp("async"))


@pytest.fixture(scope="module")
def tiny_engine(tiny_dir: Path) -> Callable[..., Engine]:
    """Engines without a tokenizer around one tiny random model, loaded once."""
    model = load_model(tiny_dir, ops=kernel_ops_for(torch.device("cpu")))

    def build(**settings: object) -> Engine:
        config = EngineConfig(model_dir=tiny_dir, num_cpu_threads=1, **settings)
        return Engine.build(config, model, None)

    return build


def prompt_ids(length: int, offset: int = 3) -> list[int]:
    return [(offset + 7 * i) % 250 + 1 for i in range(length)]


class StepOrder:
    """Records the runner's launches and collects, in order, by step."""

    def __init__(self, engine: Engine):
        self.events: list[tuple[str, int]] = []
        runner = engine.runner
        launch, collect = runner.launch, runner.collect
        steps: list[object] = []  # kept alive, so that no two steps share an id()

        def launching(*args: object, **kwargs: object):
            step = launch(*args, **kwargs)  # type: ignore[arg-type]
            steps.append(step)
            self.events.append(("launch", len(steps) - 1))
            return step

        def collecting(step):
            self.events.append(("collect", next(i for i, s in enumerate(steps) if s is step)))
            return collect(step)

        runner.launch = launching  # type: ignore[method-assign]
        runner.collect = collecting  # type: ignore[method-assign]

    @property
    def num_overlapped(self) -> int:
        """Steps launched while the step before them was not collected yet."""
        launched_at = {n: i for i, (kind, n) in enumerate(self.events) if kind == "launch"}
        collected_at = {n: i for i, (kind, n) in enumerate(self.events) if kind == "collect"}
        return sum(
            1 for n in launched_at if n - 1 in collected_at and collected_at[n - 1] > launched_at[n]
        )


def run(
    engine: Engine,
    requests: dict[str, tuple[list[int] | str, SamplingParams]],
    *,
    abort_after: dict[str, int] | None = None,
) -> dict[str, RequestOutput]:
    """Each request's outputs merged into one; `abort_after[rid]`: abort once it has that many
    output tokens."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    merged: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            rid = out.request_id
            merged[rid] = merged[rid].followed_by(out) if rid in merged else out
            limit = (abort_after or {}).get(rid)
            if limit is not None and not out.finished and len(merged[rid].token_ids) >= limit:
                aborted = engine.abort(rid)
                assert aborted is not None
                merged[rid] = merged[rid].followed_by(aborted)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return merged


def assert_same_outputs(got: dict[str, RequestOutput], expected: dict[str, RequestOutput]) -> None:
    assert got.keys() == expected.keys()
    for rid, want in expected.items():
        have = got[rid]
        assert (have.text, have.token_ids, have.finish_reason, have.stop_reason) == (
            want.text,
            want.token_ids,
            want.finish_reason,
            want.stop_reason,
        ), rid
        for side_have, side_want in (
            (have.logprobs, want.logprobs),
            (have.prompt_logprobs, want.prompt_logprobs),
        ):
            assert (side_have is None) == (side_want is None), rid
            for a, b in zip(side_have or [], side_want or [], strict=True):
                assert (a is None) == (b is None), rid
                if a is None or b is None:
                    continue
                assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
                assert a.logprob == pytest.approx(b.logprob, abs=LOGPROB_TOLERANCE)
                for (_, x), (_, y) in zip(a.top, b.top, strict=True):
                    assert x == pytest.approx(y, abs=LOGPROB_TOLERANCE)


def token_requests(stop_token: int) -> dict[str, tuple[list[int] | str, SamplingParams]]:
    greedy = {"temperature": 0.0, "ignore_eos": True}
    return {
        "greedy-logprobs": (prompt_ids(5), SamplingParams(max_tokens=9, logprobs=2, **greedy)),
        "prompt-logprobs": (
            prompt_ids(40, offset=17),
            SamplingParams(max_tokens=4, prompt_logprobs=1, **greedy),
        ),
        "seeded": (prompt_ids(9, offset=40), SamplingParams(max_tokens=13, seed=7, temperature=1)),
        "stop-token": (
            prompt_ids(7, offset=11),
            SamplingParams(max_tokens=30, stop_token_ids=(stop_token,), **greedy),
        ),
        "penalized": (
            prompt_ids(6, offset=90),
            SamplingParams(
                max_tokens=11, repetition_penalty=1.3, frequency_penalty=0.5, min_tokens=4, **greedy
            ),
        ),
        "long": (prompt_ids(3, offset=5), SamplingParams(max_tokens=24, **greedy)),
    }


@pytest.fixture(scope="module")
def stop_token(tiny_engine: Callable[..., Engine]) -> int:
    """A token the 'stop-token' request's greedy output meets halfway: it stops there."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    [completion] = tiny_engine().generate([prompt_ids(7, offset=11)], params)
    return completion.token_ids[len(completion.token_ids) // 2]


@pytest.mark.parametrize("max_decode_burst", [1, 4])
def test_async_scheduling_gives_the_outputs_of_synchronous_steps(
    tiny_engine: Callable[..., Engine], stop_token: int, max_decode_burst: int
) -> None:
    # A small step budget: the 40-token prompt is prefilled in chunks beside decodes.
    settings = {"max_num_batched_tokens": 16, "max_decode_burst": max_decode_burst}
    expected = run(tiny_engine(**settings), token_requests(stop_token))
    engine = tiny_engine(async_scheduling=True, **settings)
    order = StepOrder(engine)
    got = run(engine, token_requests(stop_token))
    assert_same_outputs(got, expected)
    assert got["stop-token"].finish_reason == "stop" and got["stop-token"].stop_reason == stop_token
    assert order.num_overlapped >= 5


def test_async_scheduling_under_preemption_gives_the_outputs_of_a_roomy_pool(
    tiny_engine: Callable[..., Engine],
) -> None:
    # Six blocks of 16 tokens for four requests growing to 30-40 tokens: preemptions.
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    requests = {f"r{i}": (prompt_ids(8 + 2 * i, offset=i), greedy) for i in range(4)}
    expected = run(tiny_engine(num_kv_blocks=64), requests)
    small = tiny_engine(async_scheduling=True, num_kv_blocks=6, max_num_seqs=4)
    got = run(small, requests)
    assert small.scheduler.num_preemptions > 0
    assert_same_outputs(got, expected)


def test_async_scheduling_abort_with_a_step_in_flight_frees_everything(
    tiny_engine: Callable[..., Engine],
) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    requests = {"kept": (prompt_ids(6), greedy), "aborted": (prompt_ids(9, offset=3), greedy)}
    full = run(tiny_engine(), requests)
    engine = tiny_engine(async_scheduling=True)
    got = run(engine, requests, abort_after={"aborted": 5})
    assert got["kept"].token_ids == full["kept"].token_ids
    assert got["aborted"].finish_reason == "abort"
    assert got["aborted"].token_ids == full["aborted"].token_ids[: len(got["aborted"].token_ids)]
    assert 5 <= len(got["aborted"].token_ids) < 20
    # The engine still serves after the abort.
    [after] = engine.generate([prompt_ids(6)], greedy)
    assert after.token_ids == full["kept"].token_ids


def test_async_scheduling_keeps_stop_strings_eos_and_grammars_of_synchronous_steps(
    smollm2_engine: Callable[..., Engine],
) -> None:
    settings = {"max_model_len": 256, "max_decode_burst": 4}
    sync, asynchronous = (
        smollm2_engine(**settings),
        smollm2_engine(async_scheduling=True, **settings),
    )
    prompt = "The history of the printing press begins"
    [free] = sync.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16))
    stop = free.text[8:12]
    choice = StructuredOutput("choice", json.dumps(["printing press", "movable type"]))
    requests: dict[str, tuple[list[int] | str, SamplingParams]] = {
        "stop-string": (prompt, SamplingParams(temperature=0.0, max_tokens=16, stop=(stop,))),
        "eos": ("Say yes.", SamplingParams(temperature=0.0, max_tokens=40)),
        "grammar": (prompt, SamplingParams(temperature=0.0, max_tokens=8, structured=choice)),
    }
    order = StepOrder(asynchronous)
    got = run(asynchronous, requests)
    assert_same_outputs(got, run(sync, requests))
    assert got["stop-string"].finish_reason == "stop" and got["stop-string"].stop_reason == stop
    assert got["grammar"].text in ("printing press", "movable type")
    assert order.num_overlapped > 0


def test_async_scheduling_defaults_on_for_cuda_and_off_on_the_cpu() -> None:
    assert EngineSettings(device="cuda").schedules_asynchronously
    assert EngineSettings(device="cuda:1").schedules_asynchronously
    assert not EngineSettings(device="cpu").schedules_asynchronously
    assert not EngineSettings(device="cuda", async_scheduling=False).schedules_asynchronously
    assert EngineSettings(device="cpu", async_scheduling=True).schedules_asynchronously

"""Engine behaviour on the embedded model: stopping, seeds, logprobs, aborts and bad requests."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
import torch

from appliance.engine import sampling_controls
from appliance.engine.engine import Engine
from appliance.engine.engine_config import automatic_cpu_threads
from appliance.engine.engine_settings import GPU_DECODE_BURST, EngineSettings
from appliance.engine.errors import (
    ContextLengthExceededError,
    EngineConfigError,
    InvalidRequestError,
)
from appliance.engine.outputs import RequestOutput
from appliance.engine.sampling_params import SamplingParams
from tests.appliance.engine.sampling_reference import reference_controls

PROMPT = "The history of the printing press begins"


@pytest.fixture(scope="module")
def engine(smollm2_engine: Callable[..., Engine]) -> Engine:
    return smollm2_engine(max_model_len=512)


def _run(engine: Engine, requests: dict[str, tuple[object, SamplingParams]]):
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    outputs: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return outputs


def _text(outs: list[RequestOutput]) -> str:
    return "".join(o.text for o in outs)


def _greedy_text(engine: Engine, max_tokens: int = 40) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return engine.generate([PROMPT], params)[0].text


def test_max_tokens_ends_with_length_after_exactly_that_many_tokens(engine: Engine) -> None:
    [c] = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True))
    assert len(c.token_ids) == 7
    assert c.finish_reason == "length"


def test_stop_string_truncates_the_text_and_is_reported(engine: Engine) -> None:
    full = _greedy_text(engine)
    stop = full[15:19]
    cut = full.index(stop)
    params = SamplingParams(temperature=0.0, max_tokens=40, stop=(stop,), ignore_eos=True)
    outs = _run(engine, {"s": (PROMPT, params)})["s"]
    assert _text(outs) == full[:cut]
    assert outs[-1].finish_reason == "stop"
    assert outs[-1].stop_reason == stop
    # Held-back text never leaks the start of the stop string into an earlier delta.
    assert all(stop not in o.text for o in outs)


def test_stop_string_is_kept_when_asked(engine: Engine) -> None:
    full = _greedy_text(engine)
    stop = full[15:19]
    params = SamplingParams(
        temperature=0.0, max_tokens=40, stop=(stop,), include_stop_str_in_output=True
    )
    [c] = engine.generate([PROMPT], params)
    assert c.text == full[: full.index(stop) + len(stop)]


def test_stop_token_id_ends_generation_at_that_token(engine: Engine) -> None:
    [ref] = engine.generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    )
    stop_id = ref.token_ids[5]
    first = ref.token_ids.index(stop_id)
    params = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=(stop_id,))
    outs = _run(engine, {"t": (PROMPT, params)})["t"]
    token_ids = [t for o in outs for t in o.token_ids]
    assert token_ids == ref.token_ids[: first + 1]
    assert outs[-1].finish_reason == "stop"
    assert outs[-1].stop_reason == stop_id


def _token_id(engine: Engine, word: str) -> int:
    [token_id] = engine.tokenizer.encode(word, add_special_tokens=False)
    return token_id


def test_min_tokens_holds_back_eos_even_against_a_logit_bias_for_it(engine: Engine) -> None:
    [eos] = engine.tokenizer.eos_token_ids
    biased = SamplingParams(temperature=0.0, max_tokens=10, logit_bias=((eos, 100.0),))
    [at_once] = engine.generate([PROMPT], biased)
    assert at_once.token_ids == [eos] and at_once.finish_reason == "stop"
    held = SamplingParams(temperature=0.0, max_tokens=10, logit_bias=((eos, 100.0),), min_tokens=3)
    [c] = engine.generate([PROMPT], held)
    assert eos not in c.token_ids[:3]
    assert c.token_ids[3:] == [eos] and c.finish_reason == "stop"


def test_stop_token_ids_end_after_min_tokens_without_their_text(engine: Engine) -> None:
    zebra = _token_id(engine, " zebra")
    params = SamplingParams(
        temperature=0.0,
        max_tokens=10,
        logit_bias=((zebra, 100.0),),
        stop_token_ids=(zebra,),
        min_tokens=2,
    )
    outs = _run(engine, {"z": (PROMPT, params)})["z"]
    token_ids = [t for o in outs for t in o.token_ids]
    assert len(token_ids) == 3 and zebra not in token_ids[:2] and token_ids[2] == zebra
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == zebra
    assert "zebra" not in _text(outs)


def test_logit_bias_forces_or_bans_a_token_under_greedy(engine: Engine) -> None:
    purple = _token_id(engine, " purple")
    forced = SamplingParams(
        temperature=0.0, max_tokens=3, ignore_eos=True, logit_bias=((purple, 100.0),), logprobs=1
    )
    outs = _run(engine, {"f": (PROMPT, forced)})["f"]
    assert [t for o in outs for t in o.token_ids] == [purple] * 3
    # Log-probabilities are the model's own (vLLM's raw_logprobs), not the biased ones.
    first = outs[0].logprobs[0]
    assert first.top[0][0] != purple and first.logprob < first.top[0][1]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    [ref] = engine.generate([PROMPT], greedy)
    banned = SamplingParams(
        temperature=0.0, max_tokens=4, ignore_eos=True, logit_bias=((ref.token_ids[0], -100.0),)
    )
    [c] = engine.generate([PROMPT], banned)
    assert ref.token_ids[0] not in c.token_ids


def test_penalties_change_greedy_tokens_as_the_reference_says_beside_a_plain_request(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every step's raw logits are recorded; each request's token must be the argmax of the
    per-request reference applied to its row (the plain request's, of its raw row)."""
    prompt = "Numbers: 1, 2,"
    recorded: list[torch.Tensor] = []
    compute_logits = engine.runner.model.compute_logits

    def recording(hidden: torch.Tensor, **options: bool) -> torch.Tensor:
        logits = compute_logits(hidden, **options)
        recorded.append(logits.clone())
        return logits

    monkeypatch.setattr(engine.runner.model, "compute_logits", recording)
    counted: list[int] = []
    token_counts = sampling_controls._token_counts

    def counting(token_lists, *args):
        counted.append(len(token_lists))
        return token_counts(token_lists, *args)

    monkeypatch.setattr(sampling_controls, "_token_counts", counting)
    penalized = SamplingParams(
        temperature=0.0,
        max_tokens=6,
        ignore_eos=True,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        presence_penalty=0.3,
    )
    plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    got, ref = engine.generate([prompt, prompt], [penalized, plain])
    assert got.token_ids != ref.token_ids, "the repetition penalty changes this greedy output"
    prompt_ids = engine.tokenizer.encode(prompt, add_special_tokens=True)
    assert len(recorded) == 6 and all(logits.shape[0] == 2 for logits in recorded)
    for step, logits in enumerate(recorded):
        adjusted = reference_controls(
            logits[0], penalized, prompt_ids, got.token_ids[:step], engine.tokenizer.eos_token_ids
        )
        assert adjusted.argmax().item() == got.token_ids[step]
        assert logits[1].argmax().item() == ref.token_ids[step]
    # Counted from the token ids once (prompt and output); later steps carry the counts on.
    assert counted == [1, 1]


def test_chat_reply_ends_at_the_models_end_of_turn_token(engine: Engine) -> None:
    tok = engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Say hello."}])
    prompt = tok.encode(text, add_special_tokens=False)
    [c] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=200))
    assert c.finish_reason == "stop"
    assert c.token_ids[-1] in tok.eos_token_ids
    assert "<|im_end|>" not in c.text


def test_same_seed_gives_same_sample_alone_or_in_a_batch(engine: Engine) -> None:
    seeded = SamplingParams(temperature=1.0, max_tokens=24, seed=1234, ignore_eos=True)
    [alone] = engine.generate([PROMPT], seeded)
    other = SamplingParams(temperature=1.2, max_tokens=30, ignore_eos=True)
    batch = engine.generate(["Hello there", PROMPT, "Numbers: 1, 2,"], [other, seeded, other])
    assert batch[1].token_ids == alone.token_ids
    [different] = engine.generate(
        [PROMPT], SamplingParams(temperature=1.0, max_tokens=24, seed=99, ignore_eos=True)
    )
    assert different.token_ids != alone.token_ids


def test_generated_logprobs_report_the_chosen_token_and_its_alternatives(engine: Engine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, ignore_eos=True)
    outs = _run(engine, {"l": (PROMPT, params)})["l"]
    logprobs = [lp for o in outs for lp in (o.logprobs or [])]
    assert len(logprobs) == 8
    for lp in logprobs:
        assert len(lp.top) == 3
        # Greedy: the chosen token is the most likely one.
        assert lp.top[0] == (lp.token_id, pytest.approx(lp.logprob))
        assert lp.logprob <= 0.0
        assert [p for _, p in lp.top] == sorted((p for _, p in lp.top), reverse=True)


def test_outputs_without_logprobs_requested_carry_none(engine: Engine) -> None:
    outs = _run(engine, {"n": (PROMPT, SamplingParams(max_tokens=3))})["n"]
    assert all(o.logprobs is None and o.prompt_logprobs is None for o in outs)


def test_abort_mid_generation_frees_blocks_and_others_finish(engine: Engine) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    engine.add_request("keep", PROMPT, long)
    engine.add_request("drop", PROMPT + " in Germany", long)
    for _ in range(3):
        engine.step()
    final = engine.abort("drop")
    assert final is not None and final.finish_reason == "abort"
    assert engine.abort("drop") is None
    assert engine.abort("never-existed") is None
    done = []
    while engine.has_unfinished():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == ["keep"]
    assert done[0].num_output_tokens == 30
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_bad_requests_are_refused_while_running_requests_continue(engine: Engine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("good", PROMPT, params)
    outs = engine.step()
    with pytest.raises(ContextLengthExceededError, match="shorten the prompt"):
        engine.add_request("too-long", [1] * 512, params)
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("empty", [], params)
    with pytest.raises(InvalidRequestError, match=r"token ids must be integers in \[0, 49152\)"):
        engine.add_request("bad-ids", [1, 49152], params)
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("good", PROMPT, params)
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].request_id == "good" and outs[-1].finish_reason == "length"
    assert sum(len(o.token_ids) for o in outs) == 12


def test_request_larger_than_the_whole_kv_pool_is_refused(
    smollm2_engine: Callable[..., Engine],
) -> None:
    small = smollm2_engine(num_kv_blocks=4)
    with pytest.raises(ContextLengthExceededError, match="exceeds the whole KV cache"):
        small.add_request("big", PROMPT, SamplingParams(max_tokens=100))


def test_generation_stops_at_the_context_length(smollm2_engine: Callable[..., Engine]) -> None:
    short = smollm2_engine(max_model_len=32)
    prompt = short.tokenizer.encode(PROMPT)
    [c] = short.generate([prompt], SamplingParams(max_tokens=100, ignore_eos=True))
    assert c.finish_reason == "length"
    assert len(prompt) + len(c.token_ids) == 32


def test_disabling_chunked_prefill_needs_a_budget_of_a_whole_context(
    smollm2_engine: Callable[..., Engine],
) -> None:
    with pytest.raises(EngineConfigError, match="max_num_batched_tokens"):
        smollm2_engine(enable_chunked_prefill=False, max_num_batched_tokens=64)


def test_decode_bursts_give_the_same_outputs_as_single_steps(
    engine: Engine, smollm2_engine: Callable[..., Engine]
) -> None:
    bursting = smollm2_engine(max_model_len=512, max_decode_burst=8)
    bursts: list[int] = []
    launch = bursting.runner.launch

    def counting(chunks, num_steps, generators, previous=None):
        bursts.append(num_steps)
        return launch(chunks, num_steps, generators, previous)

    bursting.runner.launch = counting
    full = _greedy_text(engine)
    prompts = [PROMPT, "Hello there", "Numbers: 1, 2,", PROMPT + " in Asia", "Numbers: 1, 2,"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=29, ignore_eos=True),  # not a multiple of 8
        SamplingParams(temperature=0.9, max_tokens=21, seed=5, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, stop=(full[15:19],), ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=64),  # may end at EOS inside a burst
        # Counts kept on the device across a burst; EOS held back for 10 tokens, then due.
        SamplingParams(
            temperature=0.0,
            max_tokens=12,
            repetition_penalty=1.3,
            frequency_penalty=0.5,
            min_tokens=10,
            logit_bias=((next(iter(engine.tokenizer.eos_token_ids)), 100.0),),
        ),
    ]
    expected = engine.generate(prompts, params)
    got = bursting.generate(prompts, params)
    assert [(c.text, c.token_ids, c.finish_reason) for c in got] == [
        (c.text, c.token_ids, c.finish_reason) for c in expected
    ]
    assert len(got[4].token_ids) == 11 and got[4].finish_reason == "stop"
    assert bursts and max(bursts) == 8
    assert bursting.block_manager.num_free_blocks == bursting.block_manager.num_blocks


def test_decode_bursts_default_to_eight_on_a_gpu_and_off_on_the_cpu(engine: Engine) -> None:
    assert EngineSettings(device="cuda").decode_burst == GPU_DECODE_BURST == 8
    assert EngineSettings(device="cuda:1").decode_burst == 8
    assert EngineSettings(device="cpu").decode_burst == 1
    assert EngineSettings(device="cuda", max_decode_burst=1).decode_burst == 1
    assert EngineSettings(device="cpu", max_decode_burst=4).decode_burst == 4
    assert engine.scheduler.config.max_decode_burst == 1  # built on the cpu, the setting unset


def test_decode_bursts_step_aside_for_waiting_requests_and_logprobs(
    smollm2_engine: Callable[..., Engine],
) -> None:
    bursting = smollm2_engine(max_model_len=512, max_decode_burst=8)
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    bursting.add_request("first", PROMPT, greedy)
    bursting.step()  # prefill
    bursting.add_request("second", "Hello there", greedy)
    # A request waits: the next step admits it instead of bursting.
    assert bursting.scheduler.schedule().num_steps == 1
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=30, logprobs=1, ignore_eos=True)
    bursting.abort("first")
    bursting.abort("second")
    bursting.add_request("lp", PROMPT, with_logprobs)
    bursting.step()
    assert bursting.scheduler.schedule().num_steps == 1
    bursting.abort("lp")
    assert bursting.block_manager.num_free_blocks == bursting.block_manager.num_blocks


def test_stats_report_queues_kv_usage_preemptions_and_prefix_hits(
    smollm2_engine: Callable[..., Engine],
) -> None:
    # Four blocks of 16 tokens: two requests growing past two blocks each cannot both run.
    engine = smollm2_engine(max_model_len=512, num_kv_blocks=4, max_num_seqs=2)
    prompt = engine.tokenizer.encode(PROMPT * 3)[:20]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", prompt, params)
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 3, 0.0)
    engine.step()
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting) == (2, 1)
    # The first has 2 blocks; the second shares the first's full block and has 1 more.
    assert stats.kv_cache_usage == 0.75
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    assert stats.num_preemptions == engine.scheduler.num_preemptions > 0
    # Each admission looks its prompt up; the first full block of the shared prompt is found.
    assert stats.num_prefix_cache_queries >= 3 * 20
    assert stats.num_prefix_cache_hits >= 2 * 16


def test_penalized_requests_preempted_and_recomputed_give_their_outputs_alone(
    engine: Engine, smollm2_engine: Callable[..., Engine]
) -> None:
    # Four blocks of 16 tokens: the two requests cannot both run to the end, so one is
    # preempted, and its penalties must count its tokens again when it comes back.
    small = smollm2_engine(max_model_len=512, num_kv_blocks=4, max_num_seqs=2)
    prompts = [small.tokenizer.encode(PROMPT * 3)[:20], small.tokenizer.encode("Numbers: 1, 2,")]
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(
            temperature=0.0, max_tokens=24, ignore_eos=True, frequency_penalty=1.0, min_tokens=5
        ),
    ]
    together = small.generate(prompts, params)
    assert small.scheduler.num_preemptions > 0
    alone = [engine.generate([p], q)[0] for p, q in zip(prompts, params, strict=True)]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]


@pytest.fixture
def torch_threads() -> Iterator[None]:
    """Torch's thread count is the process's: put it back for the tests that follow."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("torch_threads")
@pytest.mark.parametrize("num_threads", [1, 2])
def test_an_engine_on_the_cpu_runs_torch_on_the_threads_it_is_given(
    smollm2_engine: Callable[..., Engine], num_threads: int
) -> None:
    smollm2_engine(num_kv_blocks=4, num_cpu_threads=num_threads)
    assert torch.get_num_threads() == num_threads


@pytest.mark.usefixtures("torch_threads")
def test_an_engine_on_the_cpu_picks_its_threads_for_this_machine_by_default(
    smollm2_engine: Callable[..., Engine],
) -> None:
    torch.set_num_threads(3)
    smollm2_engine(num_kv_blocks=4, num_cpu_threads=0)  # 0: the setting's default, automatic
    assert torch.get_num_threads() == automatic_cpu_threads(len(os.sched_getaffinity(0)))


def test_finished_outputs_say_how_long_the_request_queued_prefilled_and_decoded(
    smollm2_engine: Callable[..., Engine],
) -> None:
    """vLLM's request phases: one sequence at a time, so the second request queues for all of
    the first's prefill and decode; one aborted before it was scheduled only queued."""
    engine = smollm2_engine(max_model_len=512, max_num_seqs=1)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.add_request("first", PROMPT, params)
    engine.add_request("second", PROMPT + " in Germany", params)
    engine.add_request("never", PROMPT, params)
    aborted = engine.abort("never")
    assert aborted is not None and aborted.times is not None
    assert aborted.times.queued_s >= 0
    assert aborted.times.prefill_s is None and aborted.times.decode_s is None
    outputs: dict[str, list[RequestOutput]] = {"first": [], "second": []}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
    for outs in outputs.values():
        assert all(o.times is None for o in outs[:-1]) and outs[-1].times is not None
    first, second = (outputs[r][-1].times for r in ("first", "second"))
    assert first.prefill_s > 0 and first.decode_s > 0
    assert second.prefill_s > 0 and second.decode_s > 0
    assert second.queued_s > 0.5 * (first.prefill_s + first.decode_s)

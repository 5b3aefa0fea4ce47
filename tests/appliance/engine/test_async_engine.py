"""The asyncio wrapper: concurrent streams, early exits that abort, errors to the caller."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

import pytest
import torch

from appliance.engine import async_engine
from appliance.engine.async_engine import AsyncEngine, _merged, _OutputStream
from appliance.engine.engine import Engine
from appliance.engine.errors import InvalidRequestError
from appliance.engine.outputs import RequestOutput
from appliance.engine.sampling_params import SamplingParams
from appliance.engine.sequence import RequestId

PROMPTS = ["The moon is", "Python is a programming language that", "Rain falls when", "Tea or"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(smollm2_engine: Callable[..., Engine]) -> Engine:
    return smollm2_engine(max_model_len=1024)


async def _until_idle(engine: Engine, timeout_s: float = 2.0) -> None:
    """Wait (bounded) for the engine thread to finish or abort everything it holds."""
    for _ in range(int(timeout_s / 0.01)):
        if not engine.has_unfinished():
            return
        await asyncio.sleep(0.01)


def _assert_idle_with_every_block_free(engine: Engine) -> None:
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


async def _collect(ae: AsyncEngine, rid: str, prompt: str) -> str:
    return "".join([out.text async for out in ae.generate(rid, prompt, GREEDY)])


def test_concurrent_streams_produce_what_the_synchronous_engine_does(engine: Engine) -> None:
    expected = [c.text for c in engine.generate(PROMPTS, GREEDY)]

    async def main() -> list[str]:
        async with AsyncEngine(engine) as ae:
            return await asyncio.gather(*(_collect(ae, f"r{i}", p) for i, p in enumerate(PROMPTS)))

    assert asyncio.run(main()) == expected


def test_leaving_a_stream_early_aborts_the_request_and_frees_its_blocks(engine: Engine) -> None:
    async def main() -> None:
        async with AsyncEngine(engine) as ae:
            long = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
            stream = ae.generate("early", PROMPTS[0], long)
            async for _ in stream:
                break
            await stream.aclose()
            # A request after the abort is served normally.
            assert await _collect(ae, "after", PROMPTS[1])
            # Checked before shutdown, which would abort everything anyway.
            await _until_idle(engine)
            _assert_idle_with_every_block_free(engine)

    asyncio.run(main())


def test_cancelled_consumer_aborts_its_request(engine: Engine) -> None:
    async def main() -> None:
        async with AsyncEngine(engine) as ae:
            long = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)

            async def consume() -> None:
                async for _ in ae.generate("cancel-me", PROMPTS[2], long):
                    pass

            task = asyncio.create_task(consume())
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # 1000 tokens take far longer than this wait: only the abort can make it idle.
            await _until_idle(engine)
            _assert_idle_with_every_block_free(engine)

    asyncio.run(main())


def test_invalid_request_raises_to_its_caller_and_others_are_served(engine: Engine) -> None:
    async def main() -> str:
        async with AsyncEngine(engine) as ae:
            good = asyncio.create_task(_collect(ae, "good", PROMPTS[3]))
            with pytest.raises(InvalidRequestError, match="shorten the prompt"):
                async for _ in ae.generate("bad", [1] * 1100, GREEDY):
                    pass
            return await good

    assert asyncio.run(main()) == engine.generate([PROMPTS[3]], GREEDY)[0].text


def test_shutdown_ends_running_requests_with_an_abort(engine: Engine) -> None:
    async def main() -> str | None:
        ae = AsyncEngine(engine)
        ae.start()
        long = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
        stream = ae.generate("cut", PROMPTS[0], long)
        await anext(stream)
        await ae.shutdown()
        last = None
        async for out in stream:
            last = out
        return last.finish_reason if last else None

    assert asyncio.run(main()) == "abort"
    _assert_idle_with_every_block_free(engine)


def test_invalid_request_raises_before_anything_is_submitted(engine: Engine) -> None:
    async def main() -> None:
        async with AsyncEngine(engine) as ae:
            with pytest.raises(InvalidRequestError, match="shorten the prompt"):
                ae.generate("bad", [1] * 1100, GREEDY)  # raises here, not when iterated
            # The same id is free: nothing was registered for the refused request.
            assert await _collect(ae, "bad", PROMPTS[0])

    asyncio.run(main())


def test_a_consumer_that_falls_behind_gets_the_queued_outputs_merged(engine: Engine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    [expected] = engine.generate([PROMPTS[1]], params)

    async def main() -> list:
        async with AsyncEngine(engine) as ae:
            outputs = []
            async for out in ae.generate("slow", PROMPTS[1], params):
                outputs.append(out)
                await asyncio.sleep(0.2)  # several engine steps happen meanwhile
            return outputs

    outputs = asyncio.run(main())
    assert len(outputs) < 24, "queued outputs reach a slow consumer together"
    assert "".join(o.text for o in outputs) == expected.text
    assert [t for o in outputs for t in o.token_ids] == expected.token_ids
    logprobs = [lp for o in outputs for lp in o.logprobs]
    assert [lp.token_id for lp in logprobs] == expected.token_ids
    assert outputs[-1].finish_reason == "length" and outputs[-1].num_output_tokens == 24


def _output(text: str, token_id: int, *, finish_reason: str | None = None) -> RequestOutput:
    return RequestOutput(
        request_id=RequestId("r"),
        text=text,
        token_ids=[token_id],
        logprobs=None,
        prompt_logprobs=None,
        finish_reason=finish_reason,
        stop_reason=None,
        num_prompt_tokens=3,
        num_output_tokens=token_id,
        num_cached_tokens=0,
    )


def test_graphs_left_from_the_build_are_captured_while_idle_and_requests_go_first(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's engine captures its CUDA graphs after it is ready, one whenever no request
    is unfinished (EngineConfig.capture_graphs_when_idle): a request that arrives during a
    capture is served before the next one (no capture under load within this test's time).
    Stand-in captures here (the CPU has no graphs): the first waits until a request is
    submitted, each notes what the engine held then."""
    monkeypatch.setattr(async_engine, "BUSY_CAPTURE_INTERVAL_S", 600.0)
    monkeypatch.setattr(async_engine, "IDLE_CAPTURE_QUIET_S", 0.0)
    submitted = threading.Event()
    seen: list[tuple[int, bool, int]] = []  # (capture, a request unfinished?, prompts admitted)
    expected = engine.generate([PROMPTS[3]], GREEDY)[0].text

    def capture(index: int) -> Callable[[], None]:
        def run() -> None:
            if index == 0:
                assert submitted.wait(timeout=10)
            stats = idle.stats()
            seen.append((index, idle.has_unfinished(), stats.num_prefix_cache_queries))

        return run

    idle = Engine(
        engine.tokenizer,
        engine.runner,
        engine.scheduler,
        vocab_size=engine.vocab_size,
        graph_captures=[capture(i) for i in range(3)],
    )
    queried = idle.stats().num_prefix_cache_queries

    async def main() -> str:
        async with AsyncEngine(idle) as ae:
            stream = ae.generate("during", PROMPTS[3], GREEDY)
            submitted.set()
            text = "".join([out.text async for out in stream])
            for _ in range(200):
                if not idle.num_pending_graphs:
                    break
                await asyncio.sleep(0.01)
            assert idle.stats().num_pending_graphs == 0
            return text

    assert asyncio.run(main()) == expected
    assert [index for index, _, _ in seen] == [0, 1, 2]
    assert not any(unfinished for _, unfinished, _ in seen)
    # The request was admitted after the first capture and before the second.
    assert seen[0][2] == queried and seen[1][2] > queried


def test_a_request_just_after_the_start_or_a_step_finds_no_capture_in_its_way(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Idle captures wait for a quiet spell (IDLE_CAPTURE_QUIET_S, lengthened here) after the
    engine thread's start and after its last step: a request sent at once, and another sent
    just after the first ended, are each served without any capture before them; once quiet,
    every graph is captured."""
    monkeypatch.setattr(async_engine, "BUSY_CAPTURE_INTERVAL_S", 600.0)
    monkeypatch.setattr(async_engine, "IDLE_CAPTURE_QUIET_S", 1.0)
    captured_at: list[float] = []
    quiet = Engine(
        engine.tokenizer,
        engine.runner,
        engine.scheduler,
        vocab_size=engine.vocab_size,
        graph_captures=[lambda: captured_at.append(time.monotonic()) for _ in range(3)],
    )

    async def main() -> float:
        async with AsyncEngine(quiet) as ae:
            for prompt in PROMPTS[:2]:
                async for _ in ae.generate(f"r-{prompt}", prompt, GREEDY):
                    pass
            served_s = time.monotonic()
            for _ in range(300):
                if not quiet.num_pending_graphs:
                    break
                await asyncio.sleep(0.01)
            return served_s

    served_s = asyncio.run(main())
    assert len(captured_at) == 3
    assert captured_at[0] >= served_s  # none before or between the two requests
    assert captured_at[0] - served_s >= 0.8  # after the quiet spell that followed them


def test_under_load_a_graph_is_captured_between_two_steps_now_and_then(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server busy from its start still captures its graphs: one between two steps every
    BUSY_CAPTURE_INTERVAL_S (shortened here). The step in flight (asynchronous scheduling) is
    processed first and its outputs delivered: the request's text is whole."""
    monkeypatch.setattr(async_engine, "BUSY_CAPTURE_INTERVAL_S", 0.05)
    monkeypatch.setattr(async_engine, "IDLE_CAPTURE_QUIET_S", 0.0)
    long = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = engine.generate([PROMPTS[1]], long)[0].text
    submitted = threading.Event()
    busy: list[bool] = []  # per capture after the first: whether a request was unfinished

    def first() -> None:  # idle at the start: the request arrives during it
        assert submitted.wait(timeout=10)

    def later() -> None:
        busy.append(busy_engine.has_unfinished())

    busy_engine = Engine(
        engine.tokenizer,
        engine.runner,
        engine.scheduler,
        vocab_size=engine.vocab_size,
        async_scheduling=True,
        graph_captures=[first, later, later, later],
    )

    async def main() -> str:
        async with AsyncEngine(busy_engine) as ae:
            stream = ae.generate("busy", PROMPTS[1], long)
            submitted.set()
            return "".join([out.text async for out in stream])

    # (A capture that took the step in flight and dropped its outputs would leave the stream
    # waiting for good: bounded.)
    assert asyncio.run(asyncio.wait_for(main(), timeout=60)) == expected
    assert len(busy) == 3 and any(busy), busy


def test_a_failed_capture_ends_the_captures_and_the_engine_serves_on(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """A graph capture that fails after the server is ready (out of GPU memory, say) costs the
    graphs still to capture, not the server: it is logged, the rest are dropped, and requests
    are served (eagerly where no graph was captured)."""
    captured: list[int] = []

    def failing() -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")

    idle = Engine(
        engine.tokenizer,
        engine.runner,
        engine.scheduler,
        vocab_size=engine.vocab_size,
        graph_captures=[lambda: captured.append(0), failing, lambda: captured.append(2)],
    )
    expected = engine.generate([PROMPTS[0]], GREEDY)[0].text

    async def main() -> str:
        async with AsyncEngine(idle) as ae:
            for _ in range(200):
                if not idle.num_pending_graphs:
                    break
                await asyncio.sleep(0.01)
            assert ae.is_running
            return await _collect(ae, "after", PROMPTS[0])

    with caplog.at_level(logging.ERROR, logger="appliance.engine.engine"):
        assert asyncio.run(main()) == expected
    assert captured == [0]
    assert idle.num_pending_graphs == 0
    assert "OutOfMemoryError" in caplog.text and "2 graphs are left uncaptured" in caplog.text


def test_a_take_returns_everything_put_since_the_last_in_order_and_waits_for_more() -> None:
    async def main() -> None:
        stream = _OutputStream()
        first, second, third = _output(" a", 1), _output(" b", 2), _output(" c", 3)
        stream.put(first)
        stream.put(second)
        assert await stream.take() == [first, second]
        waiting = asyncio.create_task(stream.take())
        await asyncio.sleep(0)
        assert not waiting.done(), "nothing was put since the last take"
        stream.put(third)
        assert await asyncio.wait_for(waiting, timeout=2) == [third]

    asyncio.run(main())


def test_a_cancelled_take_leaves_what_is_put_later_for_the_next() -> None:
    async def main() -> None:
        stream = _OutputStream()
        waiting = asyncio.create_task(stream.take())
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        later = _output(" a", 1)
        stream.put(later)
        assert await stream.take() == [later]

    asyncio.run(main())


def test_outputs_ready_together_merge_into_one_up_to_the_error_that_ended_them() -> None:
    error = RuntimeError("the engine failed")
    items = [_output(" a", 1), _output(" b", 2), error, _output(" c", 3)]
    merged, ended_by = _merged(items)
    assert merged is not None and ended_by is error
    assert (merged.text, merged.token_ids, merged.num_output_tokens) == (" a b", [1, 2], 2)
    last = _output(" c", 3, finish_reason="length")
    merged, ended_by = _merged([_output(" a", 1), last])
    assert merged is not None and ended_by is None
    assert (merged.text, merged.token_ids, merged.finish_reason) == (" a c", [1, 3], "length")
    assert _merged([error]) == (None, error)

"""A tensor-parallel worker that dies stops the engine visibly, in bounded time, naming the
worker: the synchronous engine raises TensorParallelError; the async engine stops (what /health
reports as 503 "stopped") and ends every stream with EngineDeadError. A worker that hangs alive
fails the step within the step timeout."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from appliance.engine.async_engine import AsyncEngine, EngineDeadError
from appliance.engine.engine import Engine
from appliance.engine.errors import TensorParallelError
from appliance.engine.parallel import group as group_module
from appliance.engine.sampling_params import SamplingParams
from tests.appliance.engine.models.conftest import build_hf_model, save_checkpoint
from tests.appliance.engine.parallel.test_tensor_parallel import build_engine, prompt_ids


@pytest.fixture
def tiny_dir(tmp_path: Path) -> Path:
    return save_checkpoint(build_hf_model("llama3.1"), tmp_path / "model")


def test_a_killed_worker_stops_the_engine_with_an_error_naming_it(tiny_dir: Path) -> None:
    engine = build_engine(tiny_dir, 2)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        engine.add_request("r", prompt_ids(5), params)
        engine.step()
        engine.step()
        [pid] = engine.group.worker_pids
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"rank 1 .* killed by signal 9"):
            _step_for(engine, seconds=30)
        assert time.monotonic() - started < 10
        # And it stays failed: the next step is refused at once, naming the same cause.
        with pytest.raises(TensorParallelError, match=r"rank 1"):
            engine.step()
    finally:
        engine.close()


def _step_for(engine: Engine, seconds: float) -> None:
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        engine.step()


async def kill_worker_while_streaming(
    engine: Engine, stream: AsyncIterator[object], killed_at: list[float], within_s: float = 30
) -> None:
    """Kill rank 1 at the first output (noting when in `killed_at`), then read on for at most
    `within_s`."""
    assert engine.group is not None
    async with asyncio.timeout(within_s):
        async for _ in stream:
            if not killed_at:
                os.kill(engine.group.worker_pids[0], signal.SIGKILL)
                killed_at.append(time.monotonic())


def test_a_killed_worker_stops_the_async_engine_and_ends_its_streams(tiny_dir: Path) -> None:
    engine = build_engine(tiny_dir, 2)

    async def main() -> None:
        async with AsyncEngine(engine) as ae:
            params = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
            stream = ae.generate("r", prompt_ids(5), params)
            with pytest.raises(EngineDeadError) as caught:
                await kill_worker_while_streaming(engine, stream, [])
            assert isinstance(caught.value.__cause__, TensorParallelError)
            async with asyncio.timeout(5):  # the thread ends right after failing the streams
                while ae.is_running:
                    await asyncio.sleep(0.01)
            # not is_running: what /health reports as "stopped" (503)

    try:
        asyncio.run(main())
    finally:
        engine.close()


def test_a_killed_worker_fails_the_async_engine_even_while_its_thread_is_held(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On GPUs a step can wait for a dead peer where no abort reaches it (a one-shot
    all-reduce's barrier spins on the GPU): the group's watch fails the engine by itself, the
    streams end, /health turns, and shutdown returns."""
    from appliance.engine import async_engine as async_module

    monkeypatch.setattr(async_module, "_FAILED_JOIN_S", 0.5)
    engine = build_engine(tiny_dir, 2)
    release = threading.Event()
    real_step = engine.step
    steps = 0

    def step():
        nonlocal steps
        steps += 1
        if steps > 2:  # held as a GPU wait on the dead peer would hold it
            release.wait()
        return real_step()

    monkeypatch.setattr(engine, "step", step)

    async def main() -> None:
        ae = AsyncEngine(engine)
        ae.start()
        params = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
        stream = ae.generate("r", prompt_ids(5), params)
        with pytest.raises(EngineDeadError) as caught:
            await kill_worker_while_streaming(engine, stream, [])
        assert isinstance(caught.value.__cause__, TensorParallelError)
        assert not ae.is_running and ae.has_failed  # /health: 503 "stopped"
        async with asyncio.timeout(5):
            assert isinstance(await ae.wait_failed(), TensorParallelError)
            await ae.shutdown()  # bounded, though the engine thread is still held

    try:
        asyncio.run(main())
    finally:
        release.set()
        engine.close()


def test_a_worker_that_hangs_alive_fails_the_step_within_the_step_timeout(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(group_module, "STEP_TIMEOUT_S", 8.0)
    engine = build_engine(tiny_dir, 2)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        engine.add_request("r", prompt_ids(5), params)
        engine.step()
        assert engine.group is not None
        [pid] = engine.group.worker_pids
        os.kill(pid, signal.SIGSTOP)  # alive, answering nothing
        started = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"stopped answering|step failed"):
            _step_for(engine, seconds=60)
        assert time.monotonic() - started < 8.0 + 5
        with pytest.raises(TensorParallelError):  # and at once from then on
            engine.step()
    finally:
        engine.close()  # kills the stopped worker

"""bench/engine_profile.py: the engine thread's steps profiled between a start and a stop, and
nothing else: not the steps before or after, not another thread's calls (the event loop's, in
the server), with either profiler (cProfile up to Python 3.11, the pure-Python `profile` from
3.12, where cProfile hooks every thread)."""

from __future__ import annotations

import io
import profile
import sys
import threading
import time
from pathlib import Path

import pytest

from bench.engine_profile import (
    CProfileSteps,
    EngineProfiler,
    PureProfileSteps,
    ResyncingProfile,
    function_label,
    profile_tables,
    read_window,
)

PROFILES = [
    pytest.param(
        CProfileSteps,
        marks=pytest.mark.skipif(
            sys.version_info >= (3, 12), reason="cProfile hooks every thread from Python 3.12"
        ),
        id="cProfile",
    ),
    pytest.param(PureProfileSteps, id="profile"),
]


def profiled_work() -> int:
    return sum(range(20_000))


def unprofiled_work() -> int:
    return sum(range(20_000))


def other_threads_work() -> int:
    return sum(range(20_000))


class FakeEngine:
    def __init__(self) -> None:
        self.work = unprofiled_work

    def step(self) -> list[int]:
        return [self.work()]


def on_engine_thread(fn) -> None:
    thread = threading.Thread(target=fn)
    thread.start()
    thread.join()


def functions(window: dict) -> dict[str, int]:
    """Each profiled function's name and calls."""
    return {name: calls for (_, _, name), (_, calls, *_) in window["stats"].items()}


@pytest.mark.parametrize("new_profile", PROFILES)
def test_only_the_steps_between_start_and_stop_are_profiled(new_profile, tmp_path: Path):
    engine = FakeEngine()
    profiler = EngineProfiler(engine, new_profile)
    on_engine_thread(lambda: [engine.step() for _ in range(2)])  # before: not profiled
    profiler.start()
    engine.work = profiled_work
    on_engine_thread(lambda: [engine.step() for _ in range(3)])
    profiler.stop(tmp_path / "window")  # the engine is idle: no step needed to take it
    engine.work = unprofiled_work
    outputs = []
    on_engine_thread(lambda: outputs.append(engine.step()))  # after: not profiled
    assert outputs == [[unprofiled_work()]]  # the step's own result, with or without profiling

    window = read_window(tmp_path / "window")
    assert window["num_steps"] == 3
    # The steps' time as profiled (the tables' total) lies within the thread's CPU meanwhile.
    assert 0 < window["steps_cpu_s"] <= window["engine_thread_cpu_s"]
    seen = functions(window)
    assert seen["profiled_work"] == 3
    assert seen["step"] == 3
    assert "unprofiled_work" not in seen
    # Neither profiler's own machinery is reported as the engine's (profile's simulated caller
    # and sys.setprofile).
    assert not [key for key in window["stats"] if key[0] == "profile" or key[2] == "setprofile"]


@pytest.mark.parametrize("new_profile", PROFILES)
def test_calls_on_other_threads_meanwhile_are_not_in_the_profile(new_profile, tmp_path: Path):
    engine = FakeEngine()
    engine.work = profiled_work
    profiler = EngineProfiler(engine, new_profile)
    profiler.start()
    stop = threading.Event()

    def event_loop() -> None:
        while not stop.is_set():
            other_threads_work()
            time.sleep(0)  # hand the GIL over, as the event loop does between requests

    other = threading.Thread(target=event_loop)
    other.start()
    try:
        on_engine_thread(lambda: [engine.step() for _ in range(50)])
    finally:
        stop.set()
        other.join()
    profiler.stop(tmp_path / "window")

    seen = functions(read_window(tmp_path / "window"))
    assert seen["profiled_work"] == 50
    assert "other_threads_work" not in seen
    assert "event_loop" not in seen


def test_commands_start_and_stop_a_window_and_no_step_means_no_cpu(tmp_path: Path):
    profiler = EngineProfiler(FakeEngine())
    profiler.follow(io.StringIO(f"start\nstop {tmp_path / 'window'}\n"))
    window = read_window(tmp_path / "window")
    assert (window["num_steps"], window["engine_thread_cpu_s"], window["steps_cpu_s"]) == (
        0,
        None,
        0.0,
    )
    assert window["stats"] == {}


def test_unknown_command_and_stop_without_start_are_refused(tmp_path: Path):
    profiler = EngineProfiler(FakeEngine())
    with pytest.raises(ValueError, match="unknown"):
        profiler.follow(io.StringIO("begin\n"))
    with pytest.raises(ValueError, match="without start"):
        profiler.stop(tmp_path / "window")
    assert not (tmp_path / "window").exists()


def test_tables_rank_by_own_then_cumulative_time_with_shares_of_the_thread():
    stats = {
        ("~", 0, "<built-in method torch.empty>"): (100, 100, 0.5, 0.5, {}),
        ("/x/site-packages/triton/runtime/jit.py", 500, "run"): (10, 10, 0.2, 1.5, {}),
        ("/x/engine.py", 540, "step"): (5, 5, 0.1, 2.0, {}),
    }
    lines = profile_tables(stats, total_s=2.5, top=2).splitlines()
    own = lines.index("by own time (tottime), top 2:")
    cumulative = lines.index("by cumulative time (cumtime), top 2:")
    assert lines[own + 3] == "| 0.500 | 0.500 | 20.0% | 100 | <built-in method torch.empty> |"
    assert lines[own + 4] == "| 0.200 | 1.500 | 8.0% | 10 | triton/runtime/jit.py:500(run) |"
    assert lines[cumulative + 3] == "| 0.100 | 2.000 | 80.0% | 5 | engine.py:540(step) |"
    assert lines[cumulative + 4] == (
        "| 0.200 | 1.500 | 60.0% | 10 | triton/runtime/jit.py:500(run) |"
    )
    assert len(lines) == cumulative + 5


def test_function_labels_start_at_the_package_or_repository():
    repository = Path(__file__).resolve().parents[2]
    engine = str(repository / "appliance/engine/engine.py")
    assert function_label((engine, 540, "step")) == "appliance/engine/engine.py:540(step)"
    assert function_label(("/v/lib/site-packages/torch/nn/module.py", 1, "f")) == (
        "torch/nn/module.py:1(f)"
    )
    assert function_label(("/usr/lib/python3/dist-packages/numpy/a.py", 2, "g")) == (
        "numpy/a.py:2(g)"
    )
    assert function_label(("/usr/lib/python3.12/threading.py", 9, "run")) == "threading.py:9(run)"
    assert function_label(("", 0, "sorted")) == "sorted"


def test_a_return_past_several_frames_closes_them_instead_of_stopping_the_step():
    """The profiler told that `outer` returned while `middle` and `inner` are on its stack (a
    return event past more than one frame: the H100's Python 3.12 delivered one inside the
    engine's step): `profile` asserts from inside the profiled code; the resyncing profile
    closes the skipped frames and goes on, and the later returns of frames it closed are left
    out."""

    with pytest.raises(AssertionError, match="Bad return"):
        _with_injected_event(profile.Profile, "return", "outer")
    result, names = _with_injected_event(ResyncingProfile, "return", "outer")
    assert result == 1
    assert {"outer", "middle", "inner"} <= names


def _with_injected_event(new_profile, event: str, which: str):
    """Profile outer -> middle -> inner where inner tells the profiler `event` happened for
    the frame named `which` (a frame on the stack, or the caller of outer, which it never saw
    called): returns what the profiled call returned, and the functions the profile timed."""
    prof = new_profile(time.thread_time)

    def outer():
        frames = {"outer": sys._getframe()}

        def middle():
            frames["middle"] = sys._getframe()

            def inner():
                sys.setprofile(None)  # the injected event, itself unprofiled
                try:
                    target = frames[which] if which in frames else frames["outer"].f_back
                    prof.dispatcher(target, event, None)
                finally:
                    sys.setprofile(prof.dispatcher)
                return 1

            return inner()

        return middle()

    result = prof.runcall(outer)
    prof.simulate_cmd_complete()
    return result, {name for (_, _, name) in prof.timings}


@pytest.mark.parametrize(
    "which", ["middle", "unseen"], ids=["caller-two-frames-down", "caller-never-seen"]
)
def test_a_call_whose_caller_is_not_on_top_is_placed_instead_of_stopping_the_step(which):
    """A call event whose caller is two frames below the top (the frames between returned
    without events), or was never seen called: `profile` asserts ("Bad call"); the resyncing
    profile closes the skipped frames, or counts the call under the top, and goes on."""
    with pytest.raises(AssertionError, match="Bad call"):
        _with_injected_event(profile.Profile, "call", which)
    result, _ = _with_injected_event(ResyncingProfile, "call", which)
    assert result == 1

"""Where the engine thread's CPU goes inside a running server: `Engine.step` profiled in that
thread's CPU time, between a start and a stop the benchmark sends (bench/server_load.py's
`--profile-engine`).

The one seam is the engine's `step`: `EngineProfiler` takes its place on the engine object
before the server starts, so it runs on the engine thread (AsyncEngine's, the only caller of
`step`) and nothing else in the server changes. A lock held through each step lets `stop`, on
the thread that reads the commands, take the window's profile between two steps, whether the
engine is busy or idle, without a step to carry it.

Profiles are timed in the engine thread's own CPU time (`time.thread_time`), so time the thread
waits (on the GPU, for commands, for the GIL) counts for nothing. Up to Python 3.11 cProfile
hooks only the thread that enables it; from 3.12 it hooks every thread at once
(sys.monitoring), so the event loop's calls would land in the engine's profile and the two
threads' clocks would be subtracted from each other. There the pure-Python `profile` module
does it: it hooks the calling thread only (sys.setprofile), at several times cProfile's cost per
call, and runs one call per profiler, so each step gets its own, folded into the window's.
"""

from __future__ import annotations

import cProfile
import marshal
import profile
import re
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Protocol, TextIO, TypeVar

T = TypeVar("T")
# pstats' form: (file, line, function) -> (primitive calls, calls, own s, cumulative s, callers).
Stats = dict[tuple[str, int, str], tuple[int, int, float, float, dict[Any, Any]]]


class StepProfile(Protocol):
    name: str

    def run(self, step: Callable[[], T]) -> T: ...

    def stats(self) -> Stats: ...


class CProfileSteps:
    """One cProfile for the window, around each step (Python ≤ 3.11: it hooks one thread)."""

    name = "cProfile"

    def __init__(self) -> None:
        self._profile = cProfile.Profile(time.thread_time)

    def run(self, step: Callable[[], T]) -> T:
        return self._profile.runcall(step)

    def stats(self) -> Stats:
        self._profile.create_stats()
        return self._profile.stats  # type: ignore[attr-defined]


class PureProfileSteps:
    """The pure-Python `profile` around each step, added into the window's figures after it (a
    `profile.Profile` runs one call only). Callers are not kept: the tables need none, and
    merging them would cost the engine thread more than the step's own figures."""

    name = "profile (pure Python: cProfile hooks every thread from Python 3.12)"

    def __init__(self) -> None:
        self._stats: Stats = {}

    def run(self, step: Callable[[], T]) -> T:
        one = ResyncingProfile(time.thread_time)
        try:
            return one.runcall(step)
        finally:
            one.simulate_cmd_complete()  # ends its simulated caller, as create_stats does
            for key, (primitive, _, own_s, cumulative_s, callers) in one.timings.items():
                # Its own machinery: the simulated caller and sys.setprofile.
                if key[0] == "profile" or key == ("", 0, "setprofile"):
                    continue
                before = self._stats.get(key, (0, 0, 0.0, 0.0, {}))
                self._stats[key] = (
                    before[0] + primitive,
                    before[1] + sum(callers.values()),  # calls, as pstats counts them
                    before[2] + own_s,
                    before[3] + cumulative_s,
                    {},
                )

    def stats(self) -> Stats:
        return self._stats


class ResyncingProfile(profile.Profile):
    """`profile.Profile` that survives events it did not expect. On the H100's Python 3.12 the
    engine's step once delivered a return past more than one frame on the profiler's stack
    (under torch's `inference_mode` decorator), and `profile` asserts ("Bad return"; "Bad call"
    for a call whose caller is not on top) from inside the profiled code: the engine thread
    died with it. Here the frames a return or a call skipped are closed as returned at that
    moment, a return of a frame the profiler never saw called is left out, and a call from
    such a frame is counted under whatever is on top: a step's figures can only misplace such
    frames, never stop the step."""

    def trace_dispatch_return(self, frame: Any, t: float) -> int:
        if not self._close_above(frame):
            return 0  # never seen called: nothing of it to close
        return super().trace_dispatch_return(frame, t)

    def trace_dispatch_call(self, frame: Any, t: float) -> int:
        if self.cur is not None and not self._close_above(frame.f_back):
            # A caller never seen: the base class would assert. Push as it pushes.
            code = frame.f_code
            key = (code.co_filename, code.co_firstlineno, code.co_name)
            self.cur = (t, 0, 0, key, frame, self.cur)
            calls, depth, own, cumulative, callers = self.timings.get(key, (0, -1, 0, 0, {}))
            self.timings[key] = calls, depth + 1, own, cumulative, callers
            return 1
        return super().trace_dispatch_call(frame, t)

    def _close_above(self, frame: Any) -> bool:
        """Close the frames above `frame` on the profiler's stack (they returned without an
        event); False, closing nothing, when `frame` is not on it."""
        cur = self.cur
        while cur is not None and cur[-2] is not frame:
            cur = cur[-1]
        if cur is None:
            return False
        while self.cur[-2] is not frame:
            super().trace_dispatch_return(self.cur[-2], 0)
        return True

    # `profile` dispatches events through a table of its own functions, not by method lookup.
    dispatch: ClassVar[dict[str, Callable[..., int]]] = {
        **profile.Profile.dispatch,  # type: ignore[attr-defined]
        "call": trace_dispatch_call,
        "return": trace_dispatch_return,
        "c_exception": trace_dispatch_return,
        "c_return": trace_dispatch_return,
    }


def step_profile() -> StepProfile:
    """A profile of steps on the calling thread alone, in that thread's CPU time."""
    return CProfileSteps() if sys.version_info < (3, 12) else PureProfileSteps()


class EngineProfiler:
    """Profiles `engine.step` from a `start` to a `stop PATH` command (`follow`), and writes the
    window to PATH (`read_window` reads it): the profile's statistics; the steps it saw; the
    engine thread's CPU seconds from the start of the first of them to the end of the last (all
    of its work in between, the profiler's own included; None for no step); and the seconds the
    profile puts inside the steps (the cumulative time of `step`), which leave out the engine
    loop's work between steps and, with the pure-Python profiler, most of the profiler's cost."""

    def __init__(self, engine: Any, new_profile: Callable[[], StepProfile] = step_profile):
        self._step: Callable[[], Any] = engine.step
        self._new_profile = new_profile
        self._lock = threading.Lock()
        self._profile: StepProfile | None = None
        self._num_steps = 0
        self._cpu_first_s = self._cpu_last_s = 0.0  # the engine thread's clock
        engine.step = self.step

    def step(self) -> Any:
        """On the engine thread, in place of the engine's own `step`."""
        with self._lock:
            if self._profile is None:
                return self._step()
            if self._num_steps == 0:
                self._cpu_first_s = time.thread_time()
            self._num_steps += 1
            try:
                return self._profile.run(self._step)
            finally:
                self._cpu_last_s = time.thread_time()

    def follow(self, commands: TextIO) -> None:
        """Apply each command line until the stream ends."""
        for line in commands:
            command, _, path = line.strip().partition(" ")
            if command == "start":
                self.start()
            elif command == "stop":
                self.stop(Path(path))
            else:
                raise ValueError(f"unknown engine profile command {line!r}")

    def start(self) -> None:
        with self._lock:
            self._profile = self._new_profile()
            self._num_steps = 0

    def stop(self, path: Path) -> None:
        with self._lock:
            window, self._profile = self._profile, None
            num_steps, cpu_s = self._num_steps, self._cpu_last_s - self._cpu_first_s
        if window is None:
            raise ValueError("stop without start")
        stats = window.stats()
        code = self._step.__code__  # a bound method's is its function's
        step = stats.get((code.co_filename, code.co_firstlineno, code.co_name))
        record = {
            "profiler": window.name,
            "num_steps": num_steps,
            "engine_thread_cpu_s": cpu_s if num_steps else None,
            "steps_cpu_s": 0.0 if step is None else step[3],
            "stats": stats,
        }
        # Whole or not at all: the benchmark waits for the file to appear.
        partial = path.with_name(path.name + ".partial")
        partial.write_bytes(marshal.dumps(record))
        partial.replace(path)


def read_window(path: Path) -> dict[str, Any]:
    return marshal.loads(path.read_bytes())


def profile_tables(stats: Stats, total_s: float, top: int = 25) -> str:
    """The `top` functions by own time (tottime), then by cumulative time (cumtime), as Markdown
    tables, with each one's share of `total_s` (the time the profile puts inside the steps)."""
    lines = []
    for title, column in (("own time (tottime)", 2), ("cumulative time (cumtime)", 3)):
        ranked = sorted(stats.items(), key=lambda item: item[1][column], reverse=True)[:top]
        lines += [
            f"\nby {title}, top {len(ranked)}:",
            "| own s | cumulative s | of the steps | calls | function |",
            "|---|---|---|---|---|",
        ]
        for key, (_, num_calls, own_s, cumulative_s, _) in ranked:
            share = (own_s if column == 2 else cumulative_s) / total_s if total_s > 0 else 0.0
            lines.append(
                f"| {own_s:.3f} | {cumulative_s:.3f} | {share:.1%} | {num_calls} "
                f"| {function_label(key)} |"
            )
    return "\n".join(lines)


def function_label(key: tuple[str, int, str]) -> str:
    """`path:line(name)`, the path from its package (or the repository) on, else its file name; a
    built-in function, which has no file (cProfile's `~`, profile's empty name), by its name."""
    path, line, name = key
    if path in ("~", ""):
        return name
    if packages := re.search(r"(site|dist)-packages/", path):
        path = path[packages.end() :]
    else:
        repository = Path(__file__).resolve().parent.parent
        path = (
            str(Path(path).relative_to(repository))
            if Path(path).is_relative_to(repository)
            else Path(path).name
        )
    return f"{path}:{line}({name})"

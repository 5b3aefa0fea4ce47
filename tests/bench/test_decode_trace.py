"""bench/decode_trace.py's reading of a profiler trace: which kernels a graph replay ran, their
overlap with the kernel before (programmatic launch), and what ran between replays."""

from __future__ import annotations

import json
from pathlib import Path

from bench import decode_trace


def _trace(tmp_path: Path) -> Path:
    events = []
    t = 0.0

    def device(name: str, start: float, dur: float, correlation: int, api: str) -> None:
        events.append({"cat": "cuda_runtime", "name": api, "args": {"correlation": correlation}})
        events.append(
            {"cat": "kernel", "name": name, "ts": start, "dur": dur,
             "args": {"correlation": correlation, "grid": [4, 1, 1]}}
        )  # fmt: skip

    correlation = 0
    for _ in range(3):  # three steps: a replay of two kernels, then the LM head and a copy
        correlation += 1
        device("gemv", t, 10.0, correlation, "cudaGraphLaunch")
        device("norm", t + 8.0, 5.0, correlation, "cudaGraphLaunch")  # starts 2 µs early
        correlation += 1
        device("lm_head", t + 15.0, 30.0, correlation, "cudaLaunchKernel")
        correlation += 1
        device("copy", t + 47.0, 1.0, correlation, "cudaMemcpyAsync")
        t += 50.0
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_the_report_splits_graph_kernels_from_the_work_between_replays(tmp_path, capsys):
    decode_trace.report(_trace(tmp_path))
    out = capsys.readouterr().out
    assert out.startswith("3 graph replays")
    # norm: 5 µs long, starting 2 µs before gemv ended: 3 µs effective.
    assert "| norm [4, 1, 1] | 1.0 | 5.00 | -2.00 | 3.00 |" in out
    assert "| gemv [4, 1, 1] | 1.0 | 10.00 |" in out
    between = out.split("between two replays")[1]
    assert "lm_head" in between and "copy" in between and "gemv" not in between

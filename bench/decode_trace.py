"""Where a batch-1 decode step's GPU time goes: W1's steps (bench/gpu_engine.py's random model
and engine) under torch.profiler, each kernel's time inside the decode CUDA graph and what runs
between two replays.

A kernel launched as a programmatic dependent (kernels/pdl.py) starts before the one before it
ends and waits, so its duration overstates its cost: "effective" is its duration less its
overlap with the kernel before (its negative gap). Run on the GPU machine:

    python bench/decode_trace.py [--quantization fp8] [--steps 64] [--trace FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `bench` and the appliance

from torch.profiler import ProfilerActivity, profile

from appliance.engine.sampling_params import SamplingParams
from bench import gpu_engine


def trace_w1(quantization: str | None, steps: int, path: Path) -> None:
    model = gpu_engine.random_model("llama-3.1-8b", quantization=quantization)
    engine = gpu_engine.build_engine(model, max_num_seqs=8, max_decode_burst=1)
    [prompt] = gpu_engine.random_prompts(1, 128, seed=1)
    gpu_engine.run_timed(engine, [prompt], SamplingParams(max_tokens=16, ignore_eos=True))
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        gpu_engine.run_timed(engine, [prompt], params)
    prof.export_chrome_trace(str(path))


def device_events(path: Path) -> list[tuple[bool, dict]]:
    """(replayed from a graph?, event) for every kernel and copy, in time order."""
    events = json.loads(path.read_text())["traceEvents"]
    launcher = {
        e["args"].get("correlation"): e["name"]
        for e in events
        if e.get("cat") == "cuda_runtime" and "args" in e
    }
    on_device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    on_device.sort(key=lambda e: e["ts"])
    return [("GraphLaunch" in launcher.get(e["args"].get("correlation"), ""), e) for e in on_device]


def report(path: Path) -> None:
    events = device_events(path)
    replays = sum(1 for i, (graph, _) in enumerate(events) if graph and not events[i - 1][0])
    durations: dict[str, list[float]] = defaultdict(list)
    overlaps: dict[str, list[float]] = defaultdict(list)
    previous_end = None
    for graph, e in events:
        if graph:
            name = f"{e['name'][:48]} {e['args'].get('grid')}"
            durations[name].append(e["dur"])
            if previous_end is not None:
                overlaps[name].append(e["ts"] - previous_end)
        previous_end = e["ts"] + e["dur"]
    print(f"{replays} graph replays; inside the graph, per step:")
    print("| kernel [grid] | launches | median µs | gap before, median µs | effective µs |")
    print("|---|---|---|---|---|")
    for name, ds in sorted(durations.items(), key=lambda kv: -sum(kv[1])):
        gap = statistics.median(overlaps.get(name, [0.0]))
        median = statistics.median(ds)
        print(
            f"| {name} | {len(ds) / replays:.1f} | {median:.2f} | {gap:.2f} |"
            f" {median + min(gap, 0.0):.2f} |"
        )
    # Between two replays: the runs of events outside the graph.
    between: list[list[dict]] = []
    for i, (graph, e) in enumerate(events):
        if not graph and i and events[i - 1][0]:
            between.append([])
        if not graph and between:
            between[-1].append(e)
    between = [run for run in between if run][:-1]
    middle = between[len(between) // 2]
    start = middle[0]["ts"]
    print("\nbetween two replays (the middle step), start offset and duration, µs:")
    for e in middle:
        print(f"  +{e['ts'] - start:7.1f} {e['dur']:7.1f}  {e['name'][:70]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quantization", choices=["fp8"], default=None)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--trace", type=Path, help="keep the Chrome trace here")
    args = parser.parse_args()
    path = args.trace or Path(tempfile.mkdtemp()) / "decode_trace.json"
    trace_w1(args.quantization, args.steps, path)
    report(path)


if __name__ == "__main__":
    main()

"""Where W2's GPU time goes: a window of its engine steps under torch.profiler, every kernel's
time summed by name, apart for the steps that carry a prompt and the decode-only steps.

W2's shape (bench/gpu_engine.py: the random Llama-3.1-8B, 1024 × 512/256, at most 512
running) runs to its end; the profiler records windows of its steps (`--windows
FIRST:COUNT,...`, counted in launches): W2's first ~32 steps admit the first 512 prompts beside
a growing batch of decodes, then 512 decode alone until the first wave ends. A kernel belongs to
the step whose `launch` queued it (the launch's CPU range holds the kernel's launch call). Run
on the GPU machine:

    python bench/step_trace.py [--quantization fp8] [--kv-cache-dtype fp8_e4m3]
        [--windows 8:16,100:16] [--requests 1024]
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `bench` and the appliance

from torch.profiler import ProfilerActivity, profile, record_function

from appliance.engine.sampling_params import SamplingParams
from bench import gpu_engine


def trace_w2(
    quantization: str | None, requests: int, windows: list[tuple[int, int]], directory: Path
) -> list[Path]:
    """One Chrome trace per window of launches, in `directory`."""
    model = gpu_engine.random_model("llama-3.1-8b", quantization=quantization)
    engine = gpu_engine.build_engine(model, max_num_seqs=512)
    gpu_engine.run_timed(
        engine, gpu_engine.random_prompts(8, 512, seed=2), SamplingParams(max_tokens=8)
    )
    runner = engine.runner
    launch = runner.launch
    paths = [directory / f"steps_{first}_{count}.json" for first, count in windows]
    starts = {first: i for i, (first, _) in enumerate(windows)}
    ends = {first + count: i for i, (first, count) in enumerate(windows)}
    prof = None
    launches = 0

    def traced_launch(chunks, num_steps, generators, previous=None):
        nonlocal launches, prof
        launches += 1
        if launches in ends and prof is not None:
            prof.__exit__(None, None, None)
            prof.export_chrome_trace(str(paths[ends[launches]]))
            prof = None
        if launches in starts:
            prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            prof.__enter__()
        kind = "prompt" if any(c.num_new_tokens > 1 for c in chunks) else "decode"
        with record_function(f"step:{kind}:{sum(c.num_new_tokens for c in chunks)}"):
            return launch(chunks, num_steps, generators, previous)

    runner.launch = traced_launch
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    gpu_engine.run_timed(engine, gpu_engine.random_prompts(requests, 512, seed=3), params)
    return [p for p in paths if p.exists()]


def report(path: Path) -> None:
    events = json.loads(path.read_text())["traceEvents"]
    steps = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"])
        for e in events
        if e.get("cat") == "user_annotation" and e["name"].startswith("step:")
    )
    starts = [s for s, _, _ in steps]
    step_of_launch = {}
    for e in events:
        # Triton launches through the driver API, torch and cuBLAS through the runtime's.
        if e.get("cat") not in ("cuda_runtime", "cuda_driver") or "args" not in e:
            continue
        i = bisect.bisect_right(starts, e["ts"]) - 1
        if i >= 0 and e["ts"] <= steps[i][1]:
            step_of_launch[e["args"].get("correlation")] = steps[i][2].split(":")[1]
    on_device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    first = min(e["ts"] for e in on_device)
    last = max(e["ts"] + e["dur"] for e in on_device)
    totals: dict[str, dict[str, float]] = {k: defaultdict(float) for k in ("prompt", "decode")}
    for e in on_device:
        kind = step_of_launch.get(e["args"].get("correlation"))
        if kind is not None:
            totals[kind][e["name"][:70]] += e["dur"]
    kinds = defaultdict(int)
    tokens = defaultdict(int)
    for _, _, name in steps:
        _, kind, n = name.split(":")
        kinds[kind] += 1
        tokens[kind] += int(n)
    busy = sum(e["dur"] for e in on_device)
    print(
        f"window: {len(steps)} steps, {(last - first) / 1e3:.1f} ms of device time, kernels"
        f" busy {busy / 1e3:.1f} ms ({busy / (last - first):.0%})"
    )
    for kind, by_name in totals.items():
        total = sum(by_name.values())
        print(
            f"\n{kind} steps: {kinds[kind]} ({tokens[kind]:,} tokens), kernels {total / 1e3:.1f}"
            f" ms, {total / max(kinds[kind], 1) / 1e3:.2f} ms a step"
        )
        print("| kernel | ms | share |")
        print("|---|---|---|")
        for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:16]:
            print(f"| {name} | {us / 1e3:.1f} | {us / total:.0%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quantization", choices=["fp8"], default=None)
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8_e4m3"], default="auto")
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--windows", default="8:16,100:16", help="FIRST:COUNT,... launches")
    parser.add_argument("--trace-dir", type=Path, help="keep the Chrome traces here")
    args = parser.parse_args()
    windows = [tuple(map(int, w.split(":"))) for w in args.windows.split(",")]
    gpu_engine.run_settings["kv_cache_dtype"] = args.kv_cache_dtype
    directory = args.trace_dir or Path(tempfile.mkdtemp())
    directory.mkdir(parents=True, exist_ok=True)
    for path in trace_w2(args.quantization, args.requests, windows, directory):
        print(f"\n## launches {path.stem.removeprefix('steps_').replace('_', ' + ')}")
        report(path)


if __name__ == "__main__":
    main()

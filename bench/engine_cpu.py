"""CPU smoke benchmark of the engine loop on the embedded model (SmolLM2-135M, float32).

Measures output tokens per second at batch 1 and batch 16 (prompts of PROMPT_TOKENS tokens,
OUTPUT_TOKENS new tokens each, EOS ignored so every run does the same work). Prints a Markdown
row per batch size for docs/BENCHMARKS.md.

    python bench/engine_cpu.py [--model DIR] [--repeats N] [--threads N]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from appliance.engine.engine import Engine
from appliance.engine.engine_config import EngineConfig
from appliance.engine.models.gguf_import import import_gguf
from appliance.engine.sampling_params import SamplingParams
from installer.embedded_model import default_model_dir, find_embedded_gguf

PROMPT_TOKENS = 64
OUTPUT_TOKENS = 64


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _prompts(engine: Engine, batch: int) -> list[list[int]]:
    # Distinct prompts (no prefix-cache help), each exactly PROMPT_TOKENS long.
    base = engine.tokenizer.encode(" ".join(f"item {i} of the list" for i in range(200)))
    return [base[i * 7 : i * 7 + PROMPT_TOKENS] for i in range(batch)]


def _run(engine: Engine, batch: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    prompts = _prompts(engine, batch)
    start = time.perf_counter()
    completions = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(c.token_ids) == OUTPUT_TOKENS for c in completions)
    return batch * OUTPUT_TOKENS / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=0, help="engine.num_cpu_threads; 0: automatic (default)"
    )
    args = parser.parse_args()
    model_dir = args.model or default_model_dir()
    if not (model_dir / "config.json").exists():
        import_gguf(find_embedded_gguf(), model_dir, show_progress=False)
    config = EngineConfig(
        model_dir=model_dir, enable_prefix_caching=False, num_cpu_threads=args.threads
    )
    engine = Engine.from_config(config)
    _run(engine, 2)  # warm-up
    device = f"{_cpu_name()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"
    print(f"device: {device}")
    print("| date | commit | batch | prompt/output tokens | output tok/s (median of runs) |")
    print("|---|---|---|---|---|")
    today = datetime.date.today().isoformat()
    for batch in (1, 16):
        rates = [_run(engine, batch) for _ in range(args.repeats)]
        print(
            f"| {today} | {_commit()} | {batch} | {PROMPT_TOKENS}/{OUTPUT_TOKENS} | "
            f"{statistics.median(rates):.1f} ({', '.join(f'{r:.1f}' for r in rates)}) |"
        )


if __name__ == "__main__":
    main()

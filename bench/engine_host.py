"""Host-side cost of the engine loop at the W2 shape, with the model math stubbed out.

The scheduler, block manager, input preparation and output processing run for real; the model
is a one-layer, 64-wide Llama whose attention returns its queries, so what is timed is almost
entirely the Python the engine runs between GPU steps (the part that leaves the GPU idle until
host and device work overlap). Runs anywhere, no GPU needed.

    python bench/engine_host.py [--requests 1024] [--max-num-seqs 512] [--max-decode-burst 1]
                                [--async-scheduling] [--tokenizer-dir DIR]

Without `--tokenizer-dir` the engine returns token ids only; with a model directory's tokenizer
(one imported from the embedded SmolLM2, say) it also detokenizes every token, as a server does.
"""

from __future__ import annotations

import argparse
import gc
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

import kernels.reference as reference
from appliance.engine.engine import Engine
from appliance.engine.engine_config import EngineConfig
from appliance.engine.models.config import ModelConfig
from appliance.engine.models.decoder import CausalLM
from appliance.engine.sampling_params import SamplingParams
from appliance.engine.tokenizer import Tokenizer

T = TypeVar("T")

STUB_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
}


def stub_model(step_s: float = 0.0) -> CausalLM:
    """The stub model; with `step_s`, each forward pass also sleeps that long, as the engine
    thread sleeps on a blocking CUDA event while a GPU step runs (no CPU spent)."""

    def stub_attention(q: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if step_s:
            time.sleep(step_s)  # one layer: once per forward pass
        return q

    # The reference ops (whatever the kernel contract holds), with attention stubbed out.
    stub_ops = {"paged_attention": stub_attention}
    ops = types.SimpleNamespace(**{**vars(reference), **stub_ops})
    config = ModelConfig.from_dict(STUB_CONFIG)
    with torch.device("meta"):
        model = CausalLM(config, ops)
    model.to_empty(device="cpu")
    for param in model.parameters():
        param.data.normal_()
    model.init_rope_tables(4096)
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--max-decode-burst", type=int, default=1)
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument(
        "--tokenizer-dir",
        type=Path,
        help="a model directory whose tokenizer detokenizes the outputs (the stub samples ids "
        f"below {STUB_CONFIG['vocab_size']})",
    )
    args = parser.parse_args()
    config = EngineConfig(
        model_dir=Path("stub"),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=8192,
        num_kv_blocks=40_000,
        max_decode_burst=args.max_decode_burst,
        async_scheduling=args.async_scheduling,
    )
    tokenizer = None if args.tokenizer_dir is None else Tokenizer.from_model_dir(args.tokenizer_dir)
    engine = Engine.build(config, stub_model(), tokenizer)
    # As `inferno serve` does once ready (appliance.boot.collector_pause): full collections no
    # longer visit torch's and the model's objects, so they cost what the engine allocates.
    gc.freeze()
    prompts = torch.randint(
        0, 1000, (args.requests, 512), generator=torch.Generator().manual_seed(0)
    )
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    for i, prompt in enumerate(prompts.tolist()):
        engine.add_request(str(i), prompt, params)
    # The engine thread's CPU time (steadier than wall time on a shared machine), and of it the
    # scheduling and the output processing (the wait for a step's tokens, collect, included):
    # what is left is the launch, the stub's math included.
    parts = {"schedule": 0.0, "process outputs": 0.0}
    engine.scheduler.schedule = timed(engine.scheduler.schedule, parts, "schedule")  # type: ignore[method-assign]
    engine._process = timed(engine._process, parts, "process outputs")  # type: ignore[method-assign]
    start, start_cpu, steps = time.perf_counter(), time.thread_time(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    elapsed, cpu = time.perf_counter() - start, time.thread_time() - start_cpu
    print(
        f"{args.requests} × 512/256, at most {args.max_num_seqs} running: {steps} steps in "
        f"{elapsed:.2f} s = {elapsed / steps * 1e3:.1f} ms per step; engine thread's CPU "
        f"{cpu / steps * 1e3:.2f} ms per step, of it "
        + ", ".join(f"{name} {s / steps * 1e3:.2f} ms" for name, s in parts.items())
    )


def timed(function: Callable[..., T], parts: dict[str, float], name: str) -> Callable[..., T]:
    """`function`, adding the calling thread's CPU time in it to `parts[name]`."""

    def run(*args: object) -> T:
        start = time.thread_time()
        try:
            return function(*args)
        finally:
            parts[name] += time.thread_time() - start

    return run


if __name__ == "__main__":
    main()

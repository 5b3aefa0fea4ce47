"""gpt-fast beside Inferno on W1 (PERFORMANCE.md): batch-1 decode of the random-weight
Llama-3.1-8B, 128 prompt + 256 new tokens, through gpt-fast's own model and `generate()`
(bench/peers/gpt_fast, vendored unmodified), compiled as its README runs it (`--compile`:
`decode_one_token` under `torch.compile(mode="reduce-overhead", fullgraph=True)`, prefill eager).

The model is gpu_engine's LLAMA_31_8B in gpt-fast's ModelArgs (checked against gpt-fast's own
"llama-3.1-8b" config), with weights drawn as gpu_engine draws them, and the prompt is W1's.
One generation first (compilation, CUDA-graph recording; its time reported alone), then
--runs timed generations. Decode ms/token is W1's: the time after the first token ÷ the 255
tokens after it (a device sync after gpt-fast's prefill marks the first token). Prints Markdown
rows last, as gpu_engine.py does; run it in the same GPU session as gpu_engine.py.

    python bench/gpt_fast_peer.py [--int8] [--runs 5] [--copy-tbs 3.02]
    python bench/gpt_fast_peer.py --shape tiny --device cpu [--eager]   # runs, measures nothing

--int8 is gpt-fast's int8 weight-only quantization (quantize.py, WeightOnlyInt8QuantHandler),
its answer to fewer weight bytes per token. --copy-tbs takes the copy bandwidth gpu_engine.py
measured (TB/s, read + write); without it the same measurement runs here (on CUDA).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch
from gpu_engine import (  # bench/, the script's own directory
    LLAMA_31_8B,
    copy_bandwidth,
    random_prompts,
    report,
    rows,
)

from appliance.engine.models.loader import fill_randomly

GPT_FAST_DIR = Path(__file__).parent / "peers" / "gpt_fast"
GPT_FAST_COMMIT = "6ecad9b"  # bench/peers/gpt_fast/README.md
SHAPES = {
    "8b": LLAMA_31_8B,
    # The 8B's vocabulary, so the prompt is W1's; GQA kept (2 query heads per KV head).
    "tiny": {**LLAMA_31_8B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64},
}  # fmt: skip
PROMPT_TOKENS = 128
NEW_TOKENS = 256
# gpt-fast's generate.py defaults (its README's figures are sampled with them).
SAMPLING = {"temperature": 0.8, "top_k": 200}


def import_gpt_fast() -> types.SimpleNamespace:
    """gpt-fast's modules, imported as its scripts import each other (top-level `model`,
    `generate`, `quantize`). Importing generate.py applies gpt-fast's inductor settings
    (coordinate descent tuning, FX graph cache), which belong to what is measured.

    Its generate.py and quantize.py import its `tokenizer` module, which needs sentencepiece
    and tiktoken; the benchmark feeds token ids, so a module whose get_tokenizer refuses
    stands in for it."""
    tokenizer = types.ModuleType("tokenizer")

    def get_tokenizer(*args: object) -> None:
        raise RuntimeError("bench/gpt_fast_peer.py feeds token ids: gpt-fast's tokenizer is absent")

    tokenizer.get_tokenizer = get_tokenizer  # type: ignore[attr-defined]
    sys.modules["tokenizer"] = tokenizer
    sys.path.insert(0, str(GPT_FAST_DIR))
    import generate
    import model
    import quantize

    return types.SimpleNamespace(generate=generate, model=model, quantize=quantize)


def model_args(gpt_fast: types.SimpleNamespace, config: dict) -> object:
    """gpt-fast's ModelArgs for a config in gpu_engine's (Hugging Face's) terms."""
    scaling = dict(config["rope_scaling"])
    if scaling.pop("rope_type") != "llama3":
        raise ValueError("rope_scaling.rope_type: gpt-fast implements only llama3's scaling")
    if config["head_dim"] * config["num_attention_heads"] != config["hidden_size"]:
        raise ValueError("head_dim: gpt-fast derives it as hidden_size ÷ num_attention_heads")
    return gpt_fast.model.ModelArgs(
        block_size=config["max_position_embeddings"],
        vocab_size=config["vocab_size"],
        n_layer=config["num_hidden_layers"],
        n_head=config["num_attention_heads"],
        n_local_heads=config["num_key_value_heads"],
        dim=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        rope_base=config["rope_theta"],
        norm_eps=config["rms_norm_eps"],
        rope_scaling=scaling,
    )


def build_model(
    gpt_fast: types.SimpleNamespace, shape: str, device: str, int8: bool
) -> torch.nn.Module:
    """gpt-fast's Transformer of `shape` in bf16 with gpu_engine's random weights, int8
    weight-only quantized by gpt-fast's handler when `int8`."""
    args = model_args(gpt_fast, SHAPES[shape])
    if shape == "8b" and args != gpt_fast.model.ModelArgs.from_name("llama-3.1-8b"):
        raise ValueError(
            f"gpu_engine's LLAMA_31_8B as gpt-fast's ModelArgs ({args}) differs from gpt-fast's "
            f"own llama-3.1-8b ({gpt_fast.model.ModelArgs.from_name('llama-3.1-8b')})"
        )
    with torch.device("meta"):
        model = gpt_fast.model.Transformer(args).to(torch.bfloat16)
    model.to_empty(device=device)
    fill_randomly(model, seed=0)
    if int8:
        # As gpt-fast's quantize.py writes an int8 checkpoint and generate.py loads it: the
        # quantized state, then the int8 modules (on meta) filled by assignment.
        handler = gpt_fast.quantize.WeightOnlyInt8QuantHandler(model)
        state = handler.create_quantized_state_dict()
        with torch.device("meta"):
            handler.convert_for_runtime()
        model.load_state_dict(state, assign=True)
    return model.eval()


def streamed_bytes(model: torch.nn.Module) -> int:
    """Weight bytes a decode step reads: every parameter and buffer but the embedding (one row
    is looked up) and the KV caches (gpt-fast's own _get_model_size counts those too)."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return sum(
        t.numel() * t.element_size()
        for name, t in tensors
        if not name.startswith("tok_embeddings.") and ".kv_cache." not in name
    )


class TimedGeneration:
    """gpt-fast's generate() with its prefill followed by a device sync and a timestamp, so
    that one call splits into time to the first token and time for the tokens after it."""

    def __init__(self, gpt_fast: types.SimpleNamespace, model: torch.nn.Module, device: str):
        self.generate = gpt_fast.generate
        self.model = model
        self.device = device
        self.first_token_at = 0.0
        eager_prefill = self.generate.prefill

        def prefill_then_mark(*args: object, **kwargs: object) -> torch.Tensor:
            token = eager_prefill(*args, **kwargs)
            self.generate.device_sync(device)
            self.first_token_at = time.perf_counter()
            return token

        # generate() calls the module's global, as gpt-fast's main() rebinds it to compile.
        self.generate.prefill = prefill_then_mark

    def __call__(self, prompt: torch.Tensor) -> tuple[float, float]:
        """(seconds to the first token, seconds for the NEW_TOKENS - 1 after it)."""
        self.generate.device_sync(self.device)
        start = time.perf_counter()
        seq, _ = self.generate.generate(
            self.model,
            prompt,
            NEW_TOKENS,
            batch_size=1,
            interactive=False,
            draft_model=None,
            **SAMPLING,
        )
        self.generate.device_sync(self.device)
        end = time.perf_counter()
        assert seq.shape == (1, PROMPT_TOKENS + NEW_TOKENS)
        return self.first_token_at - start, end - self.first_token_at


def prepare(args: argparse.Namespace) -> TimedGeneration:
    """gpt-fast's model of --shape on --device, its decode step compiled unless --eager."""
    gpt_fast = import_gpt_fast()
    if torch.device(args.device).type == "cpu":
        # gpt-fast compiles create_block_mask even without --compile, for two shapes; in torch
        # 2.13 inductor's C++ for the second, dynamic-shape compile does not build (mismatched
        # VecMask types), a second static one does. CPU runs only check the script.
        torch._dynamo.config.automatic_dynamic_shapes = False
    start = time.perf_counter()
    model = build_model(gpt_fast, args.shape, args.device, args.int8)
    report(f"gpt-fast random {args.shape} model built", f"{time.perf_counter() - start:.1f} s")
    if not args.eager:
        # gpt-fast's main() with --compile (no draft model, no --compile_prefill).
        gpt_fast.generate.decode_one_token = torch.compile(
            gpt_fast.generate.decode_one_token, mode="reduce-overhead", fullgraph=True
        )
    return TimedGeneration(gpt_fast, model, args.device)


def w1(generation: TimedGeneration, runs: int, copy_bw: float | None, label: str) -> None:
    [ids] = random_prompts(1, PROMPT_TOKENS, seed=1)
    prompt = torch.tensor(ids, dtype=torch.int64, device=generation.device)
    first, rest = generation(prompt)
    report(f"gpt-fast first generation ({label}: compilation, graphs)", f"{first + rest:.1f} s")
    timings = [generation(prompt) for _ in range(runs)]
    ms = statistics.median(rest / (NEW_TOKENS - 1) for _, rest in timings) * 1e3
    report(
        f"gpt-fast W1 decode ms/token ({label}; batch 1, {PROMPT_TOKENS}+{NEW_TOKENS}, "
        f"median of {runs})",
        f"{ms:.2f} ms ({1e3 / ms:.1f} tok/s)",
    )
    streamed = streamed_bytes(generation.model)
    achieved = streamed / (ms * 1e-3)
    share = "" if copy_bw is None else f" = {achieved / copy_bw:.0%} of copy"
    report(
        f"gpt-fast W1 weight bytes/s ({label})",
        f"{streamed / 1e9:.2f} GB per token at {achieved / 1e12:.2f} TB/s{share}",
    )
    ttft_ms = statistics.median(first for first, _ in timings) * 1e3
    own = statistics.median(NEW_TOKENS / (first + rest) for first, rest in timings)
    report(
        f"gpt-fast W1 time to first token (eager prefill) and its own tok/s ({label})",
        f"{ttft_ms:.1f} ms; {own:.1f} tok/s ({NEW_TOKENS} ÷ whole generate())",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--runs", type=int, default=5, help="timed generations after the first")
    parser.add_argument("--int8", action="store_true", help="gpt-fast's int8 weight-only")
    parser.add_argument("--eager", action="store_true", help="no torch.compile (a check only)")
    parser.add_argument("--copy-tbs", type=float, help="copy bandwidth in TB/s (gpu_engine.py's)")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    commit = (
        os.environ.get("INFERNO_COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
    )
    on_cuda = torch.device(args.device).type == "cuda"
    device_name = torch.cuda.get_device_name(args.device) if on_cuda else "CPU"
    print(
        f"date {datetime.date.today()} device {device_name} torch {torch.__version__} "
        f"commit {commit or 'unknown'} gpt-fast {GPT_FAST_COMMIT}"
    )
    copy_bw = None
    if args.copy_tbs is not None:
        copy_bw = args.copy_tbs * 1e12
        report("copy bandwidth (read + write, given)", f"{args.copy_tbs:.2f} TB/s")
    elif on_cuda:
        copy_bw = copy_bandwidth()
        report("copy bandwidth (read + write)", f"{copy_bw / 1e12:.2f} TB/s")
    weights = "int8 weight-only" if args.int8 else "bf16"
    w1(prepare(args), args.runs, copy_bw, f"{weights}, {'eager' if args.eager else 'compiled'}")
    print("\n| metric | value | goal |\n|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()

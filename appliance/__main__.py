"""The `inferno` command."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from appliance.engine.errors import EngineError
from installer.errors import InstallerError

if TYPE_CHECKING:  # the engine imports torch: only load it for commands that need it
    from appliance.engine.engine import Engine
    from appliance.engine.sampling_params import SamplingParams

_DESCRIPTION = "Inferno: a confidential LLM inference appliance."


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("INFERNO_LOG_LEVEL", "WARNING").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.run(args) or 0)
    except (EngineError, InstallerError) as exc:
        print(f"inferno: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inferno", description=_DESCRIPTION)
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    gen = commands.add_parser("generate", help="generate one completion and print only its text")
    gen.add_argument("--model", required=True, type=Path, help="model directory")
    gen.add_argument("--prompt", required=True, help="prompt text (a user message with --chat)")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    _add_sampling_args(gen)
    gen.set_defaults(run=_run_generate)

    demo = commands.add_parser(
        "demo", help="chat with the embedded default model (converted on first use)"
    )
    demo.add_argument("--model", type=Path, default=None, help="model directory to use instead")
    _add_sampling_args(demo, max_tokens=256)
    demo.set_defaults(run=_run_demo)

    model = commands.add_parser("model", help="manage model directories")
    model_commands = model.add_subparsers(required=True, metavar="ACTION")
    imp = model_commands.add_parser("import-gguf", help="convert a GGUF file to a model directory")
    imp.add_argument("gguf", type=Path, help="the .gguf file")
    imp.add_argument("outdir", type=Path, help="model directory to create")
    imp.set_defaults(run=_run_import_gguf)
    return parser


def _add_sampling_args(parser: argparse.ArgumentParser, *, max_tokens: int = 128) -> None:
    parser.add_argument(
        "--device", default="cpu", help="cpu, or cuda for the GPU path (bf16, Triton kernels)"
    )
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    from appliance.engine.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )


def _load_engine(model_dir: Path, device: str) -> Engine:
    from appliance.engine.engine import Engine, EngineConfig

    return Engine.from_config(EngineConfig(model_dir=model_dir, device=device))


def _run_generate(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    engine = _load_engine(args.model, args.device)
    prompt: str | list[int] = args.prompt
    if args.chat:
        prompt = _chat_prompt(engine, [{"role": "user", "content": args.prompt}])
    [completion] = engine.generate([prompt], params)
    sys.stdout.write(completion.text)
    if sys.stdout.isatty():
        sys.stdout.write("\n")
    return 0


def _run_import_gguf(args: argparse.Namespace) -> int:
    from appliance.engine.models.gguf_import import import_gguf

    out = import_gguf(args.gguf, args.outdir, show_progress=sys.stderr.isatty())
    print(f"model directory written: {out}", file=sys.stderr)
    return 0


def _run_demo(args: argparse.Namespace) -> int:
    from appliance.engine.models.gguf_import import import_gguf
    from installer.embedded_model import default_model_dir, find_embedded_gguf

    model_dir = args.model or default_model_dir()
    if not (model_dir / "config.json").exists():
        print(f"converting the embedded model into {model_dir} ...", file=sys.stderr)
        import_gguf(find_embedded_gguf(), model_dir, show_progress=sys.stderr.isatty())
    params = _sampling_params(args)
    engine = _load_engine(model_dir, args.device)
    interactive = sys.stdin.isatty()
    if interactive:
        print("Inferno demo: chat with SmolLM2-135M-Instruct on this machine. Ctrl-D ends.")
    messages: list[dict[str, str]] = []
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.strip()})
        reply = _stream(engine, _chat_prompt(engine, messages), params)
        messages.append({"role": "assistant", "content": reply})


def _chat_prompt(engine: Engine, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a conversation in the model's chat template (which carries its own BOS)."""
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return engine.tokenizer.encode(text, add_special_tokens=False)


def _stream(engine: Engine, prompt: list[int], params: SamplingParams) -> str:
    """Generate one reply, writing its text as it arrives."""
    engine.add_request("demo", prompt, params)
    parts = []
    while engine.has_unfinished():
        for out in engine.step():
            parts.append(out.text)
            sys.stdout.write(out.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return "".join(parts)


if __name__ == "__main__":
    sys.exit(main())

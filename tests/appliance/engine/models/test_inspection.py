"""`inferno model inspect`: the shape of a model directory and whether the engine serves it,
from its config and safetensors headers alone; anything unsupported is one line naming it."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from appliance.__main__ import main
from appliance.engine.models.inspection import inspect_model


def _fields(output: str) -> dict[str, str]:
    """The report's rows: a name, two or more spaces, the value."""
    return dict(re.split(r"\s{2,}", line, maxsplit=1) for line in output.splitlines())


def _copy(tiny_checkpoints, name: str, tmp_path: Path) -> Path:
    source, _ = tiny_checkpoints(name)
    return Path(shutil.copytree(source, tmp_path / name))


def test_inspect_reports_a_gemma3_checkpoint_it_serves(tiny_checkpoints, capsys):
    model_dir, _ = tiny_checkpoints("gemma3")
    assert main(["model", "inspect", str(model_dir)]) == 0
    out = _fields(capsys.readouterr().out)
    assert out["architecture"] == "Gemma3ForCausalLM"
    assert out["served"] == "yes"
    assert out["context"] == "512 tokens"
    assert out["windows"] == "24 tokens on 2 of 3 layers; full attention on 1"
    # 2 (k, v) x 3 layers x 2 KV heads x 16 dims x 2 bytes
    assert out["KV bytes/token"].startswith("384 ")
    assert out["KV groups"] == (
        "full 128 B/token (1 of 3 KV layers) for every token; "
        "window 256 B/token (2 of 3) for the last 24 of each sequence"
    )
    assert out["dtype"] == "F32 100%"
    assert out["parameters"].endswith("in 1 file(s)")


def test_inspect_counts_the_vision_tower_and_serves_the_text_model(tiny_checkpoints):
    model_dir, _ = tiny_checkpoints("gemma3-multimodal")
    report = inspect_model(model_dir)
    assert report.unsupported is None
    assert report.architecture == "Gemma3ForConditionalGeneration"


def test_inspect_names_an_unsupported_architecture_in_one_line(tiny_checkpoints, tmp_path, capsys):
    model_dir = _copy(tiny_checkpoints, "qwen3", tmp_path)
    raw = json.loads((model_dir / "config.json").read_text())
    raw["architectures"] = ["DeepseekV3ForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(raw))
    assert main(["model", "inspect", str(model_dir)]) == 1
    out = _fields(capsys.readouterr().out)
    assert out["served"] == "no"
    assert "'DeepseekV3ForCausalLM' is not supported" in out["not supported"]
    assert out["parameters"].startswith("0.11 M"), "what can be read is still shown"


@pytest.mark.parametrize(
    ("defect", "named"),
    [
        ("missing tensor", "model.norm.weight"),
        ("quantized", "quantization_config"),
    ],
)
def test_inspect_names_what_the_engine_would_refuse(tiny_checkpoints, tmp_path, defect, named):
    model_dir = _copy(tiny_checkpoints, "qwen3", tmp_path)
    if defect == "missing tensor":
        tensors = load_file(model_dir / "model.safetensors")
        del tensors["model.norm.weight"]
        save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
        named = "norm.weight"
    else:
        raw = json.loads((model_dir / "config.json").read_text())
        raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
        (model_dir / "config.json").write_text(json.dumps(raw))
    report = inspect_model(model_dir)
    assert report.unsupported is not None and named in report.unsupported

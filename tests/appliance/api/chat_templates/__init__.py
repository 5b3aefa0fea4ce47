"""Chat templates of other model families, vendored (each file names its source), and a model
directory that uses one with SmolLM2's vocabulary and weights."""

from __future__ import annotations

import json
from pathlib import Path

TEMPLATES = Path(__file__).parent


def with_chat_template(model_dir: Path, template: str, out: Path) -> Path:
    """`out` made a copy of `model_dir` (its files linked) whose tokenizer_config.json has the
    chat template `template` (a file name here)."""
    for item in model_dir.iterdir():
        if item.name != "tokenizer_config.json":
            (out / item.name).symlink_to(item)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = (TEMPLATES / template).read_text()
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out

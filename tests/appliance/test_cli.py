"""The `inferno` command as a user runs it: a separate process, real files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from appliance.engine.engine import Engine, EngineConfig
from appliance.engine.sampling_params import SamplingParams


def _inferno(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "appliance", *args],
        capture_output=True,
        text=True,
        input=stdin,
        timeout=300,
        check=False,
    )


@pytest.mark.slow
def test_generate_chat_prints_only_the_greedy_completion(smollm2_dir: Path) -> None:
    question = "Name a famous painting by Leonardo da Vinci."
    result = _inferno(
        "generate", "--model", str(smollm2_dir), "--prompt", question, "--chat",
        "--max-tokens", "24", "--temperature", "0",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    engine = Engine.from_config(EngineConfig(model_dir=smollm2_dir))
    tok = engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": question}])
    prompt = tok.encode(text, add_special_tokens=False)
    [expected] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24))
    assert result.stdout == expected.text
    assert expected.text


def test_generate_with_an_unknown_model_dir_says_so_and_exits_2(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    result = _inferno("generate", "--model", str(missing), "--prompt", "hi")
    assert result.returncode == 2
    assert result.stdout == ""
    assert f"model directory {missing} does not exist" in result.stderr
    assert "Traceback" not in result.stderr


def test_generate_with_a_corrupt_safetensors_file_names_the_file(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_bytes((smollm2_dir / name).read_bytes())
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    result = _inferno("generate", "--model", str(broken), "--prompt", "hi")
    assert result.returncode == 2
    assert "model.safetensors is not a valid safetensors file" in result.stderr


def test_generate_with_bad_sampling_parameters_names_the_parameter(smollm2_dir: Path) -> None:
    result = _inferno("generate", "--model", str(smollm2_dir), "--prompt", "hi", "--top-p", "1.5")
    assert result.returncode == 2
    assert "'top_p'" in result.stderr


def test_import_gguf_of_a_missing_file_fails_cleanly(tmp_path: Path) -> None:
    result = _inferno("model", "import-gguf", str(tmp_path / "x.gguf"), str(tmp_path / "out"))
    assert result.returncode == 2
    assert "x.gguf" in result.stderr
    assert not (tmp_path / "out").exists()


def test_demo_answers_each_piped_line_as_a_chat_turn(smollm2_dir: Path) -> None:
    result = _inferno(
        "demo", "--model", str(smollm2_dir), "--max-tokens", "12",
        stdin="What is 2 plus 2?\n\nName a colour.\n",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    replies = result.stdout.splitlines()
    # Two questions (the blank line is skipped): two replies, one per line.
    assert len(replies) == 2
    assert all(reply.strip() for reply in replies)

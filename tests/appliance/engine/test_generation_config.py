"""generation_config.json as transformers reads it: several end-of-sequence ids, and the
sampling defaults a request that leaves them out gets (vLLM's `--generation-config auto`);
values this server cannot use are refused naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from appliance.engine.errors import ModelLoadError
from appliance.engine.generation_config import GenerationConfig, SamplingDefaults

# Qwen/Qwen3-8B's generation_config.json, unchanged.
QWEN3 = {
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
    "transformers_version": "4.51.0",
}


def _written(tmp_path: Path, config: dict[str, Any]) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_qwen3s_file_reads_as_transformers_reads_it(tmp_path: Path) -> None:
    from transformers import GenerationConfig as HFGenerationConfig

    model_dir = _written(tmp_path, QWEN3)
    ours = GenerationConfig.from_model_dir(model_dir)
    theirs = HFGenerationConfig.from_pretrained(model_dir)
    assert list(ours.eos_token_ids) == theirs.eos_token_id == [151645, 151643]
    assert ours.defaults == SamplingDefaults(
        temperature=theirs.temperature, top_p=theirs.top_p, top_k=theirs.top_k
    )
    assert ours.defaults.stated() == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}


def test_one_eos_id_every_default_and_nulls_as_absent(tmp_path: Path) -> None:
    config = {"eos_token_id": 2, "temperature": 0, "top_p": 1, "min_p": 0.05,
              "repetition_penalty": 1.1, "max_new_tokens": 256, "top_k": None}  # fmt: skip
    read = GenerationConfig.from_model_dir(_written(tmp_path, config))
    assert read == GenerationConfig(
        (2,),
        SamplingDefaults(temperature=0.0, top_p=1.0, min_p=0.05, repetition_penalty=1.1,
                         max_tokens=256),
    )  # fmt: skip


def test_a_model_without_the_file_states_nothing(tmp_path: Path) -> None:
    assert GenerationConfig.from_model_dir(tmp_path) == GenerationConfig()
    assert GenerationConfig().defaults.stated() == {}


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("temperature", "hot", "temperature must be a number in [0, 2]"),
        ("temperature", 3.0, "temperature must be a number in [0, 2]"),
        ("top_p", 0, "top_p must be a number in (0, 1]"),
        ("top_k", -1, "top_k must be an integer of at least 0"),
        ("top_k", True, "top_k must be an integer"),
        ("repetition_penalty", 0, "repetition_penalty must be a number above 0"),
        ("max_new_tokens", 0, "max_new_tokens must be an integer of at least 1"),
        ("eos_token_id", "</s>", "eos_token_id must be a token id or a list"),
        ("eos_token_id", [1, -2], "eos_token_id must be a token id or a list"),
    ],
)
def test_a_value_this_server_cannot_use_is_refused_naming_the_file_and_field(
    tmp_path: Path, field: str, value: object, words: str
) -> None:
    with pytest.raises(ModelLoadError) as refused:
        GenerationConfig.from_model_dir(_written(tmp_path, {field: value}))
    assert "generation_config.json" in str(refused.value)
    assert words in str(refused.value)


def test_a_file_that_is_not_a_json_object_is_refused(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text("[1]")
    with pytest.raises(ModelLoadError, match="not a JSON object"):
        GenerationConfig.from_model_dir(tmp_path)

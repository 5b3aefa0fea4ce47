"""The weights digest every inference entry names: reproducible with standard tools."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from appliance.boot.weights import digest_weights
from appliance.errors import ModelFilesError


def test_the_digest_is_the_documented_sha256sum_listing_of_every_weight_file(
    tmp_path: Path,
) -> None:
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"second shard")
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"first shard")
    (tmp_path / "config.json").write_text("{}")
    listed = subprocess.run(
        "LC_ALL=C sha256sum *.safetensors | sha256sum",
        shell=True, cwd=tmp_path, capture_output=True, text=True, check=True,
    ).stdout.split()[0]  # fmt: skip
    assert digest_weights(tmp_path) == f"sha256:{listed}"
    before = digest_weights(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"second shard, changed")
    assert digest_weights(tmp_path) != before


def test_a_directory_without_weight_files_has_no_digest(tmp_path: Path) -> None:
    with pytest.raises(ModelFilesError, match=r"holds no \*\.safetensors weight files"):
        digest_weights(tmp_path)


@pytest.mark.slow
def test_the_served_model_on_three_processes_answers_as_on_one(smollm2_dir: Path) -> None:
    """`engine.tensor_parallel_size = 3` on the server's load path (LoadedModel.load): the
    workers start, each reads its shard, and the greedy answer is the one-process answer."""
    from appliance.boot.weights import LoadedModel
    from appliance.engine.engine_config import EngineConfig
    from appliance.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8)
    answers = []
    for size in (1, 3):
        config = EngineConfig(
            model_dir=smollm2_dir, tensor_parallel_size=size, num_kv_blocks=32, num_cpu_threads=1
        )
        loaded = LoadedModel.load(config)
        try:
            [answer] = loaded.engine.generate(["The capital of France is"], params)
            answers.append(answer.token_ids)
            assert loaded.weights_digest == digest_weights(smollm2_dir)
            assert set(loaded.phases_ms) == {"weights_ms", "engine_build_ms"}
        finally:
            loaded.engine.close()
    assert answers[0] == answers[1] and answers[0]

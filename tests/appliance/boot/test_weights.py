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

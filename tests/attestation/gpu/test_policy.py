"""The [gpu] policy table: fail closed on anything empty, missing, unknown or unsafe."""

from __future__ import annotations

from pathlib import Path

import pytest

from attestation.errors import PolicyError
from attestation.gpu import GpuPolicy

MINIMAL = {"driver_versions": ["550.90.07"], "vbios_versions": ["96.00.9f.00.01"], "num_gpus": 8}


def test_minimal_table_takes_the_secure_defaults() -> None:
    policy = GpuPolicy.from_table(MINIMAL)
    assert policy.vbios_versions == {"96.00.9F.00.01"}  # hex compared in one case
    assert policy.num_gpus == {8}
    assert policy.require_cc_on and policy.require_dev_tools_off
    assert not policy.accept_expired_rim_certificate
    assert policy.revocation_accept == {"good"}
    assert policy.allowed_mismatch_indices == frozenset()
    assert policy.architectures == {"HOPPER"} and policy.chips == {"GH100"}


@pytest.mark.parametrize(
    ("defect", "table", "message"),
    [
        ("empty table", {}, "empty GPU policy never passes"),
        ("missing driver versions", {**MINIMAL, "driver_versions": None}, "driver_versions"),
        ("empty allow-list", {**MINIMAL, "driver_versions": []}, "non-empty list"),
        ("typo in a key", {**MINIMAL, "require_cc_onn": True}, "unknown keys"),
        ("revoked accepted", {**MINIMAL, "revocation_accept": ["good", "revoked"]}, "never"),
        ("unknown state", {**MINIMAL, "revocation_accept": ["fine"]}, "unknown state"),
        ("zero GPUs", {**MINIMAL, "num_gpus": 0}, "positive integer"),
        ("boolean count", {**MINIMAL, "num_gpus": True}, "positive integer"),
        ("string flag", {**MINIMAL, "require_cc_on": "yes"}, "true or false"),
        ("block index 0", {**MINIMAL, "allowed_mismatch_indices": [0]}, "block indices"),
        ("expired as maybe", {**MINIMAL, "expired_rim_certificate": "warn"}, "reject or accept"),
        ("negative max age", {**MINIMAL, "revocation_max_age_s": -1}, "positive integer"),
    ],
)
def test_unsafe_or_malformed_table_is_refused(defect: str, table: dict, message: str) -> None:
    table = {k: v for k, v in table.items() if v is not None}
    with pytest.raises(PolicyError, match=message):
        GpuPolicy.from_table(table)


def test_boards_are_optional_and_never_empty() -> None:
    assert GpuPolicy.from_table(MINIMAL).boards is None
    assert GpuPolicy.from_table({**MINIMAL, "boards": ["g520_0200_885"]}).boards == {
        "G520_0200_885"
    }
    with pytest.raises(PolicyError, match="boards must be a non-empty list"):
        GpuPolicy.from_table({**MINIMAL, "boards": []})


def test_policy_file_without_a_gpu_table_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "policy.toml"
    path.write_text("[snp]\nallow_debug = false\n")
    with pytest.raises(PolicyError, match=r"no \[gpu\] table"):
        GpuPolicy.from_file(path)


def test_empty_and_missing_policy_files_are_refused(tmp_path: Path) -> None:
    (tmp_path / "empty.toml").write_text("")
    with pytest.raises(PolicyError, match="empty"):
        GpuPolicy.from_file(tmp_path / "empty.toml")
    with pytest.raises(PolicyError, match="does not exist"):
        GpuPolicy.from_file(tmp_path / "absent.toml")


def test_policy_file_is_read(tmp_path: Path) -> None:
    path = tmp_path / "policy.toml"
    path.write_text(
        '[gpu]\ndriver_versions = ["550.90.07"]\nvbios_versions = ["96.00.9F.00.01"]\n'
        'num_gpus = [1, 8]\nrevocation_accept = ["good", "stale"]\n'
    )
    policy = GpuPolicy.from_file(path)
    assert policy.num_gpus == {1, 8}
    assert policy.revocation_accept == {"good", "stale"}

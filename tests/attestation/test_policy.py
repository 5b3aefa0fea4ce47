"""The attestation policy file: read fail-closed, within a size and a nesting limit (issue 13,
defect 2: tomllib recurses on nested arrays and inline tables)."""

from __future__ import annotations

from pathlib import Path

import pytest

from attestation.errors import PolicyError
from attestation.input_limits import MAX_POLICY_BYTES
from attestation.policy import read_policy_file

DEEP = 100_000


@pytest.mark.parametrize("value", ["[" * DEEP + "]" * DEEP, "{ a = " * DEEP + "1" + " }" * DEEP])
def test_policy_100000_levels_deep_is_a_policy_error(tmp_path: Path, value: str) -> None:
    path = tmp_path / "policy.toml"
    path.write_text(f"[gpu]\nx = {value}\n")
    with pytest.raises(PolicyError, match=f"policy file {path} nests .* deeper than 64 levels"):
        read_policy_file(path)


def test_policy_over_its_size_limit_is_a_policy_error(tmp_path: Path) -> None:
    path = tmp_path / "policy.toml"
    path.write_text("[gpu]\n" + "# padding\n" * (MAX_POLICY_BYTES // 10 + 1))
    with pytest.raises(PolicyError, match="over the limit of 1048576 bytes"):
        read_policy_file(path)


def test_policy_that_is_not_utf8_is_a_policy_error(tmp_path: Path) -> None:
    path = tmp_path / "policy.toml"
    path.write_bytes(b'[gpu]\nx = "\xff"\n')
    with pytest.raises(PolicyError, match="not TOML: it is not UTF-8"):
        read_policy_file(path)

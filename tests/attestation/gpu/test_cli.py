"""`python -m attestation verify-gpu`: the JSON verdict and the exit status (0 trusted, 1 not
trusted, 2 unusable input), run in-process through main() and once as a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from attestation.__main__ import main
from attestation.gpu.evidence import evidence_list_to_json
from attestation.input_limits import MAX_GPU_EVIDENCE_BYTES
from tests.attestation.gpu.conftest import VECTORS, RealGpu

POLICY_545 = """\
[gpu]
driver_versions = ["545.00"]
vbios_versions = ["96.00.5E.00.01"]
num_gpus = 1
require_cc_on = false          # evidence from the exchange format carries no NVML state
require_dev_tools_off = false
revocation_accept = ["good", "unchecked"]
"""


@pytest.fixture
def files_545(tmp_path: Path, gpu_545: RealGpu) -> list[str]:
    (tmp_path / "evidence.json").write_text(evidence_list_to_json([gpu_545.evidence]))
    (tmp_path / "policy.toml").write_text(POLICY_545)
    return [
        "verify-gpu",
        "--evidence",
        str(tmp_path / "evidence.json"),
        "--rims",
        str(VECTORS / "h100-545"),
        "--policy",
        str(tmp_path / "policy.toml"),
    ]


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    status = main(args)
    return status, json.loads(capsys.readouterr().out)


def test_545_at_a_pinned_time_is_trusted(
    files_545: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    status, out = run([*files_545, "--at", "2025-05-01T00:00:00Z"], capsys)
    assert status == 0
    assert out["result"] == "trusted"
    assert out["at"] == "2025-05-01T00:00:00Z"
    assert out["claims"]["gpus"][0]["num_measurements_compared"] == 33


def test_545_today_is_not_trusted_and_says_why(
    files_545: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    status, out = run([*files_545, "--at", "2026-11-22T00:00:00+00:00"], capsys)
    assert status == 1
    assert out["result"] == "not trusted"
    assert {f["name"] for f in out["failed"]} == {"gpu0.rim.driver", "gpu0.rim.vbios"}
    assert all("RIM certificate expired" in f["detail"] for f in out["failed"])


def test_wrong_expected_nonce_is_not_trusted(
    files_545: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    status, out = run([*files_545, "--at", "2025-05-01T00:00:00Z", "--nonce", "00" * 32], capsys)
    assert status == 1
    assert [f["name"] for f in out["failed"]] == ["gpu0.nonce"]


@pytest.mark.parametrize(
    ("defect", "edit"),
    [
        ("empty policy", lambda d: (d / "policy.toml").write_text("")),
        ("policy without [gpu]", lambda d: (d / "policy.toml").write_text("[snp]\nx = 1\n")),
        ("evidence not JSON", lambda d: (d / "evidence.json").write_text("{")),
        ("evidence missing", lambda d: (d / "evidence.json").unlink()),
    ],
)
def test_unusable_input_exits_2(
    files_545: list[str],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    defect: str,
    edit: Callable[[Path], object],
) -> None:
    edit(tmp_path)
    status, out = run(files_545, capsys)
    assert status == 2, defect
    assert out["result"] == "unusable input"


def test_time_without_offset_is_unusable(
    files_545: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    status, out = run([*files_545, "--at", "2025-05-01T00:00:00"], capsys)
    assert status == 2
    assert "UTC offset" in out["error"]


def test_nvat_evidence_through_a_subprocess(tmp_path: Path) -> None:
    policy = tmp_path / "policy.toml"
    policy.write_text(
        POLICY_545.replace("545.00", "590.12").replace("96.00.5E.00.01", "96.00.A5.00.01")
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "attestation",
            "verify-gpu",
            "--evidence",
            str(VECTORS / "nvat-format" / "hopper_evidence_590.12.json"),
            "--rims",
            str(tmp_path),
            "--policy",
            str(policy),
            "--roots",
            str(VECTORS / "roots"),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 1, result.stderr
    out = json.loads(result.stdout)
    passed = {c["name"] for c in out["checks"] if c["passed"]}
    assert {"gpu0.signature", "gpu0.certificate_chain", "gpu0.fwid", "gpu0.nonce"} <= passed
    assert {f["name"] for f in out["failed"]} == {"gpu0.rim.driver", "gpu0.rim.vbios"}


def test_ppcie_evidence_of_8_gpus_is_verified_not_refused_for_its_format(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 13, defect 3: exit 1 (no RIMs are published for it), not 2 "unknown keys"."""
    policy = tmp_path / "policy.toml"
    policy.write_text(
        POLICY_545.replace("545.00", "590.12")
        .replace("96.00.5E.00.01", "96.00.A5.00.01")
        .replace("num_gpus = 1", "num_gpus = 8")
    )
    status, out = run(
        ["verify-gpu", "--evidence", str(VECTORS / "ppcie" / "gpu_evidence.json"),
         "--rims", str(tmp_path), "--policy", str(policy), "--at", "2026-11-22T00:00:00Z"],
        capsys,
    )  # fmt: skip
    assert status == 1, out
    assert {f["name"].split(".", 1)[1] for f in out["failed"]} == {"rim.driver", "rim.vbios"}
    assert len(out["claims"]["gpus"]) == 8


DEEP = 100_000


def _subprocess(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "attestation", *args], capture_output=True, text=True, check=False
    )


@pytest.mark.parametrize("defect", ["evidence", "policy"])
def test_input_100000_levels_deep_exits_2_with_one_line_and_no_traceback(
    tmp_path: Path, defect: str
) -> None:
    """Issue 13, defect 2: unusable input, not a RecursionError traceback (exit 1)."""
    evidence, policy = tmp_path / "evidence.json", tmp_path / "policy.toml"
    deep = "[" * DEEP + "]" * DEEP
    nvat = (VECTORS / "nvat-format" / "hopper_evidence_590.12.json").read_text()
    evidence.write_text(deep if defect == "evidence" else nvat)
    policy.write_text(POLICY_545 + (f"x = {deep}\n" if defect == "policy" else ""))
    result = _subprocess("verify-gpu", "--evidence", str(evidence), "--rims", str(tmp_path),
                         "--policy", str(policy))  # fmt: skip
    assert (result.returncode, result.stderr) == (2, "")
    [line] = result.stdout.splitlines()
    out = json.loads(line)
    assert out["result"] == "unusable input"
    assert "deeper than 64 levels" in out["error"]


def test_evidence_file_over_its_size_limit_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    evidence = tmp_path / "evidence.json"
    evidence.write_bytes(b" " * (MAX_GPU_EVIDENCE_BYTES + 1))
    (tmp_path / "policy.toml").write_text(POLICY_545)
    status, out = run(["verify-gpu", "--evidence", str(evidence), "--rims", str(tmp_path),
                       "--policy", str(tmp_path / "policy.toml")], capsys)  # fmt: skip
    assert status == 2
    assert "over the limit of 4194304 bytes" in out["error"]

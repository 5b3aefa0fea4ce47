"""`python -m attestation verify-cpu`: exit 0 for trusted synthetic evidence and for dcap-qvl's
real TDX quote inside its collateral window, 1 for the real SEV-SNP report (debug allowed), 2 for
unusable input; the verdict is printed as JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.serialization import Encoding

from attestation.__main__ import main
from attestation.binding import report_data
from attestation.cpu.evidence import CpuEvidence
from attestation.input_limits import MAX_CPU_EVIDENCE_BYTES
from tests.attestation.cpu.conftest import DCAP, DCAP_MR_TD, DCAP_REPORT_DATA, RealSnp
from tests.attestation.cpu.synthetic import SyntheticSnp

MIN_TCB = "{ bootloader = 2, tee = 0, snp = 5, microcode = 68 }"


def _write(tmp_path: Path, evidence: dict[str, object], policy: str) -> tuple[Path, Path]:
    evidence_path = tmp_path / "cpu.json"
    evidence_path.write_text(json.dumps(evidence))
    policy_path = tmp_path / "policy.toml"
    policy_path.write_text(policy)
    return evidence_path, policy_path


def test_verify_cpu_exits_0_for_trusted_synthetic_evidence_bound_to_a_challenge(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    platform = SyntheticSnp.create()
    nonce, digest, key = bytes(32), bytes(range(32)), b"\x07" * 32
    evidence = platform.evidence(report_data(nonce, digest, key))
    table = platform.policy_table()
    tcb = ", ".join(f"{k} = {v}" for k, v in table["min_tcb"].items())
    policy = f'[snp]\nmeasurements = ["{table["measurements"][0]}"]\nmin_tcb = {{ {tcb} }}\n'
    evidence_path, policy_path = _write(tmp_path, evidence.to_json(), policy)
    trust = platform.write_trust_directory(tmp_path / "trust")
    binding = [nonce.hex(), digest.hex(), key.hex()]
    status = main(["verify-cpu", "--evidence", str(evidence_path), "--policy", str(policy_path),
                   "--trust", str(trust), "--binding", *binding])  # fmt: skip
    assert status == 0, capsys.readouterr().out
    assert json.loads(capsys.readouterr().out)["result"] == "trusted"


def test_verify_cpu_exits_1_for_the_real_snp_report_with_debug(
    real_snp: RealSnp, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    measurement = real_snp.parsed.measurement.hex()
    policy = (
        f'[snp]\nmeasurements = ["{measurement}"]\nmin_tcb = {MIN_TCB}\n'
        'revocation_accept = ["good", "unchecked"]  # no AMD CRL among the vectors\n'
    )
    evidence_path, policy_path = _write(tmp_path, real_snp.evidence().to_json(), policy)
    (tmp_path / "trust" / "snp").mkdir(parents=True)
    (tmp_path / "trust" / "snp" / "ark-milan.pem").write_bytes(
        real_snp.ark.public_bytes(Encoding.PEM)
    )
    status = main(["verify-cpu", "--evidence", str(evidence_path), "--policy", str(policy_path),
                   "--trust", str(tmp_path / "trust"), "--at", "2025-01-01T00:00:00Z",
                   "--report-data", real_snp.parsed.report_data.hex()])  # fmt: skip
    verdict = json.loads(capsys.readouterr().out)
    assert status == 1
    assert [failure["name"] for failure in verdict["failed"]] == ["snp.policy.debug"]


@pytest.mark.parametrize(
    "evidence", [{"kind": "snp", "report": "AAAA"}, {"kind": "nope", "report": "AAAA"}]
)
def test_verify_cpu_exits_2_for_unusable_evidence(
    evidence: dict[str, object], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = f'[snp]\nmeasurements = ["{"00" * 48}"]\nmin_tcb = {MIN_TCB}\n'
    evidence_path, policy_path = _write(tmp_path, evidence, policy)
    status = main(["verify-cpu", "--evidence", str(evidence_path), "--policy", str(policy_path),
                   "--trust", str(tmp_path), "--report-data", "00" * 64])  # fmt: skip
    assert status == 2
    assert json.loads(capsys.readouterr().out)["result"] == "unusable input"


def test_verify_cpu_trusts_the_dcap_tdx_quote_through_a_trust_directory_of_collateral_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 13, defect 1: a trust directory that only adds Intel's collateral keeps the built-in
    Intel SGX Root CA (docs/ATTESTATION.md, "Trust directory")."""
    (tmp_path / "trust" / "tdx" / "collateral").mkdir(parents=True)
    (tmp_path / "trust" / "tdx" / "collateral" / "b0c06f.json").write_text(
        (DCAP / "tdx_quote_collateral.json").read_text()
    )
    evidence = CpuEvidence("tdx", (DCAP / "tdx_quote").read_bytes(), provider="tdx_guest")
    policy = f'[tdx]\nmrtd = ["{DCAP_MR_TD}"]\ntcb_statuses = ["UpToDate"]\n'
    evidence_path, policy_path = _write(tmp_path, evidence.to_json(), policy)
    status = main(["verify-cpu", "--evidence", str(evidence_path), "--policy", str(policy_path),
                   "--trust", str(tmp_path / "trust"), "--at", "2025-07-01T00:00:00Z",
                   "--report-data", DCAP_REPORT_DATA.hex()])  # fmt: skip
    verdict = json.loads(capsys.readouterr().out)
    assert status == 0, verdict["failed"]
    assert verdict["claims"]["tcb_status"] == "UpToDate"


DEEP = 100_000


def test_cpu_evidence_100000_levels_deep_exits_2_with_one_line_and_no_traceback(
    tmp_path: Path,
) -> None:
    """Issue 13, defect 2: unusable input, not a RecursionError traceback (exit 1)."""
    evidence = tmp_path / "cpu.json"
    evidence.write_text('{"kind": "snp", "report": ' + "[" * DEEP + "]" * DEEP + "}")
    policy = tmp_path / "policy.toml"
    policy.write_text(f'[snp]\nmeasurements = ["{"00" * 48}"]\nmin_tcb = {MIN_TCB}\n')
    result = subprocess.run(
        [sys.executable, "-m", "attestation", "verify-cpu", "--evidence", str(evidence),
         "--policy", str(policy), "--trust", str(tmp_path), "--report-data", "00" * 64],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert (result.returncode, result.stderr) == (2, "")
    [line] = result.stdout.splitlines()
    assert "EvidenceError: the CPU evidence nests arrays and objects deeper than 64" in line


def test_cpu_evidence_over_its_size_limit_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    evidence = tmp_path / "cpu.json"
    evidence.write_bytes(b" " * (MAX_CPU_EVIDENCE_BYTES + 1))
    status = main(["verify-cpu", "--evidence", str(evidence), "--policy", str(evidence),
                   "--trust", str(tmp_path), "--report-data", "00" * 64])  # fmt: skip
    assert status == 2
    assert "over the limit of 1048576 bytes" in json.loads(capsys.readouterr().out)["error"]

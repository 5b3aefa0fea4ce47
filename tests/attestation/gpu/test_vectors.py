"""Every NVIDIA vector of tests/attestation/vectors/README.md behaves as that README states.

Regenerate: the files under tests/attestation/vectors/nvidia are copies of public files
of NVIDIA nvtrust and attestation-sdk (licenses beside them); nothing here is derived from them.
"""

from __future__ import annotations

import json
import shutil
from datetime import UTC, datetime
from pathlib import Path

import pytest

from attestation.gpu import GpuTrust, verify_gpu_evidence
from attestation.gpu.chain import validity_problems
from attestation.gpu.errors import RimChainError, RimSignatureError
from attestation.gpu.evidence import evidence_list_from_json
from attestation.gpu.report import GpuReport
from attestation.gpu.rim import verify_rim
from attestation.gpu.roots import (
    NVIDIA_CORIM_ROOT_SHA256,
    NVIDIA_DEVICE_IDENTITY_CA_SHA256,
    fingerprint,
    load_pinned_root,
    nvidia_corim_root,
    nvidia_device_identity_ca,
)
from attestation.verdict import Check, Verdict
from tests.attestation.gpu.conftest import (
    BEFORE_RIM_EXPIRY,
    TODAY,
    VECTORS,
    RealGpu,
    real_evidence,
    real_policy,
)

MECHANISM = ("report", "nonce", "certificate_chain", "fwid", "signature")


def checks_by_name(verdict: Verdict) -> dict[str, Check]:
    return {check.name: check for check in verdict.checks}


def test_built_in_roots_are_the_published_nvidia_roots() -> None:
    for name, expected in [
        ("nvidia_device_identity_ca.pem", NVIDIA_DEVICE_IDENTITY_CA_SHA256),
        ("nvidia_corim_signing_root_ca.pem", NVIDIA_CORIM_ROOT_SHA256),
    ]:
        assert fingerprint(load_pinned_root((VECTORS / "roots" / name).read_bytes())) == expected
    assert fingerprint(nvidia_device_identity_ca()) == NVIDIA_DEVICE_IDENTITY_CA_SHA256
    assert fingerprint(nvidia_corim_root()) == NVIDIA_CORIM_ROOT_SHA256


def test_545_report_parses_to_its_versions_and_64_blocks(gpu_545: RealGpu) -> None:
    report = GpuReport.parse(gpu_545.evidence.report)
    assert report.nonce == gpu_545.nonce
    assert report.driver_version == "545.00"
    assert report.vbios_version == "96.00.5E.00.01"
    assert sorted(report.measurements) == list(range(1, 65))
    assert report.fwid is None
    assert report.board == ("1010", "0200", "882")


def test_545_passes_with_all_33_measurements_before_rim_expiry(
    gpu_545: RealGpu, trust_545: GpuTrust
) -> None:
    verdict = verify_gpu_evidence(
        [gpu_545.evidence],
        expected_nonces=[gpu_545.nonce],
        policy=gpu_545.policy,
        trust=trust_545,
        at=BEFORE_RIM_EXPIRY,
    )
    assert verdict.trusted, verdict.failures
    claims = verdict.claims["gpus"][0]
    assert claims["num_measurements_compared"] == 33
    assert claims["mismatched_blocks"] == []
    assert claims["rims"] == {
        "driver": "driver_rim_545.00.swidtag",
        "vbios": "vbios_rim_1010_0200_882_96005E0001_test.swidtag",
    }


def test_545_today_fails_with_rim_certificate_expired(
    gpu_545: RealGpu, trust_545: GpuTrust
) -> None:
    verdict = verify_gpu_evidence(
        [gpu_545.evidence],
        expected_nonces=[gpu_545.nonce],
        policy=gpu_545.policy,
        trust=trust_545,
        at=TODAY,
    )
    assert not verdict.trusted
    assert {c.name for c in verdict.failures} == {"gpu0.rim.driver", "gpu0.rim.vbios"}
    for check in verdict.failures:
        assert "RIM certificate expired" in check.detail
    assert checks_by_name(verdict)["gpu0.measurements"].passed


def test_545_today_passes_when_policy_accepts_expired_rim_certificates(
    gpu_545: RealGpu, trust_545: GpuTrust
) -> None:
    policy = real_policy("545.00", "96.00.5E.00.01", expired_rim_certificate="accept")
    verdict = verify_gpu_evidence(
        [gpu_545.evidence],
        expected_nonces=[gpu_545.nonce],
        policy=policy,
        trust=trust_545,
        at=TODAY,
    )
    assert verdict.trusted, verdict.failures
    assert "RIM certificate expired" in checks_by_name(verdict)["gpu0.rim.driver"].detail


def test_550_signature_chain_and_fwid_verify_and_no_rims_are_public(
    gpu_550: RealGpu, trust_no_rims: GpuTrust
) -> None:
    verdict = verify_gpu_evidence(
        [gpu_550.evidence],
        expected_nonces=[gpu_550.nonce],
        policy=gpu_550.policy,
        trust=trust_no_rims,
        at=TODAY,
    )
    checks = checks_by_name(verdict)
    assert all(checks[f"gpu0.{step}"].passed for step in MECHANISM)
    assert checks["gpu0.fwid"].detail == ""  # compared, not skipped
    assert verdict.claims["gpus"][0]["fwid"].startswith("f5c384ae")
    assert {c.name for c in verdict.failures} == {"gpu0.rim.driver", "gpu0.rim.vbios"}
    assert "RimNotFoundError" in checks["gpu0.rim.driver"].detail


def test_nvat_format_evidence_signature_chain_and_fwid_verify(trust_no_rims: GpuTrust) -> None:
    path = VECTORS / "nvat-format" / "hopper_evidence_590.12.json"
    evidence = evidence_list_from_json(path.read_bytes())
    assert json.loads(path.read_text()) == [item.to_json() for item in evidence]
    policy = real_policy("590.12", "96.00.A5.00.01", chips=["GH100"])
    verdict = verify_gpu_evidence(
        evidence,
        expected_nonces=[evidence[0].nonce],
        policy=policy,
        trust=trust_no_rims,
        at=TODAY,
    )
    checks = checks_by_name(verdict)
    assert all(checks[f"gpu0.{step}"].passed for step in MECHANISM)
    assert verdict.claims["gpus"][0]["board"] == "G520_0200_885"
    assert checks["gpu0.policy.driver_version"].passed
    h100_only = real_policy("590.12", "96.00.A5.00.01", boards=["1010_0200_882"])
    verdict = verify_gpu_evidence(
        evidence,
        expected_nonces=[evidence[0].nonce],
        policy=h100_only,
        trust=trust_no_rims,
        at=TODAY,
    )
    assert "board G520_0200_885 not in" in checks_by_name(verdict)["gpu0.policy.board"].detail


def test_negative_report_has_invalid_signature_and_fwid_mismatch(
    gpu_550: RealGpu, trust_no_rims: GpuTrust
) -> None:
    evidence = real_evidence(
        "h100-550", gpu_550.nonce, VECTORS / "negative" / "attestation_report_invalid_signature.hex"
    )
    verdict = verify_gpu_evidence(
        [evidence],
        expected_nonces=[evidence.nonce],
        policy=gpu_550.policy,
        trust=trust_no_rims,
        at=TODAY,
    )
    checks = checks_by_name(verdict)
    assert not verdict.trusted
    assert "ReportSignatureError" in checks["gpu0.signature"].detail
    assert "FwidMismatchError" in checks["gpu0.fwid"].detail
    assert (
        "gpu0.rim.driver" not in checks
    )  # nothing is read from a report that failed its signature


PROD_RIMS = sorted(path.name for path in (VECTORS / "rims").glob("*_PROD.swidtag"))


@pytest.mark.parametrize("name", PROD_RIMS)
def test_prod_rim_verifies_and_is_valid_inside_its_signer_window(name: str) -> None:
    rim = verify_rim(
        (VECTORS / "rims" / name).read_bytes(), name=name, corim_root=nvidia_corim_root()
    )
    assert rim.kind == "vbios"
    assert rim.version.replace(".", "").upper() in name.upper()
    assert len(rim.golden) == 12
    signer = rim.signer_chain[0]
    inside = (
        signer.not_valid_before_utc + (signer.not_valid_after_utc - signer.not_valid_before_utc) / 2
    )
    assert validity_problems(rim.signer_chain, inside) == []
    assert validity_problems(rim.signer_chain, TODAY) != []


def test_rim_with_broken_xml_signature_is_rejected() -> None:
    data = (VECTORS / "negative" / "incorrect_signature_driver_rim.xml").read_bytes()
    with pytest.raises(RimSignatureError, match="does not verify"):
        verify_rim(data, name="incorrect_signature", corim_root=nvidia_corim_root())


def test_rim_signed_under_a_debug_root_is_rejected_as_not_the_pinned_root() -> None:
    data = (VECTORS / "negative" / "incorrect_cert_chain_driver_rim.xml").read_bytes()
    with pytest.raises(RimChainError, match="not the pinned CoRIM root"):
        verify_rim(data, name="incorrect_cert_chain", corim_root=nvidia_corim_root())


def test_rim_signed_under_a_debug_root_is_rejected_even_when_that_root_is_known() -> None:
    data = (VECTORS / "negative" / "incorrect_cert_chain_driver_rim.xml").read_bytes()
    debug_root = load_pinned_root((VECTORS / "negative" / "incorrect_rim_root.crt").read_bytes())
    assert debug_root.subject != nvidia_corim_root().subject
    with pytest.raises(RimChainError):
        verify_rim(data, name="incorrect_cert_chain", corim_root=nvidia_corim_root())


def test_validation_time_is_the_callers_not_the_clock(
    gpu_545: RealGpu, trust_545: GpuTrust
) -> None:
    verdict = verify_gpu_evidence(
        [gpu_545.evidence],
        expected_nonces=[gpu_545.nonce],
        policy=gpu_545.policy,
        trust=trust_545,
        at=datetime(2025, 6, 23, tzinfo=UTC),
    )
    failed = {c.name for c in verdict.failures}
    assert failed == {"gpu0.rim.vbios"}  # the VBIOS signer expired 2025-06-22, the driver's 06-26


def test_545_against_the_production_vbios_rim_of_its_version_mismatches_four_blocks(
    gpu_545: RealGpu, tmp_path: Path
) -> None:
    """The 545 GPU ran a test VBIOS (its RIM is named `_test`): NVIDIA's production RIM of the
    same version, chosen from the PROD set by board id and version, signs other values for
    blocks 2, 3, 4 and 10. The comparison is block by block, not all-or-nothing."""
    shutil.copy(VECTORS / "h100-545" / "driver_rim_545.00.swidtag", tmp_path)
    for path in (VECTORS / "rims").glob("*_PROD.swidtag"):
        shutil.copy(path, tmp_path)
    verdict = verify_gpu_evidence(
        [gpu_545.evidence],
        expected_nonces=[gpu_545.nonce],
        policy=gpu_545.policy,
        trust=GpuTrust.from_paths(rim_dir=tmp_path),
        at=BEFORE_RIM_EXPIRY,
    )
    claims = verdict.claims["gpus"][0]
    assert claims["rims"]["vbios"] == "1010_0200_882_96005E0001_PROD.swidtag"
    assert claims["mismatched_blocks"] == [2, 3, 4, 10]
    assert [c.name for c in verdict.failures] == ["gpu0.measurements"]
    allowing = real_policy("545.00", "96.00.5E.00.01", allowed_mismatch_indices=[2, 3, 4, 10])
    assert verify_gpu_evidence(
        [gpu_545.evidence],
        expected_nonces=[gpu_545.nonce],
        policy=allowing,
        trust=GpuTrust.from_paths(rim_dir=tmp_path),
        at=BEFORE_RIM_EXPIRY,
    ).trusted


PPCIE = VECTORS / "ppcie" / "gpu_evidence.json"


def test_ppcie_evidence_of_8_gpus_verifies_as_given(trust_no_rims: GpuTrust) -> None:
    """Issue 13, defect 3: NVIDIA's PPCIe shape (per-GPU driver_version, vbios_version and
    version) is accepted, and its informative versions agree with the signed reports."""
    evidence = evidence_list_from_json(PPCIE.read_bytes())
    assert [item.to_json() for item in evidence] == json.loads(PPCIE.read_text())
    policy = real_policy("590.12", "96.00.A5.00.01", num_gpus=8)
    verdict = verify_gpu_evidence(
        evidence,
        expected_nonces=[item.nonce for item in evidence],
        policy=policy,
        trust=trust_no_rims,
        at=TODAY,
    )
    checks = checks_by_name(verdict)
    for gpu in range(8):
        steps = (*MECHANISM, "declared.driver_version", "declared.vbios_version")
        assert all(checks[f"gpu{gpu}.{step}"].passed for step in steps), gpu
    assert checks["gpu.count"].passed and checks["gpu.distinct"].passed
    # No RIMs for driver 590.12 / VBIOS 96.00.A5.00.01 are published among the vectors.
    assert {c.name.split(".", 1)[1] for c in verdict.failures} == {"rim.driver", "rim.vbios"}

"""The evidence exchange format (NVIDIA's, and its PPCIe shape with informative versions) and
the digest the CPU report binds."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from dataclasses import replace

import pytest

from attestation.gpu import GpuTrust, gpu_evidence_digest, verify_gpu_evidence
from attestation.gpu.errors import GpuEvidenceFormatError
from attestation.gpu.evidence import evidence_list_from_json, evidence_list_to_json
from attestation.input_limits import MAX_GPU_EVIDENCE_BYTES
from tests.attestation.gpu.conftest import TODAY, VECTORS, RealGpu, real_policy


def test_round_trip_keeps_every_field(gpu_550: RealGpu) -> None:
    evidence = replace(gpu_550.evidence, cc_mode="on", dev_tools_mode=False)
    (back,) = evidence_list_from_json(evidence_list_to_json([evidence]))
    assert back == evidence


def test_nvat_file_keeps_its_exact_json(gpu_550: RealGpu) -> None:
    text = (VECTORS / "nvat-format" / "hopper_evidence_590.12.json").read_text()
    assert [e.to_json() for e in evidence_list_from_json(text)] == json.loads(text)


def test_digest_is_sha256_of_sorted_compact_json_and_changes_with_any_field(
    gpu_550: RealGpu,
) -> None:
    evidence = [gpu_550.evidence]
    canonical = json.dumps([gpu_550.evidence.to_json()], sort_keys=True, separators=(",", ":"))
    assert gpu_evidence_digest(evidence) == hashlib.sha256(canonical.encode()).digest()
    changed = [replace(gpu_550.evidence, dev_tools_mode=True)]
    assert gpu_evidence_digest(changed) != gpu_evidence_digest(evidence)
    assert gpu_evidence_digest(evidence * 2) != gpu_evidence_digest(evidence)


@pytest.mark.parametrize(
    ("defect", "text"),
    [
        ("not JSON", "{"),
        ("empty list", "[]"),
        ("object instead of list", "{}"),
        ("missing certificate", '[{"arch": "HOPPER", "nonce": "00", "evidence": ""}]'),
        ("unknown key", '[{"arch": "H", "nonce": "", "evidence": "", "certificate": "", "x": 1}]'),
        ("bad hex", '[{"arch": "H", "nonce": "zz", "evidence": "", "certificate": ""}]'),
        ("bad base64", '[{"arch": "H", "nonce": "", "evidence": "!!", "certificate": ""}]'),
        (
            "bad cc mode",
            '[{"arch": "H", "nonce": "", "evidence": "", "certificate": "", "cc_mode": "maybe"}]',
        ),
    ],
)
def test_malformed_evidence_json_is_unusable(defect: str, text: str) -> None:
    with pytest.raises(GpuEvidenceFormatError):
        evidence_list_from_json(text)


def test_importing_the_package_touches_no_device() -> None:
    code = "import sys, attestation.gpu; print('pynvml' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


PPCIE = VECTORS / "ppcie" / "gpu_evidence.json"


def _ppcie_items() -> list[dict[str, object]]:
    return json.loads(PPCIE.read_text())


def test_ppcie_evidence_keeps_its_exact_json_and_digest_covers_the_informative_fields() -> None:
    items = _ppcie_items()
    evidence = evidence_list_from_json(json.dumps(items))
    assert [item.to_json() for item in evidence] == items
    assert (evidence[0].driver_version, evidence[0].vbios_version) == ("590.12", "96.00.A5.00.01")
    items[0]["driver_version"] = "590.13"
    assert gpu_evidence_digest(evidence_list_from_json(json.dumps(items))) != gpu_evidence_digest(
        evidence
    )


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("driver_version", 590, "driver_version must be a non-empty string"),
        ("vbios_version", "", "vbios_version must be a non-empty string"),
        ("version", "2.0", "evidence format version '2.0' is not one of"),
        ("vbios", "96.00.A5.00.01", r"unknown keys \['vbios'\]"),
    ],
)
def test_ppcie_entry_with_a_malformed_or_unknown_field_is_unusable(
    key: str, value: object, message: str
) -> None:
    items = _ppcie_items()
    items[3][key] = value
    with pytest.raises(GpuEvidenceFormatError, match=message):
        evidence_list_from_json(json.dumps(items))


@pytest.mark.parametrize(
    ("field", "declared", "signed"),
    [("driver_version", "590.13", "590.12"), ("vbios_version", "96.00.A5.00.02", "96.00.A5.00.01")],
)
def test_informative_version_that_disagrees_with_the_signed_report_fails_the_named_check(
    field: str, declared: str, signed: str
) -> None:
    """The informative fields are never trusted: each is compared with the signed value."""
    items = _ppcie_items()
    items[2][field] = declared
    evidence = evidence_list_from_json(json.dumps(items))
    verdict = verify_gpu_evidence(
        evidence,
        expected_nonces=[item.nonce for item in evidence],
        policy=real_policy("590.12", "96.00.A5.00.01", num_gpus=8),
        trust=GpuTrust.from_paths(rim_dir=VECTORS / "roots"),  # holds no RIM
        at=TODAY,
    )
    failed = {c.name: c.detail for c in verdict.failures if ".rim." not in c.name}
    assert list(failed) == [f"gpu2.declared.{field}"]
    assert failed[f"gpu2.declared.{field}"] == (
        f"DeclaredVersionMismatchError: the evidence declares {field} {declared}, "
        f"the signed report {signed}"
    )
    claims = verdict.claims["gpus"][2]
    assert claims[field] == signed, "claims come from the signed report only"


DEEP = 100_000


def test_evidence_100000_levels_deep_is_unusable_not_a_recursion_error() -> None:
    """Issue 13, defect 2."""
    with pytest.raises(GpuEvidenceFormatError, match="deeper than 64 levels"):
        evidence_list_from_json("[" * DEEP + "]" * DEEP)


def test_evidence_over_its_size_limit_is_unusable() -> None:
    entry = _ppcie_items()[0]
    text = json.dumps([entry] * (MAX_GPU_EVIDENCE_BYTES // len(json.dumps(entry)) + 1))
    with pytest.raises(GpuEvidenceFormatError, match="over the limit of 4194304 bytes"):
        evidence_list_from_json(text)

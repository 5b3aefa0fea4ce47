"""The evidence exchange format and the digest the CPU report binds."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from dataclasses import replace

import pytest

from attestation.gpu import gpu_evidence_digest
from attestation.gpu.errors import GpuEvidenceFormatError
from attestation.gpu.evidence import evidence_list_from_json, evidence_list_to_json
from tests.attestation.gpu.conftest import VECTORS, RealGpu


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

"""CpuEvidence's JSON form round-trips and refuses malformed input as EvidenceError."""

from __future__ import annotations

import json

import pytest

from attestation.cpu import CpuEvidence
from attestation.errors import EvidenceError


def test_evidence_json_round_trips() -> None:
    evidence = CpuEvidence("snp", b"\x01" * 1184, b"table", "sev_guest")
    assert CpuEvidence.from_json(json.loads(json.dumps(evidence.to_json()))) == evidence
    bare = CpuEvidence("tdx", b"quote")
    assert CpuEvidence.from_json(bare.to_json()) == bare
    assert bare.to_json()["auxblob"] is None


@pytest.mark.parametrize(
    "value",
    [
        [],
        {"kind": "sgx", "report": "AA=="},
        {"kind": "snp"},
        {"kind": "snp", "report": "not base64!"},
        {"kind": "snp", "report": ""},
        {"kind": "snp", "report": "AA==", "auxblob": 5},
        {"kind": "snp", "report": "AA==", "extra": 1},
        {"kind": "snp", "report": "AA==", "provider": 7},
    ],
)
def test_malformed_evidence_json_is_refused(value: object) -> None:
    with pytest.raises(EvidenceError):
        CpuEvidence.from_json(value)

"""The client's verification of a `/v1/attestation` answer, without a server: an answer made
from synthetic GPU and SEV-SNP evidence exactly as the appliance makes it passes; every way it
can be wrong fails its own check; and hostile answers are refused at parsing, each named after
its defect."""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from attestation.binding import Channel, gpu_nonces, report_data, report_data_v2
from attestation.errors import EvidenceError, PolicyError
from attestation.gpu import gpu_evidence_digest
from attestation.remote.connection import AttestationAnswer
from attestation.remote.document import MAX_ATTESTATION_RESPONSE_BYTES, AttestationDocument
from attestation.remote.errors import ApplianceNotTrustedError
from attestation.remote.policy import AppliancePolicy
from attestation.remote.transport import verdict_of
from attestation.remote.trust import ApplianceTrust
from attestation.remote.verify import verify_appliance
from tests.attestation.cpu.synthetic import SyntheticSnp
from tests.attestation.gpu.synthetic import SyntheticGpuSetup, synthetic_gpu_setup

NONCE = bytes(range(32))
KEY = bytes(range(64, 96))
SPKI = hashlib.sha256(b"the appliance's SubjectPublicKeyInfo").digest()
VKEY = "inferno.test/log+01020304+AQIDBAUGBwgJCgsMDQ4PEBESExQVFhcYGRobHB0eHyA="
BOUND = Channel(SPKI, VKEY)


@dataclass(frozen=True)
class Fixture:
    gpus: SyntheticGpuSetup
    snp: SyntheticSnp
    trust: ApplianceTrust

    def policy(self, **appliance: Any) -> AppliancePolicy:
        tables = {"gpu": self.gpus.policy_table(), "snp": self.snp.policy_table(),
                  "appliance": {"audit_vkeys": [VKEY], **appliance}}  # fmt: skip
        return AppliancePolicy.from_tables(tables, "test")

    def answer(self, *, binding: str = "v2", channel: Channel = BOUND) -> dict[str, Any]:
        """The JSON of /v1/attestation, as appliance.api.attestation writes it."""
        gpu = self.gpus.collect(gpu_nonces(NONCE, len(self.gpus.gpus)))
        digest = gpu_evidence_digest(gpu)
        bound = (report_data_v2(NONCE, digest, KEY, channel) if binding == "v2"
                 else report_data(NONCE, digest, KEY))  # fmt: skip
        evidence = {
            "challenge": NONCE.hex(), "attestation_public_key": KEY.hex(),
            "gpu": [item.to_json() for item in gpu], "cpu": self.snp.evidence(bound).to_json(),
            "gpu_evidence_digest": digest.hex(), "report_data": bound.hex(), "binding": binding,
            "tls_spki_sha256": None if channel.tls_spki_sha256 is None
            else channel.tls_spki_sha256.hex(),
            "audit_vkey": channel.audit_vkey,
        }  # fmt: skip
        verdict = {"result": "trusted", "at": "2026-11-26T04:00:00Z", "failed": [], "checks": []}
        standing = {**verdict, "at": datetime.now(UTC).isoformat()}
        return {"tee": "VERIFIED", "nonce": NONCE.hex(), "tls_spki_sha256": SPKI.hex(),
                "evidence": evidence, "verdict": verdict, "signed_verdict": {},
                "standing_verdict": standing}  # fmt: skip


@pytest.fixture(scope="module")
def fixture(tmp_path_factory: pytest.TempPathFactory) -> Fixture:
    directory = tmp_path_factory.mktemp("remote")
    gpus = synthetic_gpu_setup(directory / "gpu", num_gpus=1)
    snp = SyntheticSnp.create()
    trust_dir = directory / "trust"
    (trust_dir / "gpu").mkdir(parents=True)
    gpus.rim_dir.rename(trust_dir / "gpu" / "rims")
    gpus.roots_dir.rename(trust_dir / "gpu" / "roots")
    snp.write_trust_directory(trust_dir / "cpu")
    return Fixture(gpus, snp, ApplianceTrust.load(trust_dir))


def _verify(fixture: Fixture, answer: dict[str, Any], **changes: Any) -> set[str]:
    arguments = {"nonce": NONCE, "peer_spki_sha256": SPKI, "policy": fixture.policy(),
                 "trust": fixture.trust, "at": datetime.now(UTC), **changes}  # fmt: skip
    document = AttestationDocument.parse(json.dumps(answer).encode())
    verdict = verify_appliance(document, **arguments)
    assert verdict.checks
    return {check.name for check in verdict.failures}


def test_an_answer_bound_to_this_connection_passes(fixture: Fixture) -> None:
    assert _verify(fixture, fixture.answer()) == set()


def test_each_wrong_answer_fails_its_own_check(fixture: Fixture) -> None:
    answer = fixture.answer()
    other_spki = hashlib.sha256(b"a relay's key").digest()
    assert _verify(fixture, answer, peer_spki_sha256=other_spki) == {
        "channel.tls_spki", "snp.report_data"}  # fmt: skip
    assert _verify(fixture, answer, nonce=bytes(32)) == {
        "appliance.nonce", "gpu0.nonce", "snp.report_data"}  # fmt: skip
    later = datetime.now(UTC) + timedelta(minutes=5)
    allows_60_s = fixture.policy(max_verdict_age_s=60)
    assert _verify(fixture, answer, policy=allows_60_s, at=later) == {"appliance.verdict_age"}
    # A log the policy does not name: the binding holds, the vkey is refused.
    other_log = fixture.answer(channel=Channel(SPKI, "inferno.test/other+05060708+AAAA"))
    assert _verify(fixture, other_log) == {"channel.audit_vkey"}
    # Evidence of the v1 domain binds no channel at all.
    assert _verify(fixture, fixture.answer(binding="v1")) >= {"channel.binding", "snp.report_data"}
    # An appliance serving plain HTTP binds no TLS key.
    plain = fixture.answer(channel=Channel(None, VKEY))
    assert _verify(fixture, plain) == {"channel.tls_spki", "snp.report_data"}
    # The appliance's own state.
    assert _verify(fixture, {**answer, "tee": "FAILED"}) == {"appliance.tee"}


def test_an_answer_without_evidence_fails_at_once(fixture: Fixture) -> None:
    answer = {**fixture.answer(), "evidence": None, "tee": "FAILED"}
    assert _verify(fixture, answer) == {"appliance.evidence"}


def _corrupt(answer: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    *parents, last = path.split(".")
    node = answer
    for key in parents:
        node = node[key]
    node[last] = value
    return answer


HOSTILE = {
    "nonce-not-hex": ("nonce", "zz" * 32),
    "nonce-short": ("nonce", "00" * 31),
    "spki-wrong-size": ("evidence.tls_spki_sha256", "00" * 48),
    "vkey-not-a-string": ("evidence.audit_vkey", 7),
    "vkey-empty": ("evidence.audit_vkey", ""),
    "key-wrong-size": ("evidence.attestation_public_key", "00" * 33),
    "no-gpu": ("evidence.gpu", []),
    "too-many-gpus": ("evidence.gpu", [{}] * 65),
    "unknown-binding": ("evidence.binding", "v3"),
    "unknown-tee": ("tee", "TRUSTED"),
    "evidence-not-object": ("evidence", []),
    "standing-time-naive": ("standing_verdict.at", "2026-11-26T04:00:00"),
}


@pytest.mark.parametrize("defect", HOSTILE)
def test_a_malformed_answer_is_refused_naming_the_field(fixture: Fixture, defect: str) -> None:
    path, value = HOSTILE[defect]
    answer = _corrupt(fixture.answer(), path, value)
    with pytest.raises(EvidenceError):
        AttestationDocument.parse(json.dumps(answer).encode())


def test_an_oversized_or_deeply_nested_answer_is_refused_before_parsing() -> None:
    with pytest.raises(EvidenceError, match=r"larger|over"):
        AttestationDocument.parse(b" " * (MAX_ATTESTATION_RESPONSE_BYTES + 1))
    with pytest.raises(EvidenceError, match="nest"):
        AttestationDocument.parse(b"[" * 100_000 + b"]" * 100_000)


@pytest.mark.parametrize(
    ("appliance", "reason"),
    [
        ({}, "no \\[appliance\\] table"),
        ({"max_verdict_age_s": 60}, "audit_vkeys"),
        ({"audit_vkeys": []}, "never passes"),
        ({"audit_vkeys": [VKEY], "max_verdict_age_s": 0}, "max_verdict_age_s"),
        ({"audit_vkeys": [VKEY], "max_verdict_age_s": True}, "max_verdict_age_s"),
        ({"audit_vkeys": [VKEY], "trust_the_appliance": True}, "unknown keys"),
    ],
)
def test_a_client_policy_that_could_pass_anything_is_refused(
    fixture: Fixture, appliance: dict[str, Any], reason: str
) -> None:
    tables = {"gpu": fixture.gpus.policy_table(), "snp": fixture.snp.policy_table(),
              "appliance": appliance}  # fmt: skip
    with pytest.raises(PolicyError, match=reason):
        AppliancePolicy.from_tables(tables, "test")


def test_a_trust_directory_without_rims_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="gpu/rims"):
        ApplianceTrust.load(tmp_path)


def test_a_cpu_report_that_cannot_be_parsed_is_not_trusted_by_the_transport(
    fixture: Fixture,
) -> None:
    answer = fixture.answer()
    answer["evidence"]["cpu"]["report"] = base64.b64encode(b"\0" * 100).decode()
    document = AttestationDocument.parse(json.dumps(answer).encode())
    with pytest.raises(ApplianceNotTrustedError, match=r"appliance\.evidence") as refused:
        verdict_of(AttestationAnswer(SPKI, document), NONCE, fixture.policy(), fixture.trust)
    assert not refused.value.verdict.trusted

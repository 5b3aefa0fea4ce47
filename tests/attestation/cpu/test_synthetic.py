"""The synthetic SEV-SNP platform that the boot gate's tests build on: its evidence verifies
under its own pinned test ARK and policy, and each policy lever it offers is refused."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime

import pytest

from attestation.binding import report_data
from attestation.cpu import CpuTrust, verify_cpu_evidence
from tests.attestation.cpu.synthetic import SyntheticSnp

NOW = datetime(2026, 11, 22, tzinfo=UTC)
BINDING = report_data(bytes(range(32)), hashlib.sha256(b"gpu evidence").digest(), b"k" * 32)


@pytest.fixture(scope="module")
def platform() -> SyntheticSnp:
    return SyntheticSnp.create()


def test_synthetic_report_verifies_under_its_test_trust_and_policy(platform: SyntheticSnp) -> None:
    verdict = verify_cpu_evidence(
        platform.evidence(BINDING),
        expected_report_data=BINDING,
        policy=platform.policy(),
        trust=platform.trust(NOW),
        at=NOW,
    )
    assert verdict.trusted, verdict.failures
    assert verdict.claims["report_data"] == BINDING.hex()


@pytest.mark.parametrize(
    ("options", "failed_check"),
    [
        ({"debug": True}, "snp.policy.debug"),
        ({"measurement": bytes(48)}, "snp.policy.measurement"),
        ({"vmpl": 2}, "snp.policy.vmpl"),
        ({"migrate_ma": True}, "snp.policy.migrate_ma"),
    ],
)
def test_synthetic_policy_violation_is_refused_by_name(
    platform: SyntheticSnp, options: dict[str, object], failed_check: str
) -> None:
    verdict = verify_cpu_evidence(
        platform.evidence(BINDING, **options),
        expected_report_data=BINDING,
        policy=platform.policy(),
        trust=platform.trust(NOW),
        at=NOW,
    )
    assert [check.name for check in verdict.failures] == [failed_check]


def test_synthetic_evidence_is_not_trusted_under_another_platforms_ark(
    platform: SyntheticSnp,
) -> None:
    other = SyntheticSnp.create()
    verdict = verify_cpu_evidence(
        platform.evidence(BINDING),
        expected_report_data=BINDING,
        policy=platform.policy(),
        trust=other.trust(),
        at=NOW,
    )
    assert [check.name for check in verdict.failures] == ["snp.certificate_chain"]


def test_synthetic_trust_directory_loads_back(platform: SyntheticSnp, tmp_path) -> None:
    trust = CpuTrust.load(platform.write_trust_directory(tmp_path))
    assert trust.snp_arks["Milan"] == platform.ark  # replaces AMD's ARK-Milan
    assert set(trust.snp_arks) == {"Milan", "Genoa", "Turin"}
    assert CpuTrust.load(tmp_path, builtin_roots=False).snp_arks == {"Milan": platform.ark}


@pytest.mark.parametrize("product", ["Genoa", "Turin"])
def test_synthetic_report_of_other_processor_lines_verifies_with_their_tcb_layout(
    product: str,
) -> None:
    platform = SyntheticSnp.create(product)  # type: ignore[arg-type]
    verdict = verify_cpu_evidence(
        platform.evidence(BINDING),
        expected_report_data=BINDING,
        policy=platform.policy(),
        trust=platform.trust(NOW),
        at=NOW,
    )
    assert verdict.trusted, verdict.failures
    assert verdict.claims["product"] == product
    assert verdict.claims["reported_tcb"] == platform.tcb.to_json()


def test_synthetic_report_below_the_minimum_tcb_is_refused(platform: SyntheticSnp) -> None:
    minimum = {**platform.tcb.to_json(), "snp": platform.tcb.snp + 1}
    verdict = verify_cpu_evidence(
        platform.evidence(BINDING),
        expected_report_data=BINDING,
        policy=platform.policy(min_tcb=minimum),
        trust=platform.trust(NOW),
        at=NOW,
    )
    assert [check.name for check in verdict.failures] == ["snp.policy.min_tcb"]


@pytest.mark.parametrize("version", [3, 5])
def test_synthetic_reports_of_later_abi_versions_verify(
    platform: SyntheticSnp, version: int
) -> None:
    verdict = verify_cpu_evidence(
        platform.evidence(BINDING, version=version),
        expected_report_data=BINDING,
        policy=platform.policy(),
        trust=platform.trust(NOW),
        at=NOW,
    )
    assert verdict.trusted, verdict.failures
    assert verdict.claims["version"] == version

"""The synthetic SEV-SNP platform that the boot gate's tests build on: its evidence verifies
under its own pinned test ARK and policy, and each policy lever it offers is refused."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from datetime import UTC, datetime

import pytest

from attestation.binding import report_data
from attestation.cpu import CpuTrust, verify_cpu_evidence
from attestation.cpu.snp import PLATFORM_CIPHERTEXT_HIDING_EN, PLATFORM_SMT_EN, PLATFORM_TSME_EN
from attestation.verdict import Verdict
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


def _verdict(platform: SyntheticSnp, policy: dict[str, object], **options: object) -> Verdict:
    return verify_cpu_evidence(
        platform.evidence(BINDING, **options),
        expected_report_data=BINDING,
        policy=platform.policy(**policy),
        trust=platform.trust(NOW),
        at=NOW,
    )


@pytest.mark.parametrize("field", ["current", "committed"])
def test_synthetic_tcb_below_the_minimum_is_refused_only_when_the_policy_judges_it(
    platform: SyntheticSnp, field: str
) -> None:
    older = replace(platform.tcb, microcode=platform.tcb.microcode - 1)
    options = {f"{field}_tcb": older}
    assert _verdict(platform, {}, **options).trusted
    verdict = _verdict(platform, {"min_tcb_current_and_committed": True}, **options)
    assert [check.name for check in verdict.failures] == [f"snp.policy.min_{field}_tcb"]
    assert verdict.failures[0].detail.startswith(f"{field} TCB ")
    assert "is below the minimum" in verdict.failures[0].detail
    assert _verdict(platform, {"min_tcb_current_and_committed": True}).trusted


def test_synthetic_platform_with_smt_enabled_is_refused_when_smt_is_not_allowed(
    platform: SyntheticSnp,
) -> None:
    no_smt = {"allow_smt": False}
    verdict = _verdict(platform, no_smt, smt=False, platform_info=PLATFORM_SMT_EN)
    assert [check.name for check in verdict.failures] == ["snp.policy.platform_smt"]
    assert "SMT enabled (PLATFORM_INFO SMT_EN)" in verdict.failures[0].detail
    verdict = _verdict(platform, no_smt, smt=True, platform_info=0)
    assert [check.name for check in verdict.failures] == ["snp.policy.smt"]
    assert _verdict(platform, no_smt, smt=False, platform_info=0).trusted


def test_synthetic_platform_without_tsme_is_refused_when_the_policy_requires_it(
    platform: SyntheticSnp,
) -> None:
    verdict = _verdict(platform, {"require_tsme": True})
    assert [check.name for check in verdict.failures] == ["snp.policy.tsme"]
    assert "TSME enabled (PLATFORM_INFO TSME_EN)" in verdict.failures[0].detail
    tsme = PLATFORM_SMT_EN | PLATFORM_TSME_EN
    assert _verdict(platform, {"require_tsme": True}, platform_info=tsme).trusted


@pytest.mark.parametrize(
    ("version", "platform_info", "trusted"),
    [
        (3, PLATFORM_SMT_EN, False),
        (3, PLATFORM_SMT_EN | PLATFORM_CIPHERTEXT_HIDING_EN, True),
        (5, PLATFORM_SMT_EN | PLATFORM_CIPHERTEXT_HIDING_EN, True),
        # Before version 3 the bit is reserved: set, it still proves nothing.
        (2, PLATFORM_SMT_EN | PLATFORM_CIPHERTEXT_HIDING_EN, False),
    ],
)
def test_synthetic_platform_without_ciphertext_hiding_is_refused_when_required(
    platform: SyntheticSnp, version: int, platform_info: int, trusted: bool
) -> None:
    policy = {"require_ciphertext_hiding": True}
    verdict = _verdict(platform, policy, version=version, platform_info=platform_info)
    assert verdict.trusted is trusted
    if not trusted:
        assert [check.name for check in verdict.failures] == ["snp.policy.ciphertext_hiding"]
        assert "ciphertext hiding enabled" in verdict.failures[0].detail

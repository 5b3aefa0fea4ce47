"""SEV-SNP revocation from the operator's copy of AMD's CRL: good, revoked, stale and unchecked
are each reported, and the policy accepts only what it lists (default: good)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from attestation.cpu import CpuTrust, verify_cpu_evidence
from attestation.cpu.revocation import check_snp_revocation
from tests.attestation.cpu.synthetic import SyntheticSnp

NOW = datetime(2026, 11, 22, tzinfo=UTC)
WEEK = timedelta(days=7)


@pytest.fixture(scope="module")
def platform() -> SyntheticSnp:
    return SyntheticSnp.create()


def test_fresh_crl_without_the_ask_is_good(platform: SyntheticSnp) -> None:
    status = check_snp_revocation(
        ask=platform.ask, ark=platform.ark, crl=platform.crl(issued=NOW), at=NOW, max_age=WEEK
    )
    assert status.state == "good"


def test_crl_listing_the_ask_is_revoked(platform: SyntheticSnp) -> None:
    crl = platform.crl(issued=NOW - timedelta(hours=1), revoke_ask=True)
    status = check_snp_revocation(ask=platform.ask, ark=platform.ark, crl=crl, at=NOW, max_age=WEEK)
    assert status.state == "revoked"
    assert "ASK" in status.detail


@pytest.mark.parametrize("age", [timedelta(days=8), timedelta(days=30)])
def test_old_crl_is_stale(platform: SyntheticSnp, age: timedelta) -> None:
    crl = platform.crl(issued=NOW - age)
    status = check_snp_revocation(ask=platform.ask, ark=platform.ark, crl=crl, at=NOW, max_age=WEEK)
    assert status.state == "stale"


def test_missing_crl_future_crl_and_foreign_crl_are_unchecked(platform: SyntheticSnp) -> None:
    other = SyntheticSnp.create()
    cases = {
        "no CRL": None,
        "after the validation time": platform.crl(issued=NOW + timedelta(days=1)),
        "pinned ARK": other.crl(issued=NOW),  # same name, another key
    }
    for reason, crl in cases.items():
        status = check_snp_revocation(
            ask=platform.ask, ark=platform.ark, crl=crl, at=NOW, max_age=WEEK
        )
        assert status.state == "unchecked", reason
        assert reason in status.detail


def _verdict(platform: SyntheticSnp, trust: CpuTrust, **policy: object):
    return verify_cpu_evidence(
        platform.evidence(bytes(64)),
        expected_report_data=bytes(64),
        policy=platform.policy(**policy),
        trust=trust,
        at=NOW,
    )


def test_default_policy_refuses_a_revoked_ask(platform: SyntheticSnp) -> None:
    trust = CpuTrust(
        snp_arks={"Milan": platform.ark},
        snp_crls={"Milan": platform.crl(issued=NOW - timedelta(hours=1), revoke_ask=True)},
    )
    verdict = _verdict(platform, trust, revocation_accept=["good", "stale", "unchecked"])
    assert [check.name for check in verdict.failures] == ["snp.policy.revocation"]
    assert verdict.claims["revocation"] == "revoked"


def test_default_policy_refuses_when_no_crl_is_bundled(platform: SyntheticSnp) -> None:
    verdict = _verdict(platform, CpuTrust(snp_arks={"Milan": platform.ark}))
    assert [check.name for check in verdict.failures] == ["snp.policy.revocation"]
    assert "unchecked" in verdict.failures[0].detail


def test_policy_may_accept_unchecked_explicitly(platform: SyntheticSnp) -> None:
    verdict = _verdict(
        platform, CpuTrust(snp_arks={"Milan": platform.ark}), revocation_accept=["unchecked"]
    )
    assert verdict.trusted


def test_crl_in_the_trust_directory_is_loaded_for_its_product(
    platform: SyntheticSnp, tmp_path: Path
) -> None:
    trust = CpuTrust.load(platform.write_trust_directory(tmp_path, at=NOW))
    assert set(trust.snp_crls) == {"Milan"}
    assert _verdict(platform, trust).claims["revocation"] == "good"

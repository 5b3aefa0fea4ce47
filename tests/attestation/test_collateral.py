"""The collateral's age (attestation/collateral.py): the `[collateral]` policy table, and the
check `collateral.age`, which a stale bundle fails naming its age and the limit, a fresh one
passes, and collateral from no dated bundle fails whenever the policy sets a maximum."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from attestation.collateral import CollateralPolicy, describe_age, verify_collateral
from attestation.errors import PolicyError
from attestation.trust_bundle import TrustBundleId

AT = datetime(2026, 11, 26, tzinfo=UTC)
WEEK_S = 7 * 86400
BUNDLE = TrustBundleId("3f2a" * 16, datetime(2026, 11, 10, tzinfo=UTC))


def test_a_stale_bundle_fails_naming_its_age_and_the_limit() -> None:
    verdict = verify_collateral(BUNDLE, CollateralPolicy(WEEK_S), at=AT)
    [check] = verdict.checks
    assert (check.name, check.passed) == ("collateral.age", False)
    assert check.detail == (
        "trust bundle 3f2a3f2a3f2a3f2a… created 2026-11-10T00:00:00Z is 16 days old "
        "(1382400 s); the policy allows 7 days (max_age_s = 604800)"
    )
    assert not verdict.trusted


def test_a_fresh_bundle_passes_and_the_claims_name_it() -> None:
    verdict = verify_collateral(
        BUNDLE, CollateralPolicy(WEEK_S), at=BUNDLE.created + timedelta(days=2)
    )
    assert verdict.trusted
    assert verdict.checks[0].detail.startswith("trust bundle 3f2a3f2a3f2a3f2a… created ")
    assert dict(verdict.claims) == {
        "trust_bundle": {"digest": BUNDLE.digest, "created": "2026-11-10T00:00:00Z"}
    }


def test_a_bundle_exactly_at_the_limit_passes_and_one_second_more_fails() -> None:
    at = BUNDLE.created + timedelta(seconds=WEEK_S)
    assert verify_collateral(BUNDLE, CollateralPolicy(WEEK_S), at=at).trusted
    later = at + timedelta(seconds=1)
    assert not verify_collateral(BUNDLE, CollateralPolicy(WEEK_S), at=later).trusted


def test_no_dated_bundle_fails_when_the_policy_sets_a_maximum_age() -> None:
    verdict = verify_collateral(None, CollateralPolicy(WEEK_S), at=AT)
    [check] = verdict.failures
    assert check.name == "collateral.age"
    assert check.detail.startswith("no dated trust bundle: the collateral's age is unknown")
    assert dict(verdict.claims) == {"trust_bundle": None}


def test_a_bundle_dated_after_the_validation_time_fails() -> None:
    verdict = verify_collateral(
        BUNDLE, CollateralPolicy(WEEK_S), at=BUNDLE.created - timedelta(hours=1)
    )
    [check] = verdict.failures
    assert check.detail.endswith("is dated 3600 s after the validation time")


def test_without_a_maximum_no_check_runs_and_the_claims_still_name_the_bundle() -> None:
    verdict = verify_collateral(BUNDLE, CollateralPolicy(), at=AT)
    assert verdict.checks == ()
    assert verdict.claims["trust_bundle"]["digest"] == BUNDLE.digest


def test_the_policy_table_is_optional_and_read_when_present() -> None:
    assert CollateralPolicy.from_tables({"gpu": {}}) == CollateralPolicy(None)
    assert CollateralPolicy.from_tables({"collateral": {"max_age_s": 3600}}).max_age_s == 3600


@pytest.mark.parametrize(
    ("table", "refused"),
    [
        ({}, "exactly one key, max_age_s"),
        ({"max_age_s": 60, "max_age_days": 1}, "exactly one key, max_age_s"),
        ({"max_age_s": "7d"}, "a whole number of seconds"),
        ({"max_age_s": True}, "a whole number of seconds"),
        ({"max_age_s": 0}, "must be 1 to"),
        ({"max_age_s": -5}, "must be 1 to"),
    ],
)
def test_a_malformed_collateral_table_is_a_policy_error(table: Any, refused: str) -> None:
    with pytest.raises(PolicyError, match=refused):
        CollateralPolicy.from_tables({"collateral": table})


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(1382400, "16 days"), (86400, "1 day"), (7.5 * 86400, "7.5 days"), (3600, "1 hour"),
     (5400, "1.5 hours"), (0, "0 hours")],
)  # fmt: skip
def test_describe_age(seconds: float, text: str) -> None:
    assert describe_age(seconds) == text

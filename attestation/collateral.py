"""How old the attestation collateral may be: the `[collateral]` table of the policy file and
the check `collateral.age` (docs/ATTESTATION.md, "Trust bundles").

Revocation answers and Intel's collateral go stale in days, and a verifier that never fetches
anything cannot see that a newer answer exists. The policy therefore bounds the age of the
trust bundle the collateral came from, judged from the date the bundle was signed with
(attestation.trust_bundle). Fail closed: with a maximum age set, collateral without a dated
bundle fails the check, and so does a bundle dated after the validation time.

    [collateral]
    max_age_s = 604800          # optional table; a positive whole number of seconds
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from attestation.errors import PolicyError
from attestation.trust_bundle import TrustBundleId, format_created
from attestation.verdict import Check, Verdict

CHECK_NAME = "collateral.age"
_DAY_S = 86400
# Ten years: a longer maximum is a typo, not a policy.
_MAX_MAX_AGE_S = 3650 * _DAY_S


@dataclass(frozen=True, slots=True)
class CollateralPolicy:
    """`max_age_s`: the oldest trust bundle accepted, in seconds; None: the policy sets no
    maximum and `collateral.age` does not run."""

    max_age_s: int | None = None

    @classmethod
    def from_tables(cls, tables: Mapping[str, Any]) -> CollateralPolicy:
        """Parse the optional `[collateral]` table of attestation.policy.read_policy_file's
        tables. Raises PolicyError for an empty table, an unknown key, or a maximum that is not
        a whole number of seconds from 1 to ten years."""
        table = tables.get("collateral")
        if table is None:
            return cls()
        if not isinstance(table, Mapping) or set(table) != {"max_age_s"}:
            raise PolicyError("policy [collateral] must hold exactly one key, max_age_s")
        value = table["max_age_s"]
        if not isinstance(value, int) or isinstance(value, bool):
            raise PolicyError("policy collateral.max_age_s must be a whole number of seconds")
        if not 1 <= value <= _MAX_MAX_AGE_S:
            raise PolicyError(f"policy collateral.max_age_s must be 1 to {_MAX_MAX_AGE_S}")
        return cls(value)


def verify_collateral(
    bundle: TrustBundleId | None, policy: CollateralPolicy, *, at: datetime
) -> Verdict:
    """The collateral's part of a verdict: its claims name the trust bundle (`trust_bundle`:
    digest and created, or None), and with a maximum age, the check `collateral.age`."""
    claims = {"trust_bundle": None if bundle is None else bundle.to_json()}
    if policy.max_age_s is None:
        return Verdict((), at, claims)
    return Verdict((_age_check(bundle, policy.max_age_s, at),), at, claims)


def _age_check(bundle: TrustBundleId | None, max_age_s: int, at: datetime) -> Check:
    allowed = f"the policy allows {describe_age(max_age_s)} (max_age_s = {max_age_s})"
    if bundle is None:
        return Check(
            CHECK_NAME, False,
            f"no dated trust bundle: the collateral's age is unknown, and {allowed}",
        )  # fmt: skip
    named = f"trust bundle {bundle.digest[:16]}… created {format_created(bundle.created)}"
    age_s = int((at - bundle.created).total_seconds())
    if age_s < 0:
        return Check(CHECK_NAME, False, f"{named} is dated {-age_s} s after the validation time")
    detail = f"{named} is {describe_age(age_s)} old ({age_s} s); {allowed}"
    return Check(CHECK_NAME, age_s <= max_age_s, detail)


def describe_age(seconds: float) -> str:
    """`seconds` in days (one decimal, `16 days`, `7.5 days`), or in hours below a day."""
    if seconds >= _DAY_S:
        days = f"{seconds / _DAY_S:.1f}".removesuffix(".0")
        return f"{days} day" if days == "1" else f"{days} days"
    hours = f"{seconds / 3600:.1f}".removesuffix(".0")
    return f"{hours} hour" if hours == "1" else f"{hours} hours"

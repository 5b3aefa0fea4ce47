"""The local demo issuer: its key file, and tokens that its own verifier accepts with the role
asked for and that no other issuer's verifier accepts."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import jwt
import pytest

from appliance.auth.errors import AuthConfigError, AuthenticationError, Reason
from appliance.auth.local_issuer import (
    LOCAL_AUDIENCE,
    LOCAL_ISSUER,
    LocalIssuer,
    TokenRequestError,
)
from appliance.auth.roles import Role


def test_key_is_made_owner_only_once_and_reused(tmp_path: Path) -> None:
    key_file = tmp_path / "auth" / "local-issuer.pem"
    first = LocalIssuer.load_or_create(key_file, 600)
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert LocalIssuer.load_or_create(key_file, 600).kid == first.kid


def test_key_file_readable_by_others_is_refused(tmp_path: Path) -> None:
    key_file = tmp_path / "k.pem"
    LocalIssuer.load_or_create(key_file, 600)
    key_file.chmod(0o644)
    with pytest.raises(AuthConfigError, match="readable by others"):
        LocalIssuer.load_or_create(key_file, 600)


def test_minted_token_is_a_short_lived_rfc9068_token_with_the_role(tmp_path: Path) -> None:
    issuer = LocalIssuer.load_or_create(tmp_path / "k.pem", 600)
    token = issuer.mint(Role.ADMIN, "ops-alice", time.time())
    header = jwt.get_unverified_header(token)
    assert header == {"alg": "EdDSA", "kid": issuer.kid, "typ": "at+jwt"}
    principal = asyncio.run(issuer.verifier(leeway_s=0).verify(token, header))
    assert (principal.issuer, principal.subject, principal.roles) == (
        LOCAL_ISSUER, "ops-alice", {Role.ADMIN},
    )  # fmt: skip
    assert principal.expires_at - time.time() == pytest.approx(600, abs=5)
    claims = jwt.decode(token, options={"verify_signature": False})
    assert claims["aud"] == LOCAL_AUDIENCE


def test_token_of_another_appliance_local_issuer_is_refused(tmp_path: Path) -> None:
    ours = LocalIssuer.load_or_create(tmp_path / "ours.pem", 600)
    theirs = LocalIssuer.load_or_create(tmp_path / "theirs.pem", 600)
    token = theirs.mint(Role.ADMIN, "intruder", time.time())
    with pytest.raises(AuthenticationError) as refused:
        asyncio.run(ours.verifier(0).verify(token, jwt.get_unverified_header(token)))
    assert refused.value.reason is Reason.UNKNOWN_KEY


def test_expired_local_token_is_refused(tmp_path: Path) -> None:
    issuer = LocalIssuer.load_or_create(tmp_path / "k.pem", 60)
    token = issuer.mint(Role.USER, "u", time.time() - 3600)
    with pytest.raises(AuthenticationError) as refused:
        asyncio.run(issuer.verifier(0).verify(token, jwt.get_unverified_header(token)))
    assert refused.value.reason is Reason.EXPIRED


@pytest.mark.parametrize(
    ("roles", "subject", "ttl_s", "reason"),
    [
        ({Role.ADMIN, Role.AUDITOR}, "ops", 600, "kept apart"),
        (set(), "ops", 600, "at least one role"),
        ({Role.USER}, "ops", 601, "60 s to 600 s"),
        ({Role.USER}, "ops", 59, "60 s to 600 s"),
        ({Role.USER}, " ", 600, "printable"),
        ({Role.USER}, "a\nb", 600, "printable"),
        ({Role.USER}, "x" * 257, 600, "printable"),
    ],
)
def test_plan_refuses_what_no_token_may_be(
    tmp_path: Path, roles: set[Role], subject: str, ttl_s: int, reason: str
) -> None:
    issuer = LocalIssuer.load_or_create(tmp_path / "k.pem", 600)
    with pytest.raises(TokenRequestError, match=reason):
        issuer.plan(roles, subject, time.time(), ttl_s)


def test_a_planned_token_is_signed_as_planned_with_several_roles(tmp_path: Path) -> None:
    issuer = LocalIssuer.load_or_create(tmp_path / "k.pem", 600)
    planned = issuer.plan({Role.USER, Role.SERVICE}, "team", 1_000_000.0, 120)
    claims = jwt.decode(issuer.sign(planned), options={"verify_signature": False})
    assert (claims["jti"], claims["roles"]) == (planned.token_id, ["service", "user"])
    assert (claims["iat"], claims["exp"]) == (1_000_000, 1_000_120)
    target = planned.audit_target()
    assert target["token_id"] == planned.token_id and target["roles"] == ["service", "user"]
    assert target["expires"] == "1970-01-12T13:48:40+00:00"

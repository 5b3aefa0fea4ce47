"""The local demo issuer: its key file, and tokens that its own verifier accepts with the role
asked for and that no other issuer's verifier accepts."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import jwt
import pytest

from appliance.auth.errors import AuthConfigError, AuthenticationError, Reason
from appliance.auth.local_issuer import LOCAL_AUDIENCE, LOCAL_ISSUER, LocalIssuer
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

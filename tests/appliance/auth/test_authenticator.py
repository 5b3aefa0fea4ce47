"""The authenticator remembers a verified token for a minute at most and never past its `exp`,
and never remembers a refusal."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from appliance.auth.access_token import AccessTokenVerifier
from appliance.auth.authenticator import VERIFIED_TOKEN_TTL_S, Authenticator
from appliance.auth.errors import AuthenticationError, Reason
from appliance.auth.local_issuer import LocalIssuer
from appliance.auth.principal import Principal
from appliance.auth.roles import Role

TOKEN_TTL_S = 600


class Clock:
    """The authenticator's clock, moved by the tests; it starts at the real time."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


class CountingVerifier:
    """The local issuer's real verifier (it checks `exp` against the real time, so the tokens
    are minted for now), counting the signatures it checks."""

    def __init__(self, verifier: AccessTokenVerifier) -> None:
        self.verifier, self.calls = verifier, 0

    async def verify(self, token: str, header: Mapping[str, Any]) -> Principal:
        self.calls += 1
        return await self.verifier.verify(token, header)


@pytest.fixture
def issuer(tmp_path: Path) -> LocalIssuer:
    return LocalIssuer.load_or_create(tmp_path / "k.pem", TOKEN_TTL_S)


def _authenticator(issuer: LocalIssuer, clock: Clock) -> tuple[Authenticator, CountingVerifier]:
    counting = CountingVerifier(issuer.verifier(leeway_s=0))
    return Authenticator({issuer.issuer: counting}, clock), counting  # type: ignore[dict-item]


def _authenticate(authenticator: Authenticator, token: str) -> Principal:
    return asyncio.run(authenticator.authenticate([f"Bearer {token}"]))


def test_a_token_seen_again_within_the_ttl_is_not_verified_again(issuer: LocalIssuer) -> None:
    clock = Clock()
    authenticator, counting = _authenticator(issuer, clock)
    token = issuer.mint(Role.USER, "alice", time.time())
    first = _authenticate(authenticator, token)
    clock.now += VERIFIED_TOKEN_TTL_S - 1
    assert _authenticate(authenticator, token) == first
    assert counting.calls == 1
    clock.now += 1
    assert _authenticate(authenticator, token) == first
    assert counting.calls == 2


def test_a_remembered_token_is_verified_again_at_its_expiry(issuer: LocalIssuer) -> None:
    clock = Clock()
    authenticator, counting = _authenticator(issuer, clock)
    token = issuer.mint(Role.USER, "alice", time.time())
    principal = _authenticate(authenticator, token)
    # Expiry comes before the TTL: the cache must not outlive the token.
    clock.now = principal.expires_at
    _authenticate(authenticator, token)  # the real clock: still valid, so verified afresh
    assert counting.calls == 2


def test_a_refused_token_is_checked_every_time(issuer: LocalIssuer, tmp_path: Path) -> None:
    authenticator, counting = _authenticator(issuer, Clock())
    stranger = LocalIssuer.load_or_create(tmp_path / "stranger.pem", TOKEN_TTL_S)
    token = stranger.mint(Role.ADMIN, "mallory", time.time())
    for _ in range(2):
        with pytest.raises(AuthenticationError) as refused:
            _authenticate(authenticator, token)
        assert refused.value.reason is Reason.UNKNOWN_KEY
    assert counting.calls == 2


def test_the_oldest_token_is_forgotten_when_the_cache_is_full(issuer: LocalIssuer) -> None:
    authenticator, counting = _authenticator(issuer, Clock())
    authenticator.verified.max_entries = 2
    tokens = [issuer.mint(Role.USER, f"user-{i}", time.time()) for i in range(3)]
    for token in tokens:
        _authenticate(authenticator, token)
    _authenticate(authenticator, tokens[2])
    assert counting.calls == 3
    _authenticate(authenticator, tokens[0])
    assert counting.calls == 4

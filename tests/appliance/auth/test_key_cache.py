"""The issuer's keys as the appliance keeps them, against a real OpenID provider that rotates its
key and goes down: one rate-limited refetch for an unknown kid, the last good JWK Set on disk,
and refusal once the cached keys are older than the staleness limit."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import jwt
import pytest

from appliance.auth.authenticator import Authenticator
from appliance.auth.errors import AuthenticationError, Reason
from appliance.auth.idp_http import IdpHttp, idp_tls_context
from appliance.auth.key_cache import KeyStatus, cache_file_for
from appliance.auth.settings import AuthSettings
from tests.appliance.auth.idp import IdpCa, OidcProvider, private_key, signing_key
from tests.appliance.auth.realm import SERVICE_SECRET, auth_settings, start_idp

TTL_S, REFETCH_S, STALENESS_S = 300.0, 10.0, 3600.0


@pytest.fixture
def idp(idp_ca: IdpCa, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OidcProvider]:
    """A provider of its own for each test: these tests rotate its keys and stop it."""
    provider = start_idp(tmp_path_factory.mktemp("idp"), idp_ca)
    try:
        yield provider
    finally:
        provider.stop()


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class CountingHttp(IdpHttp):
    """The real client, counting the requests it makes."""

    num_requests = 0

    async def get_json(self, url: str) -> object:
        self.num_requests += 1
        return await super().get_json(url)


class Appliance:
    """An authenticator as a running appliance holds it, in one event loop."""

    def __init__(self, settings: AuthSettings, clock: Clock) -> None:
        self.settings, self.clock = settings, clock

    async def __aenter__(self) -> Appliance:
        self.http = CountingHttp(idp_tls_context(self.settings.ca_file), 2.0)
        self.authenticator = Authenticator.from_settings(self.settings, self.http, None, self.clock)
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.http.aclose()

    async def accepts(self, token: str) -> bool:
        await self.authenticator.authenticate([f"Bearer {token}"])
        return True

    async def refusal(self, token: str) -> Reason:
        try:
            await self.authenticator.authenticate([f"Bearer {token}"])
        except AuthenticationError as exc:
            return exc.reason
        raise AssertionError("the token was accepted")


def _settings(idp: OidcProvider, ca: IdpCa, cache_dir: Path) -> AuthSettings:
    return auth_settings(
        idp, ca, cache_dir,
        jwks_cache_ttl_s=TTL_S, jwks_refetch_interval_s=REFETCH_S, jwks_max_staleness_s=STALENESS_S,
    )  # fmt: skip


def _token(idp: OidcProvider) -> str:
    return idp.client_credentials_token("svc-batch", SERVICE_SECRET)


def test_rotated_key_is_accepted_once_the_refetch_interval_has_passed(
    idp: OidcProvider, idp_ca: IdpCa, tmp_path: Path
) -> None:
    clock = Clock()

    async def scenario() -> None:
        async with Appliance(_settings(idp, idp_ca, tmp_path), clock) as appliance:
            assert await appliance.accepts(_token(idp))
            assert appliance.http.num_requests == 2  # discovery, then the JWKS
            idp.rotate(signing_key("key-2"))
            rotated = _token(idp)
            clock.now += 1.0  # within the refetch interval of the first fetch: not yet
            assert await appliance.refusal(rotated) is Reason.UNKNOWN_KEY
            assert appliance.http.num_requests == 2
            clock.now += REFETCH_S
            assert await appliance.accepts(rotated)
            assert appliance.http.num_requests == 4
            assert await appliance.accepts(_token(idp))  # no further fetch for a known kid
            assert appliance.http.num_requests == 4

    asyncio.run(scenario())


def test_flood_of_unknown_kids_costs_one_fetch_per_interval(
    idp: OidcProvider, idp_ca: IdpCa, tmp_path: Path
) -> None:
    clock = Clock()
    genuine = _token(idp)
    claims = jwt.decode(genuine, options={"verify_signature": False})
    key = private_key(idp.keys[0])

    async def scenario() -> None:
        async with Appliance(_settings(idp, idp_ca, tmp_path), clock) as appliance:
            await appliance.accepts(genuine)
            for i in range(50):
                forged = jwt.encode(claims, key, "ES256", headers={"kid": f"random-{i}"})
                clock.now += 0.5  # 25 s in all: two more refetch intervals
                assert await appliance.refusal(forged) is Reason.UNKNOWN_KEY
            assert appliance.http.num_requests == 2 + 2 * 2

    asyncio.run(scenario())


def test_idp_down_cached_keys_serve_until_the_staleness_limit_then_refuse(
    idp: OidcProvider, idp_ca: IdpCa, tmp_path: Path
) -> None:
    clock = Clock()
    token = _token(idp)

    async def scenario() -> None:
        async with Appliance(_settings(idp, idp_ca, tmp_path), clock) as appliance:
            keys = appliance.authenticator.verifiers[idp.issuer].keys
            assert keys.status() == KeyStatus(False, (), None, stale=True)  # none fetched yet
            assert await appliance.accepts(token)
            assert keys.status() == KeyStatus(
                False, ("key-1",), 1_000_000.0, stale=False,
                refresh_at=1_000_000.0 + TTL_S, stale_at=1_000_000.0 + STALENESS_S,
                last_attempt_at=1_000_000.0,
            )  # fmt: skip
            idp.stop()
            clock.now += TTL_S + 1  # due for a refresh, which fails: the cached keys still do
            assert await appliance.accepts(token)
            failed = keys.status()  # the failed attempt shows, after the last good fetch
            assert failed.last_attempt_at == clock.now and failed.fetched_at == 1_000_000.0
            clock.now = 1_000_000.0 + STALENESS_S + 1
            assert await appliance.refusal(token) is Reason.KEYS_UNAVAILABLE
            assert keys.status().stale
            idp.start()  # back, same issuer and keys: accepted once the next fetch is due
            clock.now += REFETCH_S
            assert await appliance.accepts(token)

    asyncio.run(scenario())


def test_restart_while_the_idp_is_down_uses_the_keys_kept_on_disk(
    idp: OidcProvider, idp_ca: IdpCa, tmp_path: Path
) -> None:
    clock = Clock()
    token = _token(idp)
    settings = _settings(idp, idp_ca, tmp_path)

    async def first_run() -> None:
        async with Appliance(settings, clock) as appliance:
            assert await appliance.accepts(token)

    async def after_restart() -> tuple[bool, Reason]:
        async with Appliance(settings, clock) as appliance:
            clock.now += TTL_S
            accepted = await appliance.accepts(token)
            clock.now = 1_000_000.0 + STALENESS_S + 1
            return accepted, await appliance.refusal(token)

    asyncio.run(first_run())
    record = json.loads(cache_file_for(tmp_path, idp.issuer).read_text())
    assert record["issuer"] == idp.issuer and record["fetched_at"] == clock.now
    assert (cache_file_for(tmp_path, idp.issuer).stat().st_mode & 0o777) == 0o600
    idp.stop()
    assert asyncio.run(after_restart()) == (True, Reason.KEYS_UNAVAILABLE)


def test_first_start_with_the_idp_down_and_no_cache_refuses(
    idp: OidcProvider, idp_ca: IdpCa, tmp_path: Path
) -> None:
    token = _token(idp)
    idp.stop()

    async def scenario() -> Reason:
        async with Appliance(_settings(idp, idp_ca, tmp_path), Clock()) as appliance:
            return await appliance.refusal(token)

    assert asyncio.run(scenario()) is Reason.KEYS_UNAVAILABLE


def test_idp_whose_certificate_is_not_from_the_configured_ca_is_not_trusted(
    idp: OidcProvider, tmp_path: Path
) -> None:
    other_ca = IdpCa.create(tmp_path)
    token = _token(idp)

    async def scenario() -> Reason:
        async with Appliance(_settings(idp, other_ca, tmp_path), Clock()) as appliance:
            return await appliance.refusal(token)

    assert asyncio.run(scenario()) is Reason.KEYS_UNAVAILABLE


def test_cached_keys_of_another_issuer_or_a_corrupt_file_are_ignored(
    idp: OidcProvider, idp_ca: IdpCa, tmp_path: Path
) -> None:
    token = _token(idp)
    settings = _settings(idp, idp_ca, tmp_path)

    async def fetch_once() -> None:
        async with Appliance(settings, Clock()) as appliance:
            await appliance.accepts(token)

    asyncio.run(fetch_once())
    idp.stop()
    cache_file = cache_file_for(tmp_path, idp.issuer)
    record = json.loads(cache_file.read_text())

    async def refusal() -> Reason:
        async with Appliance(settings, Clock()) as appliance:
            return await appliance.refusal(token)

    cache_file.write_text(json.dumps({**record, "issuer": "https://elsewhere.example"}))
    assert asyncio.run(refusal()) is Reason.KEYS_UNAVAILABLE
    cache_file.write_text("{not json")
    assert asyncio.run(refusal()) is Reason.KEYS_UNAVAILABLE

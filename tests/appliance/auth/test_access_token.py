"""Bearer access tokens of a real OpenID provider (oidc-provider, over TLS trusted through a
customer CA), verified by the authenticator: the roles of genuine tokens, and the refusal of
every hostile token with the reason it deserves, audited through the denial hook."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.auth.authenticator import Authenticator
from appliance.auth.denials import DenialReporter
from appliance.auth.errors import AuthenticationError, AuthorizationError, Reason
from appliance.auth.idp_http import IdpHttp, idp_tls_context
from appliance.auth.principal import Principal
from appliance.auth.roles import Role
from appliance.auth.settings import AuthSettings
from audit.event import Action, AuditEvent, Outcome
from tests.appliance.auth.hostile import HOSTILE, Material
from tests.appliance.auth.idp import AUDIENCE, IdpCa, OidcProvider, authorization_code_tokens
from tests.appliance.auth.realm import (
    CONSOLE_SECRET,
    SERVICE_SECRET,
    auth_settings,
    issuer_settings,
    start_idp,
)


async def _authenticate(settings: AuthSettings, token: str) -> Principal:
    http = IdpHttp(idp_tls_context(settings.ca_file), settings.fetch_timeout_s)
    try:
        authenticator = Authenticator.from_settings(settings, http, None, time.time)
        return await authenticator.authenticate([f"Bearer {token}"])
    finally:
        await http.aclose()


def authenticate(settings: AuthSettings, token: str) -> Principal:
    return asyncio.run(_authenticate(settings, token))


@pytest.fixture(scope="module")
def settings(idp: OidcProvider, idp_ca: IdpCa, tmp_path_factory: pytest.TempPathFactory):
    issuer = issuer_settings(idp, require_access_token_type=True)
    return auth_settings(idp, idp_ca, tmp_path_factory.mktemp("jwks"), issuer=issuer)


@pytest.mark.parametrize(
    ("client", "roles"),
    [("svc-batch", {Role.SERVICE}), ("svc-ops", {Role.ADMIN}), ("svc-nothing", set())],
)
def test_client_credentials_token_is_accepted_with_the_roles_its_claims_map_to(
    idp: OidcProvider, settings: AuthSettings, client: str, roles: set[Role]
) -> None:
    token = idp.client_credentials_token(client, SERVICE_SECRET)
    principal = authenticate(settings, token)
    assert principal.issuer == idp.issuer
    assert principal.subject == client
    assert principal.client_id == client
    assert principal.roles == roles
    assert principal.expires_at > time.time()


def test_user_roles_come_from_group_role_and_client_role_claims(
    idp: OidcProvider, settings: AuthSettings
) -> None:
    # Access tokens of the authorization code flow, for users whose roles sit in three places.
    expected = {"alice": {Role.USER}, "bob": {Role.ADMIN}, "carol": {Role.AUDITOR}}
    for user, roles in expected.items():
        tokens = authorization_code_tokens(
            idp, AUDIENCE, CONSOLE_SECRET, _redirect(idp), user, f"{user}-password"
        )
        assert authenticate(settings, tokens["access_token"]).roles == roles


def test_token_granting_both_admin_and_auditor_is_denied(
    idp: OidcProvider, settings: AuthSettings
) -> None:
    tokens = authorization_code_tokens(
        idp, AUDIENCE, CONSOLE_SECRET, _redirect(idp), "mallory", "mallory-password"
    )
    with pytest.raises(AuthorizationError, match="separation of duties"):
        authenticate(settings, tokens["access_token"])


def _redirect(idp: OidcProvider) -> str:
    [console] = [c for c in idp.clients if c["client_id"] == AUDIENCE]
    return console["redirect_uris"][0]


@pytest.fixture(scope="module")
def other_idp(idp_ca: IdpCa, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OidcProvider]:
    provider = start_idp(tmp_path_factory.mktemp("other-idp"), idp_ca)
    try:
        yield provider
    finally:
        provider.stop()


@pytest.fixture(scope="module")
def attacker_socket() -> Iterator[socket.socket]:
    """A listening loopback socket that hostile headers point at: nothing may connect to it."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        sock.setblocking(False)
        yield sock


@pytest.fixture(scope="module")
def material(
    idp: OidcProvider, other_idp: OidcProvider, attacker_socket: socket.socket
) -> Material:
    tokens = authorization_code_tokens(
        idp, AUDIENCE, CONSOLE_SECRET, _redirect(idp), "alice", "alice-password"
    )
    port = attacker_socket.getsockname()[1]
    return Material.make(idp, other_idp, tokens["id_token"], f"https://127.0.0.1:{port}/jwks")


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_token_is_refused_for_its_reason_and_audited(
    name: str, material: Material, settings: AuthSettings, attacker_socket: socket.socket
) -> None:
    make, reason = HOSTILE[name]
    token = make(material)
    events: list[AuditEvent] = []

    async def record(event: AuditEvent) -> None:
        events.append(event)

    async def refuse() -> AuthenticationError:
        http = IdpHttp(idp_tls_context(settings.ca_file), settings.fetch_timeout_s)
        authenticator = Authenticator.from_settings(settings, http, None, time.time)
        denials = DenialReporter(record, settings.failure_events_per_minute, time.monotonic)
        try:
            await authenticator.authenticate([f"Bearer {token}"])
        except AuthenticationError as exc:
            await denials.authentication_failed(exc, "192.0.2.7", "req-1")
            return exc
        finally:
            await http.aclose()
        raise AssertionError(f"{name} was accepted")

    error = asyncio.run(refuse())
    assert error.reason is reason
    [event] = events
    assert (event.action, event.outcome) == (Action.AUTHENTICATE, Outcome.FAILURE)
    assert event.details == {"reason": str(reason)}
    assert event.source_address == "192.0.2.7"
    assert token not in repr(event)
    with pytest.raises(BlockingIOError):
        attacker_socket.accept()  # no key was fetched from where the token pointed


def test_id_token_is_accepted_where_the_access_token_type_is_not_enforced(
    material: Material, idp: OidcProvider, idp_ca: IdpCa, tmp_path: Path
) -> None:
    """The contrast that shows the `typ` check matters: this issuer's ID tokens name the
    appliance's audience (one client for both, as Keycloak sites often have)."""
    lax = auth_settings(idp, idp_ca, tmp_path)
    assert authenticate(lax, material.id_token).subject == "alice"


def test_authorization_header_forms(idp: OidcProvider, settings: AuthSettings) -> None:
    token = idp.client_credentials_token("svc-batch", SERVICE_SECRET)

    async def reason(values: list[str]) -> Reason:
        http = IdpHttp(idp_tls_context(settings.ca_file), settings.fetch_timeout_s)
        authenticator = Authenticator.from_settings(settings, http, None, time.time)
        try:
            await authenticator.authenticate(values)
        except AuthenticationError as exc:
            return exc.reason
        finally:
            await http.aclose()
        raise AssertionError(f"{values} was accepted")

    assert asyncio.run(reason([])) is Reason.NO_TOKEN
    assert asyncio.run(reason([f"Basic {token}"])) is Reason.NO_TOKEN
    assert asyncio.run(reason([f"Bearer {token}", f"Bearer {token}"])) is Reason.MALFORMED_REQUEST
    assert asyncio.run(reason([f"Bearer {token} extra"])) is Reason.MALFORMED_REQUEST
    assert asyncio.run(reason(["Bearer " + "a" * 20000 + ".b.c"])) is Reason.MALFORMED_TOKEN
    assert authenticate(settings, token).subject == "svc-batch"  # scheme is case-insensitive too
    assert asyncio.run(_authenticate_raw(settings, f"bEaReR {token}")).subject == "svc-batch"


async def _authenticate_raw(settings: AuthSettings, value: str) -> Principal:
    http = IdpHttp(idp_tls_context(settings.ca_file), settings.fetch_timeout_s)
    try:
        return await Authenticator.from_settings(settings, http, None, time.time).authenticate(
            [value]
        )
    finally:
        await http.aclose()

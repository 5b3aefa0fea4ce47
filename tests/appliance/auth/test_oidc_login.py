"""Console login against the real OpenID provider: the authorization code flow with PKCE
scripted end to end (the IdP's own login page, as a browser posts it), the checks on the way
back, and RP-initiated logout."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import httpx
import pytest

from appliance.auth.authenticator import Authenticator
from appliance.auth.errors import LoginError
from appliance.auth.idp_http import IdpHttp, idp_tls_context
from appliance.auth.oidc_login import ConsoleLogin
from appliance.auth.roles import Role
from appliance.auth.settings import AuthSettings
from tests.appliance.auth.idp import AUDIENCE, IdpCa, OidcProvider, log_in
from tests.appliance.auth.realm import CONSOLE_SECRET, auth_settings, issuer_settings

ORIGIN = "https://127.0.0.1:8443"  # the realm's default console origin
T = TypeVar("T")


def console_settings(idp: OidcProvider, ca: IdpCa, directory: Path) -> AuthSettings:
    secret_file = directory / "console-secret"
    secret_file.write_text(CONSOLE_SECRET + "\n")
    issuer = issuer_settings(
        idp,
        console_client_id=AUDIENCE,
        console_client_secret_file=secret_file,
        console_redirect_uri=f"{ORIGIN}/console/callback",
        console_post_logout_redirect_uri=f"{ORIGIN}/console/",
    )
    return auth_settings(idp, ca, directory, issuer=issuer)


def with_login(settings: AuthSettings, scenario: Callable[[ConsoleLogin], Awaitable[T]]) -> T:
    async def run() -> T:
        http = IdpHttp(idp_tls_context(settings.ca_file), settings.fetch_timeout_s)
        try:
            authenticator = Authenticator.from_settings(settings, http, None, time.time)
            login = ConsoleLogin.from_settings(settings, http, authenticator, time.time)
            assert login is not None
            return await scenario(login)
        finally:
            await http.aclose()

    return asyncio.run(run())


def _browser_log_in(idp: OidcProvider, url: str, user: str) -> dict[str, str]:
    """What the IdP sends the browser back to the callback with."""
    with idp.http() as browser:
        back = log_in(browser, url, user, f"{user}-password")
    location = httpx.URL(back.headers["location"])
    assert str(location.copy_with(query=None)) == f"{ORIGIN}/console/callback"
    return dict(location.params)


@pytest.mark.parametrize(("user", "roles"), [("alice", {Role.USER}), ("bob", {Role.ADMIN})])
def test_authorization_code_login_with_pkce_ends_with_the_users_roles(
    idp: OidcProvider, idp_ca: IdpCa, tmp_path: Path, user: str, roles: set[Role]
) -> None:
    settings = console_settings(idp, idp_ca, tmp_path)

    async def scenario(login: ConsoleLogin) -> tuple[str, set[Role], str]:
        url, pending_id = await login.begin()
        query = httpx.URL(url).params
        assert url.startswith(f"{idp.issuer}/auth?")
        assert query["code_challenge_method"] == "S256"
        assert query["client_id"] == AUDIENCE and query["scope"] == "openid"
        assert len(query["state"]) >= 32 and len(query["nonce"]) >= 32
        params = await asyncio.to_thread(_browser_log_in, idp, url, user)
        assert params["iss"] == idp.issuer
        completed = await login.complete(pending_id, params)
        return completed.principal.subject, set(completed.principal.roles), completed.id_token

    subject, granted, id_token = with_login(settings, scenario)
    assert (subject, granted) == (user, roles)
    assert id_token.count(".") == 2


def test_callback_is_refused_in_another_browser_with_another_state_or_twice(
    idp: OidcProvider, idp_ca: IdpCa, tmp_path: Path
) -> None:
    settings = console_settings(idp, idp_ca, tmp_path)

    async def scenario(login: ConsoleLogin) -> list[str]:
        refusals = []
        url, pending_id = await login.begin()
        params = await asyncio.to_thread(_browser_log_in, idp, url, "alice")
        for attempt in (
            lambda: login.complete(None, params),  # no login cookie: another browser
            lambda: login.complete("forged-id", params),
            lambda: login.complete(pending_id, {**params, "iss": "https://127.0.0.1:1"}),
        ):
            try:
                await attempt()
            except LoginError as exc:
                refusals.append(str(exc))
        # A pending login is used up by its first callback, even a refused one.
        url, pending_id = await login.begin()
        params = await asyncio.to_thread(_browser_log_in, idp, url, "alice")
        try:
            await login.complete(pending_id, {**params, "state": "x" * 43})
        except LoginError as exc:
            refusals.append(str(exc))
        try:
            await login.complete(pending_id, params)
        except LoginError as exc:
            refusals.append(str(exc))
        return refusals

    refusals = with_login(settings, scenario)
    assert refusals == [
        "no login in progress in this browser (or it took too long)",
        "no login in progress in this browser (or it took too long)",
        "the callback names another issuer",
        "the callback's state is not this login's",
        "no login in progress in this browser (or it took too long)",
    ]


def test_code_without_the_pkce_verifier_is_refused_by_the_idp(
    idp: OidcProvider, idp_ca: IdpCa, tmp_path: Path
) -> None:
    """The IdP checks the S256 challenge: a code stolen on its way back is useless alone."""
    settings = console_settings(idp, idp_ca, tmp_path)

    async def scenario(login: ConsoleLogin) -> int:
        url, _ = await login.begin()
        params = await asyncio.to_thread(_browser_log_in, idp, url, "alice")
        async with httpx.AsyncClient(verify=idp_tls_context(idp_ca.cert_file)) as http:
            response = await http.post(
                f"{idp.issuer}/token",
                data={"grant_type": "authorization_code", "code": params["code"],
                      "redirect_uri": f"{ORIGIN}/console/callback", "client_id": AUDIENCE,
                      "client_secret": CONSOLE_SECRET,
                      "code_verifier": "a-guessed-verifier-" + "x" * 40},
            )  # fmt: skip
        return response.status_code

    assert with_login(settings, scenario) == 400


def test_a_code_the_idp_refuses_at_the_exchange_is_a_login_error(
    idp: OidcProvider, idp_ca: IdpCa, tmp_path: Path
) -> None:
    """authlib's error for the IdP's answer (invalid_grant) becomes the login's own error."""
    settings = console_settings(idp, idp_ca, tmp_path)

    async def scenario(login: ConsoleLogin) -> str:
        url, pending_id = await login.begin()
        params = await asyncio.to_thread(_browser_log_in, idp, url, "alice")
        with pytest.raises(LoginError) as refused:
            await login.complete(pending_id, {**params, "code": "a-forged-code"})
        return str(refused.value)

    assert with_login(settings, scenario) == "the code exchange failed (OAuthError)"


def test_logout_url_ends_the_idp_session_with_the_id_token_hint(
    idp: OidcProvider, idp_ca: IdpCa, tmp_path: Path
) -> None:
    settings = console_settings(idp, idp_ca, tmp_path)

    async def scenario(login: ConsoleLogin) -> str | None:
        return await login.logout_url("the.id.token")

    url = with_login(settings, scenario)
    assert url is not None
    parsed = httpx.URL(url)
    assert str(parsed.copy_with(query=None)) == f"{idp.issuer}/session/end"
    assert dict(parsed.params) == {
        "id_token_hint": "the.id.token",
        "client_id": AUDIENCE,
        "post_logout_redirect_uri": f"{ORIGIN}/console/",
    }

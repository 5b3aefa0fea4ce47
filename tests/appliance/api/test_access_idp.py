"""The server behind a real OpenID provider (oidc-provider, tests/appliance/auth/idp.py): service
tokens from client credentials used with OpenAI's client, the hostile-token suite refused over
HTTP with 401 and audited, and the console login scripted end to end through the server's own
routes and the IdP's login page, down to RP-initiated logout."""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from appliance.engine.engine import Engine
from tests.appliance.api.conftest import MODEL_NAME, RunningServer, make_settings, running_server
from tests.appliance.api.test_audit_trail import AuditDatabase
from tests.appliance.auth.hostile import HOSTILE, Material
from tests.appliance.auth.idp import (
    AUDIENCE,
    IdpCa,
    OidcProvider,
    authorization_code_tokens,
    log_in,
)
from tests.appliance.auth.realm import CONSOLE_SECRET, SERVICE_SECRET, issuer_settings, start_idp
from tests.appliance.console.test_routes import entries


@pytest.fixture(scope="module")
def port() -> int:
    """A free loopback port for the server, known before the IdP registers its console client
    (whose redirect URI names it)."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def idp_ca(tmp_path_factory: pytest.TempPathFactory) -> IdpCa:
    return IdpCa.create(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def idp(
    idp_ca: IdpCa, port: int, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OidcProvider]:
    provider = start_idp(tmp_path_factory.mktemp("idp"), idp_ca, f"https://127.0.0.1:{port}")
    try:
        yield provider
    finally:
        provider.stop()


@pytest.fixture(scope="module")
def server(
    idp: OidcProvider, idp_ca: IdpCa, port: int, api_engine: Engine, smollm2_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RunningServer]:  # fmt: skip
    directory = tmp_path_factory.mktemp("server")
    secret_file = directory / "console-secret"
    secret_file.write_text(CONSOLE_SECRET)
    origin = f"https://127.0.0.1:{port}"
    issuer = issuer_settings(
        idp,
        require_access_token_type=True,
        console_client_id=AUDIENCE,
        console_client_secret_file=str(secret_file),
        console_redirect_uri=f"{origin}/console/callback",
        console_post_logout_redirect_uri=f"{origin}/console/",
    )
    auth = {
        "issuers": [issuer],
        "ca_file": str(idp_ca.cert_file),
        "jwks_cache_dir": str(directory / "jwks"),
        "failure_events_per_minute": 10_000,
    }
    settings = make_settings(directory, smollm2_dir, auth=auth, port=port)
    with running_server(settings, api_engine) as running:
        yield running


def test_service_token_from_client_credentials_serves_inference_with_openais_client(
    server: RunningServer, idp: OidcProvider
) -> None:
    token = idp.client_credentials_token("svc-batch", SERVICE_SECRET)
    http_client = httpx.Client(verify=server.tls_context())
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=token, http_client=http_client)
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    assert reply.choices[0].message.content is not None
    ops = idp.client_credentials_token("svc-ops", SERVICE_SECRET)  # admin: no inference
    admin = openai.OpenAI(base_url=f"{server.url}/v1", api_key=ops, http_client=http_client)
    with pytest.raises(openai.PermissionDeniedError):
        admin.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2)
    with httpx.Client(verify=server.tls_context()) as http:
        metrics = http.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {ops}"})
    assert metrics.status_code == 200


@pytest.fixture(scope="module")
def other_idp(idp_ca: IdpCa, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OidcProvider]:
    provider = start_idp(tmp_path_factory.mktemp("other-idp"), idp_ca)
    try:
        yield provider
    finally:
        provider.stop()


@pytest.fixture(scope="module")
def material(idp: OidcProvider, other_idp: OidcProvider, port: int) -> Material:
    tokens = authorization_code_tokens(
        idp, AUDIENCE, CONSOLE_SECRET, f"https://127.0.0.1:{port}/console/callback",
        "alice", "alice-password",
    )  # fmt: skip
    return Material.make(idp, other_idp, tokens["id_token"], "https://127.0.0.1:9/jwks.json")


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_token_is_refused_with_401_and_audited(
    name: str, material: Material, server: RunningServer
) -> None:
    make, reason = HOSTILE[name]
    with server.http(role=None) as http:
        response = http.post(
            "/v1/chat/completions",
            headers={"Authorization": f"Bearer {make(material)}"},
            json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}]},
        )
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"] == (
        f'Bearer realm="inferno", error="invalid_token", error_description="{reason}"'
    )
    _, index, _ = response.headers["Audit-Entry"].split(" ")
    entry = AuditDatabase(server).entry(int(index))
    assert (entry["action"], entry["outcome"]) == ("auth.authenticate", "failure")
    assert entry["details"] == {"reason": str(reason)}


def _browser(server: RunningServer, idp_ca: IdpCa) -> httpx.Client:
    """A browser trusting the server's and the IdP's certificates, keeping cookies."""
    tls = ssl.create_default_context(cafile=idp_ca.cert_file)
    tls.load_verify_locations(cafile=server.cert_file)
    return httpx.Client(verify=tls, timeout=30)


@pytest.mark.parametrize(("user", "roles"), [("alice", ["user"]), ("bob", ["admin"])])
def test_console_login_with_pkce_end_to_end_then_logout(
    server: RunningServer, idp: OidcProvider, idp_ca: IdpCa, user: str, roles: list[str]
) -> None:
    with _browser(server, idp_ca) as browser:
        start = browser.get(f"{server.url}/console/login")
        assert start.status_code == 303
        assert "__Host-inferno_login=" in start.headers["set-cookie"]
        back = log_in(browser, start.headers["location"], user, f"{user}-password")
        callback = browser.get(back.headers["location"])
        # A page of the console moves on: the Strict cookie would not follow the IdP's redirect.
        assert callback.status_code == 200, callback.text
        assert '<meta http-equiv="refresh" content="0; url=/console/">' in callback.text
        cookie = next(c for c in callback.headers.get_list("set-cookie") if "session" in c)
        assert cookie.startswith("__Host-inferno_session=")
        assert "; Secure; HttpOnly; SameSite=Strict" in cookie
        session = browser.get(f"{server.url}/console/session")
        assert session.status_code == 200
        assert (session.json()["subject"], session.json()["roles"]) == (user, roles)
        # The sign-in is in the audit log, recorded before the cookie was set.
        [signed_in] = [
            e for e in entries(server) if e["action"] == "auth.authenticate"
            and e["actor"]["subject"] == user and e["outcome"] == "success"
        ]  # fmt: skip
        assert signed_in["details"] == {"method": "console sign-in (OIDC)", "issuer": idp.issuer}
        # An API route takes no session cookie: the console session is not a bearer token.
        assert browser.get(f"{server.url}/v1/models").status_code == 401
        csrf = {"X-CSRF-Token": session.json()["csrf_token"]}
        logout = browser.post(f"{server.url}/console/logout", headers=csrf)
        assert logout.status_code == 303
        end_session = httpx.URL(logout.headers["location"])
        assert str(end_session.copy_with(query=None)) == f"{idp.issuer}/session/end"
        assert end_session.params["post_logout_redirect_uri"] == f"{server.url}/console/"
        assert end_session.params["id_token_hint"].count(".") == 2
        assert browser.get(f"{server.url}/console/session").status_code == 401


def test_console_callback_without_the_login_cookie_is_refused(
    server: RunningServer, idp: OidcProvider, idp_ca: IdpCa
) -> None:
    with _browser(server, idp_ca) as browser:
        start = browser.get(f"{server.url}/console/login")
        back = log_in(browser, start.headers["location"], "alice", "alice-password")
        browser.cookies.delete("__Host-inferno_login")
        callback = browser.get(back.headers["location"])
    assert callback.status_code == 400
    assert "no login in progress in this browser" in callback.text
    refused = [
        e for e in entries(server) if e["action"] == "auth.authenticate"
        and e["details"].get("reason", "").startswith("console login failed: no login in progress")
    ]  # fmt: skip
    assert refused and refused[-1]["outcome"] == "failure"
